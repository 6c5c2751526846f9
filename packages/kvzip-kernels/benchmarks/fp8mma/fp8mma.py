#!/usr/bin/env python3
"""fp8mma: a research decode design with e4m3 codebook levels decoded by register PRMT into
tensor-core operands (issue 36 item 3; kernel and layout: ``fp8mma.cu``; design and results:
kvzip-kernels NOTES.md, "fp8 tensor-core decode"). Not wired into the product.

A research variant of ``4bit`` at head_dim 128, page size 16: sign-magnitude 4-bit codes whose 8
magnitudes are e4m3 bytes (levels e4m3(alpha L) / alpha of the 4-bit Lloyd-Max levels L of
N(0, 1), alpha minimising the N(0, 1) MSE with midpoint edges), an fp16 scale per token (the
1 / alpha folded in), K token-major and V channel-major in words of 8 tokens (fp8mma.cu's
header has the bit layout). The quantiser works on the rows as given (the transformed
coordinates y of spec/4bit.md: the rotation is a host-side matter, identical to ``4bit``'s).

    python fp8mma.py sass [--out DIR]            # sm_90a (and sm_89) SASS of the loop, on the CPU
    python fp8mma.py gpu --out DIR [--quick]     # on a GPU: check against the reference, time
                                                 # beside v6's 4bit (kvzip_kernels.plan)

Library use (the CPU test): :func:`levels`, :func:`pack_k`, :func:`pack_v`, :func:`unpack_k`,
:func:`unpack_v`, :func:`reference`, :func:`model`, :func:`tolerance`, :func:`sass_counts`.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import functools
import json
import math
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
SRC = HERE / "fp8mma.cu"
D = 128
PS = 16
PAGE = PS * 64 + 2 * PS  # a K (or V) page as one array: 1024 code bytes, 16 fp16 scales
CODES = 2 * PS * 64  # a page's K and V codes in the cache (the scales apart: to_cache)
TILE = 32

# ---- e4m3 ------------------------------------------------------------------------------------


def e4m3_value(byte: np.ndarray) -> np.ndarray:
    """float64 values of e4m3fn bytes (0x7f / 0xff are NaN)."""
    b = np.asarray(byte, dtype=np.int64)
    s = np.where(b & 0x80, -1.0, 1.0)
    e = (b >> 3) & 0xF
    m = b & 7
    v = np.where(e == 0, m / 8.0 * 2.0**-6, (1 + m / 8.0) * 2.0 ** (e - 7.0))
    return np.where((b & 0x7F) == 0x7F, np.nan, s * v)


_ALL = e4m3_value(np.arange(256))
_POS = np.arange(0x7F)  # finite non-negative bytes, ascending values


def e4m3_byte(x: np.ndarray) -> np.ndarray:
    """Round float values to the nearest e4m3 (ties to even mantissa), saturating at +-448."""
    x = np.asarray(x, dtype=np.float64)
    a = np.minimum(np.abs(x), 448.0)
    vals = _ALL[_POS]
    i = np.clip(np.searchsorted(vals, a), 1, len(vals) - 1)
    lo, hi = vals[i - 1], vals[i]
    pick_hi = (a - lo > hi - a) | ((a - lo == hi - a) & ((_POS[i - 1] & 1) == 1))
    b = np.where(pick_hi, _POS[i], _POS[i - 1]).astype(np.int64)
    b = np.where(a == 0, 0, b)
    return np.where((x < 0) & (b != 0), b | 0x80, b).astype(np.uint8)


def e4m3_round(x: np.ndarray) -> np.ndarray:
    return e4m3_value(e4m3_byte(x))


def f16(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float64).astype(np.float16).astype(np.float64)


# ---- levels ----------------------------------------------------------------------------------


def _gauss_mse(levels: np.ndarray) -> float:
    """E[(x - Q(x))^2] for x ~ N(0, 1), Q nearest of ``levels`` (ascending), midpoint edges."""
    erf = np.vectorize(math.erf)
    e = np.concatenate(([-np.inf], (levels[1:] + levels[:-1]) / 2, [np.inf]))
    pdf = np.exp(-(e**2) / 2) / math.sqrt(2 * math.pi)
    pdf[~np.isfinite(e)] = 0.0
    cdf = 0.5 * (1 + erf(e / math.sqrt(2)))
    mass = np.diff(cdf)
    m1 = pdf[:-1] - pdf[1:]  # integral of x phi
    ee = np.where(np.isfinite(e), e, 0.0)
    m2 = mass + (ee[:-1] * pdf[:-1] - ee[1:] * pdf[1:])  # integral of x^2 phi
    return float(np.sum(m2 - 2 * levels * m1 + levels**2 * mass))


@functools.cache
def levels() -> dict:
    """The e4m3 magnitudes: alpha (grid search, N(0, 1) MSE with midpoint edges), the 8 bytes
    (ascending), the levels e4m3(alpha L) / alpha (16, ascending), the two PRMT table words."""
    from kvzip_formats.lloyd_max import gaussian_codebook

    L = gaussian_codebook(4)
    best = None
    for alpha in np.linspace(0.5, 8.0, 7501):
        lv = e4m3_round(alpha * L) / alpha
        mse = _gauss_mse(lv)
        if best is None or mse < best[0]:
            best = (mse, alpha)
    mse, alpha = best
    mags = e4m3_byte(alpha * L[8:])  # ascending magnitudes
    lv = e4m3_round(alpha * L) / alpha
    t0 = int.from_bytes(bytes(mags[:4].tolist()), "little")
    t1 = int.from_bytes(bytes(mags[4:].tolist()), "little")
    return dict(
        alpha=float(alpha),
        mag_bytes=[int(b) for b in mags],
        mag_values=e4m3_value(mags).tolist(),
        levels=lv.tolist(),
        lloyd_max=L.tolist(),
        mse_exact=_gauss_mse(L),
        mse_e4m3=mse,
        t0=t0,
        t1=t1,
    )


# ---- quantiser and packer ----------------------------------------------------------------------


def quantise(y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``y [..., D]`` -> (sign-magnitude codes [..., D] uint8: sign << 3 | magnitude index,
    fp16 scales [...] such that value = scale * e4m3(magnitude byte) * sign), as spec/4bit.md
    section 4 with the e4m3 levels: s0 = f16(rms), nearest level of y / s0 (midpoint edges,
    ties to the lower level), least-squares scale, then 1 / alpha folded into the scale."""
    lv = levels()
    lev = np.asarray(lv["levels"])
    y = np.asarray(y, dtype=np.float32)
    s0 = f16(np.sqrt(np.mean(y.astype(np.float64) ** 2, axis=-1)))
    u = np.where(s0[..., None] > 0, y / np.where(s0 > 0, s0, 1)[..., None], 0.0)
    edges = (lev[1:] + lev[:-1]) / 2
    c = np.searchsorted(edges, u, side="left")  # #{edges < u}
    lc = lev[c]
    den = np.sum(lc * lc, axis=-1)
    s = f16(np.sum(y * lc, axis=-1) / np.where(den > 0, den, 1))
    s = np.where(np.isfinite(s) & (s > 0), s, s0)
    sign = (c < 8).astype(np.uint8)
    mag = np.where(c >= 8, c - 8, 7 - c).astype(np.uint8)
    return (sign << 3) | mag, f16(s / lv["alpha"]).astype(np.float16)


