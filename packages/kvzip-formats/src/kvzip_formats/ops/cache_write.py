"""Reference cache-write into kvzip's paged KV layout (``spec/paged_layout.md``).

One layer's K (or V) cache is a ``torch.uint8`` tensor ``[num_blocks, num_kv_heads,
block_size * token_head_bytes]``. Inside the page of one block and KV head, the code bytes of
all ``block_size`` tokens come first, then their metadata (token ``t`` at
``block_size * code_bytes + t * meta_bytes``). K codes are token-major (byte ``j`` of token
``t`` at ``t * code_bytes + j``); V codes are channel-major (at ``j * block_size + t``), so
that each operand of the decode kernel's two matrix products reads consecutive bytes.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from kvzip_formats.base import FormatError, KVFormat, check_kind

#: Page sizes the layout is specified for (vLLM's block sizes); 16-byte alignment of every
#: page's code and metadata regions follows from block_size % 16 == 0.
BLOCK_SIZES = (16, 32, 64, 128)


@dataclass(frozen=True)
class PagedLayout:
    """Byte geometry of one (block, KV head) page for a format and head_dim."""

    block_size: int
    head_dim: int
    code_bytes: int
    meta_bytes: int

    @classmethod
    def of(
        cls, fmt: KVFormat, head_dim: int, block_size: int, kind: str | None = None
    ) -> PagedLayout:
        """The page geometry of ``fmt``'s K (``kind="k"``) or V rows; formats whose K and V
        rows differ (the compact ``3.5bit``) need ``kind``."""
        if block_size not in BLOCK_SIZES:
            raise FormatError(f"block_size must be one of {BLOCK_SIZES}, got {block_size}")
        return cls(
            block_size,
            head_dim,
            _row_part(fmt, "code_bytes", head_dim, kind),
            _row_part(fmt, "meta_bytes", head_dim, kind),
        )

    @property
    def token_head_bytes(self) -> int:
        return self.code_bytes + self.meta_bytes

    @property
    def page_bytes(self) -> int:
        """Bytes of one (block, KV head) page: the cache's last dimension."""
        return self.block_size * self.token_head_bytes

    @property
    def meta_offset(self) -> int:
        """Byte offset of the metadata region inside a page."""
        return self.block_size * self.code_bytes

    def codes_view(self, cache: torch.Tensor, kind: str) -> torch.Tensor:
        """``[num_blocks, num_kv_heads, block_size, code_bytes]`` view of the code region
        (for V a transposed view: V pages store their codes channel-major)."""
        region = cache[..., : self.meta_offset]
        if kind == "k":
            return region.unflatten(-1, (self.block_size, self.code_bytes))
        return region.unflatten(-1, (self.code_bytes, self.block_size)).transpose(-1, -2)

    def meta_view(self, cache: torch.Tensor) -> torch.Tensor:
        """``[num_blocks, num_kv_heads, block_size, meta_bytes]`` view of the metadata region."""
        return cache[..., self.meta_offset :].unflatten(-1, (self.block_size, self.meta_bytes))


def _row_part(fmt: KVFormat, what: str, head_dim: int, kind: str | None) -> int:
    fn = getattr(fmt, what)
    if kind is not None and "kind" in inspect.signature(fn).parameters:
        return fn(head_dim, kind)
    return fn(head_dim)


def new_paged_cache(
    fmt: KVFormat,
    num_blocks: int,
    num_kv_heads: int,
    block_size: int,
    head_dim: int,
    *,
    device: torch.device | str = "cpu",
    kind: str | None = None,
) -> torch.Tensor:
    """A zero-filled paged cache for one layer's K or V (``kind`` where their rows differ)."""
    lay = PagedLayout.of(fmt, head_dim, block_size, kind)
    return torch.zeros(num_blocks, num_kv_heads, lay.page_bytes, dtype=torch.uint8, device=device)


