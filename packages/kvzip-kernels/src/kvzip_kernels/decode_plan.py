"""Decode attention as plan and run: one plan per forward step, one launch sequence per layer.

In a serving step every attention layer decodes the same sequences over caches of the same
shape: only the query, the layer's caches (and its bf16 sinks and window) and the layer's
calibration differ. :func:`plan` does, once per step, what the layers share: it validates the
shapes, dtypes, devices and strides (the format's support, the caches against the format's
paged layout, ``spec/paged_layout.md``), picks the kernel (CUDA or Triton) and the split-KV
sizes, computes where each sequence's rows stop under a residual window, and allocates the
scratch buffers (partial outputs, log-sum-exps, the folded query) that every layer reuses: the
layers run one after the other on one stream, so a buffer is free again when the next layer's
first kernel starts. :meth:`DecodePlan.run` then only launches (a few attribute compares guard
against a layer whose tensors do not match the plan; no torch op beyond the launches).

:func:`supports` / :func:`refusal` answer, without touching a tensor, whether the kernels take
a configuration (format, head size, block size, heads, sinks, window) and why not.

Example::

    p = plan("4bit", num_q_heads=32, head_dim=128, block_table=bt, seq_lens=lens,
             k_cache=k0, v_cache=v0, block_size=16, max_seq_len=int(lens.max()), n_sink=1)
    for layer, (q, k, v, sinks) in enumerate(layers):
        p.run(q, k, v, layer=layer, sinks=sinks, out=outs[layer])
"""

from __future__ import annotations

import math
import os
from collections import Counter
from dataclasses import dataclass

import torch
import triton

from kvzip_formats import FormatError, KVFormat
from kvzip_formats.ops import check_decode_inputs
from kvzip_kernels._decode_codebook import _codebook_split_kernel
from kvzip_kernels._decode_kernels import _fp8_split_kernel, _int4_split_kernel, _merge_kernel
from kvzip_kernels._device_consts import codebook_lut, fold_q, on_device, transform_consts, unfold_o
from kvzip_kernels._formats import check_strided_cache, kernel_spec, resolve
from kvzip_kernels._merge_extra import Ring, SinkSlots, merge_extra, window_row_end

LOG2E = 1.4426950408889634

#: Layer calls by ``"format:backend"`` (``"4bit:cuda"``, ``"4bit:triton"``): which kernels a
#: run (a serving benchmark, say) used, ``auto`` having chosen per plan.
CALLS: Counter[str] = Counter()


@dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters of the split-KV stage.

    Defaults from sm_90 SASS and H200 timings (NOTES.md): block_n 128 with 4 warps issues
    33 warp-instructions per token and KV head in the int4 loop, against 61 for block_n 64.
    """

    block_n: int = 128  # tokens per loop iteration (a multiple of the page size)
    num_warps: int = 4
    num_stages: int = 2
    num_splits: int | None = None  # split-KV factor; None: see _num_splits
    split_tokens: int = 2048  # target tokens per split (halved down to 512 to fill the GPU)
    #: the CUDA split kernel's design (``_cuda.VARIANTS``: ``v6``, ``v7``, ``v7s4``; NOTES.md
    #: "v7"), or ``auto``: each format's measured best (``_cuda.SHIPPED``); a ValueError names
    #: them for anything else
    cuda_variant: str = "auto"

    def __post_init__(self):
        from kvzip_kernels._cuda import check_variant

        check_variant(self.cuda_variant, auto=True)


#: A CTA's fixed cost in tokens streamed, for :func:`_splits_by_rounds`: 70B-TP8 at 32k on the
#: H200 (v6, NOTES.md "Split sizing by rounds") read ~16 us per round of CTAs against
#: ~0.011 us per token, ~1500 tokens; a third of that keeps the choice near the old rule's.
SPLIT_FIXED_TOKENS = 512


def _num_splits(
    batch: int,
    num_kv_heads: int,
    max_tokens: int,
    cfg: DecodeConfig,
    device,
    ctas_per_sm: int = 0,
    step: int = 0,
) -> int:
    """Splits of ~``split_tokens`` tokens: many short programs keep the last wave's idle
    share small (9 splits of 14.5k tokens ran 1.09 waves and cost ~25% at 8B, batch 8);
    shorter splits, down to 512 tokens, while there are fewer than 4 programs per SM. With
    ``ctas_per_sm`` (the CUDA kernel's residency): :func:`_splits_by_rounds` (``step``: the
    multiple of tokens a split is rounded up to)."""
    sms = (
        torch.cuda.get_device_properties(device).multi_processor_count
        if device.type == "cuda"
        else 4
    )
    if ctas_per_sm > 0:
        step = step or cfg.block_n
        return _splits_by_rounds(batch * num_kv_heads, max_tokens, sms * ctas_per_sm, cfg, step)
    tokens = max(cfg.split_tokens, cfg.block_n)
    while (
        tokens > max(512, cfg.block_n)
        and batch * num_kv_heads * math.ceil(max_tokens / tokens) < 4 * sms
    ):
        tokens //= 2
    return int(min(max(1, math.ceil(max_tokens / tokens)), 1024))


def _splits_by_rounds(work: int, max_tokens: int, slots: int, cfg: DecodeConfig, step: int) -> int:
    """Splits for ``work`` (sequence, KV head) pairs of up to ``max_tokens`` tokens on ``slots``
    resident CTAs (SMs x CTAs per SM). The CTAs of a split grid are all of one length and
    start together, so they run in rounds of ``slots``, and each round pays a CTA's fixed cost
    (block ids, the level tables, the ring's first tile, the merge) once: a grid of 1.29
    rounds costs two. Of the split lengths the plan can give (multiples of ``step`` from
    max(512, block_n) to max(split_tokens, block_n), which include the old rule's 512, 1024 and
    2048), the longest whose rounds x (SPLIT_FIXED_TOKENS + tokens per split) is within 3% of
    the least (fewer partial outputs to merge, fewer CTAs)."""
    up = lambda x: -(-x // step) * step  # noqa: E731
    lo, hi = up(max(512, cfg.block_n)), up(max(cfg.split_tokens, cfg.block_n))
    costs = []  # (cost, splits), longest split first
    for t in range(hi, lo - 1, -max(step, step * (128 // step))):
        n = max(1, math.ceil(max_tokens / t))
        costs.append((math.ceil(work * n / slots) * (SPLIT_FIXED_TOKENS + min(t, max_tokens)), n))
    least = min(c for c, _ in costs)
    # the longest split within 3% of the least cost: a few percent of a model is no reason
    # for more, shorter CTAs
    n = next(n for c, n in costs if c <= 1.03 * least)
    return int(min(n, 1024))


def refusal(
    fmt: KVFormat | str,
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    sinks: bool = False,
    window: bool = False,
    config: DecodeConfig | None = None,
) -> str | None:
    """Why the kernels (decode and cache write) do not take this configuration, or None if
    they do. Reads no tensor: the format's kernel description and the geometry only."""
    try:
        f = resolve(fmt)
        spec = kernel_spec(f, head_dim, block_size)
    except FormatError as e:
        return str(e)
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        return f"num_q_heads {num_q_heads} is not a multiple of num_kv_heads {num_kv_heads}"
    if spec.family == "codebook" and (spec.k_groups is None or spec.v_groups is None):
        return (
            f"format {f.name!r}: the decode kernel reads rows of at most two channel groups "
            f"of 2, 3 or 4 bits with >= 16 channels per class (4 bits: >= 32 channels; "
            f"2 and 3 bits: 32 or >= 64); this format's rows at head_dim {head_dim} have "
            f"groups K {f.spec.k_groups}, V {f.spec.v_groups}"
        )
    if sinks and spec.family != "codebook":
        return "sinks= is for the compact formats (bf16 sink tokens); this format has none"
    if window and spec.family != "codebook":
        return (
            "recent= (a residual window) is for the compact formats (4bit, 3.5bit, 3bit); "
            f"format {f.name!r} reads every token from its rows"
        )
    cfg = config or DecodeConfig()
    if cfg.block_n % block_size and block_size % cfg.block_n:
        return f"config.block_n {cfg.block_n} and block_size {block_size} must divide"
    return None


def supports(fmt: KVFormat | str, **geometry) -> bool:
    """Whether the kernels take this configuration (:func:`refusal` says why not)."""
    return refusal(fmt, **geometry) is None


def plan(
    fmt: KVFormat | str,
    *,
    num_q_heads: int,
    head_dim: int,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_size: int,
    max_seq_len: int | None = None,
    sm_scale: float | None = None,
    block_stride: int | None = None,
    n_sink: int = 0,
    window: int = 0,
    recent_from: torch.Tensor | None = None,
    row_end: torch.Tensor | None = None,
    config: DecodeConfig | None = None,
    backend: str | None = None,
) -> DecodePlan:
    """The step's :class:`DecodePlan`, for one new token per sequence.

    ``block_table`` int32 ``[batch, max_blocks]`` and ``seq_lens`` int32 ``[batch]`` (each
    >= 1) are the step's; ``k_cache``/``v_cache`` one layer's caches (uint8 ``[num_blocks,
    num_kv_heads, block_size * token_head_bytes]``; every layer's must have the same shape and
    strides; ``block_stride``: see ``check_strided_cache``). ``max_seq_len`` (an upper bound of
    seq_lens) avoids reading seq_lens on the host. ``n_sink``: the bf16 sink tokens each run
    gets (``sinks=``); ``window``: the entries of a right-aligned bf16 window each run gets
    (``recent=``: ``R`` for ``(k, v)`` ``[batch, R, H, d]``, ``recent + 1`` for a
    :class:`Ring`), with ``recent_from`` (the window holds positions from there on) or
    ``row_end`` (where each sequence's rows stop, int32 ``[batch]``: a Ring's ``row_end``).
    ``backend``: ``"auto"`` (default; or ``KVZIP_KERNELS_BACKEND``) runs the CUDA C++ split
    kernel (``_cuda.py``) on sm_90 where it builds and Triton elsewhere; ``"cuda"`` forces it
    (a ``FormatError`` saying why where it cannot run); ``"triton"`` forces Triton.
    """
    f = resolve(fmt)
    if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2:
        raise FormatError(
            f"block_table must be int32 [batch, max_blocks], got {getattr(block_table, 'shape', block_table)}"  # noqa: E501
        )
    b = block_table.shape[0]
    if not isinstance(k_cache, torch.Tensor) or k_cache.dim() != 3:
        raise FormatError(
            "k_cache must be uint8 [num_blocks, num_kv_heads, page_bytes], got "
            f"{getattr(k_cache, 'shape', k_cache)}"
        )
    hkv = k_cache.shape[1]
    d = head_dim
    why = refusal(
        f,
        num_q_heads=num_q_heads,
        num_kv_heads=hkv,
        head_dim=d,
        block_size=block_size,
        sinks=n_sink > 0,
        window=window > 0,
        config=config,
    )
    if why is not None:
        raise FormatError(why)
    spec = kernel_spec(f, d, block_size)
    k_stride = check_strided_cache(k_cache, spec.layout, None, block_stride, "k_cache")
    v_stride = check_strided_cache(v_cache, spec.vlay, None, block_stride, "v_cache")
    # q's shape stands in for the query every run gets (checked there)
    q_meta = torch.empty(b, num_q_heads, d, dtype=torch.bfloat16, device="meta")
    check_decode_inputs(
        q_meta,
        k_cache[:1].contiguous(),
        v_cache[:1].contiguous(),
        block_table,
        seq_lens,
        spec.layout,
        spec.vlay,
    )
    if v_cache.shape[:2] != k_cache.shape[:2]:
        raise FormatError(
            f"v_cache shape {tuple(v_cache.shape)} and k_cache shape {tuple(k_cache.shape)} "
            "differ in blocks or heads"
        )
    dev = block_table.device
    devs = {t.device for t in (k_cache, v_cache, block_table, seq_lens)}
    if len(devs) != 1:
        raise FormatError(f"caches, block_table and seq_lens must share one device, got {devs}")
    cfg = config or DecodeConfig()
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
        if int(seq_lens.min()) < 1:
            raise FormatError(f"seq_lens must be >= 1, got min {int(seq_lens.min())}")
    if max_seq_len > block_table.shape[1] * block_size:
        raise FormatError(
            f"max_seq_len {max_seq_len} exceeds block_table capacity "
            f"{block_table.shape[1]} blocks x {block_size}"
        )
    full = end = None
    if window:
        if row_end is not None and recent_from is not None:
            raise FormatError("recent_from= is for a window tensor; a Ring carries its row_end")
        for name, t, dt in (("row_end", row_end, torch.int32), ("recent_from", recent_from, None)):
            if t is not None and (
                not isinstance(t, torch.Tensor)
                or t.shape != (b,)
                or t.device != dev
                or t.is_floating_point()
                or (dt is not None and t.dtype != dt)
            ):
                raise FormatError(
                    f"{name} must be an integer tensor [batch={b}] on {dev}, got "
                    f"{getattr(t, 'dtype', type(t))} {tuple(getattr(t, 'shape', ()))}"
                )
        full = seq_lens.to(torch.int32)
        # the rows end where the window starts (never inside the sinks)
        end = row_end if row_end is not None else window_row_end(full, window, n_sink, recent_from)
    elif recent_from is not None or row_end is not None:
        raise FormatError("recent_from= and row_end= need a window (recent=)")
    from kvzip_kernels import _cuda

    g = num_q_heads // hkv
    use_cuda = _cuda.choose(backend, f.name, spec, g, dev) == "cuda"
    return DecodePlan(
        f, spec, cfg, b, num_q_heads, hkv, d, block_size, max_seq_len, sm_scale, block_table,
        seq_lens, full, end, n_sink, window, k_cache, v_cache, k_stride, v_stride, use_cuda,
    )  # fmt: skip


class DecodePlan:
    """A decode step's shared work (:func:`plan`); :meth:`run` per layer."""

    def __init__(
        self, f, spec, cfg, b, hq, hkv, d, block_size, max_seq_len, sm_scale, block_table,
        seq_lens, full, end, n_sink, window, k_cache, v_cache, k_stride, v_stride, use_cuda,
    ):  # fmt: skip
        self.fmt, self.spec, self.config = f, spec, cfg
        self.batch, self.num_q_heads, self.num_kv_heads, self.head_dim = b, hq, hkv, d
        self.block_size = block_size
        self.n_sink, self.window = n_sink, window
        self.block_table, self.seq_lens = block_table, seq_lens
        self.full, self.row_end = full, end
        dev = block_table.device
        self.device = dev
        self.use_cuda = use_cuda
        self.calls_key = f"{f.name}:{'cuda' if use_cuda else 'triton'}"
        # what every layer's caches must match (their shape and strides were validated here)
        self.k_sig = (tuple(k_cache.shape), k_cache.stride(), k_cache.dtype, k_cache.device)
        self.v_sig = (tuple(v_cache.shape), v_cache.stride(), v_cache.dtype, v_cache.device)
        self.k_stride, self.v_stride = k_stride, v_stride
        self.scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
        from kvzip_kernels import _cuda

        #: the CUDA design this plan runs (``config.cuda_variant`` with ``auto`` resolved)
        self.cuda_variant = _cuda.resolve_variant(cfg.cuda_variant, f.name, k_stride, v_stride)
        ctas = 0
        if use_cuda and cfg.num_splits is None:
            ctas = _cuda.ctas_per_sm(f.name, d, dev, self.cuda_variant)
        step = max(cfg.block_n, block_size)
        splits = cfg.num_splits or _num_splits(b, hkv, max_seq_len, cfg, dev, ctas, step)
        per_split = triton.cdiv(triton.cdiv(max_seq_len, splits), step) * step
        self.splits = triton.cdiv(max_seq_len, per_split)
        self.per_split = per_split
        g = hq // hkv
        self.group = g
        self.interpret = os.environ.get("TRITON_INTERPRET") == "1"
        self.common = dict(
            INTERPRET=self.interpret,
            G=g,
            BLOCK_M=max(16, triton.next_power_of_2(g)),
            D=d,
            PS=block_size,
            BLOCK_N=cfg.block_n,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
        self.grid = (b * hkv, self.splits)
        # scratch shared by the step's layers (stream order frees them between layers)
        self.o_part = torch.empty(b * hq * self.splits * d, dtype=torch.float32, device=dev)
        self.lse = torch.empty(b * hq * self.splits, dtype=torch.float32, device=dev)
        self.codebook = spec.family == "codebook"
        self.rot = None
        if spec.rotation is not None:  # K and V are stored as x @ R: rotate q the same way
            self.rot = on_device(spec.rotation, dev, lambda r: r.float().contiguous())
        self.y = None
        if self.codebook or self.rot is not None:
            self.y = torch.empty(b, hq, d, dtype=torch.float32, device=dev)
        self.q16 = self.qs = None
        if self.codebook:
            self.q16 = torch.empty(b, hq, d, dtype=torch.float16, device=dev)
            self.qs = torch.empty(b * hq, dtype=torch.float32, device=dev)
            # merge_extra's lengths where there is no window (an unread placeholder)
            self.lens_or_placeholder = full if full is not None else seq_lens
        # the split kernels stop where the bf16 window starts
        self.row_lens = end if end is not None else seq_lens
        self.geometry = None
        if use_cuda:
            self.geometry = dict(
                num_kv_heads=hkv,
                k_page_bytes=spec.layout.page_bytes,
                v_page_bytes=spec.vlay.page_bytes,
                k_blk_stride=k_stride,
                v_blk_stride=v_stride,
                block_size=block_size,
                tokens_per_split=per_split,
                num_splits=self.splits,
            )
            if self.codebook:
                from kvzip_kernels import _cuda

                self.lut16 = _cuda.level_table(spec, dev)
        elif self.codebook:
            self.lut = codebook_lut(spec.k_groups, spec.v_groups, str(dev))
            self.consts = {}
            for kind, groups in (("K", spec.k_groups), ("V", spec.v_groups)):
                for i, (bits, n, off, off1) in enumerate(groups):
                    self.consts.update(
                        {f"{kind}B{i}": bits, f"{kind}N{i}": n, f"{kind}O{i}": off,
                         f"{kind}P{i}": off1}
                    )  # fmt: skip

    # -- the layer call ------------------------------------------------------------------
    def _check(self, q, k_cache, v_cache, out, sinks, recent) -> None:
        """What differs per layer, against the plan: attribute compares only."""
        want = (self.batch, self.num_q_heads, self.head_dim)
        if not isinstance(q, torch.Tensor) or tuple(q.shape) != want or q.dtype != torch.bfloat16:
            raise FormatError(
                f"q must be bfloat16 {list(want)} (the plan's), got "
                f"{getattr(q, 'dtype', type(q))} {list(getattr(q, 'shape', ()))}"
            )
        for name, t, sig in (("k_cache", k_cache, self.k_sig), ("v_cache", v_cache, self.v_sig)):
            if (tuple(t.shape), t.stride(), t.dtype, t.device) != sig:
                raise FormatError(
                    f"{name} {t.dtype} {tuple(t.shape)} strides {t.stride()} on {t.device} is not "
                    f"the planned cache's ({sig[2]} {sig[0]} strides {sig[1]} on {sig[3]})"
                )
        if out is not None and (
            tuple(out.shape) != want or out.dtype != torch.bfloat16 or not out.is_contiguous()
        ):
            raise FormatError(
                f"out must be a contiguous bf16 tensor of shape {want}, "
                f"got {out.dtype} {tuple(out.shape)}"
            )
        if (sinks is not None) != (self.n_sink > 0):
            raise FormatError(
                f"the plan has n_sink={self.n_sink}: sinks= must be "
                f"{'given' if self.n_sink else 'None'}"
            )
        if isinstance(sinks, SinkSlots):
            _check_sink_slots(sinks, q, self.num_kv_heads, self.n_sink)
        elif sinks is not None:
            bwant = (self.batch, self.n_sink, self.num_kv_heads, self.head_dim)
            for part, t in zip("kv", sinks, strict=True):
                if tuple(t.shape) != bwant or t.dtype != torch.bfloat16 or t.device != q.device:
                    raise FormatError(
                        f"sinks {part} must be bf16 {list(bwant)} on {q.device}, got {t.dtype} "
                        f"{list(t.shape)} on {t.device}"
                    )
        if (recent is not None) != (self.window > 0):
            raise FormatError(
                f"the plan has window={self.window}: recent= must be "
                f"{'given' if self.window else 'None'}"
            )
        if isinstance(recent, Ring):
            _check_ring(recent, q, self.num_kv_heads)
            if recent.recent + 1 != self.window or recent.row_end is not self.row_end:
                raise FormatError(
                    f"the Ring (recent {recent.recent}) is not the planned window of "
                    f"{self.window} entries with its row_end (plan(window=ring.recent + 1, "
                    "row_end=ring.row_end))"
                )
        elif recent is not None:
            bwant = (self.batch, self.window, self.num_kv_heads, self.head_dim)
            if not (isinstance(recent, tuple) and len(recent) == 2):
                raise FormatError(f"recent must be a Ring or a tuple (k, v) of {list(bwant)}")
            for part, t in zip("kv", recent, strict=True):
                if tuple(t.shape) != bwant or t.dtype != torch.bfloat16 or t.device != q.device:
                    raise FormatError(
                        f"recent {part} must be bf16 {list(bwant)} on {q.device}, got {t.dtype} "
                        f"{list(t.shape)} on {t.device}"
                    )

    def run(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        *,
        layer: int = 0,
        out: torch.Tensor | None = None,
        sinks: tuple[torch.Tensor, torch.Tensor] | SinkSlots | None = None,
        recent: tuple[torch.Tensor, torch.Tensor] | Ring | None = None,
    ) -> torch.Tensor:
        """One layer's decode: ``q`` bf16 ``[batch, num_q_heads, head_dim]`` over the layer's
        caches (shaped and strided as the planned ones) into ``out`` (bf16, contiguous; a new
        tensor when None), which it returns. ``sinks``: bf16 ``(k, v)`` ``[batch, n_sink,
        num_kv_heads, head_dim]`` (spec/4bit.md sections 6 and 8) or a :class:`SinkSlots`
        (read from a server's sink store by slot); ``recent``: the planned
        window, ``(k, v)`` ``[batch, window, num_kv_heads, head_dim]`` right-aligned or a
        :class:`Ring` (spec/residual_window.md)."""
        self._check(q, k_cache, v_cache, out, sinks, recent)
        CALLS[self.calls_key] += 1
        if out is None:
            out = torch.empty_like(q)
        if q.stride(2) != 1:
            q = q.contiguous()
        if self.rot is not None:
            q = (q.float() @ self.rot).to(torch.bfloat16)
        scale2 = self.scale * LOG2E
        if self.codebook:
            self._codebook(q, k_cache, v_cache, layer, out, sinks, recent, scale2)
            return out
        if self.use_cuda:  # int4, int4-rot
            from kvzip_kernels import _cuda

            q = q.contiguous()
            _cuda.split(
                self.fmt.name, q, None, None, k_cache, v_cache, self.block_table, self.seq_lens,
                self.o_part, self.lse, scale2, variant=self.cuda_variant,
                **self.geometry,
            )  # fmt: skip
        elif self.spec.family == "int4":
            _int4_split_kernel[self.grid](
                q, k_cache, v_cache, k_cache.view(torch.int32), v_cache.view(torch.int32),
                self.block_table, self.seq_lens, self.o_part, self.lse, scale2, q.stride(0),
                q.stride(1), self.block_table.stride(0), self.num_kv_heads,
                self.spec.layout.page_bytes, self.k_stride, self.per_split, self.splits,
                **self.common,
            )  # fmt: skip
        else:
            _fp8_split_kernel[self.grid](
                q, k_cache.view(torch.float8_e4m3fn), v_cache.view(torch.float8_e4m3fn),
                self.block_table, self.seq_lens, self.o_part, self.lse,
                scale2 * self.spec.k_scale, self.spec.v_scale, q.stride(0), q.stride(1),
                self.block_table.stride(0), self.num_kv_heads, self.spec.layout.page_bytes,
                self.k_stride, self.per_split, self.splits, **self.common,
            )  # fmt: skip
        target = out if self.rot is None else self.y
        self._merge(target, out_bf16=self.rot is None)
        if self.rot is not None:
            out.copy_(self.y @ self.rot)
        return out

    def _merge(self, target, out_bf16: bool) -> None:
        _merge_kernel[(self.batch * self.num_q_heads,)](
            self.o_part,
            self.lse,
            target,
            self.splits,
            CH=16,
            D=self.head_dim,
            OUT_BF16=out_bf16,
            INTERPRET=self.interpret,
            num_warps=4,
        )

    def _codebook(self, q, k_cache, v_cache, layer, out, sinks, recent, scale2) -> None:
        """The compact formats: the calibrated transforms folded into q and the output.

        ``score = q . (B_k y_k + mean_k) = (B_k^T q) . y_k + const`` (the constant is the same
        for every key and drops out of the softmax); ``o = B_v y + mean_v`` since the
        probabilities sum to 1. ``q'`` is scaled per row by a power of two into fp16's range
        (exact), the kernel undoes it in the scores. With sinks or a window the split kernels
        skip the sink positions and stop at the window, and the output merges their exact
        bf16 K/V by log-sum-exp; then ``q . mean_k`` no longer cancels and shifts the rows'
        log-sum-exp (spec/4bit.md section 6)."""
        f, spec, dev = self.fmt, self.spec, self.device
        hkv = self.num_kv_heads
        # constants on the device once (a per-call upload from host memory waits for the
        # stream: ~1 ms per call on the H200, _device_consts.py)
        mean_k, bk, _, _ = transform_consts(f.transform_of("k", layer), dev)
        mean_v, _, bvt, _ = transform_consts(f.transform_of("v", layer), dev)
        q16, qs = fold_q(q, bk, hkv, out=(self.q16, self.qs))
        if self.use_cuda:
            from kvzip_kernels import _cuda

            _cuda.split(
                f.name, q16, qs, self.lut16, k_cache, v_cache, self.block_table, self.row_lens,
                self.o_part, self.lse, scale2, skip=self.n_sink,
                variant=self.cuda_variant, **self.geometry,
            )  # fmt: skip
        else:
            _codebook_split_kernel[self.grid](
                q16, qs, k_cache, v_cache, k_cache.view(torch.float16),
                v_cache.view(torch.float16), self.lut, self.block_table, self.row_lens,
                self.o_part, self.lse, scale2, self.block_table.stride(0), hkv,
                spec.layout.page_bytes, spec.vlay.page_bytes, self.k_stride, self.v_stride,
                self.per_split, self.splits, self.n_sink, KCB=spec.layout.code_bytes,
                VCB=spec.vlay.code_bytes, **self.consts, **self.common,
            )  # fmt: skip
        self._merge(self.y, out_bf16=False)
        if sinks is None and recent is None:
            unfold_o(self.y, bvt, mean_v, out, hkv, self.interpret)
            return
        # the rows merged with the bf16 sinks and window in one kernel (_merge_extra.py)
        merge_extra(
            self.y, self.lse, bvt, mean_v, mean_k, q, sinks, recent, self.lens_or_placeholder,
            self.row_end, out, scale2, self.splits, self.interpret,
        )  # fmt: skip


def _check_sink_slots(s: SinkSlots, q, num_kv_heads: int, n_sink: int) -> None:
    b, _, d = q.shape
    st, sl = s.store, s.slots
    if st.dim() != 3 or st.dtype != torch.bfloat16 or st.device != q.device or s.n != n_sink:
        raise FormatError(
            "SinkSlots.store must be a bf16 [num_slots, blocks, values] view on the query's "
            f"device holding the plan's {n_sink} sink token(s), got {st.dtype} "
            f"{list(st.shape)} on {st.device}, n={s.n}"
        )
    if sl.shape != (b,) or sl.dtype != torch.int64 or sl.device != q.device:
        raise FormatError(
            f"SinkSlots.slots must be int64 [{b}] on {q.device}, got {sl.dtype} {list(sl.shape)}"
        )
    need = n_sink * 2 * num_kv_heads * d
    if st.shape[1] * st.shape[2] < need:
        held = st.shape[1] * st.shape[2]
        raise FormatError(f"SinkSlots.store slots hold {held} values, need {need}")


def _check_ring(ring: Ring, q, num_kv_heads: int) -> None:
    b, _, d = q.shape
    want = (b, num_kv_heads, d)
    for name, t in (("fresh_k", ring.fresh_k), ("fresh_v", ring.fresh_v)):
        if t.shape != want or t.dtype != torch.bfloat16 or t.device != q.device:
            raise FormatError(
                f"Ring.{name} must be bf16 {list(want)} on {q.device}, got {t.dtype} "
                f"{list(t.shape)} on {t.device}"
            )
    for name, t, dt in (("slots", ring.slots, torch.int64), ("row_end", ring.row_end, torch.int32)):
        if t.shape != (b,) or t.dtype != dt or t.device != q.device:
            raise FormatError(
                f"Ring.{name} must be {dt} [{b}] on {q.device}, got {t.dtype} {list(t.shape)}"
            )
    st = ring.store
    if st.dim() != 3 or st.dtype != torch.bfloat16 or st.device != q.device or ring.recent < 1:
        raise FormatError(
            "Ring.store must be a bf16 [num_slots, blocks, values] view on the query's device "
            f"and recent >= 1, got {st.dtype} {list(st.shape)}, recent {ring.recent}"
        )
    need = ring.recent * 2 * num_kv_heads * d
    if st.shape[1] * st.shape[2] < need:
        raise FormatError(f"Ring.store slots hold {st.shape[1] * st.shape[2]} values, need {need}")
