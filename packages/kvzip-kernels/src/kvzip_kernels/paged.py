"""A server's paged cache in a kvzip format, and the attention over it (no vLLM here:
kvzip-vllm's backend is a thin adapter over this module, tested on its own, on the CPU and on
CUDA).

One attention layer's cache, as vLLM hands it to the backend (spec/paged_layout.md section 5):
uint8 ``[num_blocks, num_kv_heads, block_size, content_bytes]`` with ``content_bytes = tbh_k +
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

Paths, the same bytes and (within the kernels' earned tolerance) the same attention:

- reference (torch): the format's ``encode`` scattered into the pages, attention in float32
  over the format's ``decode`` of every cached token, sinks from the pool; every query
  length (prefill chunks included);
- kernels (kvzip-kernels): ``cache_write`` and, for requests with one new token,
  ``paged_decode`` with ``block_stride=`` and ``sinks=``. They run wherever Triton runs: CUDA,
  and the CPU under ``TRITON_INTERPRET=1`` (the tests' CPU twin);
- prefill workspace (CUDA by default): the chunk's sequences' cached pages decoded into one
  bf16 workspace by the format's vectorised torch decode (one call per K and V for the whole
  batch), sinks placed, then a variable-length attention kernel over it (vLLM's
  FlashAttention where the backend passes it, ``sdpa_varlen`` otherwise).

A format, head size or block size the kernels refuse (e.g. head size 32, or ``turbo4``) is
found by ``kvzip_kernels.refusal`` (no tensor touched); the reason is logged once per process
and that configuration takes the reference path. Errors on real calls are never caught.

Per forward step (``step_plan``, made by the step's first layer and shared by the others): the
host lists of the step's lengths, which requests decode through the kernels, and the kernels'
``DecodePlan`` (validation, split sizes, where the rows stop under a residual window, scratch
buffers); a layer's ``attend`` then only launches.
"""

from __future__ import annotations

import functools
import logging
import math
import os
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvzip_formats.ops import PagedLayout, gather_rows
from kvzip_kernels._merge_extra import Ring, SinkSlots, ring_write, window_row_end
from kvzip_kernels.cache_write import cache_write
from kvzip_kernels.decode_plan import DecodePlan, refusal
from kvzip_kernels.decode_plan import plan as plan_decode
from kvzip_kernels.sinks import (  # noqa: F401  (re-exported: the tests import them from here)
    SINK_SLOT_TOKENS,
    SinkPool,
    StepSinks,
    plan_step,
    sink_plan,
    sink_reserve_bytes,
)
from kvzip_kernels.window import DEFAULT_SLOT_TOKENS, StepWindow, WindowPool, window_reserve_bytes

# under vLLM's logger tree, whose handlers a server configures (the name it had in kvzip_vllm)
logger = logging.getLogger("vllm.kvzip.paged")

#: Calls per path in this process (``write_kernels``, ``write_reference``, ``decode_kernels``,
#: ``prefill_workspace``, ``attend_reference``; ``prefill_workspace`` counts its
#: ``varlen`` kernel too, as ``varlen:<name>``): how the tests see which path vLLM ran.
PATH_CALLS: Counter[str] = Counter()


def triton_runs(device: torch.device) -> bool:
    """Whether kvzip-kernels' Triton kernels run on ``device``: CUDA, or the CPU under the
    Triton interpreter (``TRITON_INTERPRET=1``, read by Triton at import)."""
    if device.type == "cuda":
        return True
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class Geometry:
    """What the kernels' support depends on (``refusal``'s cache key)."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int


@dataclass
class StepPlan:
    """One forward step's plan for one layer configuration (``PagedAttention.step_plan``),
    shared by every layer of the step: the step's lengths on the host, the requests with one
    new token that the decode kernel takes (``one``; ``rest``: the others), their rows and
    batch indices where the batch is mixed, their share of the step's sink and window plans,
    and the kernels' ``DecodePlan`` (None where no request decodes through the kernels)."""

    qsl: list[int]
    lens: list[int]
    one: list[int]
    rest: list[int]
    decode: DecodePlan | None = None
    rows: torch.Tensor | None = None  # the decode requests' query rows (a mixed batch)
    idx: torch.Tensor | None = None  # their batch indices (a mixed batch)
    sinks: StepSinks | None = None  # the decode requests' sinks
    window: StepWindow | None = None  # the decode requests' window


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