def check_paged_cache(
    cache: torch.Tensor, lay: PagedLayout, *, num_kv_heads: int | None = None, name: str = "cache"
) -> None:
    """Raise FormatError unless ``cache`` is a contiguous uint8 ``[blocks, heads, page_bytes]``."""
    if not isinstance(cache, torch.Tensor):
        raise FormatError(f"{name} must be a torch.Tensor, got {type(cache).__name__}")
    want = (
        f"[num_blocks, num_kv_heads, {lay.page_bytes}] (block_size {lay.block_size} x "
        f"{lay.token_head_bytes} bytes per token and head)"
    )
    if cache.dtype != torch.uint8:
        raise FormatError(f"{name} must be torch.uint8 {want}, got dtype {cache.dtype}")
    if cache.dim() != 3 or cache.shape[2] != lay.page_bytes:
        raise FormatError(f"{name} must have shape {want}, got {tuple(cache.shape)}")
    if num_kv_heads is not None and cache.shape[1] != num_kv_heads:
        raise FormatError(
            f"{name} has {cache.shape[1]} KV heads, expected {num_kv_heads}: "
            f"shape {tuple(cache.shape)}"
        )
    if not cache.is_contiguous():
        raise FormatError(f"{name} must be contiguous, got strides {cache.stride()}")


def check_slot_mapping(slot_mapping: torch.Tensor, num_tokens: int, num_slots: int) -> None:
    if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.dtype not in (
        torch.int32,
        torch.int64,
    ):
        got = slot_mapping.dtype if isinstance(slot_mapping, torch.Tensor) else type(slot_mapping)
        raise FormatError(f"slot_mapping must be an int32 or int64 tensor, got {got}")
    if slot_mapping.shape != (num_tokens,):
        raise FormatError(
            f"slot_mapping must have shape [num_tokens] = [{num_tokens}], "
            f"got {tuple(slot_mapping.shape)}"
        )
    if num_tokens and int(slot_mapping.max()) >= num_slots:
        raise FormatError(
            f"slot_mapping holds slot {int(slot_mapping.max())} but the cache has only "
            f"{num_slots} slots (num_blocks * block_size)"
        )
    if num_tokens and int(slot_mapping.min()) < -1:
        raise FormatError(
            f"slot_mapping values must be >= -1 (-1 = skip), got {int(slot_mapping.min())}"
        )


def cache_write(
    fmt: KVFormat,
    x: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    kind: str,
    layer: int = 0,
    block_size: int,
) -> None:
    """Encode ``x`` ``[tokens, kv_heads, head_dim]`` and write token ``i`` into slot
    ``slot_mapping[i]`` (``block = slot // block_size``, ``offset = slot % block_size``) of
    ``cache``; slot ``-1`` skips the token (vLLM's padding)."""
    check_kind(kind)
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        raise FormatError(f"x must be [tokens, kv_heads, head_dim], got {getattr(x, 'shape', x)}")
    t, h, d = x.shape
    lay = PagedLayout.of(fmt, d, block_size, kind)
    check_paged_cache(cache, lay, num_kv_heads=h)
    check_slot_mapping(slot_mapping, t, cache.shape[0] * block_size)
    keep = slot_mapping >= 0
    rows = fmt.encode(x[keep.to(x.device)], kind=kind, layer=layer).to(cache.device)
    slots = slot_mapping[keep].to(device=cache.device, dtype=torch.int64)
    blk, off = slots // block_size, slots % block_size
    lay.codes_view(cache, kind)[blk, :, off] = rows[..., : lay.code_bytes]
    if lay.meta_bytes:
        lay.meta_view(cache)[blk, :, off] = rows[..., lay.code_bytes :]


def gather_rows(
    cache: torch.Tensor, lay: PagedLayout, block_table_row: torch.Tensor, seq_len: int, kind: str
) -> torch.Tensor:
    """The packed rows ``[seq_len, kv_heads, token_head_bytes]`` of one sequence, in order."""
    tok = torch.arange(seq_len, device=cache.device)
    blk = block_table_row.to(cache.device, torch.int64)[tok // lay.block_size]
    off = tok % lay.block_size
    check_kind(kind)
    codes = lay.codes_view(cache, kind)[blk, :, off]
    if not lay.meta_bytes:
        return codes
    return torch.cat((codes, lay.meta_view(cache)[blk, :, off]), -1)
