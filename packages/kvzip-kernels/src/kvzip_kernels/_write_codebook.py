"""Cache-write kernel of the compact formats: quantize transformed rows and pack bit planes.

The transform ``y = A (x - mean)`` runs as one batched matmul in torch on the device (float32;
spec/4bit.md section 3 allows one float32 rounding step against the float64 reference). This
kernel does the rest of section 4 and the row layout of section 5, and scatters into the
paged layout: ``s0 = f16(sqrt(mean y^2))``, codes = number of decision edges below ``y/s0``,
least-squares scale ``s = f16(<y, l> / <l, l>)`` (``s0`` where that is not finite and
positive), then the bit planes of each channel group. One program per token, all KV heads.
Reductions may run in another order than torch's (the spec allows ``s`` to differ in the last
fp16 place).

Rejected inputs (spec/4bit.md section 9) are found here, per row, as the reference finds them:
an element of ``x`` that is NaN, infinite or beyond float16's range (``not |x| <= 65504``), or
a token scale ``s0`` that is not finite (the RMS of ``y`` overflows float16). Such a row is
written with a NaN token scale, so that it decodes to NaN and never to a plausible value, and
the kernel records the failure in ``status`` (see ``kvzip_kernels.cache_write.check_status``):
``status[0]`` ORs ``X_BAD`` / ``RMS_BAD``, ``status[1]`` keeps ``2**31 - 1 - first failing token``
(an atomic max, so that a zero-filled word is a fresh one).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvzip_kernels._decode_codebook import _level

X_BAD = 1  # an element of x is NaN, inf or |x| > 65504
RMS_BAD = 2  # a transformed row's RMS is not finite in float16


@triton.jit
def _rows_out_of_range(x_ptr, tok, stride_xt, stride_xh, h, hm, D: tl.constexpr):
    """[H_P] int1: heads of token ``tok`` whose row of ``x`` holds NaN, inf or |x| > 65504."""
    d = tl.arange(0, D)
    xp = x_ptr + tok.to(tl.int64) * stride_xt + h.to(tl.int64)[:, None] * stride_xh + d[None, :]
    x = tl.load(xp, mask=hm[:, None], other=0.0).to(tl.float32)
    bad = (tl.abs(x) <= 65504.0) == 0  # NaN compares false
    return (tl.max(bad.to(tl.int32), 1) != 0) & hm


@triton.jit
def _report(status_ptr, tok, flags):
    """Record a rejected token: OR its flags into status[0], the lowest token into status[1]
    (as ``2**31 - 1 - tok``, by atomic max: a zero-filled status is a fresh one)."""
    tl.atomic_or(status_ptr, flags, mask=flags != 0)
    tl.atomic_max(status_ptr + 1, 2147483647 - tok, mask=flags != 0)


@triton.jit
def _codes(u, BITS: tl.constexpr, edge_ptr):
    """Code = #{edges < u} (ties go to the lower level), int32."""
    c = tl.zeros(u.shape, tl.int32)
    for e in tl.static_range((1 << BITS) - 1):
        c += (u > tl.load(edge_ptr + e)).to(tl.int32)
    return c


@triton.jit
def _unit(y, s0):
    """u = y / s0 as the reference computes it (IEEE float32 division; 0 where s0 == 0)."""
    safe = tl.where(s0 > 0, s0, 1.0)[:, None]
    return tl.where(s0[:, None] > 0, tl.math.div_rn(y, safe), 0.0)


@triton.jit
def _load_codes(yrow, hm, ch, s0, BITS: tl.constexpr, edge_ptr):
    """Codes of channels ``ch`` ([W]) of every head ([H_P] row pointers): [H_P, W] int32."""
    y = tl.load(yrow[:, None] + ch[None, :], mask=hm[:, None], other=0.0)
    return _codes(_unit(y, s0), BITS, edge_ptr)


@triton.jit
def _group_fit(
    yrow, hm, s0, START: tl.constexpr, N: tl.constexpr, BITS: tl.constexpr, edge_ptr, lev_ptr
):
    """(sum y l, sum l l) over one group's channels, per head."""
    ch = START + tl.arange(0, N)
    y = tl.load(yrow[:, None] + ch[None, :], mask=hm[:, None], other=0.0)
    c = _codes(_unit(y, s0), BITS, edge_ptr)
    m0, m1, m2, m3 = (
        tl.load(lev_ptr),
        tl.load(lev_ptr + 1),
        tl.load(lev_ptr + 2),
        tl.load(lev_ptr + 3),
    )
    m4, m5, m6, m7 = (
        tl.load(lev_ptr + 4),
        tl.load(lev_ptr + 5),
        tl.load(lev_ptr + 6),
        tl.load(lev_ptr + 7),
    )
    lv = _level(c, BITS, m0, m1, m2, m3, m4, m5, m6, m7).to(tl.float32)
    return tl.sum(y * lv, 1), tl.sum(lv * lv, 1)


