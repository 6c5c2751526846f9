#!/usr/bin/env python3
"""A numpy model of csrc/paged_decode.cu's per-lane fragment logic, run through paged_decode on
the CPU (no GPU needed): the model stands in for ``_cuda.split`` and must match the float32
reference within the tests' earned tolerance. It checks the kernel's index mappings (which
lane holds which token, head and channel in the mma and movmatrix fragments of the PTX ISA),
not the compiled code; a change of the kernel's mappings needs the same change here.

    TRITON_INTERPRET=1 PYTHONPATH=packages/kvzip-kernels/tests python3 \
        packages/kvzip-kernels/benchmarks/cuda_model.py [int4 4bit 3.5bit 3bit] [-- v6 v5 v4a]

The shipped design is v6 (NOTES.md): the fragment logic on the bytes its cp.async ring stages
hold (``stage_tile``: K rows, V byte rows of 16 tokens, metadata); a warp's tile is two
16-token units sharing one online-softmax update, and its index builders (k3_indices, v_frag's
word-wide 3-bit indices, byte_of as PTX prmt) are modelled bit for bit. The designs before it
are modelled too, for their history (their kernels are in git history, NOTES.md says where):
v5 (16-token tiles on the same stages, indices built one by one) and v4a (on the pages).
"""

import math
import sys

import numpy as np
import torch
from test_paged_decode import _rel, make_case

import kvzip_kernels._cuda as C
from kvzip_formats.ops import paged_decode as ref_paged_decode
from kvzip_kernels import DecodeConfig, paged_decode
from kvzip_kernels._formats import kernel_spec

lanes = np.arange(32)
G_ = lanes >> 2
Q_ = lanes & 3


def r16(x, bf16):  # round float32 -> 16-bit float value (as float32)
    t = torch.tensor(np.asarray(x, np.float32))
    return (t.bfloat16() if bf16 else t.half()).float().numpy()


def mma(c, a, b0, b1):
    # a: [32,4,2] values; b0,b1: [32,2]; c: [32,4]
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))
    for l in range(32):
        g, q = G_[l], Q_[l]
        for i in range(2):
            A[g, 2 * q + i] = a[l, 0, i]
            A[g + 8, 2 * q + i] = a[l, 1, i]
            A[g, 2 * q + 8 + i] = a[l, 2, i]
            A[g + 8, 2 * q + 8 + i] = a[l, 3, i]
            B[2 * q + i, g] = b0[l, i]
            B[2 * q + 8 + i, g] = b1[l, i]
    C = A @ B
    out = c.copy()
    for l in range(32):
        g, q = G_[l], Q_[l]
        for i in range(2):
            out[l, i] += C[g, 2 * q + i]
            out[l, 2 + i] += C[g + 8, 2 * q + i]
    return out


def movtrans(x):  # x [32,2]
    M = np.zeros((8, 8))
    for l in range(32):
        M[G_[l], 2 * Q_[l] : 2 * Q_[l] + 2] = x[l]
    out = np.zeros((32, 2))
    for l in range(32):
        g, q = G_[l], Q_[l]
        out[l] = [M[2 * q, g], M[2 * q + 1, g]]
    return out


def xor_red(v, op, offs):
    v = v.copy()
    for o in offs:
        v = op(v, v[lanes ^ o])
    return v


def fmt_consts(FMT, D):
    """Fmt<FMT, D> of the kernel: K/V code bytes per row, metadata bytes, 3bit's K split."""
    K3 = FMT == 3
    KCB = 7 * D // 16 if K3 else D // 2
    VCB = D // 2 if FMT <= 1 else (3 * D // 8 if FMT == 2 else 5 * D // 16)
    MB = 4 if FMT == 0 else 2
    KS4 = D // 32 if K3 else D // 16
    NW4 = D // 64 if K3 else D // 32
    MT3 = D // 16 if FMT == 2 else (D // 32 if FMT == 3 else 0)
    return K3, KCB, VCB, MB, KS4, NW4, MT3