def sdpa_varlen(q, k, v, cu_q: Sequence[int], cu_k: Sequence[int], scale: float, out) -> None:
    """Causal attention of packed sequences (``q`` ``[tokens, heads, d]``, ``k``/``v``
    ``[keys, kv_heads, d]``, host offsets ``cu_q``/``cu_k``), each sequence's queries being its
    last keys' positions (FlashAttention's bottom-right causal mask), by torch's
    ``scaled_dot_product_attention``; into ``out`` ``[tokens, heads, d]``."""
    rep = q.shape[1] // k.shape[1]
    for i in range(len(cu_q) - 1):
        qs, qe, ks, ke = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
        if qe == qs:
            continue
        nq, nk = qe - qs, ke - ks
        mask = (
            torch.arange(nk, device=q.device)[None, :]
            <= torch.arange(nk - nq, nk, device=q.device)[:, None]
        )
        o = torch.nn.functional.scaled_dot_product_attention(
            q[qs:qe].transpose(0, 1),
            k[ks:ke].repeat_interleave(rep, 1).transpose(0, 1),
            v[ks:ke].repeat_interleave(rep, 1).transpose(0, 1),
            attn_mask=mask,
            scale=scale,
        )
        out[qs:qe] = o.transpose(0, 1).to(out.dtype)


#: ``varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale, out)``: the prefill workspace's kernel
#: (cu_q/cu_k int32 device tensors, max_q/max_k ints)
VarlenAttention = Callable[..., None]


