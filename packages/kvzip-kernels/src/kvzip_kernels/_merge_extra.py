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
(``results/kernels/paged_decode/bench_paged_decode_window.md``).
"""

from __future__ import annotations

from dataclasses import dataclass

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


@triton.jit
def _ring_offsets(ri, c, h, num_kv_heads, ring_s1, ring_per, D: tl.constexpr):
    """Element offsets, from its slot's first value, of ring entry ``ri`` (``[N]``), kind ``c``
    (0: K, 1: V), KV head ``h`` (or one entry ``ri`` and heads ``h`` ``[N]``): the entry's
    ``D`` values at ``((ri * 2 + c) * num_kv_heads + h) * D`` of the slot's values, which run
    through consecutive blocks' reserves of ``ring_per`` values each (32-bit: ``ring_write``
    and ``merge_extra`` check a slot fits)."""
    d = tl.arange(0, D)
    f = ((ri * 2 + c) * num_kv_heads + h.to(tl.int32))[:, None] * D + d[None, :]
    return (f // ring_per) * ring_s1 + f % ring_per


@triton.jit
def _ring_chunk(
    ring_ptr, slot_ptr, fk_ptr, fv_ptr, bi, h, nn, start, ok, n_win, num_kv_heads, ring_s0,
    ring_s1, ring_per, fk_sb, fk_sh, fv_sb, fv_sh, D: tl.constexpr,
):  # fmt: skip
    """A chunk of window entries ``nn`` read where the backend keeps them: entry ``j < R``
    (``R = n_win - 1``) at position ``start + j`` from the sequence's ring, entry ``R`` the
    step's own token from ``fk``/``fv`` ``[b, H, D]``."""
    r = n_win - 1
    d = tl.arange(0, D)
    base = ring_ptr + tl.load(slot_ptr + bi).to(tl.int64) * ring_s0
    ri = (tl.where(ok, start + nn, 0) % r).to(tl.int32)
    in_ring = (ok & (nn < r))[:, None]
    kx = tl.load(
        base + _ring_offsets(ri, 0, h, num_kv_heads, ring_s1, ring_per, D),
        mask=in_ring,
        other=0.0,
    )
    vx = tl.load(
        base + _ring_offsets(ri, 1, h, num_kv_heads, ring_s1, ring_per, D),
        mask=in_ring,
        other=0.0,
    )
    new = ((nn == r) & ok)[:, None]
    fk = tl.load(fk_ptr + bi * fk_sb + h * fk_sh + d)
    fv = tl.load(fv_ptr + bi * fv_sb + h * fv_sh + d)
    kx = tl.where(new, fk[None, :], kx)
    vx = tl.where(new, fv[None, :], vx)
    return kx, vx


@triton.jit
def _ring_write_kernel(
    ring_ptr, key_ptr, value_ptr, rows_ptr, slots_ptr, idx_ptr, num_kv_heads, ring_s0, ring_s1,
    ring_per, k_sr, k_sh, v_sr, v_sh, H_P: tl.constexpr, D: tl.constexpr,
):  # fmt: skip
    """Token ``i`` of the step (row ``rows[i]`` of ``key``/``value`` ``[tokens, H, D]``) into
    ring entry ``idx[i]`` of slot ``slots[i]``."""
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i).to(tl.int64)
    slot = tl.load(slots_ptr + i).to(tl.int64)
    ri = tl.load(idx_ptr + i).to(tl.int32)
    hh = tl.arange(0, H_P)
    d = tl.arange(0, D)
    m = (hh < num_kv_heads)[:, None]
    base = ring_ptr + slot * ring_s0
    x = tl.load(key_ptr + row * k_sr + hh[:, None] * k_sh + d[None, :], mask=m, other=0.0)
    tl.store(base + _ring_offsets(ri, 0, hh, num_kv_heads, ring_s1, ring_per, D), x, mask=m)
    x = tl.load(value_ptr + row * v_sr + hh[:, None] * v_sh + d[None, :], mask=m, other=0.0)
    tl.store(base + _ring_offsets(ri, 1, hh, num_kv_heads, ring_s1, ring_per, D), x, mask=m)


