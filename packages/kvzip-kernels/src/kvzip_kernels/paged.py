"""A server's paged cache in a kvzip format, and the attention over it (no vLLM here:
kvzip-vllm's backend is a thin adapter over this module, tested on its own, on the CPU and on
CUDA).

One attention layer's cache, as vLLM hands it to the backend: uint8 ``[num_blocks,
num_kv_heads, block_size, content_bytes]``, each block its K pages, its V pages and its share
of the sink pool's and a residual window's slots (``_paged_cache.py`` has the layout and the
slots: ``PagedCache``, the base of ``PagedAttention``).

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
import os
from dataclasses import dataclass

import torch

from kvzip_kernels._merge_extra import SinkSlots, ring_write, window_row_end
from kvzip_kernels._paged_cache import PATH_CALLS, Geometry, content_bytes
from kvzip_kernels._paged_torch import TorchPaths, VarlenAttention, sdpa_varlen
from kvzip_kernels.cache_write import cache_write
from kvzip_kernels.decode_plan import DecodePlan, refusal
from kvzip_kernels.decode_plan import plan as plan_decode
from kvzip_kernels.sinks import (
    SINK_SLOT_TOKENS,
    SinkPool,
    StepSinks,
    plan_step,
    sink_plan,
    sink_reserve_bytes,
)
from kvzip_kernels.window import DEFAULT_SLOT_TOKENS, StepWindow, WindowPool, window_reserve_bytes

# the public names, some from the sibling modules (the tests and kvzip-vllm import them here)
__all__ = [
    "DEFAULT_SLOT_TOKENS",
    "PATH_CALLS",
    "SINK_SLOT_TOKENS",
    "Geometry",
    "PagedAttention",
    "SinkPool",
    "StepPlan",
    "StepSinks",
    "StepWindow",
    "VarlenAttention",
    "WindowPool",
    "content_bytes",
    "plan_step",
    "sdpa_varlen",
    "sink_plan",
    "sink_reserve_bytes",
    "triton_runs",
    "window_reserve_bytes",
]

# under vLLM's logger tree, whose handlers a server configures (the name it had in kvzip_vllm)
logger = logging.getLogger("vllm.kvzip.paged")


def triton_runs(device: torch.device) -> bool:
    """Whether kvzip-kernels' Triton kernels run on ``device``: CUDA, or the CPU under the
    Triton interpreter (``TRITON_INTERPRET=1``, read by Triton at import)."""
    if device.type == "cuda":
        return True
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


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


class PagedAttention(TorchPaths):
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
        if prefill not in (None, "workspace", "reference"):
            raise ValueError(f"prefill must be 'workspace' or 'reference', got {prefill!r}")
        super().__init__(
            fmt,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_size=head_size,
            block_size=block_size,
            recent=recent,
            window_slot_tokens=window_slot_tokens,
        )
        self.scale = float(scale)
        self.kernels = kernels
        self.prefill, self.varlen = prefill, varlen

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
