#!/usr/bin/env python3
"""A numpy model of csrc/paged_decode.cu's per-lane fragment logic, run through paged_decode on
the CPU (no GPU needed): the model stands in for ``_cuda.split`` and must match the float32
reference within the tests' earned tolerance. It checks the kernel's index mappings (which
lane holds which token, head and channel in the mma and movmatrix fragments of the PTX ISA),
not the compiled code; a change of the kernel's mappings needs the same change here.

    TRITON_INTERPRET=1 PYTHONPATH=packages/kvzip-kernels/tests python3 \
        packages/kvzip-kernels/benchmarks/cuda_model.py [int4 4bit]
"""

import math
import sys

import numpy as np
import torch
from test_paged_decode import _rel, make_case

import kvzip_kernels._cuda as C
from kvzip_formats.ops import paged_decode as ref_paged_decode
from kvzip_kernels import DecodeConfig, paged_decode

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


def split_cta(
    INT4, D, q, qs, lut16, kc, vc, bt_row, PS, tok_lo, tok_hi, kho, vho, kbs, vbs, G, qk_scale, NW=4
):
    """One CTA. q: [G, D] float (bf16 or fp16 values); kc/vc: flat uint8 arrays.
    Returns the partial output o [G, D] and log-sum-exp lse [G] (base 2)."""
    KS = D // 16
    CB = D // 2
    BF = INT4
    # per-lane B fragments of q
    qpad = np.zeros((8, D))
    qpad[:G] = q
    bq = np.zeros((32, KS, 2, 2))
    for l in range(32):
        g, qq = G_[l], Q_[l]
        for ks in range(KS):
            base = qq * (D // 4) + 4 * ks
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
    levels = lut16

    def lutpair(byte):  # -> (level lo nibble, level hi nibble)
        return np.array([levels[byte & 15], levels[byte >> 4]])

    def i4pair(byte):
        return np.array([128 + (byte & 15), 128 + (byte >> 4)], float)

    sm = []
    tile_lo = tok_lo // 16
    tile_hi = (tok_hi + 15) // 16 if tok_lo < tok_hi else tile_lo
    for w in range(NW):
        m_i = np.full((32, 2), -np.inf)
        l_i = np.zeros((32, 2))
        acc_c = np.zeros((32, 2))
        acc = np.zeros((KS, 32, 4))
        for tile in range(tile_lo + w, tile_hi, NW):
            t0 = tile * 16
            blk = int(bt_row[t0 // PS])
            toff = t0 % PS
            kpage = blk * kbs + kho
            vpage = blk * vbs + vho
            ks_r = np.zeros((32, 2))
            kz_r = np.zeros((32, 2))
            vs_r = np.zeros((32, 2))
            vz_r = np.zeros((32, 2))
            valid = np.zeros((32, 2), bool)
            chunks = np.zeros((32, 2, CB // 4), np.int64)
            for l in range(32):
                for r in range(2):
                    t = toff + G_[l] + 8 * r
                    tok = t0 + G_[l] + 8 * r
                    valid[l, r] = tok_lo <= tok < tok_hi
                    off = kpage + t * CB + Q_[l] * (CB // 4)
                    chunks[l, r] = kc[off : off + CB // 4]
                    if valid[l, r]:
                        mo = PS * CB + t * (4 if INT4 else 2)
                        km = (
                            kc[kpage + mo : kpage + mo + 4].copy().view(np.float16)
                            if INT4
                            else kc[kpage + mo : kpage + mo + 2].copy().view(np.float16)
                        )
                        vm = (
                            vc[vpage + mo : vpage + mo + 4].copy().view(np.float16)
                            if INT4
                            else vc[vpage + mo : vpage + mo + 2].copy().view(np.float16)
                        )
                        ks_r[l, r] = km[0]
                        vs_r[l, r] = vm[0] * (1 if INT4 else 64)
                        if INT4:
                            kz_r[l, r] = km[1]
                            vz_r[l, r] = vm[1]
            s = np.zeros((32, 4))
            for ks in range(KS):
                a = np.zeros((32, 4, 2))
                for l in range(32):
                    b0, b1 = chunks[l, 0, 2 * ks], chunks[l, 0, 2 * ks + 1]
                    c0, c1 = chunks[l, 1, 2 * ks], chunks[l, 1, 2 * ks + 1]
                    if INT4:  # low nibbles of the two bytes, then the high nibbles
                        a[l, 0] = [128 + (b0 & 15), 128 + (b1 & 15)]
                        a[l, 1] = [128 + (c0 & 15), 128 + (c1 & 15)]
                        a[l, 2] = [128 + (b0 >> 4), 128 + (b1 >> 4)]
                        a[l, 3] = [128 + (c0 >> 4), 128 + (c1 >> 4)]
                    else:
                        a[l, 0] = lutpair(b0)
                        a[l, 1] = lutpair(c0)
                        a[l, 2] = lutpair(b1)
                        a[l, 3] = lutpair(c1)
                s = mma(s, a, bq[:, ks, 0], bq[:, ks, 1])
            for i in range(4):
                r, c = i >> 1, i & 1
                v = (
                    (s[:, i] * ks_r[:, r] + (kz_r[:, r] - 128 * ks_r[:, r]) * colc[:, c]) * qk_scale
                    if INT4
                    else s[:, i] * ks_r[:, r] * colc[:, c]
                )
                s[:, i] = np.where(valid[:, r], v, -np.inf)
            alpha = np.zeros((32, 2))
            p = np.zeros((32, 4))
            for c in range(2):
                mx = np.maximum(s[:, c], s[:, 2 + c])
                mx = xor_red(mx, np.maximum, (4, 8, 16))
                m_new = np.maximum(m_i[:, c], mx)
                none = m_new == -np.inf
                m_use = np.where(none, 0, m_new)
                alpha[:, c] = np.where(none, 1, np.exp2(m_i[:, c] - m_use))
                p[:, c] = np.exp2(s[:, c] - m_use)
                p[:, 2 + c] = np.exp2(s[:, 2 + c] - m_use)
                l_i[:, c] = l_i[:, c] * alpha[:, c] + p[:, c] + p[:, 2 + c]
                m_i[:, c] = m_new
            plo = r16(np.stack([p[:, 0] * vs_r[:, 0], p[:, 1] * vs_r[:, 0]], 1), BF)
            phi = r16(np.stack([p[:, 2] * vs_r[:, 1], p[:, 3] * vs_r[:, 1]], 1), BF)
            if INT4:
                acc_c[:, 0] = (
                    acc_c[:, 0] * alpha[:, 0]
                    + p[:, 0] * vz_r[:, 0]
                    + p[:, 2] * vz_r[:, 1]
                    - 128 * (plo[:, 0] + phi[:, 0])
                )
                acc_c[:, 1] = (
                    acc_c[:, 1] * alpha[:, 1]
                    + p[:, 1] * vz_r[:, 0]
                    + p[:, 3] * vz_r[:, 1]
                    - 128 * (plo[:, 1] + phi[:, 1])
                )
            bp0 = movtrans(plo)
            bp1 = movtrans(phi)
            for mt in range(KS):
                a = np.zeros((32, 4, 2))
                for l in range(32):
                    j = 8 * mt + G_[l]
                    base = vpage + toff + 2 * Q_[l] + j * PS
                    w0 = (int(vc[base]), int(vc[base + 1]))
                    w1 = (int(vc[base + 8]), int(vc[base + 9]))
                    if INT4:
                        a[l, 0] = [128 + (w0[0] & 15), 128 + (w0[1] & 15)]
                        a[l, 1] = [128 + (w0[0] >> 4), 128 + (w0[1] >> 4)]
                        a[l, 2] = [128 + (w1[0] & 15), 128 + (w1[1] & 15)]
                        a[l, 3] = [128 + (w1[0] >> 4), 128 + (w1[1] >> 4)]
                    else:
                        a[l, 0] = [levels[w0[0] & 15], levels[w0[1] & 15]]
                        a[l, 1] = [levels[w0[0] >> 4], levels[w0[1] >> 4]]
                        a[l, 2] = [levels[w1[0] & 15], levels[w1[1] & 15]]
                        a[l, 3] = [levels[w1[0] >> 4], levels[w1[1] >> 4]]
                acc[mt] *= np.stack([alpha[:, 0], alpha[:, 1], alpha[:, 0], alpha[:, 1]], 1)
                acc[mt] = mma(acc[mt], a, bp0, bp1)
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
    INT4 = C.FORMATS[fmt_name] == 0
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
                    INT4,
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
                )
                op[rows, s] = torch.tensor(o, dtype=torch.float32)
                lp[rows, s] = torch.tensor(l, dtype=torch.float32)


def _supported(name, spec, g):
    if name not in C.FORMATS or g > C.MAX_GROUP:
        return False
    return name != "4bit" or (
        spec.k_groups[0][0] == 4 and not spec.k_groups[1][0] and spec.v_groups == spec.k_groups
    )


C.split = fake_split  # the model stands in for the CUDA kernel; the rest of paged_decode runs
C.choose = lambda backend, name, spec, g, dev: "cuda" if _supported(name, spec, g) else "triton"


def run(name, hq, hkv, d, ps, lens, cfg, sinks=False):
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


def main():
    for name in sys.argv[1:] or ["int4", "4bit"]:
        run(name, 4, 1, 64, 16, [37, 5], DecodeConfig(block_n=16, num_splits=2))
        run(name, 8, 1, 128, 64, [130], DecodeConfig(block_n=64, num_splits=2))
        run(name, 3, 3, 64, 16, [20], DecodeConfig(block_n=16, num_splits=1))
        if name == "4bit":
            run(name, 8, 2, 128, 16, [37, 1], DecodeConfig(block_n=16, num_splits=2), sinks=True)


if __name__ == "__main__":
    main()
