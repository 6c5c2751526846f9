"""One attention layer's paged cache in a kvzip format as a server holds it: the layout of a
block and the sink pool's and residual window's slots in the blocks' reserves (``PagedCache``,
the base of ``paged.PagedAttention``; no vLLM here).

The cache, as vLLM hands it to the backend (spec/paged_layout.md section 5): uint8
``[num_blocks, num_kv_heads, block_size, content_bytes]`` with ``content_bytes = tbh_k +
tbh_v + reserve`` (``tbh``: the format's bytes per token and KV head for K and for V;
``reserve``: the sink pool's and a residual window's share, below). vLLM only ever addresses
whole blocks of it (allocation, prefix caching, block copies), so the inside of a block is
kvzip's: the K pages of every KV head, then their V pages, each page in kvzip's paged layout
(``kvzip_formats/spec/paged_layout.md``), then the block's share of the sink pool::

    block b: K page (head 0) .. K page (head H-1) | V page (head 0) .. V page (head H-1) | pool

so that ``pages()`` gives K and V as ``[num_blocks, num_kv_heads, page_bytes]`` views whose
only stride is the block's (``H * block_size * content_bytes``), the form kvzip-kernels
address with ``block_stride=``. (K page then V page per (block, head) would put a stride on
the head dimension too, which the kernels do not take.)

Sink tokens (the compact formats; spec/4bit.md section 8): the first ``sink_tokens``
positions of every sequence are also kept in bf16. Only a sequence's first block has them, so
they are kept per sequence, not per block: every block reserves ``reserve`` bytes per token
and KV head (``sink_reserve_bytes``: 2 at head size 128, one sink token), and the reserves of
``blocks_per_slot`` consecutive blocks form one slot of ``sink_tokens x 2 x H x d`` bf16, one
slot per ``SINK_SLOT_TOKENS`` tokens of cache (the pool and the step's plan: ``sinks.py``).
The reserve is part of the bytes per token the backend declares, so vLLM sizes and reports
the cache with the sinks in it, and the backend
allocates nothing beside vLLM's tensor but a ``SinkPool``'s three index vectors (one per model,
shared by every layer: 8 bytes per block and 16 per slot). The ``SinkPool`` maps a first block
to its slot; a slot is given to a new sequence's first block (its first chunk) from the slots
least recently read. A sequence whose slot was given away since (possible only once more first
blocks were written than there are slots, e.g. a prefix-cache hit on a long-idle first block)
reads its sinks from its own rows, which every path writes too (the spec's rows MUST be
written): the format's decode of them, as if it had no bf16 sinks.

A residual window (``window.py``): the last ``recent`` tokens of every running sequence in
bf16, in slots made of every block's second reserve, after the sink reserve.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from kvzip_formats.ops import PagedLayout
from kvzip_kernels._merge_extra import Ring
from kvzip_kernels.sinks import SinkPool, StepSinks, sink_reserve_bytes
from kvzip_kernels.window import DEFAULT_SLOT_TOKENS, StepWindow, WindowPool, window_reserve_bytes

#: Calls per path in this process (``write_kernels``, ``write_reference``, ``decode_kernels``,
#: ``prefill_workspace``, ``attend_reference``; ``prefill_workspace`` counts its
#: ``varlen`` kernel too, as ``varlen:<name>``): how the tests see which path vLLM ran. Counted
#: by ``paged.py`` and ``_paged_torch.py``, read as ``kvzip_kernels.paged.PATH_CALLS``.
PATH_CALLS: Counter[str] = Counter()


@dataclass(frozen=True)
class Geometry:
    """What the kernels' support depends on (``refusal``'s cache key)."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int


def content_bytes(
    fmt, head_size: int, block_size: int, recent: int = 0, slot_tokens: int = DEFAULT_SLOT_TOKENS
) -> int:
    """The cache's last dimension: K's and V's bytes per token and KV head plus the sink
    pool's reserve and a residual window's (``window.py``): what the backend tells vLLM one
    token of one KV head takes."""
    rows = sum(PagedLayout.of(fmt, head_size, block_size, k).token_head_bytes for k in "kv")
    return (
        rows
        + sink_reserve_bytes(int(fmt.sink_tokens), head_size)
        + window_reserve_bytes(recent, head_size, slot_tokens)
    )


