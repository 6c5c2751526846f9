"""Split-KV decode kernel for the compact formats (``4bit``, ``3.5bit``, ``3bit``).

Rows (kvzip_formats/spec/4bit.md section 5): a b-bit code per transformed channel (4 bits:
one nibble plane; 3 bits: a 2-bit plane of the low bits, then a 1-bit plane), then one fp16
token scale ``s``; the value is ``s * levels_b[c]`` with a symmetric Lloyd-Max codebook. The
calibrated transform is folded into the query (``q' = B_k^T q``, by the caller) and into the
output (``o = B_v y + mean_v``, by the caller), so the kernel is attention in the
transformed domain: ``score = s * (q' . L[c])``, ``y = sum_t p_t s_t L[c_t]``.

Channels are split into R classes by the position of their bits in a byte (R = 2 for
nibbles: even and odd channels; R = 4 for the 2-bit plane: channel ``4i + r``); each class is
one ``tl.dot`` of depth head_dim / R, with q' gathered the same way.

The codebook lookup is a select tree on the magnitude bits (symmetric levels: 3 selects for
8 magnitudes at 4 bits plus the sign, 1 + 2 at 3 bits): correct first. It costs ~8-10
instructions per element against 1 for int4's affine codes (NOTES.md: the compact formats'
kernels are the next optimisation target).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvzip_kernels._decode_kernels import _dot


@triton.jit
def _level(c, BITS: tl.constexpr, m0, m1, m2, m3, m4, m5, m6, m7):
    """Integer codes -> fp16 codebook levels (ascending, symmetric: c < 2**(BITS-1) negative)."""
    HALF: tl.constexpr = 1 << (BITS - 1)
    neg = c < HALF
    m = tl.where(neg, HALF - 1 - c, c - HALF)
    b0 = (m & 1) != 0
    b1 = (m & 2) != 0
    v = tl.where(b1, tl.where(b0, m3, m2), tl.where(b0, m1, m0))
    if BITS == 4:
        hi = tl.where(b1, tl.where(b0, m7, m6), tl.where(b0, m5, m4))
        v = tl.where((m & 4) != 0, hi, v)
    return tl.where(neg, -v, v).to(tl.float16)


@triton.jit
def _class_codes(
    ptr,
    base,
    t,
    i,
    r: tl.constexpr,
    BITS: tl.constexpr,
    CB: tl.constexpr,
    D: tl.constexpr,
    PS: tl.constexpr,
    CHANNEL_MAJOR: tl.constexpr,
    mask,
):
    """Codes of channel class r ([BLOCK_N, D // R]) of one page-set of rows.

    4 bits: class r = channels 2i + r (nibble r of byte i). 3 bits: class r = channels 4i + r
    (bits 2r..2r+1 of 2-bit-plane byte i, and bit 4 (i % 2) + r of 1-bit-plane byte i // 2).
    """
    if CHANNEL_MAJOR:  # byte j of token t at j * PS + t
        b = tl.load(ptr + (base + t)[:, None] + (i * PS)[None, :], mask=mask[:, None], other=0)
    else:  # at t * CB + j
        b = tl.load(ptr + (base + t * CB)[:, None] + i[None, :], mask=mask[:, None], other=0)
    b = b.to(tl.int32)
    if BITS == 4:
        return (b >> (4 * r)) & 15
    lo = (b >> (2 * r)) & 3
    j1 = D // 4 + i // 2  # 1-bit plane byte of channel 4i + r
    if CHANNEL_MAJOR:
        h = tl.load(ptr + (base + t)[:, None] + (j1 * PS)[None, :], mask=mask[:, None], other=0)
    else:
        h = tl.load(ptr + (base + t * CB)[:, None] + j1[None, :], mask=mask[:, None], other=0)
    hb = (h.to(tl.int32) >> ((i % 2) * 4 + r)[None, :]) & 1
    return lo | (hb << 2)


@triton.jit
def _codebook_split_kernel(
    q_ptr,
    qs_ptr,
    kc_ptr,
    vc_ptr,
    kh_ptr,
    vh_ptr,
    lut_ptr,
    bt_ptr,
    sl_ptr,
    o_ptr,
    lse_ptr,
    qk_scale,
    stride_btb,
    num_kv_heads,
    k_page_bytes,
    v_page_bytes,
    k_blk_stride,
    v_blk_stride,
    tokens_per_split,
    num_splits,
    skip,
    G: tl.constexpr,
    BLOCK_M: tl.constexpr,
    D: tl.constexpr,
    PS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    KBITS: tl.constexpr,
    VBITS: tl.constexpr,
    KCB: tl.constexpr,
    VCB: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // num_kv_heads
    h = bh % num_kv_heads
    seq_len = tl.load(sl_ptr + b)
    tok_lo = tl.maximum(split * tokens_per_split, skip)
    tok_hi = tl.minimum(seq_len, split * tokens_per_split + tokens_per_split)
    page_hi = tl.cdiv(tok_hi, PS)
    KR: tl.constexpr = 2 if KBITS == 4 else 4
    VR: tl.constexpr = 2 if VBITS == 4 else 4
    KW: tl.constexpr = D // KR
    VW: tl.constexpr = D // VR
    # codebook magnitudes: lut[0:8] for K's bit width, lut[8:16] for V's
    k0, k1, k2, k3 = (
        tl.load(lut_ptr),
        tl.load(lut_ptr + 1),
        tl.load(lut_ptr + 2),
        tl.load(lut_ptr + 3),
    )
    k4, k5, k6, k7 = (
        tl.load(lut_ptr + 4),
        tl.load(lut_ptr + 5),
        tl.load(lut_ptr + 6),
        tl.load(lut_ptr + 7),
    )
    v0, v1, v2, v3 = (
        tl.load(lut_ptr + 8),
        tl.load(lut_ptr + 9),
        tl.load(lut_ptr + 10),
        tl.load(lut_ptr + 11),
    )
    v4, v5, v6, v7 = (
        tl.load(lut_ptr + 12),
        tl.load(lut_ptr + 13),
        tl.load(lut_ptr + 14),
        tl.load(lut_ptr + 15),
    )

    m = tl.arange(0, BLOCK_M)
    n = tl.arange(0, BLOCK_N)
    ki = tl.arange(0, KW)
    vi = tl.arange(0, VW)
    rows = (b * num_kv_heads + h) * G + m
    qrow = q_ptr + rows[:, None] * D
    qm = (m < G)[:, None]
    q0 = tl.load(qrow + KR * ki[None, :], mask=qm, other=0.0)
    q1 = tl.load(qrow + KR * ki[None, :] + 1, mask=qm, other=0.0)
    q2 = q0
    q3 = q1
    if KR == 4:
        q2 = tl.load(qrow + KR * ki[None, :] + 2, mask=qm, other=0.0)
        q3 = tl.load(qrow + KR * ki[None, :] + 3, mask=qm, other=0.0)
    row_scale = tl.load(qs_ptr + rows, mask=m < G, other=0.0) * qk_scale

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    a0 = tl.zeros([BLOCK_M, VW], tl.float32)
    a1 = tl.zeros([BLOCK_M, VW], tl.float32)
    a2 = tl.zeros([BLOCK_M, VW], tl.float32)
    a3 = tl.zeros([BLOCK_M, VW], tl.float32)
    kho = h.to(tl.int64) * k_page_bytes
    vho = h.to(tl.int64) * v_page_bytes
    # the first split starts at the page holding `skip` (sink tokens are attended elsewhere)
    loop_hi = tl.where(tok_lo < tok_hi, tok_hi, 0)  # no iteration without a valid token
    for start in range((tok_lo // PS) * PS, loop_hi, BLOCK_N):
        tok = start + n
        valid = (tok < tok_hi) & (tok >= tok_lo)
        in_page = tok // PS < page_hi
        blk = tl.load(bt_ptr + b * stride_btb + tok // PS, mask=in_page, other=0).to(tl.int64)
        t = tok % PS
        kb = tl.max_constancy(tl.multiple_of(blk * k_blk_stride + kho, 16), PS)
        vb = tl.max_constancy(tl.multiple_of(blk * v_blk_stride + vho, 16), PS)
        ks = tl.load(kh_ptr + (kb + PS * KCB + 2 * t) // 2, mask=valid, other=0.0).to(tl.float32)
        vs = tl.load(vh_ptr + (vb + PS * VCB + 2 * t) // 2, mask=valid, other=0.0).to(tl.float32)

        s = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        c = _class_codes(kc_ptr, kb, t, ki, 0, KBITS, KCB, D, PS, False, in_page)
        s = _dot(q0, tl.trans(_level(c, KBITS, k0, k1, k2, k3, k4, k5, k6, k7)), s, INTERPRET)
        c = _class_codes(kc_ptr, kb, t, ki, 1, KBITS, KCB, D, PS, False, in_page)
        s = _dot(q1, tl.trans(_level(c, KBITS, k0, k1, k2, k3, k4, k5, k6, k7)), s, INTERPRET)
        if KR == 4:
            c = _class_codes(kc_ptr, kb, t, ki, 2, KBITS, KCB, D, PS, False, in_page)
            s = _dot(q2, tl.trans(_level(c, KBITS, k0, k1, k2, k3, k4, k5, k6, k7)), s, INTERPRET)
            c = _class_codes(kc_ptr, kb, t, ki, 3, KBITS, KCB, D, PS, False, in_page)
            s = _dot(q3, tl.trans(_level(c, KBITS, k0, k1, k2, k3, k4, k5, k6, k7)), s, INTERPRET)
        s = s * ks[None, :] * row_scale[:, None]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        # p * s scaled by 64 before the fp16 cast: keeps long-context probabilities (~1e-5)
        # out of fp16's subnormal range; token scales up to ~1000 stay finite.
        pw = (p * (vs * 64.0)[None, :]).to(tl.float16)
        c = _class_codes(vc_ptr, vb, t, vi, 0, VBITS, VCB, D, PS, True, in_page)
        a0 = _dot(
            pw, _level(c, VBITS, v0, v1, v2, v3, v4, v5, v6, v7), a0 * alpha[:, None], INTERPRET
        )
        c = _class_codes(vc_ptr, vb, t, vi, 1, VBITS, VCB, D, PS, True, in_page)
        a1 = _dot(
            pw, _level(c, VBITS, v0, v1, v2, v3, v4, v5, v6, v7), a1 * alpha[:, None], INTERPRET
        )
        if VR == 4:
            c = _class_codes(vc_ptr, vb, t, vi, 2, VBITS, VCB, D, PS, True, in_page)
            a2 = _dot(
                pw, _level(c, VBITS, v0, v1, v2, v3, v4, v5, v6, v7), a2 * alpha[:, None], INTERPRET
            )
            c = _class_codes(vc_ptr, vb, t, vi, 3, VBITS, VCB, D, PS, True, in_page)
            a3 = _dot(
                pw, _level(c, VBITS, v0, v1, v2, v3, v4, v5, v6, v7), a3 * alpha[:, None], INTERPRET
            )
        m_i = m_new

    inv = tl.where(l_i > 0, 1.0 / (64.0 * l_i), 0.0)
    lse = tl.where(l_i > 0, m_i + tl.log2(l_i), float("-inf"))
    orow = o_ptr + (rows.to(tl.int64) * num_splits + split) * D
    om = (m < G)[:, None]
    tl.store(orow[:, None] + VR * vi[None, :], a0 * inv[:, None], mask=om)
    tl.store(orow[:, None] + VR * vi[None, :] + 1, a1 * inv[:, None], mask=om)
    if VR == 4:
        tl.store(orow[:, None] + VR * vi[None, :] + 2, a2 * inv[:, None], mask=om)
        tl.store(orow[:, None] + VR * vi[None, :] + 3, a3 * inv[:, None], mask=om)
    tl.store(lse_ptr + rows * num_splits + split, lse, mask=m < G)