def tables(FMT, lv):
    """fill_tables: the level-pair tables (each entry a pair of level values)."""
    T = {}
    for i in range(256):
        T[("K4", i)] = (lv[0][i & 15], lv[0][i >> 4])
        T[("V4", i)] = (lv[2][i & 15], lv[2][i >> 4])
    for x in range(64):
        c0 = (x & 3) | (((x >> 4) & 1) << 2)
        c1 = ((x >> 2) & 3) | (((x >> 5) & 1) << 2)
        T[("K3", x)] = (lv[1][c0], lv[1][c1])
        T[("V3", x)] = (lv[2][c0], lv[2][c1])
    for x in range(16):
        T[("V2", x)] = (lv[3][x & 3], lv[3][x >> 2])
    return T


def rep_tables(FMT, lv):
    """v5's RepLut: one table per code width (level_pair of entry e; csrc fill_rep), the
    regions mapped as RepLut maps them: K4 -> 0, K3 -> 256, V0 -> 0 (4bit) or 256, V2 -> 320."""

    def level_pair(e):
        if e < 256:
            return (lv[0][e & 15], lv[0][e >> 4])
        if e < 320:
            x = e - 256
            return (
                lv[1][(x & 3) | (((x >> 4) & 1) << 2)],
                lv[1][((x >> 2) & 3) | (((x >> 5) & 1) << 2)],
            )
        x = e - 320
        return (lv[3][x & 3], lv[3][x >> 2])

    base = {"K4": 0, "K3": 256, "V4": 0, "V3": 256, "V2": 320}
    size = {"K4": 256, "K3": 64, "V4": 256, "V3": 64, "V2": 16}
    if FMT == 1:
        base["V4"] = 0
    return {(r, i): level_pair(base[r] + i) for r in base for i in range(size[r])}


def u(mem, off, n):  # little-endian unsigned of n bytes
    return int.from_bytes(bytes(mem[off : off + n].astype(np.uint8)), "little")