class PagedCache:
    """One layer's cache in a kvzip format: its geometry and the formats' page layouts, the
    views of its K and V pages and of the sink and window slots in the blocks' reserves, and
    the bf16 sinks and window read and written there (torch only; ``paged.PagedAttention``
    adds the write and the attention)."""

    def __init__(
        self,
        fmt,
        *,
        num_heads: int,
        num_kv_heads: int,
        head_size: int,
        block_size: int,
        recent: int = 0,
        window_slot_tokens: int = DEFAULT_SLOT_TOKENS,
    ) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}"
            )
        self.fmt = fmt
        self.geometry = Geometry(num_heads, num_kv_heads, head_size, block_size)
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_size, self.block_size = head_size, block_size
        self.layouts = {
            kind: PagedLayout.of(fmt, head_size, block_size, kind) for kind in ("k", "v")
        }
        # sink tokens: the first positions of every sequence in bf16 (spec/4bit.md section 8),
        # in a pool of slots made of every block's reserve (module docstring)
        self.sink_tokens = int(fmt.sink_tokens)
        self.reserve = sink_reserve_bytes(self.sink_tokens, head_size)
        self.blocks_per_slot = 0
        if self.sink_tokens:
            slot = 4 * self.sink_tokens * head_size  # per KV head: bf16 K and V
            if slot % (block_size * self.reserve):
                raise ValueError(
                    f"block_size {block_size}: a sink slot ({slot} bytes per KV head) is not a "
                    f"whole number of blocks' reserves ({self.reserve} bytes per token)"
                )
            self.blocks_per_slot = slot // (block_size * self.reserve)
        # a residual window (window.py): the last `recent` tokens in bf16, in slots made of
        # every block's second reserve
        self.recent = int(recent)
        self.window_reserve = window_reserve_bytes(self.recent, head_size, window_slot_tokens)
        self.window_blocks_per_slot = 0
        if self.recent:
            if not self.sink_tokens:
                raise ValueError("a residual window is for the compact formats (with sinks)")
            wslot = 4 * self.recent * head_size  # per KV head: bf16 K and V of `recent` tokens
            if wslot % (block_size * self.window_reserve):
                raise ValueError(
                    f"block_size {block_size}, window of {self.recent} tokens, "
                    f"{window_slot_tokens} tokens per slot: a window slot ({wslot} bytes per KV "
                    f"head) is not a whole number of blocks' reserves ({self.window_reserve} "
                    "bytes per token); supported: powers of two"
                )
            self.window_blocks_per_slot = wslot // (block_size * self.window_reserve)

    # -- layout -----------------------------------------------------------------------
    @property
    def token_head_bytes(self) -> int:
        """K's and V's bytes per token and KV head (the rows, without the sink reserve)."""
        return sum(lay.token_head_bytes for lay in self.layouts.values())

    @property
    def content_bytes(self) -> int:
        """The cache's last dimension: the rows plus the sink and window reserves."""
        return self.token_head_bytes + self.reserve + self.window_reserve

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one layer (vLLM's page size for the layer)."""
        return self.num_kv_heads * self.block_size * self.content_bytes

    def num_sink_slots(self, num_blocks: int) -> int:
        return num_blocks // self.blocks_per_slot if self.sink_tokens else 0

    def new_cache(self, num_blocks: int, device="cpu") -> torch.Tensor:
        """A zeroed cache shaped as vLLM allocates it (for tests and benchmarks)."""
        g = self.geometry
        return torch.zeros(
            num_blocks,
            g.num_kv_heads,
            g.block_size,
            self.content_bytes,
            dtype=torch.uint8,
            device=device,
        )

    def new_pool(self, kv_cache: torch.Tensor) -> SinkPool | None:
        """The sink pool for caches of ``kv_cache``'s blocks (None without sink tokens)."""
        if not self.sink_tokens:
            return None
        nb = kv_cache.shape[0]
        return SinkPool(nb, self.num_sink_slots(nb), kv_cache.device)

    def _check(self, kv_cache: torch.Tensor) -> None:
        want = (self.num_kv_heads, self.block_size, self.content_bytes)
        if (
            kv_cache.dtype != torch.uint8
            or kv_cache.dim() != 4
            or tuple(kv_cache.shape[1:]) != want
        ):
            raise ValueError(
                f"kv_cache must be uint8 [num_blocks, {', '.join(map(str, want))}], got "
                f"{kv_cache.dtype} {tuple(kv_cache.shape)}"
            )
        kv_cache.view(kv_cache.shape[0], -1)  # raises rather than copies if a block is split

    def _block_stride(self, kv_cache: torch.Tensor) -> int:
        # the block stride as the kernels check it (a one-block view would report another)
        return kv_cache.stride(0) if kv_cache.shape[0] > 1 else self.block_bytes

    def pages(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V pages ``[num_blocks, num_kv_heads, page_bytes]``: views into ``kv_cache``
        (never copies) strided by the block only, ``stride(0)`` bytes per block."""
        self._check(kv_cache)
        nb, h = kv_cache.shape[0], self.num_kv_heads
        stride = self._block_stride(kv_cache)
        pk, pv = self.layouts["k"].page_bytes, self.layouts["v"].page_bytes
        base = kv_cache.storage_offset()
        return (
            kv_cache.as_strided((nb, h, pk), (stride, pk, 1), base),
            kv_cache.as_strided((nb, h, pv), (stride, pv, 1), base + h * pk),
        )

    def sink_store(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """The sink pool's slots in ``kv_cache``: a bf16 view ``[num_slots, blocks_per_slot,
        reserve_elems]`` over the blocks' reserves (each slot's ``blocks_per_slot *
        reserve_elems`` values are its ``[sink_tokens, 2 (K, V), num_kv_heads, head_size]``)."""
        self._check(kv_cache)
        r, nb = self.blocks_per_slot, kv_cache.shape[0]
        n = self.num_sink_slots(nb)
        stride = self._block_stride(kv_cache)
        area = self.num_kv_heads * self.block_size * self.reserve
        rows = self.num_kv_heads * self.block_size * self.token_head_bytes
        raw = kv_cache.as_strided(
            (n, r, area), (r * stride, stride, 1), kv_cache.storage_offset() + rows
        )
        return raw.view(torch.bfloat16)

    # -- residual window (window.py) --------------------------------------------------
    def num_window_slots(self, num_blocks: int) -> int:
        return num_blocks // self.window_blocks_per_slot if self.recent else 0

    def new_window_pool(self, kv_cache: torch.Tensor) -> WindowPool | None:
        if not self.recent:
            return None
        return WindowPool(self.num_window_slots(kv_cache.shape[0]))

    def window_store(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """The window slots in ``kv_cache``: bf16 ``[num_slots, blocks_per_slot, elems]`` over
        the blocks' window reserves (a slot's values, in order, are its ring ``[recent, 2,
        num_kv_heads, head_size]``)."""
        self._check(kv_cache)
        r, nb = self.window_blocks_per_slot, kv_cache.shape[0]
        n = self.num_window_slots(nb)
        stride = self._block_stride(kv_cache)
        hb = self.num_kv_heads * self.block_size
        area = hb * self.window_reserve
        start = hb * (self.token_head_bytes + self.reserve)
        raw = kv_cache.as_strided(
            (n, r, area), (r * stride, stride, 1), kv_cache.storage_offset() + start
        )
        return raw.view(torch.bfloat16)

    def rings(self, kv_cache, slots: torch.Tensor) -> torch.Tensor:
        """The rings of ``slots`` ``[b]``: bf16 ``[b, recent, 2, num_kv_heads, head_size]``."""
        g = self.geometry
        got = self.window_store(kv_cache)[slots]
        return got.view(len(slots), self.recent, 2, g.num_kv_heads, g.head_size)

    def _tokens(self, x) -> torch.Tensor:
        """The step's K or V as bf16 ``[tokens, num_kv_heads, head_size]`` (a view if it is)."""
        x = self._fresh(x, slice(None))
        return x if x.dtype == torch.bfloat16 and x.stride(2) == 1 else x.to(torch.bfloat16)

    def ring(self, kv_cache, win: StepWindow, fresh_k, fresh_v, row_end: torch.Tensor):
        """For a decode step through the kernels: the window as a ``kvzip_kernels.Ring``, read
        by the decode where the rings hold it (the step's own tokens, ``fresh_k``/``fresh_v``
        ``[b, num_kv_heads, head_size]``, are its last entry). Where the rows stop
        (``row_end``) is the same for every layer of the step: computed once, by
        ``step_plan`` (its ``DecodePlan.row_end``)."""
        return Ring(
            self.window_store(kv_cache), win.slots, self._tokens(fresh_k),
            self._tokens(fresh_v), self.recent, row_end,
        )  # fmt: skip

    def place_window(self, k, v, kv_cache, win: StepWindow, j: int, fresh_k, fresh_v, base=0):
        """Sequence ``j`` of ``win``: its ring's positions ``max(ctx - recent, valid_from,
        sink_tokens) .. ctx - 1`` and its new tokens (``fresh_k``/``fresh_v`` ``[q,
        num_kv_heads, head_size]``) written over its decoded rows in ``k`` and ``v`` (from row
        ``base``)."""
        c = win.ctx_host[j]
        lo = max(c - self.recent, win.valid_from_host[j], self.sink_tokens)
        ring = None
        if win.has_host[j] and lo < c:
            ring = self.rings(kv_cache, win.slots[j : j + 1])[0]
            pos = torch.arange(lo, c, device=ring.device) % self.recent
        q = fresh_k.shape[0]
        for part, (x, fresh) in enumerate(((k, fresh_k), (v, fresh_v))):
            if ring is not None:
                x[base + lo : base + c] = ring[pos, part].to(x.dtype).to(x.device)
            x[base + c : base + c + q] = fresh.to(torch.bfloat16).to(x.dtype).to(x.device)

    def _slots(self, kv_cache, slots: torch.Tensor) -> torch.Tensor:
        g = self.geometry
        got = self.sink_store(kv_cache)[slots]
        return got.view(len(slots), self.sink_tokens, 2, g.num_kv_heads, g.head_size)

    def write_sinks(self, key, value, kv_cache, sinks: StepSinks | None) -> None:
        """The bf16 copies of the step's tokens at sink positions, into their slots."""
        if not self.sink_tokens:
            return
        if sinks is None:
            raise ValueError(
                f"format {getattr(self.fmt, 'name', self.fmt)} keeps {self.sink_tokens} sink "
                "token(s): the write needs the step's StepSinks (plan_step)"
            )
        if not sinks.rows.numel():
            return
        slots = sinks.slots[sinks.write_req]
        cur = self._slots(kv_cache, slots)
        rows = sinks.rows.to(key.device)
        cur[sinks.row_req, sinks.pos, 0] = key[rows].to(torch.bfloat16)
        cur[sinks.row_req, sinks.pos, 1] = value[rows].to(torch.bfloat16)
        store = self.sink_store(kv_cache)
        store[slots] = cur.view(len(slots), *store.shape[1:])

    def sinks_of(self, kv_cache, sinks: StepSinks, *, layer: int):
        """The bf16 sink K and V ``[batch, sink_tokens, num_kv_heads, head_size]`` of the
        step's sequences: from their slots, or (a slot given away since) from the format's
        decode of their own rows."""
        got = self._slots(kv_cache, sinks.slots)
        if sinks.may_miss:
            own = self._row_sinks(kv_cache, sinks.first, layer)
            got = torch.where(sinks.valid[:, None, None, None, None], got, own)
        return got[:, :, 0], got[:, :, 1]

    def _row_sinks(self, kv_cache, first: torch.Tensor, layer: int) -> torch.Tensor:
        """The format's decode of the rows at the sink positions of blocks ``first``
        ``[batch]``: bf16 ``[batch, sink_tokens, 2, num_kv_heads, head_size]``."""
        b, s = first.shape[0], self.sink_tokens
        off = torch.arange(s, device=first.device)
        out = []
        for kind, pages in zip("kv", self.pages(kv_cache), strict=True):
            lay = self.layouts[kind]
            rows = lay.codes_view(pages, kind)[first[:, None], :, off[None, :]]
            if lay.meta_bytes:
                meta = lay.meta_view(pages)[first[:, None], :, off[None, :]]
                rows = torch.cat((rows, meta), -1)
            x = self.fmt.decode(
                rows.reshape(b * s, self.num_kv_heads, -1),
                kind=kind,
                layer=layer,
                head_dim=self.head_size,
            )
            out.append(x.reshape(b, s, self.num_kv_heads, self.head_size))
        return torch.stack(out, 2).to(torch.bfloat16)

    def _fresh(self, x, rows) -> torch.Tensor:
        return x[rows].reshape(-1, self.num_kv_heads, self.head_size)