def _word(codes8: np.ndarray) -> np.ndarray:
    """8 sign-magnitude codes [..., 8] (lo 0..3, hi 0..3) -> the uint32 word of fp8mma.cu."""
    c = codes8.astype(np.uint32)
    w = np.zeros(c.shape[:-1], dtype=np.uint32)
    for i in range(4):
        lo, hi = c[..., i], c[..., 4 + i]
        w |= (lo & 7) << (4 * i) | ((lo >> 3) & 1) << (8 * i + 7)
        w |= (hi & 7) << (16 + 4 * i) | ((hi >> 3) & 1) << (8 * i + 3)
    return w


def _unword(w: np.ndarray) -> np.ndarray:
    w = w.astype(np.uint32)
    out = np.zeros(w.shape + (8,), dtype=np.uint8)
    for i in range(4):
        out[..., i] = ((w >> (4 * i)) & 7) | (((w >> (8 * i + 7)) & 1) << 3)
        out[..., 4 + i] = ((w >> (16 + 4 * i)) & 7) | (((w >> (8 * i + 3)) & 1) << 3)
    return out


def _k_perm() -> np.ndarray:
    """Channel of each code of a K row's 16 words in word order: word 4q + ks, lo i ->
    32q + 8ks + i, hi i -> 32q + 8ks + 4 + i."""
    return np.arange(D).reshape(16, 8)  # (word, code) -> channel: the natural order


def _v_tokens() -> np.ndarray:
    """Token position (within the page) of each code of V word half h: lo i -> 4(i >> 1) +
    2h + (i & 1), hi i -> 4(2 + (i >> 1)) + 2h + (i & 1). [2 halves, 8 codes]."""
    t = np.zeros((2, 8), dtype=np.int64)
    for h in range(2):
        for i in range(4):
            t[h, i] = 4 * (i >> 1) + 2 * h + (i & 1)
            t[h, 4 + i] = 4 * (2 + (i >> 1)) + 2 * h + (i & 1)
    return t


