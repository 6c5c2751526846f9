"""Triton kernels of paged decode attention (split-KV stage and its reduction).

Grid of the attention stage: (batch * num_kv_heads, num_splits). A program takes every query
head of one KV head as the M rows of ``tl.dot`` (padded to 16) and one contiguous range of the
sequence's pages, and writes its normalised partial output and log-sum-exp (base 2); the
reduction kernel merges the splits. Dequantisation is folded into the matrix products:

* int4 (affine, per token scale ``s`` and zero ``z``): a code ``c`` becomes the bf16 number
  ``128 + c`` by one OR into the exponent bits (``0x4300 | c``), no int-to-float convert. Then
  ``q.k = s * (q.(c+128)) + (z - 128 s) * sum(q)`` and for V
  ``sum_t p_t (s_t c_t + z_t) = (p*s).(C+128) + sum_t (p_t z_t - 128 (p*s)_t)``, with the
  bf16-rounded ``p*s`` used in both terms so that its rounding only multiplies ``c``.
  The nibble split gives even and odd channels as two tensors; q is split the same way and
  each product is two dots of K-depth head_dim/2.
* fp8 e4m3: codes convert to fp16 (one cvt per two elements on sm_90); the per-tensor scales
  multiply the scores and the output.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _dot(a, b, acc, INTERPRET: tl.constexpr):
    """tl.dot; under the Triton 3.6 interpreter bf16 operands go through float32, because its
    dot multiplies bf16 tensors as their raw uint16 storage. The GPU build never sees this."""
    if INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc)


@triton.jit
def _to_bf16(x, INTERPRET: tl.constexpr):
    """float32 -> bf16, round to nearest even. The Triton 3.6 interpreter's cast truncates
    (measured: 1.2% relative output error instead of 0.24%), so it rounds by hand there."""
    if INTERPRET:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)
    return x.to(tl.bfloat16)


@triton.jit
def _bf16_code(c):
    """4-bit codes (uint8 0..15) -> bf16 ``128 + c`` (exact): OR into a bf16 of exponent 2**7."""
    return (c.to(tl.int16) | 0x4300).to(tl.bfloat16, bitcast=True)


@triton.jit
def _unpack4(c, INTERPRET: tl.constexpr):
    """uint8 bytes -> (low nibbles, high nibbles) as bf16 ``128 + nibble``.

    On the GPU one PTX block handles 4 bytes with 2 PRMT + 2 SHR + 4 LOP3 (1 instruction per
    element): PRMT interleaves each byte with the constant 0x43, an AND keeps the low nibble,
    a shift and one LOP3 ((x >> 4) & 0x000F000F | 0x43004300) make the high nibble's bf16.
    Plain Triton ops compiled to ~2.8 integer ops per element (sm_90 SASS of version 1).
    """
    if INTERPRET:
        return _bf16_code(c & 15), _bf16_code(c >> 4)
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 t0, t1;
        prmt.b32 t0, $4, 0x43, 0x4140;
        prmt.b32 t1, $4, 0x43, 0x4342;
        lop3.b32 $0, t0, 0xFF0FFF0F, 0, 0xC0;
        lop3.b32 $1, t1, 0xFF0FFF0F, 0, 0xC0;
        shr.b32 t0, t0, 4;
        shr.b32 t1, t1, 4;
        lop3.b32 $2, t0, 0x000F000F, 0x43004300, 0xEA;
        lop3.b32 $3, t1, 0x000F000F, 0x43004300, 0xEA;
        }""",
        constraints="=r,=r,=r,=r,r",
        args=[c],
        dtype=(tl.bfloat16, tl.bfloat16),
        is_pure=True,
        pack=4,
    )


