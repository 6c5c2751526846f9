"""Paged decode attention on kvzip's paged cache (``kvzip_formats/spec/paged_layout.md``).

``paged_decode(fmt, q, k_cache, v_cache, block_table, seq_lens, block_size=...)`` matches
``kvzip_formats.ops.paged_decode`` (float32 attention on the dequantised cache) within the
earned tolerance. Validation happens here; the kernels trust their inputs.
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
from kvzip_formats.ops.paged_decode import check_window
from kvzip_kernels._decode_codebook import _codebook_split_kernel
from kvzip_kernels._decode_kernels import _fp8_split_kernel, _int4_split_kernel, _merge_kernel
from kvzip_kernels._device_consts import codebook_lut, fold_q, on_device, transform_consts, unfold_o
from kvzip_kernels._formats import check_strided_cache, kernel_spec, resolve
from kvzip_kernels._merge_extra import Ring, merge_extra, window_row_end

LOG2E = 1.4426950408889634

#: Calls of :func:`paged_decode` by ``"format:backend"`` (``"4bit:cuda"``, ``"4bit:triton"``):
#: which kernels a run (a serving benchmark, say) used, ``auto`` having chosen per call.
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
    # the CUDA kernel's design where the CUDA backend runs: "v4a" or "v5" (_cuda.py); None:
    # KVZIP_KERNELS_CUDA_VARIANT, else _cuda.DEFAULT_VARIANT
    cuda_variant: str | None = None


def _num_splits(batch: int, num_kv_heads: int, max_tokens: int, cfg: DecodeConfig, device) -> int:
    """Splits of ~``split_tokens`` tokens: many short programs keep the last wave's idle
    share small (9 splits of 14.5k tokens ran 1.09 waves and cost ~25% at 8B, batch 8);
    shorter splits, down to 512 tokens, while there are fewer than 4 programs per SM."""
    sms = (
        torch.cuda.get_device_properties(device).multi_processor_count
        if device.type == "cuda"
        else 4
    )
    tokens = max(cfg.split_tokens, cfg.block_n)
    while (
        tokens > max(512, cfg.block_n)
        and batch * num_kv_heads * math.ceil(max_tokens / tokens) < 4 * sms
    ):
        tokens //= 2
    return int(min(max(1, math.ceil(max_tokens / tokens)), 1024))


def paged_decode(
    fmt: KVFormat | str,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    block_size: int,
    layer: int = 0,
    sm_scale: float | None = None,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,
    config: DecodeConfig | None = None,
    block_stride: int | None = None,
    sinks: tuple[torch.Tensor, torch.Tensor] | None = None,
    recent: tuple[torch.Tensor, torch.Tensor] | None = None,
    recent_from: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Decode attention for one new token per sequence.

    q ``[batch, num_q_heads, head_dim]`` bf16; k_cache/v_cache uint8 ``[num_blocks,
    num_kv_heads, block_size * token_head_bytes]``; block_table int32 ``[batch, max_blocks]``;
    seq_lens int32 ``[batch]`` (each >= 1). Returns ``out`` ``[batch, num_q_heads, head_dim]``
    bf16. ``max_seq_len`` (an upper bound of seq_lens) avoids reading seq_lens on the host.
    Rotated formats (``int4-rot``) get the query rotated before and the output after.
    ``block_stride`` (bytes) admits caches strided in their block dimension, such as vLLM's
    ``kv[:, 0]`` / ``kv[:, 1]`` (see ``check_strided_cache``). ``sinks``: for the compact
    formats, the bf16 copies ``(k, v)`` ``[batch, n_sink, num_kv_heads, head_dim]`` of each
    sequence's first tokens, attended instead of their rows (spec/4bit.md sections 6 and 8).
    ``recent``: for the compact formats, a residual window (spec/residual_window.md): the bf16
    copies ``(k, v)`` ``[batch, R, num_kv_heads, head_dim]`` of each sequence's last ``R``
    tokens, right-aligned (entry ``j`` is position ``seq_lens[b] - R + j``; entries before the
    sinks are ignored), attended instead of their rows: the kernels read the rows up to
    ``max(seq_lens - R, n_sink)`` and the window is merged with the sinks by log-sum-exp.
    ``recent_from`` (int ``[batch]``, on the device): the window holds only positions from
    there on; the rows before it are read (the row end moves there, never past the sequence).
    ``backend``: ``"auto"`` (default; or the ``KVZIP_KERNELS_BACKEND`` environment variable)
    runs the CUDA C++ split kernel (``_cuda.py``: int4, int4-rot, 4bit, 3.5bit, 3bit; at most 8
    query heads per KV head; ``config.cuda_variant`` picks its design) on sm_90 where it builds,
    and Triton elsewhere; ``"cuda"`` forces it (a
    ``FormatError`` saying why where it cannot run), ``"triton"`` forces the Triton kernels.

    Example::

        out = paged_decode("int4", q, k_cache, v_cache, block_table, seq_lens, block_size=16)
    """
    f = resolve(fmt)
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise FormatError(f"q must be [batch, num_q_heads, head_dim], got {getattr(q, 'shape', q)}")
    if q.dtype != torch.bfloat16:
        raise FormatError(f"q must be bfloat16 [batch, num_q_heads, head_dim], got {q.dtype}")
    spec = kernel_spec(f, q.shape[2], block_size)
    blk_stride = check_strided_cache(k_cache, spec.layout, None, block_stride, "k_cache")
    v_blk_stride = check_strided_cache(v_cache, spec.vlay, None, block_stride, "v_cache")
    check_decode_inputs(
        q,
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
    devs = {t.device for t in (q, k_cache, v_cache, block_table, seq_lens)}
    if len(devs) != 1:
        raise FormatError(f"q, caches, block_table and seq_lens must share one device, got {devs}")
    cfg = config or DecodeConfig()
    if cfg.block_n % block_size and block_size % cfg.block_n:
        raise FormatError(f"config.block_n {cfg.block_n} and block_size {block_size} must divide")
    b, hq, d = q.shape
    hkv = k_cache.shape[1]
    g = hq // hkv
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
        if int(seq_lens.min()) < 1:
            raise FormatError(f"seq_lens must be >= 1, got min {int(seq_lens.min())}")
    if max_seq_len > block_table.shape[1] * block_size:
        raise FormatError(
            f"max_seq_len {max_seq_len} exceeds block_table capacity "
            f"{block_table.shape[1]} blocks x {block_size}"
        )
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != torch.bfloat16 or not out.is_contiguous():
        raise FormatError(
            f"out must be a contiguous bf16 tensor of shape {tuple(q.shape)}, "
            f"got {out.dtype} {tuple(out.shape)}"
        )
    if q.stride(2) != 1:
        q = q.contiguous()
    if spec.rotation is not None:  # K and V are stored as x @ R: rotate q the same way
        rot = on_device(spec.rotation, q.device, lambda r: r.float().contiguous())
        q = (q.float() @ rot).to(torch.bfloat16)

    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    splits = cfg.num_splits or _num_splits(b, hkv, max_seq_len, cfg, q.device)
    step = max(cfg.block_n, block_size)
    per_split = triton.cdiv(triton.cdiv(max_seq_len, splits), step) * step
    splits = triton.cdiv(max_seq_len, per_split)
    o_part = torch.empty(b * hq * splits * d, dtype=torch.float32, device=q.device)
    lse = torch.empty(b * hq * splits, dtype=torch.float32, device=q.device)
    block_m = max(16, triton.next_power_of_2(g))
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    common = dict(
        INTERPRET=interpret,
        G=g,
        BLOCK_M=block_m,
        D=d,
        PS=block_size,
        BLOCK_N=cfg.block_n,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    grid = (b * hkv, splits)
    page_bytes = spec.layout.page_bytes
    post = None
    if sinks is not None:
        _check_sinks(sinks, spec, q, k_cache.shape[1])
    if recent is not None:
        if spec.family != "codebook":
            raise FormatError(
                "recent= (a residual window) is for the compact formats (4bit, 3.5bit, 3bit); "
                f"format {f.name!r} reads every token from its rows"
            )
        if isinstance(recent, Ring):
            _check_ring(recent, q, k_cache.shape[1], recent_from)
        else:
            check_window(recent, "recent", q, k_cache.shape[1])
        if recent_from is not None and (
            not isinstance(recent_from, torch.Tensor)
            or recent_from.shape != (q.shape[0],)
            or recent_from.device != q.device
            or recent_from.is_floating_point()
        ):
            raise FormatError(
                f"recent_from must be an integer tensor [batch={q.shape[0]}] on {q.device}, got "
                f"{getattr(recent_from, 'dtype', type(recent_from))} "
                f"{tuple(getattr(recent_from, 'shape', ()))}"
            )
    elif recent_from is not None:
        raise FormatError("recent_from= needs recent= (the window it starts)")
    from kvzip_kernels import _cuda

    use_cuda = _cuda.choose(backend, f.name, spec, g, q.device) == "cuda"
    CALLS[f"{f.name}:{'cuda' if use_cuda else 'triton'}"] += 1
    geometry = dict(
        num_kv_heads=hkv,
        k_page_bytes=spec.layout.page_bytes,
        v_page_bytes=spec.vlay.page_bytes,
        k_blk_stride=blk_stride,
        v_blk_stride=v_blk_stride,
        block_size=block_size,
        tokens_per_split=per_split,
        num_splits=splits,
        variant=cfg.cuda_variant,
    )
    if use_cuda:
        _cuda.pick_variant(cfg.cuda_variant)  # an unknown name fails before any launch
    if spec.family == "codebook":
        if spec.k_groups is None or spec.v_groups is None:
            raise FormatError(
                f"format {f.name!r}: the decode kernel reads rows of at most two channel groups "
                f"of 2, 3 or 4 bits with >= 16 channels per class (4 bits: >= 32 channels; "
                f"2 and 3 bits: 32 or >= 64); this format's "
                f"rows at head_dim {d} have groups K {f.spec.k_groups}, V {f.spec.v_groups}"
            )
        q, post = _codebook_launch(
            f,
            spec,
            q,
            k_cache,
            v_cache,
            block_table,
            seq_lens,
            o_part,
            lse,
            scale,
            layer,
            blk_stride,
            v_blk_stride,
            per_split,
            splits,
            grid,
            common,
            sinks,
            geometry if use_cuda else None,
            recent,
            recent_from,
        )
    elif use_cuda:  # int4, int4-rot
        q = q.contiguous()
        _cuda.split(
            f.name, q, None, None, k_cache, v_cache, block_table, seq_lens, o_part, lse,
            scale * LOG2E, **geometry,
        )  # fmt: skip
    elif spec.family == "int4":
        _int4_split_kernel[grid](
            q,
            k_cache,
            v_cache,
            k_cache.view(torch.int32),
            v_cache.view(torch.int32),
            block_table,
            seq_lens,
            o_part,
            lse,
            scale * LOG2E,
            q.stride(0),
            q.stride(1),
            block_table.stride(0),
            hkv,
            page_bytes,
            blk_stride,
            per_split,
            splits,
            **common,
        )
    else:
        _fp8_split_kernel[grid](
            q,
            k_cache.view(torch.float8_e4m3fn),
            v_cache.view(torch.float8_e4m3fn),
            block_table,
            seq_lens,
            o_part,
            lse,
            scale * LOG2E * spec.k_scale,
            spec.v_scale,
            q.stride(0),
            q.stride(1),
            block_table.stride(0),
            hkv,
            page_bytes,
            blk_stride,
            per_split,
            splits,
            **common,
        )
    target = (
        out
        if spec.rotation is None and post is None
        else torch.empty(b, hq, d, dtype=torch.float32, device=q.device)
    )
    _merge_kernel[(b * hq,)](
        o_part,
        lse,
        target,
        splits,
        S_P=triton.next_power_of_2(splits),
        CH=16,
        D=d,
        OUT_BF16=spec.rotation is None and post is None,
        INTERPRET=interpret,
        num_warps=4,
    )
    if spec.rotation is not None:
        out.copy_(target @ rot)
    if post is not None:
        post(target, out)
    return out


def _codebook_launch(
    f,
    spec,
    q,
    k_cache,
    v_cache,
    block_table,
    seq_lens,
    o_part,
    lse,
    scale,
    layer,
    k_blk_stride,
    v_blk_stride,
    per_split,
    splits,
    grid,
    common,
    sinks=None,
    cuda_geometry=None,
    recent=None,
    recent_from=None,
):
    """The compact formats: fold the calibrated transforms into q and the output.

    ``score = q . (B_k y_k + mean_k) = (B_k^T q) . y_k + const`` (the constant is the same for
    every key and drops out of the softmax); ``o = B_v y + mean_v`` since the probabilities
    sum to 1. ``q'`` is scaled per row by a power of two into fp16's range (exact), the kernel
    undoes it in the scores. With ``sinks`` the kernel skips the sink positions and the
    output merges their exact bf16 K/V by log-sum-exp; then ``q . mean_k`` no longer cancels
    and shifts the rows' log-sum-exp (spec/4bit.md section 6). Returns the fp16 ``q'`` and the
    output transform. ``cuda_geometry``: run the CUDA split kernel (``_cuda.split``) instead.
    With ``recent`` (a residual window) the kernels stop at each sequence's window, which is
    merged like the sinks.
    """
    b, hq, d = q.shape
    hkv = k_cache.shape[1]
    n_sink = 0 if sinks is None else sinks[0].shape[1]
    full = end = None
    if isinstance(recent, Ring):  # the server computed where the rows end, once per step
        full, end = seq_lens.to(torch.int32), recent.row_end
        seq_lens = end
    elif recent is not None:  # rows end where the window starts (never inside the sinks)
        full = seq_lens.to(torch.int32)
        end = window_row_end(full, recent[0].shape[1], n_sink, recent_from)
        seq_lens = end
    tk, tv = f.transform_of("k", layer), f.transform_of("v", layer)
    dev = q.device
    # constants on the device once (a per-call upload from host memory waits for the stream:
    # ~1 ms per call on the H200, _device_consts.py); q' by one kernel instead of ~10 torch ops
    mean_k, bk, _, _ = transform_consts(tk, dev)
    mean_v, _, bvt, _ = transform_consts(tv, dev)
    q16, qs = fold_q(q, bk, hkv)
    if cuda_geometry is not None:
        from kvzip_kernels import _cuda

        lut = _cuda.level_table(spec, dev)
        _cuda.split(
            f.name, q16, qs, lut, k_cache, v_cache, block_table, seq_lens, o_part, lse,
            scale * LOG2E, skip=n_sink, **cuda_geometry,
        )  # fmt: skip
    else:
        _codebook_triton(
            spec, q16, qs, k_cache, v_cache, block_table, seq_lens, o_part, lse, scale,
            k_blk_stride, v_blk_stride, per_split, splits, grid, common, sinks,
        )  # fmt: skip
    interpret = common["INTERPRET"]

    def post(y, out):  # [b, hq, d] float32 in the transformed domain -> bf16 ``out``
        if sinks is None and recent is None:
            unfold_o(y, bvt, mean_v, out, hkv, interpret)
            return
        # the rows merged with the bf16 sinks and window in one kernel (_merge_extra.py)
        merge_extra(
            y, lse, bvt, mean_v, mean_k, q, sinks, recent, full, end, out, scale * LOG2E,
            splits, interpret,
        )  # fmt: skip

    return q16, post


def _codebook_triton(
    spec, q16, qs, k_cache, v_cache, block_table, seq_lens, o_part, lse, scale,
    k_blk_stride, v_blk_stride, per_split, splits, grid, common, sinks,
):  # fmt: skip
    hkv = k_cache.shape[1]
    lut = codebook_lut(spec.k_groups, spec.v_groups, str(q16.device))
    consts = {}
    for kind, groups in (("K", spec.k_groups), ("V", spec.v_groups)):
        for g, (bits, n, off, off1) in enumerate(groups):
            consts.update(
                {f"{kind}B{g}": bits, f"{kind}N{g}": n, f"{kind}O{g}": off, f"{kind}P{g}": off1}
            )
    _codebook_split_kernel[grid](
        q16,
        qs,
        k_cache,
        v_cache,
        k_cache.view(torch.float16),
        v_cache.view(torch.float16),
        lut,
        block_table,
        seq_lens,
        o_part,
        lse,
        scale * LOG2E,
        block_table.stride(0),
        hkv,
        spec.layout.page_bytes,
        spec.vlay.page_bytes,
        k_blk_stride,
        v_blk_stride,
        per_split,
        splits,
        0 if sinks is None else sinks[0].shape[1],
        KCB=spec.layout.code_bytes,
        VCB=spec.vlay.code_bytes,
        **consts,
        **common,
    )


def _check_ring(ring: Ring, q, num_kv_heads: int, recent_from) -> None:
    b, _, d = q.shape
    if recent_from is not None:
        raise FormatError("recent_from= is for a window tensor; a Ring carries its row_end")
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


def _check_sinks(sinks, spec, q, num_kv_heads) -> None:
    if spec.family != "codebook":
        raise FormatError(
            "sinks= is for the compact formats (bf16 sink tokens); this format has none"
        )
    check_window(sinks, "sinks", q, num_kv_heads)