def krow_chan(FMT, D, ks, q):
    K3, KCB, VCB, MB, KS4, NW4, MT3 = fmt_consts(FMT, D)
    if K3:
        return q * (D // 8) + 4 * ks if ks < KS4 else D // 2 + q * (D // 8) + 4 * (ks - KS4)
    return q * (D // 4) + 4 * ks


def krow_load(FMT, D, mem, row, q):
    K3, KCB, VCB, MB, KS4, NW4, MT3 = fmt_consts(FMT, D)
    p = row + q * NW4 * 4
    w = [u(mem, p + 4 * i, 4) for i in range(NW4)]
    lo = hi = 0
    if K3:
        pl = row + D // 4 + q * (D // 32)
        ph = row + D // 4 + D // 8 + q * (D // 64)
        lo, hi = (u(mem, pl, 4), u(mem, ph, 2)) if D == 128 else (u(mem, pl, 2), u(mem, ph, 1))
    return w, lo, hi


def krow_pairs(FMT, D, kr, ks, T, v6=False):
    """KRow::pairs (compact) or KRow::int4: the values of (a_lo pair, a_hi pair)."""
    K3, KCB, VCB, MB, KS4, NW4, MT3 = fmt_consts(FMT, D)
    w, lo, hi = kr
    if FMT == 0:
        x = (w[ks >> 1] >> (16 * (ks & 1))) & 0xFFFF
        b0, b1 = x & 0xFF, x >> 8
        return [128 + (b0 & 15), 128 + (b1 & 15)], [128 + (b0 >> 4), 128 + (b1 >> 4)]
    if ks < KS4:
        x = (w[ks >> 1] >> 16) if ks & 1 else w[ks >> 1] & 0xFFFF
        return list(T[("K4", x & 0xFF)]), list(T[("K4", x >> 8)])
    kk = ks - KS4
    if v6:  # k3_indices: the row's indices 4 at a time, byte kk of x0 / x1
        x0, x1 = k3_indices(lo, hi)
        return list(T[("K3", byte_of(x0, kk))]), list(T[("K3", byte_of(x1, kk))])
    L, H = lo >> (8 * kk), hi >> (4 * kk)
    return (
        list(T[("K3", (L & 0xF) | ((H & 3) << 4))]),
        list(T[("K3", ((L >> 4) & 0xF) | ((H & 0xC) << 2))]),
    )


def prmt(a, b, sel):
    """PTX prmt.b32 (default mode): byte i of the result is byte (sel nibble i & 7) of the
    8 bytes b:a, or that byte's sign bit replicated when the nibble's bit 3 is set."""
    src = (a & 0xFFFFFFFF) | ((b & 0xFFFFFFFF) << 32)
    out = 0
    for i in range(4):
        n = (sel >> (4 * i)) & 0xF
        byte = (src >> (8 * (n & 7))) & 0xFF
        if n & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def byte_of(w, k):  # csrc byte_of: prmt(w, 0, 0x4440 | k)
    return prmt(w, 0, 0x4440 | k)


def k3_indices(lo, hi):
    """csrc k3_indices (v6): byte kk of x0 / x1 = the 6-bit index of channels (c, c+1) /
    (c+2, c+3) of the 3-bit group's k-step kk."""
    t = prmt(hi, 0, 0x1100)
    hs = (t & 0x000F000F) | ((t >> 4) & 0x0F000F00)
    x0 = ((lo & 0x0F0F0F0F) + ((hs & 0x03030303) << 4)) & 0xFFFFFFFF
    x1 = (((lo >> 4) & 0x0F0F0F0F) + ((hs & 0x0C0C0C0C) << 2)) & 0xFFFFFFFF
    return x0, x1


def v_pairs(mem, p, paired):
    """v_pairs: the two 16-bit token pairs of a byte row (k-rows 2q, 2q+1 and 2q+8, 2q+9)."""
    if paired:
        x = u(mem, p, 4)
        return x & 0xFFFF, x >> 16
    return u(mem, p, 2), u(mem, p + 8, 2)


def v_frag(FMT, D, mem, vrow, ST, mt, g, T, paired=False, v6=False):
    """v_frag: a[0..3] as pairs of values (k-rows 2q, 2q+1 / 2q+8, 2q+9)."""
    K3, KCB, VCB, MB, KS4, NW4, MT3 = fmt_consts(FMT, D)

    def split(tl, th):  # prmt 0x5410 / 0x7632 of two level pairs
        return [tl[0], th[0]], [tl[1], th[1]]

    if FMT <= 1:
        j = 8 * mt + g
        w0, w1 = v_pairs(mem, vrow + j * ST, paired)
        if FMT == 0:

            def i4(w):
                b0, b1 = w & 0xFF, w >> 8
                return [128 + (b0 & 15), 128 + (b1 & 15)], [128 + (b0 >> 4), 128 + (b1 >> 4)]

            a0, a1 = i4(w0)
            a2, a3 = i4(w1)
            return [a0, a1, a2, a3]
        a0, a1 = split(T[("V4", w0 & 0xFF)], T[("V4", w0 >> 8)])
        a2, a3 = split(T[("V4", w1 & 0xFF)], T[("V4", w1 >> 8)])
        return [a0, a1, a2, a3]
    if mt < MT3:
        j, j1 = 4 * mt + (g >> 1), D // 4 + 2 * mt + (g >> 2)
        sl, sh = 4 * (g & 1), 2 * (g & 3)
        if v6:  # v_frag6: the 4 tokens' indices in the bytes of one word
            W, H = u(mem, vrow + j * ST, 4), u(mem, vrow + j1 * ST, 4)
            X = ((W >> sl) & 0x0F0F0F0F) + (((H >> sh) & 0x03030303) << 4)
            x0, x1 = byte_of(X, 0) | byte_of(X, 1) << 8, byte_of(X, 2) | byte_of(X, 3) << 8
        else:
            w0, w1 = v_pairs(mem, vrow + j * ST, paired)
            h0, h1 = v_pairs(mem, vrow + j1 * ST, paired)
            x0 = ((w0 >> sl) & 0x0F0F) | (((h0 >> sh) & 0x0303) << 4)
            x1 = ((w1 >> sl) & 0x0F0F) | (((h1 >> sh) & 0x0303) << 4)
        tab = "V3"
    else:
        j = D // 8 + 4 * (mt - MT3) + (g >> 1)
        sl = 4 * (g & 1)
        if v6:
            X = (u(mem, vrow + j * ST, 4) >> sl) & 0x0F0F0F0F
            x0, x1 = byte_of(X, 0) | byte_of(X, 1) << 8, byte_of(X, 2) | byte_of(X, 3) << 8
        else:
            w0, w1 = v_pairs(mem, vrow + j * ST, paired)
            x0 = (w0 >> sl) & 0x0F0F
            x1 = (w1 >> sl) & 0x0F0F
        tab = "V2"
    a0, a1 = split(T[(tab, x0 & 0xFF)], T[(tab, x0 >> 8)])
    a2, a3 = split(T[(tab, x1 & 0xFF)], T[(tab, x1 >> 8)])
    return [a0, a1, a2, a3]


def stage_tile(FMT, D, kc, vc, kpage, vpage, toff, PS):
    """v5's issue(): the bytes one shared-memory stage holds for the tile at page offset toff."""
    K3, KCB, VCB, MB, KS4, NW4, MT3 = fmt_consts(FMT, D)
    parts = [kc[kpage + toff * KCB : kpage + toff * KCB + 16 * KCB]]
    parts += [vc[vpage + j * PS + toff : vpage + j * PS + toff + 16] for j in range(VCB)]
    parts.append(kc[kpage + PS * KCB + toff * MB : kpage + PS * KCB + (toff + 16) * MB])
    parts.append(vc[vpage + PS * VCB + toff * MB : vpage + PS * VCB + (toff + 16) * MB])
    return np.concatenate(parts)


def split_cta(
    FMT, D, q, qs, lv, kc, vc, bt_row, PS, tok_lo, tok_hi, kho, vho, kbs, vbs, G, qk_scale,
    NW=4, variant="v4a",
):  # fmt: skip
    """One CTA. q: [G, D] float (bf16 or fp16 values); kc/vc: flat uint8 arrays; lv: [4, 16]
    levels. Returns the partial output o [G, D] and log-sum-exp lse [G] (base 2)."""
    INT4 = FMT == 0
    K3, KCB, VCB, MB, KS4, NW4, MT3 = fmt_consts(FMT, D)
    KS = D // 16
    BF = INT4
    T = None if INT4 else (tables(FMT, lv) if variant == "v4a" else rep_tables(FMT, lv))
    # per-lane B fragments of q
    qpad = np.zeros((8, D))
    qpad[:G] = q
    bq = np.zeros((32, KS, 2, 2))
    for l in range(32):
        g, qq = G_[l], Q_[l]
        for ks in range(KS):
            base = krow_chan(FMT, D, ks, qq)
            if INT4:  # the K fragments' order: (c, c+2), (c+1, c+3)
                bq[l, ks, 0] = qpad[g, [base, base + 2]]
                bq[l, ks, 1] = qpad[g, [base + 1, base + 3]]
            else:  # (c, c+1), (c+2, c+3)
                bq[l, ks, 0] = qpad[g, base : base + 2]
                bq[l, ks, 1] = qpad[g, base + 2 : base + 4]
    if INT4:
        s = bq.sum(axis=(1, 2, 3))
        s = s + s[lanes ^ 1]
        s = s + s[lanes ^ 2]
        colc = np.stack([s[4 * (2 * Q_)], s[4 * (2 * Q_ + 1)]], 1)
    else:
        colc = np.zeros((32, 2))
        for l in range(32):
            for i in range(2):
                hd = 2 * Q_[l] + i
                colc[l, i] = qs[hd] * qk_scale if hd < G else 0

    sm = []
    tile_lo = tok_lo // 16
    tile_hi = (tok_hi + 15) // 16 if tok_lo < tok_hi else tile_lo
    staged = variant in ("v5", "v6")  # fragments read from the ring stages' bytes
    v6 = variant == "v6"

    def unit_scores(tile):
        """One 16-token unit (v4a/v5: a tile): its scores s [32, 4] (-inf where invalid) and
        what its P.V needs."""
        t0 = tile * 16
        blk = int(bt_row[t0 // PS])
        toff = t0 % PS
        kpage = blk * kbs + kho
        vpage = blk * vbs + vho
        if staged:  # the stage's bytes; rows, V rows and metadata inside it
            st = stage_tile(FMT, D, kc, vc, kpage, vpage, toff, PS)
            kmem, krow0, kmeta = st, 0, 16 * KCB + 16 * VCB
            vmem, vrow0, vst, vmeta = st, 16 * KCB, 16, 16 * KCB + 16 * VCB + 16 * MB
            rowoff = 0
        else:
            kmem, krow0, kmeta = kc, kpage, kpage + PS * KCB
            vmem, vrow0, vst, vmeta = vc, vpage + toff, PS, vpage + PS * VCB
            rowoff = toff
        ks_r = np.zeros((32, 2))
        kz_r = np.zeros((32, 2))
        vs_r = np.zeros((32, 2))
        vz_r = np.zeros((32, 2))
        valid = np.zeros((32, 2), bool)
        krows = {}
        for l in range(32):
            for r in range(2):
                # v5, v6: score row g + 8r is token 4(g/2) + 2r + g%2 of the unit (v_pairs)
                tr = 4 * (G_[l] >> 1) + 2 * r + (G_[l] & 1) if staged else G_[l] + 8 * r
                t = rowoff + tr
                tok = t0 + tr
                valid[l, r] = tok_lo <= tok < tok_hi
                krows[l, r] = krow_load(FMT, D, kmem, krow0 + t * KCB, Q_[l])
                if valid[l, r]:
                    km = kmem[kmeta + t * MB : kmeta + (t + 1) * MB].copy().view(np.float16)
                    vm = vmem[vmeta + t * MB : vmeta + (t + 1) * MB].copy().view(np.float16)
                    ks_r[l, r] = km[0]
                    vs_r[l, r] = vm[0] * (1 if INT4 else 64)
                    if INT4:
                        kz_r[l, r] = km[1]
                        vz_r[l, r] = vm[1]
        s = np.zeros((32, 4))
        for ks in range(KS):
            a = np.zeros((32, 4, 2))
            for l in range(32):
                a[l, 0], a[l, 2] = krow_pairs(FMT, D, krows[l, 0], ks, T, v6)
                a[l, 1], a[l, 3] = krow_pairs(FMT, D, krows[l, 1], ks, T, v6)
            s = mma(s, a, bq[:, ks, 0], bq[:, ks, 1])
        for i in range(4):
            r, c = i >> 1, i & 1
            v = (
                (s[:, i] * ks_r[:, r] + (kz_r[:, r] - 128 * ks_r[:, r]) * colc[:, c]) * qk_scale
                if INT4
                else s[:, i] * ks_r[:, r] * colc[:, c]
            )
            s[:, i] = np.where(valid[:, r], v, -np.inf)
        return s, (vs_r, vz_r, vmem, vrow0, vst)

    def unit_pv(acc, acc_c, p, pvargs):
        """O^T += V^T P'^T of one unit (p: its probabilities [32, 4]; acc, acc_c already
        rescaled); returns acc_c."""
        vs_r, vz_r, vmem, vrow0, vst = pvargs
        plo = r16(np.stack([p[:, 0] * vs_r[:, 0], p[:, 1] * vs_r[:, 0]], 1), BF)
        phi = r16(np.stack([p[:, 2] * vs_r[:, 1], p[:, 3] * vs_r[:, 1]], 1), BF)
        if INT4:
            acc_c = acc_c.copy()
            acc_c[:, 0] += (
                p[:, 0] * vz_r[:, 0] + p[:, 2] * vz_r[:, 1] - 128 * (plo[:, 0] + phi[:, 0])
            )
            acc_c[:, 1] += (
                p[:, 1] * vz_r[:, 0] + p[:, 3] * vz_r[:, 1] - 128 * (plo[:, 1] + phi[:, 1])
            )
        bp0 = movtrans(plo)
        bp1 = movtrans(phi)
        for mt in range(KS):
            a = np.zeros((32, 4, 2))
            for l in range(32):
                vr = vrow0 + (4 if staged else 2) * Q_[l]
                a[l] = v_frag(FMT, D, vmem, vr, vst, mt, G_[l], T, paired=staged, v6=v6)
            acc[mt] = mma(acc[mt], a, bp0, bp1)
        return acc_c

    for w in range(NW):
        m_i = np.full((32, 2), -np.inf)
        l_i = np.zeros((32, 2))
        acc_c = np.zeros((32, 2))
        acc = np.zeros((KS, 32, 4))
        if v6:  # warp w's tile n: units tile_lo + 2w + 2nNW and the next one (if in range)
            tiles = [
                [u for u in (u0, u0 + 1) if u < tile_hi]
                for u0 in range(tile_lo + 2 * w, tile_hi, 2 * NW)
            ]
        else:
            tiles = [[t] for t in range(tile_lo + w, tile_hi, NW)]
        for units in tiles:
            got = [unit_scores(t) for t in units]
            s_all = np.concatenate([g_[0] for g_ in got], 1)  # [32, 4 * units]
            alpha = np.zeros((32, 2))
            ps = [np.zeros((32, 4)) for _ in got]
            for c in range(2):
                mx = s_all[:, c::2].max(axis=1)  # the unit(s)' columns c, 2 + c
                mx = xor_red(mx, np.maximum, (4, 8, 16))
                m_new = np.maximum(m_i[:, c], mx)
                none = m_new == -np.inf
                m_use = np.where(none, 0, m_new)
                alpha[:, c] = np.where(none, 1, np.exp2(m_i[:, c] - m_use))
                tot = 0
                for (su, _), pu in zip(got, ps, strict=True):
                    pu[:, c] = np.exp2(su[:, c] - m_use)
                    pu[:, 2 + c] = np.exp2(su[:, 2 + c] - m_use)
                    tot = tot + pu[:, c] + pu[:, 2 + c]
                l_i[:, c] = l_i[:, c] * alpha[:, c] + tot
                m_i[:, c] = m_new
            a4 = np.stack([alpha[:, 0], alpha[:, 1], alpha[:, 0], alpha[:, 1]], 1)
            acc *= a4[None]
            acc_c = acc_c * alpha
            for (_, pvargs), pu in zip(got, ps, strict=True):
                acc_c = unit_pv(acc, acc_c, pu, pvargs)
        for c in range(2):
            l_i[:, c] = xor_red(l_i[:, c], np.add, (4, 8, 16))
            acc_c[:, c] = xor_red(acc_c[:, c], np.add, (4, 8, 16))
        mm = np.zeros(8)
        ll = np.zeros(8)
        oo = np.zeros((8, D))
        for l in range(32):
            g, qq = G_[l], Q_[l]
            if g == 0:
                mm[2 * qq], mm[2 * qq + 1] = m_i[l]
                ll[2 * qq], ll[2 * qq + 1] = l_i[l]
            for mt in range(KS):
                ch = 16 * mt + 2 * g
                oo[2 * qq, ch] = acc[mt, l, 0] + acc_c[l, 0]
                oo[2 * qq + 1, ch] = acc[mt, l, 1] + acc_c[l, 1]
                oo[2 * qq, ch + 1] = acc[mt, l, 2] + acc_c[l, 0]
                oo[2 * qq + 1, ch + 1] = acc[mt, l, 3] + acc_c[l, 1]
        sm.append((mm, ll, oo))
    o = np.zeros((G, D))
    lse = np.zeros(G)
    for hd in range(G):
        mx = max(x[0][hd] for x in sm)
        L = 0
        O = np.zeros(D)
        if mx != -np.inf:
            for mm, ll, oo in sm:
                f = 0 if mm[hd] == -np.inf else 2 ** (mm[hd] - mx)
                L += f * ll[hd]
                O += f * oo[hd]
        o[hd] = O * (1 if INT4 else 1 / 64) / L if L > 0 else 0
        lse[hd] = mx + math.log2(L) if L > 0 else -np.inf
    return o, lse


def fake_split(
    fmt_name,
    q,
    qs,
    lut16,
    kc,
    vc,
    bt,
    sl,
    o_part,
    lse,
    qk_scale,
    *,
    num_kv_heads,
    k_page_bytes,
    v_page_bytes,
    k_blk_stride,
    v_blk_stride,
    block_size,
    tokens_per_split,
    num_splits,
    skip=0,
):
    FMT = C.FORMATS[fmt_name]
    variant = VARIANT
    b, hq, d = q.shape
    G = hq // num_kv_heads
    qf = q.float().numpy()
    qsn = None if qs is None else qs.numpy()
    lut = None if lut16 is None else lut16.float().numpy()
    # flat byte view of the underlying storage for strided caches
    kflat = torch.as_strided(
        kc, (kc.untyped_storage().nbytes() - kc.storage_offset(),), (1,)
    ).numpy()
    vflat = torch.as_strided(
        vc, (vc.untyped_storage().nbytes() - vc.storage_offset(),), (1,)
    ).numpy()
    op = o_part.view(b * hq, num_splits, d)
    lp = lse.view(b * hq, num_splits)
    for bi in range(b):
        for h in range(num_kv_heads):
            for s in range(num_splits):
                lo = max(s * tokens_per_split, skip)
                hi = min(int(sl[bi]), s * tokens_per_split + tokens_per_split)
                rows = slice((bi * num_kv_heads + h) * G, (bi * num_kv_heads + h + 1) * G)
                o, l = split_cta(
                    FMT,
                    d,
                    qf[bi, h * G : (h + 1) * G],
                    None if qsn is None else qsn[rows],
                    lut,
                    kflat,
                    vflat,
                    bt[bi].numpy(),
                    block_size,
                    lo,
                    hi,
                    h * k_page_bytes,
                    h * v_page_bytes,
                    k_blk_stride,
                    v_blk_stride,
                    G,
                    qk_scale,
                    variant=variant,
                )
                op[rows, s] = torch.tensor(o, dtype=torch.float32)
                lp[rows, s] = torch.tensor(l, dtype=torch.float32)


def _supported(name, spec, g):
    if name not in C.FORMATS or g > C.MAX_GROUP:
        return False
    want = C.expected_groups(name, spec.layout.head_dim)
    return want is None or (spec.k_groups, spec.v_groups) == want


VARIANT = "v6"  # the design modelled (main's arguments after --)
C.split = fake_split  # the model stands in for the CUDA kernel; the rest of paged_decode runs
C.choose = lambda backend, name, spec, g, dev: "cuda" if _supported(name, spec, g) else "triton"


def run(name, hq, hkv, d, ps, lens, cfg, sinks=False):
    if not _supported(name, kernel_spec(resolve_fmt(name, hkv, d), d, ps), hq // hkv):
        raise SystemExit(f"{name} at d {d}: not a CUDA-kernel case")
    (fmt, q, kc, vc, bt, sl), dev = make_case(name, hq, hkv, d, ps, lens, 1, "cpu")
    sk = None
    if sinks:
        g = torch.Generator().manual_seed(9)
        sk = tuple(
            (torch.randn(len(lens), 1, hkv, d, generator=g) * 2).bfloat16() for _ in range(2)
        )
    ref = ref_paged_decode(fmt, q, kc, vc, bt, sl, block_size=ps, sinks=sk)
    plain = ref_paged_decode(
        fmt, q, kc, vc, bt, sl, block_size=ps, sinks=sk, compute_dtype=torch.bfloat16
    )
    out = paged_decode(fmt, *dev, block_size=ps, config=cfg, sinks=sk)
    err, tol = _rel(out, ref), 2 * _rel(plain, ref) + 1e-3
    print(
        name,
        hq,
        hkv,
        d,
        ps,
        lens,
        "sinks" if sinks else "",
        f"err {err:.2e} tol {tol:.2e}",
        "OK" if err <= tol else "FAIL",
    )


def resolve_fmt(name, hkv, d):
    from kvzip_formats import get_format
    from kvzip_kernels.testing import synthetic_calibration

    return get_format(
        name, calibration=synthetic_calibration(hkv, d) if name[0].isdigit() else None
    )


def main():
    """argv: formats (default all four) and, after ``--``, designs (default v6)."""
    global VARIANT
    args = sys.argv[1:]
    variants = args[args.index("--") + 1 :] if "--" in args else ["v6"]
    names = (args[: args.index("--")] if "--" in args else args) or [
        "int4", "4bit", "3.5bit", "3bit"
    ]  # fmt: skip
    for v in variants:
        VARIANT = v
        for name in names:
            print("--", v, end=" ")
            cfg = {}
            run(name, 4, 1, 64, 16, [37, 5], DecodeConfig(block_n=16, num_splits=2, **cfg))
            print("--", v, end=" ")
            run(name, 8, 1, 128, 64, [130], DecodeConfig(block_n=64, num_splits=2, **cfg))
            print("--", v, end=" ")
            run(name, 3, 3, 64, 16, [20], DecodeConfig(block_n=16, num_splits=1, **cfg))
            if name[0].isdigit():
                print("--", v, end=" ")
                cfg2 = DecodeConfig(block_n=16, num_splits=2, **cfg)
                run(name, 8, 2, 128, 16, [37, 1], cfg2, sinks=True)


if __name__ == "__main__":
    main()