@triton.jit
def _store_plane(
    cache_ptr,
    base,
    t,
    byte,
    val,
    hm,
    CB: tl.constexpr,
    PS: tl.constexpr,
    CHANNEL_MAJOR: tl.constexpr,
):
    if CHANNEL_MAJOR:  # byte j of token t at j * PS + t
        off = base[:, None] + byte[None, :] * PS + t
    else:
        off = base[:, None] + t * CB + byte[None, :]
    tl.store(cache_ptr + off, val.to(tl.uint8), mask=hm[:, None])


@triton.jit
def _group_planes(
    cache_ptr,
    base,
    t,
    yrow,
    hm,
    s0,
    START: tl.constexpr,
    N: tl.constexpr,
    BITS: tl.constexpr,
    OFF: tl.constexpr,
    OFF1: tl.constexpr,
    edge_ptr,
    CB: tl.constexpr,
    PS: tl.constexpr,
    CHANNEL_MAJOR: tl.constexpr,
):
    """Write one group's bit planes (spec/4bit.md section 5: widest plane = lowest bits)."""
    if BITS == 4:
        i = tl.arange(0, N // 2)
        lo = _load_codes(yrow, hm, START + 2 * i, s0, BITS, edge_ptr)
        hi = _load_codes(yrow, hm, START + 2 * i + 1, s0, BITS, edge_ptr)
        _store_plane(cache_ptr, base, t, OFF + i, lo | (hi << 4), hm, CB, PS, CHANNEL_MAJOR)
    else:
        i = tl.arange(0, N // 4)
        v = tl.zeros([yrow.shape[0], N // 4], tl.int32)
        for k in tl.static_range(4):
            v |= (_load_codes(yrow, hm, START + 4 * i + k, s0, BITS, edge_ptr) & 3) << (2 * k)
        _store_plane(cache_ptr, base, t, OFF + i, v, hm, CB, PS, CHANNEL_MAJOR)
        if BITS == 3:
            j = tl.arange(0, N // 8)
            w = tl.zeros([yrow.shape[0], N // 8], tl.int32)
            for k in tl.static_range(8):
                c = _load_codes(yrow, hm, START + 8 * j + k, s0, BITS, edge_ptr)
                w |= ((c >> 2) & 1) << k
            _store_plane(cache_ptr, base, t, OFF1 + j, w, hm, CB, PS, CHANNEL_MAJOR)


@triton.jit
def _codebook_write_kernel(
    x_ptr,
    y_ptr,
    cache_ptr,
    cache16_ptr,
    slot_ptr,
    edge_ptr,
    lev_ptr,
    status_ptr,
    stride_xt,
    stride_xh,
    stride_yt,
    stride_yh,
    num_kv_heads,
    page_bytes,
    blk_stride,
    H_P: tl.constexpr,
    D: tl.constexpr,
    PS: tl.constexpr,
    CB: tl.constexpr,
    CHANNEL_MAJOR: tl.constexpr,
    B0: tl.constexpr,
    N0: tl.constexpr,
    O0: tl.constexpr,
    P0: tl.constexpr,
    B1: tl.constexpr,
    N1: tl.constexpr,
    O1: tl.constexpr,
    P1: tl.constexpr,
):
    tok = tl.program_id(0)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:
        return
    blk = slot // PS
    t = slot % PS
    h = tl.arange(0, H_P)
    hm = h < num_kv_heads
    yrow = y_ptr + tok.to(tl.int64) * stride_yt + h.to(tl.int64) * stride_yh  # unit stride in d
    y = tl.load(yrow[:, None] + tl.arange(0, D)[None, :], mask=hm[:, None], other=0.0)
    s0 = tl.math.sqrt_rn(tl.sum(y * y, 1) / D).to(tl.float16).to(tl.float32)
    num, den = _group_fit(yrow, hm, s0, 0, N0, B0, edge_ptr, lev_ptr)
    if N1 > 0:
        n1, d1 = _group_fit(yrow, hm, s0, N0, N1, B1, edge_ptr + 16, lev_ptr + 8)
        num += n1
        den += d1
    s = tl.math.div_rn(num, den).to(tl.float16).to(tl.float32)
    s = tl.where((s > 0) & (s < float("inf")), s, s0)
    x_bad = _rows_out_of_range(x_ptr, tok, stride_xt, stride_xh, h, hm, D)
    rms_bad = ((s0 < float("inf")) == 0) & hm & (x_bad == 0)
    s = tl.where(x_bad | rms_bad, float("nan"), s)  # a rejected row decodes to NaN
    flags = tl.max(x_bad.to(tl.int32), 0) | tl.max(rms_bad.to(tl.int32), 0) * 2  # X_BAD, RMS_BAD
    _report(status_ptr, tok, flags)
    base = blk * blk_stride + h * page_bytes
    _group_planes(
        cache_ptr, base, t, yrow, hm, s0, 0, N0, B0, O0, P0, edge_ptr, CB, PS, CHANNEL_MAJOR
    )
    if N1 > 0:
        _group_planes(
            cache_ptr,
            base,
            t,
            yrow,
            hm,
            s0,
            N0,
            N1,
            B1,
            O1,
            P1,
            edge_ptr + 16,
            CB,
            PS,
            CHANNEL_MAJOR,
        )
    tl.store(cache16_ptr + (base + PS * CB + 2 * t) // 2, s.to(tl.float16), mask=hm)
