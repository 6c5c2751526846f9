"""The compact formats' last decode stage with bf16 tokens beside the rows, in one kernel.

A compact format attends its sink tokens (and a residual window's last tokens) from exact
bf16 copies instead of their rows (spec/4bit.md section 6, spec/residual_window.md). The
split kernels attend the rows in the transformed domain and leave per split a partial output
and a base-2 log-sum-exp without ``q . mean_k``; after the split merge, ``y`` ``[b, hq, d]``.
This kernel then, per (sequence, KV head) and its query heads: maps ``y`` back
(``o = B_v y + mean_v``), completes the rows' log-sum-exp (the splits' plus ``q . mean_k``),
scores the bf16 tokens, and merges both by log-sum-exp into the bf16 output.

It replaces about 20 torch operations per call (the einsums, the masks, the merge), whose
host time the H200 measured as GPU idle time in eager decode calls: at batch 8 and 32k a
sinked ``4bit`` call took 1,279 us against 322 us without sinks
(``results/kernels/bench_paged_decode_window.md``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvzip_kernels._decode_kernels import _to_bf16


@triton.jit
def _dot(a, b, acc, INTERPRET: tl.constexpr):
    """``acc + a @ b`` of bf16 tiles with float32 sums: on the tensor cores; in Triton's
    interpreter (whose bf16 tiles are not numbers to its dot) as float32 products, which are
    exact for bf16 values too."""
    if INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, out_dtype=tl.float32)


@triton.jit
def _attend_chunk(q16, kx, vx, ok, m_i, l_i, acc, qk_scale, INTERPRET: tl.constexpr):
    """A chunk of bf16 tokens (``kx``/``vx`` bf16 ``[BLOCK_N, D]``, ``ok``: which count) folded
    into the online softmax state ``(m_i, l_i, acc)`` of the bf16 query rows ``q16``. q . k of
    bf16 values is exact before the float32 sum; the weights, in [0, 1], go in as two bf16
    halves (hi + lo: 16 bits of mantissa)."""
    zero = tl.zeros([q16.shape[0], kx.shape[0]], tl.float32)
    sc = _dot(q16, tl.trans(kx), zero, INTERPRET) * qk_scale
    sc = tl.where(ok[None, :], sc, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(sc, 1))
    m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
    alpha = tl.where(m_i > float("-inf"), tl.exp2(m_i - m_safe), 0.0)
    p = tl.where(sc > float("-inf"), tl.exp2(sc - m_safe[:, None]), 0.0)
    hi = _to_bf16(p, INTERPRET)
    lo = _to_bf16(p - hi.to(tl.float32), INTERPRET)
    pv = _dot(lo, vx, _dot(hi, vx, acc * alpha[:, None], INTERPRET), INTERPRET)
    return m_new, l_i * alpha + tl.sum(p, 1), pv


# n_sink and n_win stay runtime values: specialized to 1 (one sink, no window), ptxas built a
# kernel of 32 registers and a 7 KB stack (sm_90, Triton 3.6): 830 us a call in serving on the
# H200 (batch 103, 32k) against 268 us for the same kernel with a window
@triton.jit(do_not_specialize=["n_sink", "n_win"])
def _merge_extra_kernel(
    y_ptr,  # [b * hq, D] float32: the rows' merged output, transformed domain
    lse_ptr,  # [b * hq, num_splits] float32, base 2, without q . mean_k
    bt_ptr,  # [H, D, D] float32: B_v transposed
    mean_v_ptr,  # [H, D] float32
    mean_k_ptr,  # [H, D] float32
    q_ptr,  # [b, hq, D] bf16, original domain
    sk_ptr,
    sv_ptr,  # sinks [b, n_sink, H, D] bf16 (strided)
    wk_ptr,
    wv_ptr,  # window [b, R, H, D] bf16 (strided), right-aligned at full_ptr
    full_ptr,  # [b] int32: the sequences' lengths (the window's last entry is full - 1)
    end_ptr,  # [b] int32: where the rows stop (window entries before it are not attended)
    out_ptr,  # [b, hq, D] bf16
    num_kv_heads,
    num_splits,
    n_sink,
    n_win,
    qk_scale,  # softmax scale x log2(e)
    q_sb,
    q_sh,
    sk_sb,
    sk_sn,
    sk_sh,
    sv_sb,
    sv_sn,
    sv_sh,
    wk_sb,
    wk_sn,
    wk_sh,
    wv_sb,
    wv_sn,
    wv_sh,
    G: tl.constexpr,
    BLOCK_M: tl.constexpr,
    D: tl.constexpr,
    BLOCK_K: tl.constexpr,
    S_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    pid = tl.program_id(0)
    bi = (pid // num_kv_heads).to(tl.int64)
    h = (pid % num_kv_heads).to(tl.int64)
    m = tl.arange(0, BLOCK_M)
    d = tl.arange(0, D)
    k = tl.arange(0, BLOCK_K)
    mm = m < G
    rows = (pid * G + m).to(tl.int64)
    # o = B_v y + mean_v
    bmat = bt_ptr + h * D * D
    o = tl.zeros([BLOCK_M, D], tl.float32)
    for k0 in tl.static_range(0, D, BLOCK_K):
        yc = tl.load(y_ptr + rows[:, None] * D + k0 + k[None, :], mask=mm[:, None], other=0.0)
        bc = tl.load(bmat + (k0 + k)[:, None] * D + d[None, :])
        o = tl.dot(yc, bc, o, input_precision="ieee")
    o += tl.load(mean_v_ptr + h * D + d)[None, :]
    # the rows' log-sum-exp over the splits, plus q . mean_k
    s = tl.arange(0, S_P)
    ls = tl.load(
        lse_ptr + rows[:, None] * num_splits + s[None, :],
        mask=mm[:, None] & (s < num_splits)[None, :],
        other=float("-inf"),
    )
    mx = tl.max(ls, 1)
    fin = mx > float("-inf")  # a sequence whose every token is a bf16 one has no rows
    mx0 = tl.where(fin, mx, 0.0)
    den = tl.sum(tl.where(ls > float("-inf"), tl.exp2(ls - mx0[:, None]), 0.0), 1)
    qf = tl.load(
        q_ptr + bi * q_sb + (h * G + m)[:, None] * q_sh + d[None, :], mask=mm[:, None], other=0.0
    ).to(tl.float32)
    mean_k = tl.load(mean_k_ptr + h * D + d)
    lse_rows = mx0 + tl.log2(tl.where(fin, den, 1.0)) + tl.sum(qf * mean_k[None, :], 1) * qk_scale
    # online softmax: start from the rows (weight 1 at their log-sum-exp), then the bf16 tokens
    m_i = tl.where(fin, lse_rows, float("-inf"))
    l_i = tl.where(fin, 1.0, 0.0)
    acc = tl.where(fin[:, None], o, 0.0)
    # the sinks (a token or a few): one at a time, without matrix products
    for j in range(n_sink):
        kj = tl.load(sk_ptr + bi * sk_sb + j * sk_sn + h * sk_sh + d).to(tl.float32)
        vj = tl.load(sv_ptr + bi * sv_sb + j * sv_sn + h * sv_sh + d).to(tl.float32)
        sc = tl.sum(qf * kj[None, :], 1) * qk_scale
        m_new = tl.maximum(m_i, sc)
        alpha = tl.where(m_i > float("-inf"), tl.exp2(m_i - m_new), 0.0)
        p = tl.exp2(sc - m_new)
        acc = acc * alpha[:, None] + p[:, None] * vj[None, :]
        l_i = l_i * alpha + p
        m_i = m_new
    if HAS_WINDOW:  # the window: chunks of BLOCK_N tokens
        n = tl.arange(0, BLOCK_N)
        q16 = _to_bf16(qf, INTERPRET)  # exact: q is bf16
        full = tl.load(full_ptr + bi)
        end = tl.load(end_ptr + bi)
        start = full - n_win  # position of window entry 0
        for n0 in range(0, n_win, BLOCK_N):
            nn = n0 + n
            ok = (nn < n_win) & (start + nn >= end)
            kx = tl.load(
                wk_ptr + bi * wk_sb + nn[:, None] * wk_sn + h * wk_sh + d[None, :],
                mask=ok[:, None],
                other=0.0,
            )
            vx = tl.load(
                wv_ptr + bi * wv_sb + nn[:, None] * wv_sn + h * wv_sh + d[None, :],
                mask=ok[:, None],
                other=0.0,
            )
            m_i, l_i, acc = _attend_chunk(q16, kx, vx, ok, m_i, l_i, acc, qk_scale, INTERPRET)
    res = acc / l_i[:, None]
    tl.store(out_ptr + rows[:, None] * D + d[None, :], _to_bf16(res, INTERPRET), mask=mm[:, None])


def merge_extra(
    y: torch.Tensor,
    lse: torch.Tensor,
    bvt: torch.Tensor,
    mean_v: torch.Tensor,
    mean_k: torch.Tensor,
    q: torch.Tensor,
    sinks: tuple[torch.Tensor, torch.Tensor] | None,
    window: tuple[torch.Tensor, torch.Tensor] | None,
    full: torch.Tensor | None,
    end: torch.Tensor | None,
    out: torch.Tensor,
    scale_log2: float,
    num_splits: int,
    interpret: bool,
) -> None:
    """``out`` bf16 ``[b, hq, d]``: the rows' output (``y`` float32 ``[b, hq, d]`` in the
    transformed domain, ``lse`` ``[b * hq * num_splits]``) merged with attention over the bf16
    ``sinks`` ``(k, v)`` ``[b, n, H, d]`` and a right-aligned ``window`` ``[b, R, H, d]``
    (entry ``j`` at position ``full - R + j``, attended where that is ``>= end``)."""
    b, hq, d = out.shape
    hkv = bvt.shape[0]
    g = hq // hkv
    if sinks is None and window is None:
        raise ValueError("merge_extra: no bf16 tokens (sinks or a window) to merge")
    sk, sv = sinks if sinks is not None else window  # placeholders with n_sink = 0
    wk, wv = window if window is not None else sinks
    for t in (sk, sv, wk, wv, q):
        if t.stride(-1) != 1:
            raise ValueError("merge_extra: bf16 tokens and q need unit stride in head_dim")
    if window is not None and (full is None or end is None):
        raise ValueError("merge_extra: a window needs full= and end=")
    idx = full if full is not None else torch.empty(1, dtype=torch.int32, device=out.device)
    _merge_extra_kernel[(b * hkv,)](
        y,
        lse,
        bvt,
        mean_v,
        mean_k,
        q,
        sk,
        sv,
        wk,
        wv,
        idx,
        end if end is not None else idx,
        out,
        hkv,
        num_splits,
        0 if sinks is None else sk.shape[1],
        0 if window is None else wk.shape[1],
        scale_log2,
        q.stride(0),
        q.stride(1),
        *(sk.stride(i) for i in range(3)),
        *(sv.stride(i) for i in range(3)),
        *(wk.stride(i) for i in range(3)),
        *(wv.stride(i) for i in range(3)),
        G=g,
        BLOCK_M=max(16, triton.next_power_of_2(g)),
        D=d,
        BLOCK_K=32,
        S_P=max(16, triton.next_power_of_2(num_splits)),
        BLOCK_N=32,
        HAS_WINDOW=window is not None,
        INTERPRET=interpret,
        num_warps=4,
    )