# n_sink and n_win stay runtime values: specialized to 1 (one sink, no window), ptxas built a
# kernel of 32 registers and a 7 KB stack (sm_90, Triton 3.6): 830 us a call in serving on the
# H200 (batch 103, 32k) against 268 us for the same kernel with a window
@triton.jit(do_not_specialize=["num_splits", "n_sink", "n_win"])
def _merge_extra_kernel(
    y_ptr,  # [b * hq, D] float32: the rows' merged output, transformed domain
    lse_ptr,  # [b * hq, num_splits] float32, base 2, without q . mean_k
    bt_ptr,  # [H, D, D] float32: B_v transposed
    mean_v_ptr,  # [H, D] float32
    mean_k_ptr,  # [H, D] float32
    q_ptr,  # [b, hq, D] bf16, original domain
    sk_ptr,
    sv_ptr,  # sinks [b, n_sink, H, D] bf16 (strided); SINK_SLOTS: both the sink store
    wk_ptr,
    wv_ptr,  # window [b, R, H, D] bf16 (strided), right-aligned at full_ptr; RING: the new token
    sink_slot_ptr,  # SINK_SLOTS: [b] int64, each sequence's sink slot
    ring_ptr,  # RING: the backend's ring store, bf16, slot s at s * ring_s0
    slot_ptr,  # RING: [b] int64, each sequence's ring
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
    ring_s0,
    ring_s1,
    ring_per,
    sink_s0,
    sink_s1,
    sink_per,
    G: tl.constexpr,
    BLOCK_M: tl.constexpr,
    D: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    RING: tl.constexpr,
    SINK_SLOTS: tl.constexpr,
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
    # the rows' log-sum-exp over the splits, plus q . mean_k: the splits read 16 at a time with
    # a running max (one compiled kernel for every split count, as _merge_kernel)
    s = tl.arange(0, 16)
    mx = tl.full([BLOCK_M], float("-inf"), tl.float32)
    den = tl.zeros([BLOCK_M], tl.float32)
    for s0 in range(0, num_splits, 16):
        sc = s0 + s
        ls = tl.load(
            lse_ptr + rows[:, None] * num_splits + sc[None, :],
            mask=mm[:, None] & (sc < num_splits)[None, :],
            other=float("-inf"),
        )
        m_new = tl.maximum(mx, tl.max(ls, 1))
        live = m_new > float("-inf")
        den = tl.where(live, den * tl.exp2(mx - m_new), 0.0)
        den += tl.sum(tl.where(ls > float("-inf"), tl.exp2(ls - m_new[:, None]), 0.0), 1)
        mx = m_new
    fin = mx > float("-inf")  # a sequence whose every token is a bf16 one has no rows
    mx0 = tl.where(fin, mx, 0.0)
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
    if SINK_SLOTS:  # the sequence's slot in the store: [n_sink, 2, H, D] through the blocks
        sbase = sk_ptr + tl.load(sink_slot_ptr + bi).to(tl.int64) * sink_s0
    for j in range(n_sink):
        if SINK_SLOTS:
            fk = ((j * 2) * num_kv_heads + h) * D + d
            fv = fk + num_kv_heads * D
            kj = tl.load(sbase + (fk // sink_per) * sink_s1 + fk % sink_per).to(tl.float32)
            vj = tl.load(sbase + (fv // sink_per) * sink_s1 + fv % sink_per).to(tl.float32)
        else:
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
            if RING:  # entries 0 .. R - 1 from the ring (position p at p mod R), then the new one
                kx, vx = _ring_chunk(
                    ring_ptr, slot_ptr, wk_ptr, wv_ptr, bi, h, nn, start, ok, n_win,
                    num_kv_heads, ring_s0, ring_s1, ring_per, wk_sb, wk_sh, wv_sb, wv_sh, D,
                )  # fmt: skip
            else:
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


@dataclass(frozen=True)
class Ring:
    """A residual window read where a server keeps it (kvzip-vllm's rings), for
    ``paged_decode(recent=Ring(...))``: no gather into a window tensor first.

    ``store``: bf16 ``[num_slots, blocks, per]`` (strided; unit stride in the last dim), a
    slot's values in order being its ring ``[recent, 2 (K, V), num_kv_heads, head_dim]``
    (position ``p`` at entry ``p mod recent``); ``slots`` ``[batch]`` int64; ``fresh_k`` /
    ``fresh_v`` ``[batch, num_kv_heads, head_dim]`` bf16 (unit stride in head_dim): the step's
    own tokens, the window's last entry; ``row_end`` ``[batch]`` int32: where each sequence's
    rows stop (its window, from there to its last token, is read in bf16). The window holds
    ``recent + 1`` entries: positions ``seq_len - recent - 1 .. seq_len - 1``."""

    store: torch.Tensor
    slots: torch.Tensor
    fresh_k: torch.Tensor
    fresh_v: torch.Tensor
    recent: int
    row_end: torch.Tensor


@dataclass(frozen=True)
class SinkSlots:
    """Sink tokens read where a server keeps them (kvzip-vllm's sink pool), for
    ``paged_decode(sinks=SinkSlots(...))``: no gather into a sink tensor first.

    ``store``: bf16 ``[num_slots, blocks, per]`` (strided; unit stride in the last dim), a
    slot's values in order being ``[n, 2 (K, V), num_kv_heads, head_dim]``; ``slots``
    ``[batch]`` int64: each sequence's slot; ``n``: the sink tokens."""

    store: torch.Tensor
    slots: torch.Tensor
    n: int


def window_row_end(
    seq_lens: torch.Tensor, entries: int, n_sink: int, recent_from: torch.Tensor | None = None
) -> torch.Tensor:
    """Where each sequence's rows stop (int32 ``[b]``) when a right-aligned window of
    ``entries`` positions ends at ``seq_lens``: at the window's first position, or later where
    the window holds positions only from ``recent_from`` on; never inside the sinks, never past
    the sequence (spec/residual_window.md section 3)."""
    full = seq_lens.to(torch.int32)
    end = full - entries
    if recent_from is not None:
        end = torch.maximum(end, recent_from.to(torch.int32))
    return end.clamp(min=n_sink).minimum(full)


def _check_ring_store(store: torch.Tensor) -> None:
    """The kernels address a slot's values with 32-bit offsets from its first one."""
    if store.stride(2) != 1:
        raise ValueError("a ring store needs unit stride in its last dimension")
    if (store.shape[1] - 1) * store.stride(1) + store.shape[2] >= 2**31:
        raise ValueError(
            f"a ring slot spans {store.shape[1]} blocks of stride {store.stride(1)}: over 2^31 "
            "values from its first (fewer tokens per slot, KVZIP_WINDOW_SLOT_TOKENS)"
        )


def ring_write(ring: torch.Tensor, key, value, rows, slots, idx) -> None:
    """Token ``i``'s K and V (row ``rows[i]`` of ``key``/``value`` ``[tokens, H, D]``) into
    entry ``idx[i]`` of slot ``slots[i]`` of the ring store ``ring`` (as :class:`Ring`'s)."""
    m = rows.numel()
    if not m:
        return
    h, d = key.shape[1], key.shape[2]
    if key.stride(2) != 1 or value.stride(2) != 1:
        raise ValueError("ring_write: key and value need unit stride in head_dim")
    _check_ring_store(ring)
    _ring_write_kernel[(m,)](
        ring, key, value, rows, slots, idx, h, ring.stride(0), ring.stride(1), ring.shape[2],
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        H_P=triton.next_power_of_2(h), D=d, num_warps=4,
    )  # fmt: skip


def merge_extra(
    y: torch.Tensor,
    lse: torch.Tensor,
    bvt: torch.Tensor,
    mean_v: torch.Tensor,
    mean_k: torch.Tensor,
    q: torch.Tensor,
    sinks: tuple[torch.Tensor, torch.Tensor] | SinkSlots | None,
    window: tuple[torch.Tensor, torch.Tensor] | Ring | None,
    full: torch.Tensor | None,
    end: torch.Tensor | None,
    out: torch.Tensor,
    scale_log2: float,
    num_splits: int,
    interpret: bool,
) -> None:
    """``out`` bf16 ``[b, hq, d]``: the rows' output (``y`` float32 ``[b, hq, d]`` in the
    transformed domain, ``lse`` ``[b * hq * num_splits]``) merged with attention over the bf16
    ``sinks`` ``(k, v)`` ``[b, n, H, d]`` (or a :class:`SinkSlots`) and a right-aligned
    ``window`` ``[b, R, H, d]`` (entry ``j`` at position ``full - R + j``, attended where that
    is ``>= end``), or a :class:`Ring` (``R + 1`` entries)."""
    b, hq, d = out.shape
    hkv = bvt.shape[0]
    g = hq // hkv
    if sinks is None and window is None:
        raise ValueError("merge_extra: no bf16 tokens (sinks or a window) to merge")
    ring = window if isinstance(window, Ring) else None
    slotted = sinks if isinstance(sinks, SinkSlots) else None
    pair = (ring.fresh_k, ring.fresh_v) if ring is not None else window
    sink_pair = None
    sink_strides = (0, 0, 1)
    n_sink = 0
    if slotted is not None:
        _check_ring_store(slotted.store)  # the same addressing as a ring slot's
        st = slotted.store
        sink_pair = (st, st)
        sink_strides = (st.stride(0), st.stride(1), st.shape[2])
        n_sink = slotted.n
    elif sinks is not None:
        sink_pair = sinks
        n_sink = sinks[0].shape[1]
    sk, sv = sink_pair if sink_pair is not None else pair  # placeholders with n_sink = 0
    wk, wv = pair if pair is not None else sink_pair
    for t in (sk, sv, wk, wv, q):
        if t.stride(-1) != 1:
            raise ValueError("merge_extra: bf16 tokens and q need unit stride in head_dim")
    if window is not None and (full is None or end is None):
        raise ValueError("merge_extra: a window needs full= and end=")
    idx = full if full is not None else torch.empty(1, dtype=torch.int32, device=out.device)
    if ring is not None:
        n_win, store, slots = ring.recent + 1, ring.store, ring.slots
        _check_ring_store(store)
        ring_strides = (store.stride(0), store.stride(1), store.shape[2])
        # the new tokens [b, H, d] as [b, 1, H, d]: strides (batch, entry (unused), head)
        w_strides = [wk.stride(0), 0, wk.stride(1), wv.stride(0), 0, wv.stride(1)]
    else:
        n_win = 0 if window is None else wk.shape[1]
        store, slots, ring_strides = wk, idx, (0, 0, 1)
        w_strides = [*(wk.stride(i) for i in range(3)), *(wv.stride(i) for i in range(3))]
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
        slotted.slots if slotted is not None else idx,
        store,
        slots,
        idx,
        end if end is not None else idx,
        out,
        hkv,
        num_splits,
        n_sink,
        n_win,
        scale_log2,
        q.stride(0),
        q.stride(1),
        *(sk.stride(i) for i in range(3)),
        *(sv.stride(i) for i in range(3)),
        *w_strides,
        *ring_strides,
        *sink_strides,
        G=g,
        BLOCK_M=max(16, triton.next_power_of_2(g)),
        D=d,
        BLOCK_K=32,
        BLOCK_N=32,
        HAS_WINDOW=window is not None,
        RING=ring is not None,
        SINK_SLOTS=slotted is not None,
        INTERPRET=interpret,
        num_warps=4,
    )