def pack_k_page(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """One K page: codes [16, D], scales [16] -> uint8 [PAGE]."""
    w = _word(codes[:, _k_perm()])  # [16 tokens, 16 words]
    out = np.zeros(PAGE, dtype=np.uint8)
    out[: PS * 64] = np.ascontiguousarray(w).astype("<u4").view(np.uint8).reshape(-1)
    out[PS * 64 :] = scales.astype("<f2").view(np.uint8)
    return out


def pack_v_page(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """One V page: codes [16 tokens, D], scales [16] -> uint8 [PAGE]: channel pair j at 16 j:
    words (2j, h=0), (2j+1, 0), (2j, 1), (2j+1, 1)."""
    vt = _v_tokens()
    ch = codes.T  # [D, 16 tokens]
    words = _word(ch[:, vt])  # [D, 2 halves]
    arr = words.reshape(D // 2, 2, 2).transpose(0, 2, 1)  # [pair, half, even/odd]
    out = np.zeros(PAGE, dtype=np.uint8)
    out[: PS * 64] = np.ascontiguousarray(arr).astype("<u4").view(np.uint8).reshape(-1)
    out[PS * 64 :] = scales.astype("<f2").view(np.uint8)
    return out


def unpack_k_page(page: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    w = page[: PS * 64].view("<u4").reshape(PS, 16)
    codes = np.zeros((PS, D), dtype=np.uint8)
    codes[:, _k_perm()] = _unword(w)
    return codes, page[PS * 64 :].view("<f2").copy()


def unpack_v_page(page: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    arr = page[: PS * 64].view("<u4").reshape(D // 2, 2, 2).transpose(0, 2, 1).reshape(D, 2)
    c8 = _unword(arr)  # [D, 2, 8]
    codes = np.zeros((D, PS), dtype=np.uint8)
    vt = _v_tokens()
    for h in range(2):
        codes[:, vt[h]] = c8[:, h]
    return codes.T.copy(), page[PS * 64 :].view("<f2").copy()


def code_values(codes: np.ndarray) -> np.ndarray:
    """e4m3 value of sign-magnitude codes (without the token scale)."""
    mags = np.asarray(levels()["mag_values"])
    return np.where(codes & 8, -1.0, 1.0) * mags[codes & 7]


def make_case(B, hkv, G, ctx, seed=0, num_blocks=None, lens=None):
    """Random K, V rows (y coordinates, N(0, 1) with per-token scales), quantised and paged
    (random block table), and q' rows. Returns a dict of numpy arrays."""
    rng = np.random.default_rng(seed)
    lens = np.asarray(lens if lens is not None else [ctx] * B, dtype=np.int64)
    pages = -(-lens // PS)
    maxp = int(pages.max())
    nb = num_blocks or int(pages.sum()) + 3
    bt = np.zeros((B, maxp), dtype=np.int32)
    perm = rng.permutation(nb)
    used = 0
    for b in range(B):
        bt[b, : pages[b]] = perm[used : used + pages[b]]
        used += pages[b]
    # K and V pages [blocks, kv heads, PAGE] (to_cache lays them out for the kernel); blocks
    # no sequence uses: random bytes
    kc = rng.integers(0, 256, (nb, hkv, PAGE), dtype=np.uint8)
    vc = rng.integers(0, 256, (nb, hkv, PAGE), dtype=np.uint8)
    for b in range(B):
        for p in range(pages[b]):
            n = min(PS, int(lens[b]) - p * PS)
            for h in range(hkv):
                for arr, pack in ((kc, pack_k_page), (vc, pack_v_page)):
                    y = rng.standard_normal((PS, D)) * rng.uniform(0.5, 1.5, (PS, 1))
                    codes, sc = quantise(y)
                    if n < PS:  # slots past the sequence: random codes, a huge scale (masked)
                        codes[n:] = rng.integers(0, 16, (PS - n, D))
                        sc[n:] = 60000.0
                    arr[bt[b, p], h] = pack(codes, sc)
    q = rng.standard_normal((B, hkv * G, D)) * rng.uniform(0.5, 2, (B, hkv * G, 1))
    kv = to_cache(kc, vc)
    return dict(q=q, kv=kv, kc=kc, vc=vc, bt=bt, sl=lens.astype(np.int32), hkv=hkv, G=G)


def to_cache(kc: np.ndarray, vc: np.ndarray) -> np.ndarray:
    """K and V pages [blocks, H, PAGE] -> the kernel's cache uint8 [blocks, H * (CODES + 64)]:
    per block [H][K codes, V codes] then [H][K scales, V scales] (fp8mma.cu's header)."""
    nb, H = kc.shape[:2]
    codes = np.concatenate([kc[..., : PS * 64], vc[..., : PS * 64]], axis=-1)  # [nb, H, 2048]
    scales = np.concatenate([kc[..., PS * 64 :], vc[..., PS * 64 :]], axis=-1)  # [nb, H, 64]
    return np.concatenate([codes.reshape(nb, -1), scales.reshape(nb, -1)], axis=-1)


def gather(case, b, h):
    """Dequantised K, V [len, D] (float64) of sequence b, KV head h."""
    n = int(case["sl"][b])
    ks, vs = [], []
    for p in range(-(-n // PS)):
        blk = case["bt"][b, p]
        kcod, ksc = unpack_k_page(case["kc"][blk, h])
        vcod, vsc = unpack_v_page(case["vc"][blk, h])
        ks.append(code_values(kcod) * ksc.astype(np.float64)[:, None])
        vs.append(code_values(vcod) * vsc.astype(np.float64)[:, None])
    return np.concatenate(ks)[:n], np.concatenate(vs)[:n]


def reference(case) -> np.ndarray:
    """float64 attention of q' over the quantised K, V: [B, Hq, D]."""
    q, hkv, G = case["q"], case["hkv"], case["G"]
    B = q.shape[0]
    out = np.zeros_like(q)
    for b in range(B):
        for h in range(hkv):
            k, v = gather(case, b, h)
            s = q[b, h * G : (h + 1) * G] @ k.T / math.sqrt(D)
            s -= s.max(axis=1, keepdims=True)
            p = np.exp(s)
            out[b, h * G : (h + 1) * G] = (p @ v) / p.sum(axis=1, keepdims=True)
    return out


def q_prep(q: np.ndarray, variant: str):
    """q' rows [rows, D] -> the kernel's query operand and row scale qs. f8: e4m3 hi, lo of
    q' / qs0 with qs0 = max|q'| / 224 (uint8 [rows, 2, D]), qs = qs0 log2(e) / sqrt(D); cvt:
    fp16 q' log2(e) / sqrt(D) (qs unused: ones)."""
    qs0 = np.abs(q).max(axis=-1) / 224.0
    qs0 = np.where(qs0 > 0, qs0, 1.0)
    x = q / qs0[..., None]
    qsc = (qs0 * math.log2(math.e) / math.sqrt(D)).astype(np.float32)
    if variant == "f8":
        hi = e4m3_byte(x)
        lo = e4m3_byte(x - e4m3_value(hi))
        return np.stack([hi, lo], axis=-2), qsc
    c = math.log2(math.e) / math.sqrt(D)
    return (q * c).astype(np.float16), np.ones_like(qsc)


def p_scale(case) -> float:
    """P' = p * v_scale * pscale: 224 / the largest V token scale (P' <= 224 < 448)."""
    vmax = max(
        float(
            np.abs(
                unpack_v_page(case["vc"][case["bt"][b, p], h])[1][: int(case["sl"][b]) - p * PS]
            ).max()
        )
        for b in range(len(case["sl"]))
        for p in range(-(-int(case["sl"][b]) // PS))
        for h in range(case["hkv"])
    )
    return 224.0 / vmax


def q_rounded(q: np.ndarray, variant: str) -> np.ndarray:
    """The query as the kernel's operand holds it, in float64: f8: qs0 (e4m3(x) + e4m3(x -
    e4m3(x))), x = q' / qs0; cvt: fp16(q' c) / c, c = log2(e) / sqrt(D)."""
    if variant == "f8":
        qs0 = np.abs(q).max(axis=-1, keepdims=True) / 224.0
        qs0 = np.where(qs0 > 0, qs0, 1.0)
        x = q / qs0
        hi = e4m3_round(x)
        return (hi + e4m3_round(x - hi)) * qs0
    c = math.log2(math.e) / math.sqrt(D)
    return f16(q * c) / c


def tolerance(case, variant: str) -> float:
    """Max abs error allowed against :func:`reference` (NOTES, "fp8 tensor-core decode"):

    1. the query's rounding, exactly: max |o(q_rounded) - o(q')| in float64;
    2. P' = p v_scale pscale rounded to fp16 (2^-11 relative) and, f8, split hi + lo in e4m3
       (|P' - hi - lo| <= 2^-8 P' + 2^-10): per output row at most (2^-11 + 2^-8) sum_t p_t |V_tc|
       / L + 2^-10 * N * 3.0 / (pscale L) (3.0 = the largest level, L = sum_t p_t, N tokens);
    3. fp32 sums and ex2.approx: 2^-16 of the largest |V|.
    The sum, times 1.25."""
    q, hkv, G = case["q"], case["hkv"], case["G"]
    qr = q_rounded(q, variant)
    ps = p_scale(case)
    rel = 2.0**-11 + (2.0**-8 if variant == "f8" else 0.0)
    floor = 2.0**-10 if variant == "f8" else 2.0**-25
    worst = 0.0
    for b in range(q.shape[0]):
        for h in range(hkv):
            k, v = gather(case, b, h)
            rows = slice(h * G, (h + 1) * G)
            outs = []
            for qq in (q[b, rows], qr[b, rows]):
                s = qq @ k.T / math.sqrt(D)
                s -= s.max(axis=1, keepdims=True)
                p = np.exp(s)
                outs.append(((p @ v) / p.sum(axis=1, keepdims=True), p))
            (o, p), (orr, _) = outs
            L = p.sum(axis=1, keepdims=True)
            t2 = rel * (p @ np.abs(v)) / L + floor * len(k) * 3.0 / (ps * L)
            t = np.abs(orr - o) + t2 + 2.0**-16 * np.abs(v).max()
            worst = max(worst, float(t.max()))
    return 1.25 * worst


# ---- numpy model of the kernel's lanes ----------------------------------------------------------
# Registers are uint32 arrays over the 32 lanes (lane = 4 g + q); every expression below is a
# line of fp8mma.cu.

LANE = np.arange(32)
LG, LQ = LANE >> 2, LANE & 3


def prmt(a, b, sel):
    """PTX prmt.b32, default mode: byte i of the result is byte sel[4i..4i+2] of {b, a}, or
    that byte's bit 7 replicated when sel bit 4i+3 is set."""
    a, b, sel = (np.asarray(x, dtype=np.uint64) for x in (a, b, sel))
    src = (b << np.uint64(32)) | a
    r = np.zeros(np.broadcast(a, b, sel).shape, dtype=np.uint64)
    for i in range(4):
        n = (sel >> np.uint64(4 * i)) & np.uint64(0xF)
        byte = (src >> (np.uint64(8) * (n & np.uint64(7)))) & np.uint64(0xFF)
        rep = np.where(byte & np.uint64(0x80), np.uint64(0xFF), np.uint64(0))
        byte = np.where(n & np.uint64(8), rep, byte)
        r |= byte << np.uint64(8 * i)
    return r.astype(np.uint32)


def decode_word(w, t0: int, t1: int):
    """fp8mma.cu's ``decode``, bit for bit: (A_lo, A_hi) of code words ``w``."""
    w = np.asarray(w, dtype=np.uint32)
    m = w & np.uint32(0x77777777)
    alo = prmt(t0, t1, m) ^ (w & np.uint32(0x80808080))
    ahi = prmt(t0, t1, m >> np.uint32(16)) ^ ((w << np.uint32(4)) & np.uint32(0x80808080))
    return alo, ahi


def _e4m3_bytes(x):
    """[32] words -> [32, 4] e4m3 values."""
    x = np.asarray(x, dtype=np.uint32)
    return e4m3_value(np.stack([(x >> np.uint32(8 * i)) & np.uint32(0xFF) for i in range(4)], -1))


def _f16_pair(x):
    """[32] words -> [32, 2] fp16 values (low half first)."""
    x = np.asarray(x, dtype=np.uint32)
    return (
        np.stack([x & np.uint32(0xFFFF), x >> np.uint32(16)], -1)
        .astype(np.uint16)
        .view(np.float16)
        .astype(np.float64)
    )


def _f16_word(lo, hi):
    """fp16 bits of (lo, hi) float values -> [32] words (cvt.rn.f16x2.f32)."""
    lo = np.asarray(lo, dtype=np.float16).view(np.uint16).astype(np.uint32)
    hi = np.asarray(hi, dtype=np.float16).view(np.uint16).astype(np.uint32)
    return lo | (hi << np.uint32(16))


def mma_k32(a, b) -> np.ndarray:
    """mma.m16n8k32 e4m3 (PTX ISA fragments): a = 4 registers [32], b = 2 -> D [16, 8]: a0 row
    g, k 4q..4q+3; a1 row g+8; a2 row g, k 16+4q..; a3 row g+8, k 16+4q..; b0 k 4q.., col g;
    b1 k 16+4q.., col g."""
    A = np.zeros((16, 32))
    Bm = np.zeros((32, 8))
    for r, (dr, dk) in enumerate(((0, 0), (8, 0), (0, 16), (8, 16))):
        v = _e4m3_bytes(a[r])
        for i in range(4):
            A[LG + dr, 4 * LQ + dk + i] = v[:, i]
    for r, dk in enumerate((0, 16)):
        v = _e4m3_bytes(b[r])
        for i in range(4):
            Bm[4 * LQ + dk + i, LG] = v[:, i]
    return A @ Bm


def mma_k16(a, b) -> np.ndarray:
    """mma.m16n8k16 f16: a0 row g, k 2q, 2q+1; a1 row g+8; a2 row g, k 8+2q..; a3 row g+8, k
    8+2q..; b0 k 2q.., col g; b1 k 8+2q.., col g."""
    A = np.zeros((16, 16))
    Bm = np.zeros((16, 8))
    for r, (dr, dk) in enumerate(((0, 0), (8, 0), (0, 8), (8, 8))):
        v = _f16_pair(a[r])
        for i in range(2):
            A[LG + dr, 2 * LQ + dk + i] = v[:, i]
    for r, dk in enumerate((0, 8)):
        v = _f16_pair(b[r])
        for i in range(2):
            Bm[2 * LQ + dk + i, LG] = v[:, i]
    return A @ Bm


def e4m3x2_to_f16x2(x, hi: bool):
    """cvt.rn.f16x2.e4m3x2 of bytes 0-1 (or 2-3) of each word (exact: e4m3 is in fp16)."""
    v = _e4m3_bytes(x)[:, 2:] if hi else _e4m3_bytes(x)[:, :2]
    return _f16_word(v[:, 0], v[:, 1])


def k32(variant: str, a, b) -> np.ndarray:
    """fp8mma.cu's ``k32``: f8: two e4m3 mma (b hi, then lo); cvt: the A registers converted
    to fp16 pairs, k-pairs (0, 1) then (2, 3)."""
    if variant == "f8":
        return mma_k32(a, b[0:2]) + mma_k32(a, b[2:4])
    lo = [e4m3x2_to_f16x2(x, False) for x in a]
    hi = [e4m3x2_to_f16x2(x, True) for x in a]
    return mma_k16(lo, b[0:2]) + mma_k16(hi, b[2:4])


def movmatrix_trans(x) -> np.ndarray:
    """movmatrix.m8n8.trans.b16: lane (g, q) holds row g, cols 2q, 2q+1 of an 8x8 matrix."""
    x = np.asarray(x, dtype=np.uint32)
    M = np.zeros((8, 8), dtype=np.uint32)
    M[LG, 2 * LQ] = x & np.uint32(0xFFFF)
    M[LG, 2 * LQ + 1] = x >> np.uint32(16)
    T = M.T
    return T[LG, 2 * LQ] | (T[LG, 2 * LQ + 1] << np.uint32(16))


def _f16x2_to_e4m3x2(x):
    """cvt.rn.satfinite.e4m3x2.f16x2, in bits 0-15."""
    v = _f16_pair(x)
    b = e4m3_byte(v)
    return b[:, 0].astype(np.uint32) | (b[:, 1].astype(np.uint32) << np.uint32(8))


def _word_at(arr: np.ndarray, off) -> np.ndarray:
    """The little-endian uint32 at byte offsets ``off`` [32] of ``arr``."""
    off = np.asarray(off)
    b = arr[off[:, None] + np.arange(4)].astype(np.uint32)
    return b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16) | (b[:, 3] << 24)


def _f16_at(arr: np.ndarray, off) -> np.ndarray:
    off = np.asarray(off)
    return arr[off[:, None] + np.arange(2)].copy().view("<f2").astype(np.float64)[:, 0]


def _q_fragments(variant: str, qk: np.ndarray, rows: int, G: int) -> list[list[np.ndarray]]:
    """bq[ks] = 4 registers [32]: channels c = 32q + 8ks of head g; f8: (hi c..c+3, hi
    c+4..c+7, lo c..c+3, lo c+4..c+7); cvt: fp16 pairs (c, c+1), (c+4, c+5), (c+2, c+3), (c+6,
    c+7) (the uint4's x, z, y, w)."""
    bq = []
    valid = LG < G
    row = np.where(valid, rows + LG, rows)
    for ks in range(4):
        c = 32 * LQ + 8 * ks
        if variant == "f8":
            raw = qk.reshape(qk.shape[0], -1)  # [rows, 2 D] bytes: hi then lo
            regs = [_word_at_rows(raw, row, c + o) for o in (0, 4, D, D + 4)]
        else:
            raw = qk.view(np.uint16)
            regs = [
                raw[row, c + o].astype(np.uint32) | (raw[row, c + o + 1].astype(np.uint32) << 16)
                for o in (0, 4, 2, 6)
            ]
        bq.append([np.where(valid, r, 0).astype(np.uint32) for r in regs])
    return bq


def _word_at_rows(raw: np.ndarray, row, off) -> np.ndarray:
    b = raw[row[:, None], off[:, None] + np.arange(4)].astype(np.uint32)
    return b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16) | (b[:, 3] << 24)


def _tile(variant, pages, u, tok_lo, tok_hi, bq, colc, ps, t0, t1):
    """One warp's 32-token tile (pages = ((K, V) of page A, of page B)): the scores [32 tile
    rows, 8] (row 8 blk + r: block blk, row r) and the step's P'^T B registers are returned by
    ``pv``."""
    kk = np.zeros((2, 2, 32))
    bias = np.zeros((2, 2, 32))
    vsc = np.zeros((2, 2, 32))
    S = np.zeros((32, 8))
    pg = LG >> 2
    for t in range(2):
        kw = []
        for r in range(2):
            pos = 8 * t + 4 * r + (LG & 3)
            tok = u * TILE + 16 * pg + pos
            valid = (tok >= tok_lo) & (tok < tok_hi)
            kp = [pages[p][0] for p in pg]  # per lane: its page's K bytes
            kw.append([
                np.array([_word_at(kp[ln], [pos[ln] * 64 + 16 * LQ[ln] + 4 * ks])[0]
                          for ln in range(32)], dtype=np.uint32)
                for ks in range(4)
            ])  # fmt: skip
            ksc = np.array([_f16_at(pages[pg[ln]][0], [1024 + 2 * pos[ln]])[0] for ln in range(32)])
            v = np.array([_f16_at(pages[pg[ln]][1], [1024 + 2 * pos[ln]])[0] for ln in range(32)])
            kk[t, r] = np.where(valid, ksc, 0.0)
            bias[t, r] = np.where(valid, 0.0, -np.inf)
            vsc[t, r] = np.where(valid, v * ps, 0.0)
        acc = np.zeros((16, 8))
        for ks in range(4):
            a0, a2 = decode_word(kw[0][ks], t0, t1)
            a1, a3 = decode_word(kw[1][ks], t0, t1)
            acc += k32(variant, [a0, a1, a2, a3], bq[ks])
        # accumulator element (row g or g+8, col 2q + j) of lane (g, q): fmaf(acc, k, bias)
        for r in range(2):
            for j in range(2):
                k = kk[t, r] * (colc[2 * LQ + j] if variant == "f8" else 1.0)
                S[16 * t + 8 * r + LG, 2 * LQ + j] = acc[8 * r + LG, 2 * LQ + j] * k + bias[t, r]
    return S, vsc


def _p_fragments(variant, p, vsc):
    """P' = p v_scale pscale per block, packed to fp16 (lane (g, q): row g, heads 2q, 2q+1),
    movmatrix-transposed; f8: e4m3 hi and lo (b0 = blocks 0, 1, b1 = blocks 2, 3); cvt: the
    fp16 pairs (M0, M2, M1, M3)."""
    M = []
    for blk in range(4):
        t, r = blk >> 1, blk & 1
        row = 8 * blk + LG
        M.append(
            movmatrix_trans(_f16_word(p[row, 2 * LQ] * vsc[t, r], p[row, 2 * LQ + 1] * vsc[t, r]))
        )
    if variant == "cvt":
        return [M[0], M[2], M[1], M[3]]
    hi8, lo8 = [], []
    for k in range(4):
        h = _f16x2_to_e4m3x2(M[k])
        res = _f16_word(*(_f16_pair(M[k]) - _f16_pair(e4m3x2_to_f16x2(h, False))).T)  # sub.rn
        hi8.append(h)
        lo8.append(_f16x2_to_e4m3x2(res))
    s16 = np.uint32(16)
    return [hi8[0] | hi8[1] << s16, hi8[2] | hi8[3] << s16, lo8[0] | lo8[1] << s16,
            lo8[2] | lo8[3] << s16]  # fmt: skip


def model(case, variant: str = "f8", tokens_per_split=64, nw=4, units=1) -> np.ndarray:
    """The kernel's lanes in numpy: per (sequence, KV head, split, warp) the tiles of ``units``
    32-token units (two pages each) sharing one online-softmax update,
    the code words read as the lanes read them and decoded by :func:`decode_word`, the mma
    fragments of the PTX ISA (f8: m16n8k32 e4m3; cvt: the registers converted to fp16 and
    m16n8k16), the online softmax per column, P' through fp16, movmatrix and (f8) e4m3 hi + lo,
    the warps' and the splits' merge. Sums in float64 and exact exp2 (the kernel: fp32 and
    ex2.approx). [B, Hq, D]."""
    lv = levels()
    t0, t1 = lv["t0"], lv["t1"]
    q, hkv, G = case["q"], case["hkv"], case["G"]
    B = q.shape[0]
    qk, qsc = q_prep(q.reshape(B * hkv * G, D), variant)
    ps = p_scale(case)
    out = np.zeros_like(q)
    for b in range(B):
        n = int(case["sl"][b])
        npages = -(-n // PS)
        for h in range(hkv):
            rows = (b * hkv + h) * G
            bq = _q_fragments(variant, qk, rows, G)
            colc = np.array([qsc[rows + j] if j < G else 0.0 for j in range(8)])
            parts = []
            for tok_lo in range(0, n, tokens_per_split):
                tok_hi = min(n, tok_lo + tokens_per_split)
                warps = []
                for w in range(nw):
                    m_i, l_i = np.full(8, -np.inf), np.zeros(8)
                    acc = np.zeros((D, 8))  # O^T: channel, head
                    tt = TILE * units
                    for u in range(tok_lo // tt + w, -(-tok_hi // tt), nw):
                        pages, Ss, vscs = [], [], []
                        for e in range(units):
                            unit = []
                            for pg in (2 * (units * u + e), 2 * (units * u + e) + 1):
                                if pg < npages:
                                    blk = case["bt"][b, pg]
                                    unit.append((case["kc"][blk, h], case["vc"][blk, h]))
                                else:  # not copied: stale shared memory, masked
                                    unit.append((np.zeros(PAGE, np.uint8),) * 2)
                            pages.append(unit)
                            S, vsc = _tile(
                                variant, unit, units * u + e, tok_lo, tok_hi, bq, colc, ps, t0, t1
                            )
                            Ss.append(S)
                            vscs.append(vsc)
                        S = np.concatenate(Ss)
                        mx = np.maximum(m_i, S.max(axis=0))
                        m_use = np.where(np.isneginf(mx), 0.0, mx)
                        alpha = np.where(np.isneginf(mx), 1.0, np.exp2(m_i - m_use))
                        p = np.exp2(S - m_use)
                        l_i = l_i * alpha + p.sum(axis=0)
                        m_i = mx
                        acc *= alpha
                        for e in range(units):
                            bp = _p_fragments(variant, p[TILE * e : TILE * (e + 1)], vscs[e])
                            for mt in range(8):
                                vp = [pages[e][x][1] for x in LQ >> 1]
                                off = 16 * (8 * mt + LG) + 8 * (LQ & 1)
                                we = np.array([_word_at(vp[ln], [off[ln]])[0] for ln in range(32)])
                                wo = np.array(
                                    [_word_at(vp[ln], [off[ln] + 4])[0] for ln in range(32)]
                                )
                                a0, a2 = decode_word(we, t0, t1)
                                a1, a3 = decode_word(wo, t0, t1)
                                o = k32(variant, [a0, a1, a2, a3], bp)
                                # rows g -> channel 16 mt + 2g, g+8 -> 16 mt + 2g + 1
                                acc[16 * mt + 2 * np.arange(8)] += o[:8]
                                acc[16 * mt + 2 * np.arange(8) + 1] += o[8:]
                    warps.append((m_i, l_i, acc))
                mx = np.max([x[0] for x in warps], axis=0)
                L, O = np.zeros(8), np.zeros((D, 8))
                for m_w, l_w, a_w in warps:
                    f = np.where(
                        np.isneginf(m_w), 0.0, np.exp2(m_w - np.where(np.isneginf(mx), 0, mx))
                    )
                    L += f * l_w
                    O += f * a_w
                Ls = np.where(L > 0, L, 1.0)
                parts.append((mx + np.log2(Ls), (O / ps / Ls).T))
            lse = np.array([x[0] for x in parts])  # [splits, 8]
            wgt = np.exp2(lse - lse.max(axis=0))
            o = (
                sum(wgt[i][:, None] * parts[i][1] for i in range(len(parts)))
                / wgt.sum(axis=0)[:, None]
            )
            out[b, h * G : (h + 1) * G] = o[:G]
    return out


# ---- SASS ----------------------------------------------------------------------------------------

CLASSES = {
    "HMMA": "mma",
    "QMMA": "mma",
    "LDS": "lds",
    "LDG": "ldg",
    "LDGSTS": "cp.async",
    "LDGDEPBAR": "cp.async",
    "DEPBAR": "cp.async",
    "PRMT": "prmt",
    "F2FP": "f2fp",
    "HADD2": "hadd2",
    "LOP3": "lop3",
    "SHF": "shf",
    "IADD3": "int",
    "IMAD": "int",
    "LEA": "int",
    "SHFL": "shfl",
    "MUFU": "mufu",
    "MOVM": "movmatrix",
    "FMUL": "fp32",
    "FADD": "fp32",
    "FFMA": "fp32",
    "FMNMX": "fp32",
    "FSETP": "fp32",
    "FSEL": "fp32",
}


def _tool(name: str) -> str:
    import shutil

    found = shutil.which(name)
    if found:
        return found
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def _nvcc() -> str:
    from kvzip_formats.nvcc import find_nvcc

    return find_nvcc()


def compile_sass(arch: str, src: Path = SRC) -> tuple[str, str]:
    """(ptxas -v output, cuobjdump -sass) of ``src`` (fp8mma.cu) for ``arch`` ("90a", "89")."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        gen = f"-gencode=arch=compute_{arch},code=sm_{arch}"
        r = subprocess.run(
            [_nvcc(), "-O3", gen, "-Xptxas", "-v", "-cubin", "-o", str(cubin), str(src)],
            capture_output=True,
            text=True,
            check=True,
        )
        sass = subprocess.run(
            [_tool("cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True, check=True
        ).stdout
    return r.stderr, sass


def loop_body(fn: str) -> tuple[list, list[str]]:
    """(all instructions, the opcodes of the token loop) of one function's SASS: the loop is
    the shortest backward branch around every mma of the kernel (the divergent-shuffle paths
    past the exit branch back into the loop: not it)."""
    ins = re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", fn)
    addr = {int(x, 16): op for x, op in ins}
    loops = [
        (int(t, 16), int(s, 16))
        for s, t in re.findall(r"/\*([0-9a-f]+)\*/[^\n]*BRA `?\(?\.?L?[^\n]*?0x([0-9a-f]+)", fn)
        if int(t, 16) < int(s, 16)
    ]
    mmas = [x for x, op in addr.items() if op[1:4] == "MMA"]
    around = [(lo, hi) for lo, hi in loops if lo <= min(mmas) and max(mmas) <= hi]
    lo, hi = min(around, key=lambda x: x[1] - x[0])
    return ins, [op for x, op in addr.items() if lo <= x <= hi]


def v6_baseline() -> dict:
    """Today's v6 `4bit` d128 split kernel (kvzip_kernels csrc/paged_decode.cu), counted the
    same way with the same nvcc: its loop is one warp's 32-token tile."""
    from kvzip_kernels import _cuda

    log, sass = compile_sass("90a", _cuda._SRC)
    for fn in re.split(r"\n\s*Function : ", sass)[1:]:
        if re.search(r"split_v6ILi1ELi128E", fn.split("\n", 1)[0]):
            _, body = loop_body(fn)
            by = collections.Counter(CLASSES.get(op.split(".")[0], "other") for op in body)
            return dict(
                kernel="split_v6<FMT_4BIT, 128, 4, 2>",
                source="packages/kvzip-kernels/src/kvzip_kernels/csrc/paged_decode.cu",
                arch="sm_90a",
                loop_instr=len(body),
                per_token_head=round(len(body) / TILE, 2),
                by_class=dict(sorted(by.items())),
            )
    raise RuntimeError("split_v6<4bit, 128> not found in the SASS of paged_decode.cu")


def sass_counts(arch: str = "90a") -> list[dict]:
    """Per kernel variant (f8, cvt): registers, spills, static shared memory, the loop's
    instructions (the shortest backward branch around the mma instructions: one warp's
    32-token tile) by opcode and class, per token and KV head (/ 32)."""
    log, sass = compile_sass(arch)

    def name(mangled: str) -> tuple[str, int]:
        m = re.search(r"fp8mma_splitILb([01])ELi(\d)E", mangled)
        return ("f8" if m[1] == "1" else "cvt", int(m[2]))

    res: dict = {}
    cur = None
    for ln in log.splitlines():
        m = re.search(r"Compiling entry function '(\S+)'", ln)
        if m:
            cur = name(m[1])
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", ln)
        if m and cur:
            res.setdefault(cur, {})["spill_bytes"] = int(m[1]) + int(m[2])
        m = re.search(r"Used (\d+) registers.*?(\d+) bytes smem", ln)
        if m and cur:
            res.setdefault(cur, {}).update(regs=int(m[1]), static_smem_bytes=int(m[2]))
    rows = []
    for fn in re.split(r"\n\s*Function : ", sass)[1:]:
        key = name(fn.split("\n", 1)[0])
        ins, body = loop_body(fn)
        ops = collections.Counter(op.split(".")[0] for op in body)
        by = collections.Counter(CLASSES.get(op.split(".")[0], "other") for op in body)
        rows.append(
            dict(
                variant=key[0],
                units=key[1],
                tile_tokens=TILE * key[1],
                arch=f"sm_{arch}",
                **res.get(key, {}),
                dynamic_smem_bytes=4 * 2 * (2 * key[1] * (CODES + 64) + 64 * key[1]),
                loop_instr=len(body),
                per_token_head=round(len(body) / (TILE * key[1]), 2),
                by_class=dict(sorted(by.items())),
                by_opcode=dict(sorted(ops.items(), key=lambda x: -x[1])),
                whole_kernel_instr=len(ins),
            )
        )
    return sorted(rows, key=lambda r: (r["variant"], r["units"]))


def _nvcc_version() -> str:
    out = subprocess.run([_nvcc(), "--version"], capture_output=True, text=True).stdout
    return out.strip().splitlines()[-1]


SASS_ARCHS = ("90a", "89", "120", "100a")  # H100/H200; Ada; consumer and datacenter Blackwell


def cmd_sass(a) -> None:
    rows = [r for arch in SASS_ARCHS for r in sass_counts(arch)]
    v6 = v6_baseline()
    print(f"v6 4bit d128 sm_90a: loop {v6['loop_instr']} = {v6['per_token_head']} /token-head")
    for x in rows:
        print(
            f"{x['variant']:4s} U{x['units']} {x['arch']:7s} regs {x.get('regs')} "
            f"spill {x.get('spill_bytes')} "
            f"smem {x.get('static_smem_bytes')}+{x['dynamic_smem_bytes']} loop {x['loop_instr']} "
            f"= {x['per_token_head']} /token-head {x['by_class']}"
        )
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        doc = dict(
            date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            device="CPU (no GPU): nvcc + cuobjdump only",
            nvcc=_nvcc_version(),
            flags="-O3 -gencode=arch=compute_90a,code=sm_90a -cubin (and sm_89, sm_120, sm_100a)",
            command="python packages/kvzip-kernels/benchmarks/fp8mma/fp8mma.py sass --out " + a.out,
            source="packages/kvzip-kernels/benchmarks/fp8mma/fp8mma.cu",
            v6_4bit_d128=v6,
            levels=levels(),
            rows=rows,
        )
        (out / "fp8mma_sass.json").write_text(json.dumps(doc, indent=1) + "\n")
        md = [
            "# fp8mma: SASS of the decode loop (research design, 4bit-e4m3 d128)",
            "",
            f"{doc['date']}, {doc['device']}, {doc['nvcc']}; `{doc['command']}`.",
            "Loop = the shortest backward branch around the mma instructions (one warp's",
            "tile of U x 32 tokens); per token-head = loop / (32 U). Today's v6 `4bit` d128 "
            f"(same nvcc, sm_90a): {v6['loop_instr']} per 32 tokens = {v6['per_token_head']} "
            f"per token-head ({', '.join(f'{k} {n}' for k, n in v6['by_class'].items())}).",
            "",
            "| variant | U | arch | loop instr | per token-head | registers | spill bytes "
            "| smem static + dynamic | mma | prmt | lop3 | shf | f2fp | lds | other classes |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for x in rows:
            c = dict(x["by_class"])
            main = [c.pop(k, 0) for k in ("mma", "prmt", "lop3", "shf", "f2fp", "lds")]
            md.append(
                f"| {x['variant']} | {x['units']} | {x['arch']} | {x['loop_instr']} | "
                f"{x['per_token_head']} | "
                f"{x.get('regs')} | {x.get('spill_bytes')} | {x.get('static_smem_bytes')} + "
                f"{x['dynamic_smem_bytes']} | "
                + " | ".join(map(str, main))
                + " | "
                + ", ".join(f"{k} {v}" for k, v in c.items())
                + " |"
            )
        (out / "fp8mma_sass.md").write_text("\n".join(md) + "\n")
        print("wrote", out / "fp8mma_sass.json")


# ---- GPU --------------------------------------------------------------------------------------


def build(cache: Path | None = None):
    """The kernel's shared library for this GPU (nvcc, cached by source hash), loaded."""
    import ctypes as c

    import torch

    from kvzip_formats import nvcc

    cap = torch.cuda.get_device_capability()
    arch = f"{cap[0]}{cap[1]}" + ("a" if cap[0] == 9 else "")
    flags = [f"-gencode=arch=compute_{arch},code=sm_{arch}"]
    so = nvcc.build(SRC, flags, prefix="fp8mma", capability=cap, out_dir=cache)
    lib = c.CDLL(str(so))
    lib.fp8mma_split_launch.restype = c.c_int
    lib.fp8mma_split_launch.argtypes = (
        [c.c_int] + [c.c_void_p] * 7 + [c.c_uint, c.c_uint, c.c_float, c.c_longlong]
        + [c.c_int] * 3 + [c.c_longlong, c.c_int, c.c_int, c.c_int, c.c_void_p]
    )  # fmt: skip
    return lib


class Decoder:
    """One planned fp8mma call on the GPU: the query's operand (torch, on the device), the split
    kernel, the splits' merge (torch). ``kv``: uint8 [blocks, H * (CODES + 64)] (to_cache)."""

    def __init__(self, lib, variant, kv, bt, sl, hkv, G, pscale, tokens_per_split=None, units=2):
        import torch

        self.lib, self.variant = lib, variant
        self.kv, self.bt, self.sl = kv, bt, sl
        self.B, self.hkv, self.G, self.pscale, self.units = bt.shape[0], hkv, G, pscale, units
        ctx = int(sl.max().item())
        if tokens_per_split is None:  # ~4 CTAs per SM, splits of >= 256 tokens
            sms = torch.cuda.get_device_properties(kv.device).multi_processor_count
            splits = max(1, min(ctx // 256, -(-4 * sms // (self.B * hkv))))
            tokens_per_split = -(-ctx // (splits * TILE * units)) * TILE * units
        self.tps = tokens_per_split
        self.splits = -(-ctx // tokens_per_split)
        rows = self.B * hkv * G
        self.o_part = torch.empty(rows, self.splits, D, dtype=torch.float32, device=kv.device)
        self.lse = torch.empty(rows, self.splits, dtype=torch.float32, device=kv.device)
        lv = levels()
        self.t0, self.t1 = lv["t0"], lv["t1"]
        self.scale = math.log2(math.e) / math.sqrt(D)

    def prep(self, q):
        """q' [B, Hq, D] -> (operand, row scale) as :func:`q_prep` makes them."""
        import torch

        x = q.float().reshape(-1, D)
        if self.variant == "f8":
            qs0 = x.abs().amax(dim=-1).clamp_min(1e-30) / 224.0
            y = x / qs0[:, None]
            hi = y.to(torch.float8_e4m3fn)
            lo = (y - hi.float()).to(torch.float8_e4m3fn)
            op = torch.stack([hi, lo], dim=1).view(torch.uint8).contiguous()
            return op, (qs0 * self.scale).contiguous()
        return (x * self.scale).half().contiguous(), torch.ones_like(x[:, 0])

    def split(self, op, qs):
        import torch

        err = self.lib.fp8mma_split_launch(
            1 if self.variant == "f8" else 0, op.data_ptr(), qs.data_ptr(), self.kv.data_ptr(),
            self.bt.data_ptr(), self.sl.data_ptr(), self.o_part.data_ptr(), self.lse.data_ptr(),
            self.t0, self.t1, self.pscale, self.bt.stride(0), self.B, self.hkv, self.G,
            self.kv.stride(0), self.tps, self.splits, self.units,
            torch.cuda.current_stream().cuda_stream,
        )  # fmt: skip
        if err:
            raise RuntimeError(f"fp8mma_split_launch: error {err}")

    def merge(self):
        import torch

        m = self.lse.amax(dim=1, keepdim=True)
        w = torch.where(torch.isfinite(self.lse), torch.exp2(self.lse - m), 0.0)
        o = (w[..., None] * self.o_part).sum(1) / w.sum(1)[:, None]
        return o.view(self.B, self.hkv * self.G, D)

    def __call__(self, q):
        self.split(*self.prep(q))
        return self.merge()


def _median_us(torch, fn, iters, warmup):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ev = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(iters)
    ]
    for s, e in ev:
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in ev) * 1e3


VARIANTS = [("cvt", 2), ("cvt", 1), ("f8", 2), ("f8", 1)]  # (variant, 32-token units per tile)
CHECKS = [  # B, kv heads, G, lens, tokens per split (None: the timing's rule)
    (2, 2, 4, [300, 77], 64),
    (1, 1, 4, [1000], 128),
    (3, 8, 4, [513, 32, 2049], None),
    (1, 1, 8, [4096], None),
    (2, 1, 4, [16400, 9], None),
]
CONFIGS = [("8b", 32, 8, b, c) for c in (32768, 131072) for b in (8, 32)] + [
    ("70b-tp8", 8, 1, 8, 32768)
]


def _check(torch, lib, dev) -> list[dict]:
    """Both variants against :func:`reference` on :data:`CHECKS`, within :func:`tolerance`."""
    rows = []
    for B, hkv, G, lens, tps in CHECKS:
        case = make_case(B, hkv, G, max(lens), seed=B + hkv, lens=lens)
        ref = reference(case)
        tols = {v: tolerance(case, v) for v in ("f8", "cvt")}
        for variant, units in VARIANTS:
            tol = tols[variant]
            t = lambda x: torch.from_numpy(np.ascontiguousarray(x)).to(dev)  # noqa: E731
            dec = Decoder(lib, variant, t(case["kv"]), t(case["bt"]), t(case["sl"]), hkv, G,
                          p_scale(case), tps, units)  # fmt: skip
            o = dec(torch.from_numpy(case["q"]).float().to(dev)).double().cpu().numpy()
            err = float(np.abs(o - ref).max())
            ok = bool(err <= tol and np.isfinite(o).all())
            rows.append(dict(variant=variant, units=units, B=B, hkv=hkv, G=G, lens=lens, ok=ok,
                             tokens_per_split=dec.tps, max_abs_err=err, tol=tol))  # fmt: skip
            print(f"check {variant} U{units} B{B} hkv{hkv} G{G} {lens}: max abs err {err:.3e} "
                  f"(tol {tol:.3e}) {'ok' if ok else 'FAIL'}", flush=True)  # fmt: skip
    return rows


def _time(torch, lib, dev, a, shape, hq, hkv, B, ctx) -> dict:
    """fp8mma (both variants: split alone, and the whole call with the torch prep and merge)
    and v6's 4bit (``kvzip_kernels.plan``'s run: fold_q, split, merge, output transform) on
    the same batch, context and page size; random codes, valid scales."""
    from kvzip_formats import get_format
    from kvzip_formats.ops import PagedLayout
    from kvzip_kernels.decode_plan import plan
    from kvzip_kernels.testing import synthetic_calibration

    G, pps = hq // hkv, ctx // PS
    nb = B * pps
    gen = torch.Generator(device=dev).manual_seed(1234)
    bt = torch.randperm(nb, device=dev, generator=gen)[: B * pps].view(B, pps).int()
    sl = torch.full((B,), ctx, dtype=torch.int32, device=dev)
    q = torch.randn(B, hq, D, device=dev, generator=gen, dtype=torch.bfloat16)
    row = dict(shape=shape, batch=B, context=ctx, kv_heads=hkv, q_heads=hq)
    kv = torch.randint(0, 256, (nb, hkv * (CODES + 64)), dtype=torch.uint8, device=dev,
                       generator=gen)  # fmt: skip
    sc = (torch.rand(nb, hkv * 32, device=dev, generator=gen) * 0.3 + 0.05).half()
    kv[:, hkv * CODES :] = sc.view(torch.uint8)
    for variant, units in VARIANTS:
        dec = Decoder(lib, variant, kv, bt, sl, hkv, G, 224.0 / 0.35, units=units)
        op, qs = dec.prep(q)
        key = f"{variant}{units}"
        row[f"{key}_split_us"] = _median_us(torch, lambda: dec.split(op, qs), a.iters, a.warmup)  # noqa: B023
        row[f"{key}_call_us"] = _median_us(torch, lambda: dec(q), a.iters, a.warmup)  # noqa: B023
        row[f"{key}_splits"] = dec.splits
    del kv, sc
    fmt = get_format("4bit", calibration=synthetic_calibration(hkv, D))
    caches = []
    for kind in ("k", "v"):
        lay = PagedLayout.of(fmt, D, PS, kind)
        c = torch.randint(0, 256, (nb, hkv, lay.page_bytes), dtype=torch.uint8, device=dev,
                          generator=gen)  # fmt: skip
        meta = c[..., lay.meta_offset :].view(torch.float16)
        meta.copy_((torch.rand(meta.shape, device=dev, generator=gen) * 0.3 + 0.05).half())
        caches.append(c)
    kc, vc = caches
    p = plan(fmt, num_q_heads=hq, head_dim=D, block_table=bt, seq_lens=sl, k_cache=kc,
             v_cache=vc, block_size=PS, max_seq_len=ctx, backend="cuda")  # fmt: skip
    o = torch.empty_like(q)
    row["v6_run_us"] = _median_us(torch, lambda: p.run(q, kc, vc, out=o), a.iters, a.warmup)
    del caches
    nbytes = B * ctx * hkv * 2 * PAGE / PS  # 132 bytes per token and KV head, both designs
    for k in [k for k in row if k.endswith("_us")]:
        row[k] = round(row[k], 2)
        row[k[:-3] + "_pct_hbm"] = round(100 * nbytes / (row[k] * 1e-6) / (a.peak_tbps * 1e12), 1)
    row["v6_over_cvt_split"] = round(row["v6_run_us"] / row["cvt2_split_us"], 3)
    return row


def cmd_gpu(a) -> None:
    import torch

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name()
    lib = build(Path(a.cache) if a.cache else None)
    doc = dict(
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        device=name,
        torch=torch.__version__,
        command=" ".join(sys.argv),
        iters=a.iters,
        warmup=a.warmup,
        peak_tbps=a.peak_tbps,
        levels=levels(),
        checks=_check(torch, lib, dev),
        rows=[],
    )
    for cfg in CONFIGS[:1] + CONFIGS[-1:] if a.quick else CONFIGS:
        doc["rows"].append(_time(torch, lib, dev, a, *cfg))
        print(doc["rows"][-1], flush=True)
    (out / "fp8mma_gpu.json").write_text(json.dumps(doc, indent=1) + "\n")
    md = [
        f"# fp8mma on {name}",
        "",
        f"{doc['date']}; `{doc['command']}`; CUDA events, median of {a.iters} calls after "
        f"{a.warmup} warm-up; % of {a.peak_tbps} TB/s for 132 bytes per token and KV head.",
        "",
        "| variant | units | B | kv heads | G | lens | max abs err | tolerance | ok |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    md += [
        f"| {c['variant']} | {c['units']} | {c['B']} | {c['hkv']} | {c['G']} | {c['lens']} | "
        f"{c['max_abs_err']:.2e} | {c['tol']:.2e} | {c['ok']} |"
        for c in doc["checks"]
    ]
    keys = [f"{v}{u}_{k}" for v, u in VARIANTS for k in ("split", "call")] + ["v6_run"]
    md += [
        "",
        "us (% of HBM): <variant><units>_split = the fp8mma kernel alone, _call = with the "
        "torch prep and merge; v6 run = `plan(...).run` of today's `4bit` (4 launches).",
        "",
        "| shape | batch | context | " + " | ".join(keys) + " | v6 / cvt2 split |",
        "|---|---|---|" + "---|" * (len(keys) + 1),
    ]
    for r in doc["rows"]:
        cells = [f"{r[k + '_us']} ({r[k + '_pct_hbm']}%)" for k in keys]
        md.append(f"| {r['shape']} | {r['batch']} | {r['context']} | " + " | ".join(cells)
                  + f" | {r['v6_over_cvt_split']} |")  # fmt: skip
    (out / "fp8mma_gpu.md").write_text("\n".join(md) + "\n")
    print("wrote", out / "fp8mma_gpu.json")
    if not all(c["ok"] for c in doc["checks"]):
        sys.exit(1)


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("sass")
    s.add_argument("--out", default="")
    g = sub.add_parser("gpu")
    g.add_argument("--out", required=True)
    g.add_argument("--cache", default="")
    g.add_argument("--iters", type=int, default=20)
    g.add_argument("--warmup", type=int, default=5)
    g.add_argument("--quick", action="store_true")
    g.add_argument("--peak-tbps", type=float, default=4.3)
    a = p.parse_args()
    {"sass": cmd_sass, "gpu": cmd_gpu}[a.cmd](a)


if __name__ == "__main__":
    main()