class PagedAttention:
    """One layer's cache write and attention over vLLM's cache in a kvzip format.

    ``kernels``: ``None`` uses kvzip-kernels wherever Triton runs (``triton_runs``),
    ``False`` never (vLLM on the CPU: the issue's reference path), ``True`` requires them.
    ``prefill``: ``"workspace"`` (the default on CUDA) or ``"reference"`` (elsewhere) for
    requests with more than one new token; ``varlen``: the workspace's attention kernel
    (``sdpa_varlen`` when None).
    """

    def __init__(
        self,
        fmt,
        *,
        num_heads: int,
        num_kv_heads: int,
        head_size: int,
        block_size: int,
        scale: float,
        kernels: bool | None = None,
        prefill: str | None = None,
        varlen: VarlenAttention | None = None,
        recent: int = 0,
        window_slot_tokens: int = DEFAULT_SLOT_TOKENS,
    ) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}"
            )
        if prefill not in (None, "workspace", "reference"):
            raise ValueError(f"prefill must be 'workspace' or 'reference', got {prefill!r}")
        self.fmt = fmt
        self.geometry = Geometry(num_heads, num_kv_heads, head_size, block_size)
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_size, self.block_size = head_size, block_size
        self.scale = float(scale)
        self.kernels = kernels
        self.prefill, self.varlen = prefill, varlen
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

    def write_window(self, key, value, kv_cache, win: StepWindow) -> None:
        """The step's last ``recent`` new tokens of each sequence with a slot into its ring."""
        if not win.w_rows.numel():
            return
        PATH_CALLS["window_write"] += 1
        g = self.geometry
        store = self.window_store(kv_cache)
        if self.use_kernels(kv_cache.device):  # one launch (kvzip_kernels.ring_write)
            ring_write(
                store, self._tokens(key), self._tokens(value), win.w_rows, win.w_slots,
                win.w_ring,
            )  # fmt: skip
            return
        per = store.shape[2]  # values per block's reserve
        e = 2 * g.num_kv_heads * g.head_size  # values per ring entry
        rows = win.w_rows.to(key.device)
        kv = torch.stack(
            (key[rows].reshape(-1, g.num_kv_heads, g.head_size),
             value[rows].reshape(-1, g.num_kv_heads, g.head_size)), 1,
        ).to(torch.bfloat16).reshape(len(rows), e)  # fmt: skip
        f = win.w_ring.to(key.device)[:, None] * e + torch.arange(e, device=key.device)[None, :]
        slot = win.w_slots.to(key.device)[:, None].expand_as(f)
        store[slot, f // per, f % per] = kv

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

    # -- path choice ------------------------------------------------------------------
    def use_kernels(self, device: torch.device) -> bool:
        if self.kernels is False or not triton_runs(device):
            if self.kernels:
                raise RuntimeError(f"kernels=True but Triton does not run on {device}")
            return False
        why = _kernel_refusal(self.fmt, self.geometry, self.sink_tokens, self.recent, str(device))
        if why and self.kernels:
            raise RuntimeError(f"kernels=True but kvzip-kernels refuse this layer: {why}")
        return why is None

    def use_workspace(self, device: torch.device) -> bool:
        if self.prefill is not None:
            return self.prefill == "workspace"
        return device.type == "cuda"

    # -- cache write ------------------------------------------------------------------
    def write(self, key, value, kv_cache, slot_mapping, *, layer: int, sinks=None) -> None:
        """Write the new tokens' K and V ``[num_tokens, num_kv_heads, head_size]`` at
        ``slot_mapping`` ``[num_tokens]`` (``-1`` skips a token), and the bf16 copies of those
        at sink positions (``sinks``: the step's ``StepSinks``; needed with sink tokens)."""
        if self.use_kernels(kv_cache.device):
            self.write_kernels(key, value, kv_cache, slot_mapping, layer=layer, sinks=sinks)
        else:
            self.write_reference(key, value, kv_cache, slot_mapping, layer=layer, sinks=sinks)

    def write_reference(self, key, value, kv_cache, slot_mapping, *, layer: int, sinks=None):
        PATH_CALLS["write_reference"] += 1
        n = slot_mapping.shape[0]
        keep = slot_mapping >= 0
        slots = slot_mapping[keep].to(torch.int64)
        blk, off = slots // self.block_size, slots % self.block_size
        for kind, x, pages in zip("kv", (key, value), self.pages(kv_cache), strict=True):
            lay = self.layouts[kind]
            rows = self.fmt.encode(x[:n][keep], kind=kind, layer=layer)
            lay.codes_view(pages, kind)[blk, :, off] = rows[..., : lay.code_bytes]
            if lay.meta_bytes:
                lay.meta_view(pages)[blk, :, off] = rows[..., lay.code_bytes :]
        self.write_sinks(key, value, kv_cache, sinks)

    def write_kernels(self, key, value, kv_cache, slot_mapping, *, layer: int, sinks=None):
        PATH_CALLS["write_kernels"] += 1
        n = slot_mapping.shape[0]
        for kind, x, pages in zip("kv", (key, value), self.pages(kv_cache), strict=True):
            cache_write(
                self.fmt,
                x[:n],
                pages,
                slot_mapping,
                kind=kind,
                layer=layer,
                block_size=self.block_size,
                # vLLM's slots are valid; the range check reads them on the host (a sync)
                check_slots=False,
                # the value check's verdict would be read on the host too: a sync, which CUDA
                # graph capture forbids. Unchecked, a row the spec rejects (NaN, inf,
                # |x| > 65504) is still written with a NaN scale by the kernel, so it decodes to
                # NaN, never to a plausible value; the FormatError itself is raised only where
                # the verdict can be read (the reference path, cache_write's default)
                check_values=False,
                block_stride=pages.stride(0),
            )
        self.write_sinks(key, value, kv_cache, sinks)

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

    # -- attention --------------------------------------------------------------------
    def attend(
        self,
        query,
        kv_cache,
        *,
        query_start_loc_cpu,
        seq_lens_cpu,
        seq_lens,
        block_table,
        layer: int,
        out,
        sinks: StepSinks | None = None,
        window: StepWindow | None = None,
        key=None,
        value=None,
        plan: StepPlan | None = None,
    ) -> torch.Tensor:
        """Causal attention of the new tokens ``query`` ``[num_tokens, num_heads * head_size]``
        (or ``[num_tokens, num_heads, head_size]``) over the cache into ``out`` (same rows).
        Requests with one new token go to the decode kernel where it runs, the rest (prefill
        chunks) to the prefill workspace (CUDA) or the reference path. With a residual window
        (``window``, the step's plan; ``key``/``value``: the step's new K and V) the window and
        the new tokens are read in bf16, and the step's last tokens then go into the rings.
        ``plan``: the step's ``step_plan`` (made here where not given)."""
        if self.sink_tokens and sinks is None:
            raise ValueError("attend: a format with sink tokens needs the step's StepSinks")
        if self.recent and (window is None or key is None or value is None):
            raise ValueError("attend: a residual window needs the step's StepWindow, key, value")
        self._attend(
            query,
            kv_cache,
            query_start_loc_cpu=query_start_loc_cpu,
            seq_lens_cpu=seq_lens_cpu,
            seq_lens=seq_lens,
            block_table=block_table,
            layer=layer,
            out=out,
            sinks=sinks,
            window=window,
            key=key,
            value=value,
            plan=plan,
        )
        if self.recent:
            self.write_window(key, value, kv_cache, window)
        return out

    def _fresh(self, x, rows) -> torch.Tensor:
        return x[rows].reshape(-1, self.num_kv_heads, self.head_size)

    @property
    def plan_key(self) -> tuple:
        """What a step plan depends on besides the step: layers of one key share one plan."""
        return (id(self.fmt), self.geometry, self.scale, self.recent, self.kernels)

    def step_plan(
        self, kv_cache, *, query_start_loc_cpu, seq_lens_cpu, seq_lens, block_table,
        sinks: StepSinks | None = None, window: StepWindow | None = None,
    ) -> StepPlan:  # fmt: skip
        """The step's ``StepPlan`` (once per step: every layer with this ``plan_key`` and a
        cache shaped as ``kv_cache`` uses it)."""
        qsl = query_start_loc_cpu.tolist()
        lens = seq_lens_cpu.tolist()
        qlen = [qsl[i + 1] - qsl[i] for i in range(len(qsl) - 1)]
        # the decode kernel attends every sink of the slot: a sequence shorter than the sink
        # tokens takes the other path (the shipped formats have one: never the case)
        one = [i for i, n in enumerate(qlen) if n == 1 and lens[i] >= self.sink_tokens]
        if not one or not self.use_kernels(kv_cache.device):
            return StepPlan(qsl, lens, [], list(range(len(qlen))))
        st = StepPlan(qsl, lens, one, sorted(set(range(len(qlen))) - set(one)))
        bt, sl = block_table, seq_lens
        if st.rest:  # a mixed batch: the decode requests' rows and tables
            st.rows = torch.tensor([qsl[i] for i in one], device=kv_cache.device)
            st.idx = torch.tensor(one, device=block_table.device)
            bt, sl = block_table[st.idx], seq_lens[st.idx]
            if sinks is not None:
                sinks = sinks.select(st.idx.to(sinks.slots.device))
            if window is not None:
                window = window.select(st.idx.to(window.slots.device))
        st.sinks, st.window = sinks, window
        row_end = None
        if window is not None:  # R + 1 entries end at ctx + 1, held from valid_from (or ctx)
            held = torch.where(window.has, window.valid_from, window.ctx)
            row_end = window_row_end(window.ctx + 1, self.recent + 1, self.sink_tokens, held)
        k_pages, v_pages = self.pages(kv_cache)
        g = self.geometry
        st.decode = plan_decode(
            self.fmt,
            num_q_heads=g.num_heads,
            head_dim=g.head_size,
            block_table=bt.to(torch.int32),
            seq_lens=sl.to(torch.int32),
            k_cache=k_pages,
            v_cache=v_pages,
            block_size=g.block_size,
            max_seq_len=max(lens[i] for i in one),
            sm_scale=self.scale,
            block_stride=k_pages.stride(0),
            n_sink=self.sink_tokens,
            window=self.recent + 1 if window is not None else 0,
            row_end=row_end,
        )
        return st

    def _attend(
        self, query, kv_cache, *, query_start_loc_cpu, seq_lens_cpu, seq_lens, block_table,
        layer, out, sinks, window, key, value, plan=None,
    ):  # fmt: skip
        st = plan or self.step_plan(
            kv_cache, query_start_loc_cpu=query_start_loc_cpu, seq_lens_cpu=seq_lens_cpu,
            seq_lens=seq_lens, block_table=block_table, sinks=sinks, window=window,
        )  # fmt: skip
        if st.decode is not None:
            n1 = len(st.one)
            rows = slice(0, n1) if st.rows is None else st.rows
            rec = None
            if st.window is not None:
                rec = self.ring(
                    kv_cache, st.window, self._fresh(key, rows), self._fresh(value, rows),
                    st.decode.row_end,
                )  # fmt: skip
            if st.rows is None:  # a decode-only batch: no gather
                self.decode_kernels(
                    query[:n1], kv_cache, layer=layer, out=out[:n1], sinks=st.sinks,
                    recent=rec, plan=st.decode,
                )  # fmt: skip
            else:
                got = self.decode_kernels(
                    query[rows], kv_cache, layer=layer, sinks=st.sinks, recent=rec,
                    plan=st.decode,
                )  # fmt: skip
                out[rows] = got.reshape(n1, *out.shape[1:]).to(out.dtype)
        rest = st.rest
        if rest and self.use_workspace(kv_cache.device):
            self.attend_workspace(
                query,
                kv_cache,
                st.qsl,
                st.lens,
                block_table,
                layer=layer,
                out=out,
                requests=rest,
                sinks=sinks,
                window=window,
                key=key,
                value=value,
            )
        elif rest:
            self.attend_reference(
                query,
                kv_cache,
                st.qsl,
                seq_lens_cpu,
                block_table,
                layer=layer,
                out=out,
                requests=rest,
                sinks=sinks,
                window=window,
                key=key,
                value=value,
            )
        return out

    def decode_kernels(
        self,
        query,
        kv_cache,
        *,
        layer: int,
        out=None,
        sinks: StepSinks | None = None,
        recent=None,
        plan: DecodePlan,
    ) -> torch.Tensor:
        """kvzip-kernels' decode for one new token per sequence (the step's ``plan``, from
        ``step_plan``): ``query`` ``[batch, ...]``; returns ``[batch, num_heads, head_size]``
        (``out``'s storage where it is bf16). ``recent``: a residual window as a
        ``kvzip_kernels.Ring`` (``ring``)."""
        PATH_CALLS["decode_kernels"] += 1
        if recent is not None:
            PATH_CALLS["decode_kernels_window"] += 1
        b, g = query.shape[0], self.geometry
        k_pages, v_pages = self.pages(kv_cache)
        target = None
        if out is not None and out.dtype == torch.bfloat16 and out.is_contiguous():
            target = out.view(b, g.num_heads, g.head_size)
        q = query.reshape(b, g.num_heads, g.head_size)
        sk = None
        if self.sink_tokens:  # read by slot in the kernel, unless a slot may be another's now
            sk = (
                self.sinks_of(kv_cache, sinks, layer=layer)
                if sinks.may_miss
                else SinkSlots(self.sink_store(kv_cache), sinks.slots, self.sink_tokens)
            )
        res = plan.run(
            q if q.dtype == torch.bfloat16 else q.to(torch.bfloat16),
            k_pages,
            v_pages,
            layer=layer,
            out=target,
            sinks=sk,
            recent=recent,
        )
        if out is not None and target is None:
            out.copy_(res.reshape(out.shape))
        return res

    def workspace(
        self, kv_cache, block_table, lens, requests, *, layer: int, sinks=None, window=None,
        fresh=None,
    ):  # fmt: skip
        """The cached K and V of the sequences ``requests`` decoded into one packed bf16
        workspace ``[sum of their lengths, num_kv_heads, head_size]`` each (sinks in place),
        and the sequences' start offsets in it (a host list, ``len(requests) + 1``)."""
        g = self.geometry
        cu = [0]
        for i in requests:
            cu.append(cu[-1] + lens[i])
        out = []
        for kind, pages in zip("kv", self.pages(kv_cache), strict=True):
            rows = torch.cat(
                [
                    gather_rows(pages, self.layouts[kind], block_table[i], lens[i], kind)
                    for i in requests
                ]
            )
            x = self.fmt.decode(rows, kind=kind, layer=layer, head_dim=g.head_size)
            out.append(x.to(torch.bfloat16))
        if self.sink_tokens:
            idx = torch.tensor(list(requests), device=sinks.slots.device)
            sk, sv = self.sinks_of(kv_cache, sinks.select(idx), layer=layer)
            src = [
                (j, p)
                for j, i in enumerate(requests)
                for p in range(min(lens[i], self.sink_tokens))
            ]
            if src:
                dst = torch.tensor([cu[j] + p for j, p in src], device=out[0].device)
                j = torch.tensor([a for a, _ in src], device=sk.device)
                p = torch.tensor([b for _, b in src], device=sk.device)
                out[0][dst] = sk[j, p].to(out[0].device)
                out[1][dst] = sv[j, p].to(out[1].device)
        if window is not None:  # fresh: per request its new tokens' (k, v)
            PATH_CALLS["workspace_window"] += 1
            for j, i in enumerate(requests):
                self.place_window(out[0], out[1], kv_cache, window, i, *fresh[j], base=cu[j])
        return out[0], out[1], cu

    def attend_workspace(
        self, query, kv_cache, qsl, lens, block_table, *, layer: int, out, requests, sinks=None,
        window=None, key=None, value=None,
    ) -> torch.Tensor:  # fmt: skip
        """Prefill chunks: the sequences' pages decoded into a bf16 workspace, then one
        variable-length causal attention (``varlen``, or ``sdpa_varlen``) over it."""
        g = self.geometry
        reqs = [i for i in requests if qsl[i + 1] > qsl[i]]
        if not reqs:
            return out
        fresh = None
        if window is not None:
            fresh = [
                (self._fresh(key, slice(qsl[i], qsl[i + 1])),
                 self._fresh(value, slice(qsl[i], qsl[i + 1])))
                for i in reqs
            ]  # fmt: skip
        k, v, cu_k = self.workspace(
            kv_cache, block_table, lens, reqs, layer=layer, sinks=sinks, window=window,
            fresh=fresh,
        )  # fmt: skip
        rows = torch.cat([torch.arange(qsl[i], qsl[i + 1]) for i in reqs]).to(query.device)
        q = query[rows].reshape(-1, g.num_heads, g.head_size).to(torch.bfloat16)
        cu_q = [0]
        for i in reqs:
            cu_q.append(cu_q[-1] + qsl[i + 1] - qsl[i])
        o = torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)
        PATH_CALLS["prefill_workspace"] += 1
        PATH_CALLS[f"varlen:{getattr(self.varlen or sdpa_varlen, '__name__', 'varlen')}"] += 1
        if self.varlen is None:
            sdpa_varlen(q, k, v, cu_q, cu_k, self.scale, o)
        else:
            dev = q.device
            self.varlen(
                q,
                k,
                v,
                torch.tensor(cu_q, dtype=torch.int32, device=dev),
                torch.tensor(cu_k, dtype=torch.int32, device=dev),
                max(b - a for a, b in zip(cu_q, cu_q[1:], strict=False)),
                max(b - a for a, b in zip(cu_k, cu_k[1:], strict=False)),
                self.scale,
                o,
            )
        out[rows] = o.reshape(len(rows), *out.shape[1:]).to(out.dtype)
        return out

    def attend_reference(
        self,
        query,
        kv_cache,
        qsl,
        seq_lens_cpu,
        block_table,
        *,
        layer: int,
        out,
        requests=None,
        sinks=None,
        window=None,
        key=None,
        value=None,
    ) -> torch.Tensor:
        """float32 attention over the format's decode of every cached token (sinks from the
        pool; a residual window's tokens and the new ones in bf16), per request; ``qsl``: the
        query start offsets ``[batch + 1]`` (a list)."""
        PATH_CALLS["attend_reference"] += 1
        g = self.geometry
        k_pages, v_pages = self.pages(kv_cache)
        rep = g.num_heads // g.num_kv_heads
        lens = seq_lens_cpu.tolist()
        sk = sv = None
        if self.sink_tokens:
            sk, sv = self.sinks_of(kv_cache, sinks, layer=layer)
        for i in range(len(lens)) if requests is None else requests:
            qs, qe, seq_len = qsl[i], qsl[i + 1], lens[i]
            if qe == qs:
                continue
            k = self.gather(k_pages, block_table[i], seq_len, "k", layer, sk, i)
            v = self.gather(v_pages, block_table[i], seq_len, "v", layer, sv, i)
            if window is not None:
                rows = slice(qs, qe)
                self.place_window(
                    k, v, kv_cache, window, i, self._fresh(key, rows), self._fresh(value, rows)
                )
            q = query[qs:qe].reshape(qe - qs, g.num_heads, g.head_size).float()
            k = k.repeat_interleave(rep, dim=1)  # [n, hq, d]
            v = v.repeat_interleave(rep, dim=1)
            s = torch.einsum("qhd,khd->hqk", q, k) * self.scale
            # query token t sits at position seq_len - (qe - qs) + t and sees keys <= it
            qpos = torch.arange(seq_len - (qe - qs), seq_len, device=s.device)
            kpos = torch.arange(seq_len, device=s.device)
            s.masked_fill_(kpos[None, None, :] > qpos[None, :, None], -math.inf)
            o = torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), v)
            out[qs:qe].copy_(o.reshape(out[qs:qe].shape).to(out.dtype))
        return out

    def gather(self, pages, blocks, seq_len: int, kind: str, layer: int, sink=None, i=0):
        """Decoded K or V of one sequence, float32 ``[seq_len, num_kv_heads, head_size]``
        (its first positions from ``sink[i]``, the step's bf16 sinks, where given)."""
        rows = gather_rows(pages, self.layouts[kind], blocks, seq_len, kind)
        x = self.fmt.decode(rows, kind=kind, layer=layer, head_dim=self.head_size)
        n = min(self.sink_tokens, seq_len)
        if n and sink is not None:
            x[:n] = sink[i, :n].float().to(x.device)
        return x


@functools.cache
def _kernel_refusal(fmt, g: Geometry, sink_tokens: int, recent: int, device: str) -> str | None:
    """Why kvzip-kernels refuse this configuration (None if they take it): their ``refusal``
    (format, head size, block size, heads, sinks, window; the decode refuses everything the
    write does), logged once per process."""
    why = refusal(
        fmt,
        num_q_heads=g.num_heads,
        num_kv_heads=g.num_kv_heads,
        head_dim=g.head_size,
        block_size=g.block_size,
        sinks=sink_tokens > 0,
        window=recent > 0,
    )
    if why is not None:
        logger.warning(
            "kvzip: kvzip-kernels do not take format %s at %s (%s); this layer uses the torch "
            "reference path on %s (correct, slower)",
            getattr(fmt, "name", fmt),
            g,
            why,
            device,
        )
    return why