@triton.jit
def _meta2(w):
    """A little-endian (fp16, fp16) pair loaded as one int32 -> two float32."""
    a = (w & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    b = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return a, b


@triton.jit
def _int4_split_kernel(
    q_ptr,
    kc_ptr,
    vc_ptr,
    kw_ptr,
    vw_ptr,
    bt_ptr,
    sl_ptr,
    o_ptr,
    lse_ptr,
    qk_scale,  # sm_scale * log2(e)
    stride_qb,
    stride_qh,
    stride_btb,
    num_kv_heads,
    page_bytes,
    blk_stride,
    tokens_per_split,
    num_splits,
    G: tl.constexpr,
    BLOCK_M: tl.constexpr,
    D: tl.constexpr,
    PS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // num_kv_heads
    h = bh % num_kv_heads
    seq_len = tl.load(sl_ptr + b)
    tok_lo = split * tokens_per_split
    tok_hi = tl.minimum(seq_len, tok_lo + tokens_per_split)
    page_hi = tl.cdiv(tok_hi, PS)

    HALF: tl.constexpr = D // 2
    m = tl.arange(0, BLOCK_M)
    j = tl.arange(0, HALF)
    n = tl.arange(0, BLOCK_N)
    qrow = q_ptr + b * stride_qb + (h * G + m) * stride_qh
    qmask = (m < G)[:, None]
    q_ev = tl.load(qrow[:, None] + 2 * j[None, :], mask=qmask, other=0.0)
    q_od = tl.load(qrow[:, None] + 2 * j[None, :] + 1, mask=qmask, other=0.0)
    qsum = tl.sum(q_ev.to(tl.float32), 1) + tl.sum(q_od.to(tl.float32), 1)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc_ev = tl.zeros([BLOCK_M, HALF], tl.float32)
    acc_od = tl.zeros([BLOCK_M, HALF], tl.float32)
    acc_c = tl.zeros([BLOCK_M], tl.float32)
    head_off = h.to(tl.int64) * page_bytes
    for start in range(tok_lo, tok_hi, BLOCK_N):
        tok = start + n
        valid = tok < tok_hi
        in_page = tok // PS < page_hi
        blk = tl.load(bt_ptr + b * stride_btb + tok // PS, mask=valid, other=0).to(tl.int64)
        t = tok % PS
        # A page's bytes are contiguous: base is constant over runs of PS tokens and 16-byte
        # aligned; saying so lets V's token-contiguous loads become 16-byte vectors.
        base = tl.max_constancy(tl.multiple_of(blk * blk_stride + head_off, 16), PS)
        meta = (base + PS * HALF + t * 4) // 4  # int32 units: (scale, zero) of token t
        # K codes token-major, V codes channel-major (spec/paged_layout.md): each operand of
        # the two products then reads 4 consecutive bytes per 32-bit shared-memory load.
        # Codes are read by whole pages (a page is always allocated whole): a per-token mask
        # would stop the 16-byte vector loads of V; tokens past the end get p = 0 instead.
        kc = tl.load(
            kc_ptr + (base + t * HALF)[:, None] + j[None, :], mask=in_page[:, None], other=0
        )
        vc = tl.load(
            vc_ptr + (base + t)[:, None] + (j * PS)[None, :], mask=in_page[:, None], other=0
        )
        ks, kz = _meta2(tl.load(kw_ptr + meta, mask=valid, other=0))
        vs, vz = _meta2(tl.load(vw_ptr + meta, mask=valid, other=0))

        k_ev, k_od = _unpack4(kc, INTERPRET)
        s = _dot(q_ev, tl.trans(k_ev), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), INTERPRET)
        s = _dot(q_od, tl.trans(k_od), s, INTERPRET)
        s = (s * ks[None, :] + (kz - 128.0 * ks)[None, :] * qsum[:, None]) * qk_scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        pw = _to_bf16(p * vs[None, :], INTERPRET)
        v_ev, v_od = _unpack4(vc, INTERPRET)
        acc_ev = _dot(pw, v_ev, acc_ev * alpha[:, None], INTERPRET)
        acc_od = _dot(pw, v_od, acc_od * alpha[:, None], INTERPRET)
        acc_c = acc_c * alpha + tl.sum(p * vz[None, :] - 128.0 * pw.to(tl.float32), 1)
        m_i = m_new

    inv = tl.where(l_i > 0, 1.0 / l_i, 0.0)
    lse = tl.where(l_i > 0, m_i + tl.log2(l_i), float("-inf"))
    rows = (b * num_kv_heads + h) * G + m  # = b * num_q_heads + q head
    orow = o_ptr + (rows.to(tl.int64) * num_splits + split) * D
    omask = (m < G)[:, None]
    tl.store(orow[:, None] + 2 * j[None, :], (acc_ev + acc_c[:, None]) * inv[:, None], mask=omask)
    tl.store(
        orow[:, None] + 2 * j[None, :] + 1, (acc_od + acc_c[:, None]) * inv[:, None], mask=omask
    )
    tl.store(lse_ptr + rows * num_splits + split, lse, mask=m < G)


@triton.jit
def _fp8_split_kernel(
    q_ptr,
    kc_ptr,
    vc_ptr,
    bt_ptr,
    sl_ptr,
    o_ptr,
    lse_ptr,
    qk_scale,  # sm_scale * log2(e) * k_scale
    v_scale,
    stride_qb,
    stride_qh,
    stride_btb,
    num_kv_heads,
    page_bytes,
    blk_stride,
    tokens_per_split,
    num_splits,
    G: tl.constexpr,
    BLOCK_M: tl.constexpr,
    D: tl.constexpr,
    PS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // num_kv_heads
    h = bh % num_kv_heads
    seq_len = tl.load(sl_ptr + b)
    tok_lo = split * tokens_per_split
    tok_hi = tl.minimum(seq_len, tok_lo + tokens_per_split)
    page_hi = tl.cdiv(tok_hi, PS)

    m = tl.arange(0, BLOCK_M)
    d = tl.arange(0, D)
    n = tl.arange(0, BLOCK_N)
    qrow = q_ptr + b * stride_qb + (h * G + m) * stride_qh
    q = tl.load(qrow[:, None] + d[None, :], mask=(m < G)[:, None], other=0.0).to(tl.float16)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    head_off = h.to(tl.int64) * page_bytes
    for start in range(tok_lo, tok_hi, BLOCK_N):
        tok = start + n
        valid = tok < tok_hi
        in_page = tok // PS < page_hi
        blk = tl.load(bt_ptr + b * stride_btb + tok // PS, mask=valid, other=0).to(tl.int64)
        # A page's bytes are contiguous: base is constant over runs of PS tokens and 16-byte
        # aligned; saying so lets V's token-contiguous loads become 16-byte vectors.
        base = tl.max_constancy(tl.multiple_of(blk * blk_stride + head_off, 16), PS)
        t = tok % PS
        k = tl.load(kc_ptr + (base + t * D)[:, None] + d[None, :], mask=in_page[:, None], other=0.0)
        v = tl.load(
            vc_ptr + (base + t)[:, None] + (d * PS)[None, :], mask=in_page[:, None], other=0.0
        )
        s = tl.dot(q, tl.trans(k.to(tl.float16))) * qk_scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(tl.float16), v.to(tl.float16), acc * alpha[:, None])
        m_i = m_new

    inv = tl.where(l_i > 0, v_scale / l_i, 0.0)
    lse = tl.where(l_i > 0, m_i + tl.log2(l_i), float("-inf"))
    rows = (b * num_kv_heads + h) * G + m
    orow = o_ptr + (rows.to(tl.int64) * num_splits + split) * D
    tl.store(orow[:, None] + d[None, :], acc * inv[:, None], mask=(m < G)[:, None])
    tl.store(lse_ptr + rows * num_splits + split, lse, mask=m < G)


# One compiled kernel for every split count: the splits are read in chunks of CH (the split
# count is neither a block size nor specialised on), so a server whose steps change their split
# count never compiles it again mid-serving (vLLM's JIT monitor: "a latency spike").
@triton.jit(do_not_specialize=["num_splits"])
def _merge_kernel(
    o_ptr,
    lse_ptr,
    out_ptr,
    num_splits,
    CH: tl.constexpr,
    D: tl.constexpr,
    OUT_BF16: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """out[row] = sum_s 2**(lse_s - lse) o_s over the splits of one (batch, q head) row."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CH)
    # the splits' max and sum of 2**(lse - max), chunk by chunk (online)
    mx = tl.max(tl.full([CH], float("-inf"), tl.float32), 0)
    den = tl.sum(tl.zeros([CH], tl.float32), 0)
    for s0 in range(0, num_splits, CH):
        sc = s0 + c
        lc = tl.load(lse_ptr + row * num_splits + sc, mask=sc < num_splits, other=float("-inf"))
        m_new = tl.maximum(mx, tl.max(lc, 0))
        live = m_new > float("-inf")
        den = tl.where(live, den * tl.exp2(mx - m_new), 0.0)
        den += tl.sum(tl.where(lc > float("-inf"), tl.exp2(lc - m_new), 0.0), 0)
        mx = m_new
    d = tl.arange(0, D)
    acc = tl.zeros([D], tl.float32)
    for s0 in range(0, num_splits, CH):  # chunks: a [splits, D] tile would spill at 256 splits
        sc = s0 + c
        lc = tl.load(lse_ptr + row * num_splits + sc, mask=sc < num_splits, other=float("-inf"))
        w = tl.where(lc > float("-inf"), tl.exp2(lc - mx), 0.0)
        o = tl.load(
            o_ptr + (row * num_splits + sc)[:, None] * D + d[None, :],
            mask=(sc < num_splits)[:, None],
            other=0.0,
        )
        acc += tl.sum(o * w[:, None], 0)
    if OUT_BF16:
        tl.store(out_ptr + row * D + d, _to_bf16(acc / den, INTERPRET))
    else:
        tl.store(out_ptr + row * D + d, acc / den)
