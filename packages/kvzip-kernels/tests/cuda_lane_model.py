"""A numpy model of csrc/paged_decode.cu's split kernels, lane by lane, for the CPU.

The model stands in for ``_cuda.split`` (:func:`fake_split`, same signature) so that the rest of
``paged_decode`` (fold_q, the Triton merge, the sink and window merge) runs on its partial
outputs; the tests compare the result with the float32 reference (test_cuda_lane_model.py).

What it models, in the kernel's integer widths and bit patterns:

- the registers of the mma fragments as 32-bit words (fp16 / bf16 halves), the index builders
  and selectors by PTX ``prmt`` bit for bit (``byte_of``, ``int4_pairs``, ``k3_indices``,
  ``v_frag``), the replicated level-pair tables by entry (``level_pair``), ``mma.sync``
  m16n8k16 and ``movmatrix.trans`` by the PTX ISA's fragment layouts;
- the shared-memory ring as bytes at 32-bit shared addresses, filled by 16-byte ``cp.async``
  copies from global addresses computed as the kernel computes them (64-bit pointers,
  ``int`` offsets wrapped to 32 bits, v7's ``mad.wide.s32``); a copy's destination holds
  *random bytes* from its issue until a ``cp.async.wait_group`` retires its group, so a slot read
  before its copy landed, or refilled before it was read, gives a wrong answer;
- per-warp programs (v6: ``split_v6``, v7: ``split_v7`` with S = 2 or 4 slots) run as
  generators interleaved round robin at every commit, sharing one CTA's ring, so a warp writing
  into another's slots is visible too; the merge of the warps' states (``merge_store``).

What it does not model: timing, the order of memory operations between lanes (a
``__syncwarp`` is a no-op here; a wait retires the group for the whole warp), ``ex2.approx``
(exact ``exp2``), fp32 rounding of the accumulators (float64 here), bank conflicts, registers.

Expressions that transcribe kernel lines cite them as ``cu:LINE`` (csrc/paged_decode.cu as of
this module; test_cuda_lane_model.py checks that the cited source lines are still there).
"""

from __future__ import annotations

import math

import numpy as np
import torch

import kvzip_kernels._cuda as C

lanes = np.arange(32, dtype=np.int64)
G_ = lanes >> 2  # cu:719-720 g = lane >> 2, q = lane & 3
Q_ = lanes & 3
M32 = 0xFFFFFFFF
NEG_INF = -np.inf

#: model perturbations for the mutation tests (None: the kernel as written)
MUTATION: str | None = None
#: the poison seed of the ring's bytes (random until a copy lands)
SEED = 0


# ---- integer widths ------------------------------------------------------------------------
def i32(x):
    """C ``int`` arithmetic: the value wrapped to 32 bits, two's complement."""
    x = np.asarray(x, dtype=np.int64)
    return ((x + (1 << 31)) & M32) - (1 << 31)


def u32(x):
    return np.asarray(x, dtype=np.int64) & M32


# ---- PTX -----------------------------------------------------------------------------------
def prmt(a, b, sel):
    """PTX prmt.b32 (default mode): byte i of the result is byte (sel nibble i & 7) of the
    8 bytes b:a, or that byte's sign bit replicated when the nibble's bit 3 is set."""
    a, b = u32(a), u32(b)
    sel = np.asarray(sel, dtype=np.int64)
    out = np.zeros(np.broadcast(a, b, sel).shape, dtype=np.int64)
    for i in range(4):
        n = (sel >> (4 * i)) & 0xF
        k = n & 7
        byte = np.where(k < 4, a >> (8 * (k & 3)), b >> (8 * (k & 3))) & 0xFF
        byte = np.where(n & 8, np.where(byte & 0x80, 0xFF, 0), byte)
        out = out | (byte << (8 * i))
    return out


def byte_of(w, k):  # cu:172-174
    return prmt(w, 0, 0x4440 | k)


def int4_pairs(x, hi):  # cu:146-150
    t = prmt(x, 0x43, 0x4342 if hi else 0x4140)
    return t & 0xFF0FFF0F, ((t >> 4) & 0x000F000F) | 0x43004300


def k3_indices(lo, hi):  # cu:293-298
    t = prmt(hi, 0, 0x1100)
    hs = (t & 0x000F000F) | ((t >> 4) & 0x0F000F00)
    x0 = u32((lo & 0x0F0F0F0F) + ((hs & 0x03030303) << 4))
    x1 = u32(((lo >> 4) & 0x0F0F0F0F) + ((hs & 0x0C0C0C0C) << 2))
    return x0, x1


def half(x, hi, bf16):
    """The 16-bit float in bits 0-15 (or 16-31) of the words x, as float64."""
    h = ((np.asarray(x, dtype=np.int64) >> (16 if hi else 0)) & 0xFFFF).astype(np.uint16)
    if bf16:
        return (h.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return h.view(np.float16).astype(np.float64)


def to16(x, bf16):  # cvt.rn to a 16-bit float: its bits
    x = np.asarray(x, dtype=np.float32)
    if bf16:
        return (
            torch.from_numpy(x.copy()).bfloat16().view(torch.int16).numpy().astype(np.int64)
            & 0xFFFF
        )
    return x.astype(np.float16).view(np.uint16).astype(np.int64)


def pack2(lo, hi, bf16):  # cu:81-90 (lo in bits 0-15)
    return to16(lo, bf16) | (to16(hi, bf16) << 16)


def mma(c, a, b0, b1, bf16):
    """mma.sync m16n8k16 (row.col, f32 accumulate) of a warp: c [32, 4] float, a 4 words per
    lane, b0, b1 a word per lane (PTX ISA fragment layouts)."""
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))
    for i in range(2):
        A[G_, 2 * Q_ + i] = half(a[0], i, bf16)
        A[G_ + 8, 2 * Q_ + i] = half(a[1], i, bf16)
        A[G_, 2 * Q_ + 8 + i] = half(a[2], i, bf16)
        A[G_ + 8, 2 * Q_ + 8 + i] = half(a[3], i, bf16)
        B[2 * Q_ + i, G_] = half(b0, i, bf16)
        B[2 * Q_ + 8 + i, G_] = half(b1, i, bf16)
    P = A @ B
    out = c.copy()
    for i in range(2):
        out[:, i] += P[G_, 2 * Q_ + i]
        out[:, 2 + i] += P[G_ + 8, 2 * Q_ + i]
    return out


def movmatrix_trans(x):  # movmatrix.sync.aligned.m8n8.trans.b16 of one word per lane
    M = np.zeros((8, 8), dtype=np.int64)
    M[G_, 2 * Q_] = x & 0xFFFF
    M[G_, 2 * Q_ + 1] = (x >> 16) & 0xFFFF
    return M[2 * Q_, G_] | (M[2 * Q_ + 1, G_] << 16)


def xor_red(v, op):  # the shuffles over lanes ^ 4, ^ 8, ^ 16
    for o in (4, 8, 16):
        v = op(v, v[lanes ^ o])
    return v


# ---- formats and tables --------------------------------------------------------------------
class Fmt:  # cu:220-231 Fmt<FMT, D>, cu:688-695 Stage<FMT, D>
    def __init__(self, FMT, D):
        self.FMT, self.D = FMT, D
        self.INT4, self.K3 = FMT == 0, FMT == 3
        self.KCB = 7 * D // 16 if self.K3 else D // 2
        self.VCB = D // 2 if FMT <= 1 else (3 * D // 8 if FMT == 2 else 5 * D // 16)
        self.MB = 4 if self.INT4 else 2
        self.KS = D // 16
        self.KS4 = D // 32 if self.K3 else D // 16
        self.NW4 = D // 64 if self.K3 else D // 32
        self.MT3 = D // 16 if FMT == 2 else (D // 32 if FMT == 3 else 0)
        self.K, self.V, self.M = 16 * self.KCB, 16 * self.VCB, 16 * self.MB  # Stage
        self.BYTES = self.K + self.V + 2 * self.M
        assert self.K % 16 == 0 and self.V % 16 == 0 and self.M % 16 == 0
        self.ENTRIES = {1: 256, 2: 320, 3: 336}.get(FMT, 0)  # RepLut::ENTRIES


T_K4, T_K3, T_V0, T_V2 = 0, 256, 320, 576  # cu:160-163


def level_pair(lv, e):  # cu:193-207 (lv: the [4][16] fp16 levels' bits, flat)
    if e < 256:
        lo, hi = lv[e & 15], lv[e >> 4]
    elif e < 320:
        x = e - 256
        lo = lv[16 + ((x & 3) | (((x >> 4) & 1) << 2))]
        hi = lv[16 + (((x >> 2) & 3) | (((x >> 5) & 1) << 2))]
    else:
        x = e - 320
        lo, hi = lv[48 + (x & 3)], lv[48 + (x >> 2)]
    return int(lo) | (int(hi) << 16)


class RepLut:  # cu:178-191: the entry at idx * 128 + base + off, the region folded into off
    def __init__(self, FMT, lv):
        self.FMT = FMT
        n = Fmt(FMT, 64).ENTRIES
        self.table = np.array([level_pair(lv, e) for e in range(n)], dtype=np.int64)

    def __call__(self, region, idx):
        off = (
            0
            if region == T_K4
            else 256 * 128
            if region == T_K3
            else (0 if self.FMT == 1 else 256 * 128)
            if region == T_V0
            else 320 * 128
        )
        e = np.asarray(idx, dtype=np.int64) + off // 128
        assert (e < len(self.table)).all() and (e >= 0).all(), "lookup past the tables"
        return self.table[e]


# ---- shared memory -------------------------------------------------------------------------
def ld(mem, addr, n):
    """A little-endian load of n bytes per lane at shared address addr (alignment checked)."""
    addr = np.asarray(addr, dtype=np.int64)
    assert (addr % n == 0).all(), f"misaligned {n}-byte shared load"
    assert (addr >= 0).all() and (addr + n <= len(mem)).all(), "shared load out of range"
    out = np.zeros(addr.shape, dtype=np.int64)
    for k in range(n):
        out |= mem[addr + k].astype(np.int64) << (8 * k)
    return out


class KRow:  # cu:234-279
    def __init__(self, F, mem, row, q):  # load (cu:240-264)
        self.F = F
        p = row + q * (F.NW4 * 4)
        assert (p % (4 * F.NW4) == 0).all(), "misaligned vector load of a K row"
        self.w = [ld(mem, p + 4 * i, 4) for i in range(F.NW4)]
        self.lo = self.hi = np.zeros(32, dtype=np.int64)
        if F.K3:
            D = F.D
            pl = row + D // 4 + q * (D // 32)
            ph = row + D // 4 + D // 8 + q * (D // 64)
            if D == 128:
                self.lo, self.hi = ld(mem, pl, 4), ld(mem, ph, 2)
            else:
                self.lo, self.hi = ld(mem, pl, 2), ld(mem, ph, 1)

    def int4(self, ks):  # cu:272-278
        return int4_pairs(self.w[ks >> 1], bool(ks & 1))


def chan(F, ks, q):  # KRow::chan
    D = F.D
    if F.K3:
        return q * (D // 8) + 4 * ks if ks < F.KS4 else D // 2 + q * (D // 8) + 4 * (ks - F.KS4)
    return q * (D // 4) + 4 * ks


def k_pairs(F, kr, x0, x1, ks, T):  # cu:303-315
    if ks < F.KS4:
        w = kr.w[ks >> 1]
        b = 2 * (ks & 1)
        return T(T_K4, byte_of(w, b)), T(T_K4, byte_of(w, b + 1))
    return T(T_K3, byte_of(x0, ks - F.KS4)), T(T_K3, byte_of(x1, ks - F.KS4))


def v_frag(F, mem, vrow, ST, mt, g, T):  # cu:321-363
    def four(tab, X):
        t0l, t0h = T(tab, byte_of(X, 0)), T(tab, byte_of(X, 1))
        t1l, t1h = T(tab, byte_of(X, 2)), T(tab, byte_of(X, 3))
        return [prmt(t0l, t0h, 0x5410), prmt(t0l, t0h, 0x7632), prmt(t1l, t1h, 0x5410),
                prmt(t1l, t1h, 0x7632)]  # fmt: skip

    if F.FMT == 1:
        j = 8 * mt + g
        return four(T_V0, ld(mem, vrow + j * ST, 4))
    if F.INT4:
        x = ld(mem, vrow + (8 * mt + g) * ST, 4)  # v_pairs (cu:284-288)
        w0, w1 = x & 0xFFFF, x >> 16
        a0, a1 = int4_pairs(w0, False)
        a2, a3 = int4_pairs(w1, False)
        return [a0, a1, a2, a3]
    D = F.D
    if mt < F.MT3:
        j, j1 = 4 * mt + (g >> 1), D // 4 + 2 * mt + (g >> 2)
        sl, sh = 4 * (g & 1), 2 * (g & 3)
        W, H = ld(mem, vrow + j * ST, 4), ld(mem, vrow + j1 * ST, 4)
        X = u32(((W >> sl) & 0x0F0F0F0F) + (((H >> sh) & 0x03030303) << 4))
        return four(T_V0, X)
    j = D // 8 + 4 * (mt - F.MT3) + (g >> 1)
    sl = 4 * (g & 1)
    X = (ld(mem, vrow + j * ST, 4) >> sl) & 0x0F0F0F0F
    return four(T_V2, X)


# ---- a warp's state (cu:388-631 Warp<FMT, D>) -------------------------------------------
class Warp:
    def __init__(self, F, T, qbits, G, qs_rows, qk_scale):  # init (cu:397-431)
        self.F, self.T, self.BF16 = F, T, F.INT4
        self.qk_scale = qk_scale
        self.bq = []
        live = G_ < G
        qrow = np.zeros((32, F.D), dtype=np.int64)
        qrow[live] = qbits[G_[live]]
        for ks in range(F.KS):
            c = chan(F, ks, Q_)
            vx = qrow[lanes, c] | (qrow[lanes, c + 1] << 16)  # the uint2 at chan (c .. c+3)
            vy = qrow[lanes, c + 2] | (qrow[lanes, c + 3] << 16)
            b0 = prmt(vx, vy, 0x5410) if F.INT4 else vx
            b1 = prmt(vx, vy, 0x7632) if F.INT4 else vy
            self.bq.append((np.where(live, b0, 0), np.where(live, b1, 0)))
        if F.INT4:
            s = np.zeros(32)
            for b0, b1 in self.bq:
                s = (
                    s
                    + half(b0, 0, True)
                    + half(b0, 1, True)
                    + half(b1, 0, True)
                    + half(b1, 1, True)
                )
            s = s + s[lanes ^ 1]
            s = s + s[lanes ^ 2]
            self.colc = [s[4 * (2 * Q_)], s[4 * (2 * Q_ + 1)]]
        else:
            self.colc = []
            for i in range(2):
                hd = 2 * Q_ + i
                self.colc.append(np.where(hd < G, qs_rows[np.minimum(hd, G - 1)] * qk_scale, 0.0))
        self.m_i = [np.full(32, NEG_INF), np.full(32, NEG_INF)]
        self.l_i = [np.zeros(32), np.zeros(32)]
        self.acc_c = [np.zeros(32), np.zeros(32)]
        self.acc = np.zeros((F.KS, 32, 4))

    def score(self, kr, km, valid):  # cu:437-472
        F, T = self.F, self.T
        ks_r = [half(km[r], 0, False) for r in range(2)]
        kz_r = [half(km[r], 1, False) if F.INT4 else np.zeros(32) for r in range(2)]
        s = np.zeros((32, 4))
        x0 = x1 = [np.zeros(32, dtype=np.int64)] * 2
        if F.K3:
            x0, x1 = zip(*(k3_indices(kr[r].lo, kr[r].hi) for r in range(2)), strict=True)
        for ks in range(F.KS):
            a = [None] * 4
            if F.INT4:
                a[0], a[2] = kr[0].int4(ks)
                a[1], a[3] = kr[1].int4(ks)
            else:
                a[0], a[2] = k_pairs(F, kr[0], x0[0], x1[0], ks, T)
                a[1], a[3] = k_pairs(F, kr[1], x0[1], x1[1], ks, T)
            s = mma(s, a, self.bq[ks][0], self.bq[ks][1], self.BF16)
        with np.errstate(invalid="ignore", over="ignore"):
            for i in range(4):
                r, c = i >> 1, i & 1
                if F.INT4:
                    v = (
                        s[:, i] * ks_r[r] + (kz_r[r] - 128.0 * ks_r[r]) * self.colc[c]
                    ) * self.qk_scale
                else:
                    v = s[:, i] * ks_r[r] * self.colc[c]
                s[:, i] = np.where(valid[r], v, NEG_INF)
        return s

    def v_meta(self, vm):  # cu:475-486
        if self.F.INT4:
            return [half(vm[r], 0, False) for r in range(2)], [
                half(vm[r], 1, False) for r in range(2)
            ]
        return [half(vm[r], 0, False) * 64.0 for r in range(2)], [np.zeros(32)] * 2

    def softmax(self, s):  # cu:493-533 softmax<NU> (v6's pv: cu:577-630, the same steps)
        NU = len(s)
        p = [np.zeros((32, 4)) for _ in range(NU)]
        alpha = [None, None]
        for c in range(2):
            mx = s[0][:, c]
            for h in range(NU):
                mx = np.maximum(mx, np.maximum(s[h][:, c], s[h][:, 2 + c]))
            mx = xor_red(mx, np.maximum)
            m_new = np.maximum(self.m_i[c], mx)
            none = m_new == NEG_INF
            m_use = np.where(none, 0.0, m_new)
            alpha[c] = np.where(none, 1.0, np.exp2(self.m_i[c] - m_use))
            tot = np.zeros(32)
            for h in range(NU):
                p[h][:, c] = np.exp2(s[h][:, c] - m_use)
                p[h][:, 2 + c] = np.exp2(s[h][:, 2 + c] - m_use)
                tot = tot + p[h][:, c] + p[h][:, 2 + c]
            self.l_i[c] = self.l_i[c] * alpha[c] + tot
            self.m_i[c] = m_new
        if ((alpha[0] != 1.0) | (alpha[1] != 1.0)).any():  # __any_sync
            self.acc[:, :, 0] *= alpha[0]
            self.acc[:, :, 1] *= alpha[1]
            self.acc[:, :, 2] *= alpha[0]
            self.acc[:, :, 3] *= alpha[1]
            if self.F.INT4:
                self.acc_c = [self.acc_c[0] * alpha[0], self.acc_c[1] * alpha[1]]
        return p

    def pv_unit(self, p, vs_r, vz_r, mem, vrow):  # cu:538-555
        bf = self.BF16
        plo = pack2(p[:, 0] * vs_r[0], p[:, 1] * vs_r[0], bf)
        phi = pack2(p[:, 2] * vs_r[1], p[:, 3] * vs_r[1], bf)
        if self.F.INT4:
            self.acc_c[0] = self.acc_c[0] + (
                p[:, 0] * vz_r[0]
                + p[:, 2] * vz_r[1]
                - 128.0 * (half(plo, 0, bf) + half(phi, 0, bf))
            )
            self.acc_c[1] = self.acc_c[1] + (
                p[:, 1] * vz_r[0]
                + p[:, 3] * vz_r[1]
                - 128.0 * (half(plo, 1, bf) + half(phi, 1, bf))
            )
        bp0, bp1 = movmatrix_trans(plo), movmatrix_trans(phi)
        for mt in range(self.F.KS):
            a = v_frag(self.F, mem, vrow, 16, mt, G_, self.T)
            self.acc[mt] = mma(self.acc[mt], a, bp0, bp1, bf)


# ---- a CTA: global memory, the ring, cp.async groups -------------------------------------
class Cta:
    """One CTA's memories. Global: kc at address KC, vc at VC (a guard between), the block
    table at BT; shared: the dynamic window from 0 (the replicated tables, modelled by entry in
    RepLut, then the ring; a copy into the tables' bytes is an error)."""

    def __init__(self, F, NW, S, kflat, vflat, rng):
        self.F, self.NW, self.S = F, NW, S
        self.KC = 1 << 12
        self.VC = self.KC + ((len(kflat) + (1 << 16)) >> 12 << 12)
        self.glob = [(self.KC, kflat), (self.VC, vflat)]
        self.ring0 = F.ENTRIES * 128  # cu:714/865 ring = dyn_smem + ENTRIES * 128
        self.smem = rng.integers(0, 256, self.ring0 + NW * S * 2 * F.BYTES).astype(np.uint8)
        self.rng = rng
        self.open = [[] for _ in range(NW)]
        self.pending = [[] for _ in range(NW)]

    def gread(self, addr, n):
        for base, buf in self.glob:
            if base <= addr and addr + n <= base + len(buf):
                return buf[addr - base : addr - base + n]
        raise AssertionError(f"global read of {n} bytes at {addr:#x} outside kc / vc")

    def cp_async16(self, w, s, gmem, pred):
        """Each lane's predicated 16-byte copy: the destination is undefined (random) from here
        until its group retires (cp.async.cg.shared.global, cu:131-134 and cu:837-841)."""
        s, gmem = np.broadcast_to(s, (32,)), np.broadcast_to(gmem, (32,))
        for lane in np.flatnonzero(np.broadcast_to(pred, (32,))):
            d, a = int(s[lane]), int(gmem[lane])
            assert d % 16 == 0 and a % 16 == 0, "cp.async of 16 bytes needs 16-byte alignment"
            assert self.ring0 <= d and d + 16 <= len(self.smem), (
                f"cp.async into {d:#x}: not the ring"
            )
            self.open[w].append((d, self.gread(a, 16).copy()))
            self.smem[d : d + 16] = self.rng.integers(0, 256, 16)

    def commit(self, w):
        self.pending[w].append(self.open[w])
        self.open[w] = []

    def wait(self, w, n):  # cp.async.wait_group n: all but the newest n groups complete
        while len(self.pending[w]) > n:
            for d, data in self.pending[w].pop(0):
                self.smem[d : d + 16] = data


def mad_wide(a, b, base):  # cu:846-850 mad.wide.s32: int32 x int32 -> int64, + a 64-bit base
    a, b = i32(a), i32(b)
    return np.asarray(base, dtype=np.int64) + a.astype(np.int64) * b.astype(np.int64)


class Kernel:
    """The launch's parameters (Params, cu:362-384) and one CTA's indices (cu:868-880)."""

    def __init__(self, FMT, D, NW, S, P, b, h, split):
        self.F, self.NW, self.S, self.P = Fmt(FMT, D), NW, S, P
        self.b, self.h, self.split = b, h, split
        seq_len = int(P["sl"][b])
        tps = P["tokens_per_split"]
        self.tok_lo = max(split * tps, P["skip"])  # cu:874-877
        self.tok_hi = min(seq_len, split * tps + tps)
        self.tile_lo = self.tok_lo // 16
        self.tile_hi = (self.tok_hi + 15) // 16 if self.tok_lo < self.tok_hi else self.tile_lo
        self.kho = h * P["k_page_bytes"]
        self.vho = h * P["v_page_bytes"]
        self.btrow = P["bt"][b * P["stride_btb"] :]

    def load_bids(self, first, base):  # cu:888-892 (v6: cu:735-739)
        NW, P = self.NW, self.P
        u = i32(first + 2 * (base + lanes) * NW)
        out = []
        for uu in (u, u + 1):
            ok = uu < self.tile_hi
            idx = i32(uu * 16) >> P["ps_log2"]
            out.append(np.where(ok, self.btrow[np.where(ok, idx, 0)], 0).astype(np.int64))
        return out


def split_v6(k, cta, w, T, W):
    """Warp w of split_v6<FMT, D, NW, S> (cu:708-819): yields at every commit."""
    F, NW, S, P = k.F, k.NW, k.S, k.P
    PS = P["PS"]
    first = k.tile_lo + 2 * w  # cu:731-732
    ntiles = (k.tile_hi - first + 2 * NW - 1) // (2 * NW) if first < k.tile_hi else 0
    bids = [np.zeros(32, dtype=np.int64)] * 2
    MC = F.M // 16  # cu:740-747
    ksrc = cta.KC + k.kho + 16 * lanes
    vsrc = cta.VC + k.vho + lanes * PS
    kmeta = lanes < MC
    msrc = np.where(
        kmeta,
        cta.KC + k.kho + PS * F.KCB + 16 * lanes,
        cta.VC + k.vho + PS * F.VCB + 16 * (lanes - MC),
    )
    mstride = np.where(kmeta, P["k_blk_stride"], P["v_blk_stride"])
    mdst = F.K + F.V + 16 * lanes
    ring_w = cta.ring0 + w * S * 2 * F.BYTES

    def issue(n):  # cu:748-768
        for hf in range(2):
            u = first + 2 * n * NW + hf
            if u >= k.tile_hi:
                break
            blk = int(bids[hf][n & 31])
            toff = (u * 16) & (PS - 1)
            dst = ring_w + (n % S) * 2 * F.BYTES + hf * F.BYTES
            kp = ksrc + blk * P["k_blk_stride"] + toff * F.KCB
            for i in range(0, F.K // 16, 32):
                on = (F.K // 16) % 32 == 0 or (i + lanes < F.K // 16)
                cta.cp_async16(w, dst + 16 * (i + lanes), kp + 16 * i, on)
            vp = vsrc + blk * P["v_blk_stride"] + toff
            for j in range(0, F.VCB, 32):
                on = F.VCB % 32 == 0 or (j + lanes < F.VCB)
                cta.cp_async16(w, dst + F.K + 16 * (j + lanes), vp + j * PS, on)
            cta.cp_async16(w, dst + mdst, msrc + blk * mstride + toff * F.MB, lanes < 2 * MC)

    bids = k.load_bids(first, 0)  # cu:770-775
    for n in range(S - 1):
        if n < ntiles:
            issue(n)
        cta.commit(w)
        yield
    for n in range(ntiles):  # cu:783-814
        cta.wait(w, S - 2)
        nn = n + S - 1
        if (nn & 31) == 0:
            bids = k.load_bids(first, nn)
        if nn < ntiles:
            issue(nn)
        cta.commit(w)
        st0 = ring_w + (n % S) * 2 * F.BYTES
        s, vm, vrow = [], [], []
        for hf in range(2):
            st = st0 + hf * F.BYTES
            t0 = (first + 2 * n * NW + hf) * 16
            kr, km, valid, vmh = unit_rows(k, cta, st, t0)
            s.append(W.score(kr, km, valid))
            vm.append(vmh)
            vrow.append(st + F.K + 4 * Q_)
        p = W.softmax(s)  # pv (cu:562-630)
        for hf in range(2):
            vs_r, vz_r = W.v_meta(vm[hf])
            W.pv_unit(p[hf], vs_r, vz_r, cta.smem, vrow[hf])
        yield
    cta.wait(w, 0)  # cu:815


def unit_rows(k, cta, st, t0):
    """A unit's rows g, g+8 from its stage (cu:803-809 = cu:972-978)."""
    F = k.F
    kr, km, vm, valid = [], [], [], []
    for r in range(2):
        t = 4 * (G_ >> 1) + 2 * r + (G_ & 1)
        tok = t0 + t
        ok = (tok >= k.tok_lo) & (tok < k.tok_hi)
        valid.append(ok)
        kr.append(KRow(F, cta.smem, st + t * F.KCB, Q_))
        km.append(np.where(ok, ld(cta.smem, st + F.K + F.V + t * F.MB, F.MB), 0))
        vm.append(np.where(ok, ld(cta.smem, st + F.K + F.V + F.M + t * F.MB, F.MB), 0))
    return kr, km, valid, vm


def split_v7(k, cta, w, T, W):
    """Warp w of split_v7<FMT, D, NW, S> (cu:858-1004): yields at every commit."""
    F, NW, S, P = k.F, k.NW, k.S, k.P
    PS = P["PS"]
    assert 2 <= S <= 32 and (S & (S - 1)) == 0  # cu:862
    first = k.tile_lo + 2 * w  # cu:883-885
    npairs = (k.tile_hi - first + 2 * NW - 1) // (2 * NW) if first < k.tile_hi else 0
    ntiles = (npairs + 1) // 2
    MC = F.M // 16  # cu:893-903
    ksrc = cta.KC + k.kho + 16 * lanes
    vsrc = cta.VC + k.vho + lanes * PS
    kmeta = lanes < MC
    msrc = np.where(
        kmeta,
        cta.KC + k.kho + PS * F.KCB + 16 * lanes,
        cta.VC + k.vho + PS * F.VCB + 16 * (lanes - MC),
    )
    kstr, vstr = i32(P["k_blk_stride"]), i32(P["v_blk_stride"])  # (int)P.k_blk_stride
    mstr = np.where(kmeta, kstr, vstr)
    mlane = lanes < 2 * MC
    ring_s = u32(cta.ring0 + w * S * 2 * F.BYTES + 16 * lanes)  # &ring[warp][0][0] + 16 lane
    st = {"bids": None}

    def issue(m):  # cu:904-924
        bids0, bids1 = st["bids"]
        for hf in range(2):
            u = i32(first + 2 * m * NW + hf)
            on = bool(u < k.tile_hi)
            blk = (bids1 if hf else bids0)[m & 31]  # __shfl_sync(..., m & 31)
            toff = i32(u * 16) & (PS - 1)
            dst = u32(ring_s + u32(i32((m & (S - 1)) * (2 * F.BYTES) + hf * F.BYTES)))
            kp = mad_wide(blk, kstr, ksrc) + i32(toff * F.KCB)
            for i in range(0, F.K // 16, 32):
                cta.cp_async16(w, u32(dst + 16 * i), kp + 16 * i,
                               on & ((F.K // 16) % 32 == 0 or (i + lanes < F.K // 16)))  # fmt: skip
            vp = mad_wide(blk, vstr, vsrc) + toff
            for j in range(0, F.VCB, 32):
                cta.cp_async16(w, u32(dst + F.K + 16 * j), vp + j * PS,
                               on & (F.VCB % 32 == 0 or (j + lanes < F.VCB)))  # fmt: skip
            cta.cp_async16(w, u32(dst + F.K + F.V), mad_wide(blk, mstr, msrc) + i32(toff * F.MB),
                           on & mlane)  # fmt: skip

    st["bids"] = k.load_bids(first, 0)  # cu:926-931
    for m in range(S):
        issue(m)
        cta.commit(w)
        yield
    for n in range(ntiles):  # cu:939-999
        m0 = 2 * n
        if ((m0 + S) & 31) == 0 and MUTATION != "no_bid_refill":  # cu:942
            st["bids"] = k.load_bids(first, m0 + S)
        two = m0 + 1 < npairs  # cu:943
        if MUTATION == "refill_one_tile_early":  # v6's place: before the tile's reads
            for j in range(2):
                issue(m0 + j + S)
                cta.commit(w)
        s, vm = [None] * 4, [None] * 4
        for j in range(2):  # cu:947-981
            if j == 0:
                cta.wait(w, S - 1)
            else:
                cta.wait(w, S - 1 if MUTATION == "wait_one_less" else S - 2)
            if j == 1 and not two:  # cu:954-962
                for hf in (2, 3):
                    s[hf] = np.full((32, 4), NEG_INF)
                    vm[hf] = [np.zeros(32, dtype=np.int64)] * 2
                break
            st0 = u32(
                cta.ring0 + w * S * 2 * F.BYTES + ((m0 + j) & (S - 1)) * 2 * F.BYTES
            )  # cu:963
            for hf in range(2):
                stb = st0 + hf * F.BYTES
                t0 = (first + 2 * (m0 + j) * NW + hf) * 16  # cu:967
                kr, km, valid, vmh = unit_rows(k, cta, stb, t0)
                vm[2 * j + hf] = vmh
                s[2 * j + hf] = W.score(kr, km, valid)
        p = W.softmax(s)  # cu:982-983
        for j in range(2):  # cu:984-998
            if MUTATION == "refill_before_pv":
                issue(m0 + j + S)
                cta.commit(w)
            if j == 0 or two:
                st0 = u32(cta.ring0 + w * S * 2 * F.BYTES + ((m0 + j) & (S - 1)) * 2 * F.BYTES)
                for hf in range(2):
                    vs_r, vz_r = W.v_meta(vm[2 * j + hf])
                    W.pv_unit(
                        p[2 * j + hf], vs_r, vz_r, cta.smem, st0 + hf * F.BYTES + F.K + 4 * Q_
                    )
            if MUTATION not in ("refill_before_pv", "refill_one_tile_early"):
                issue(m0 + j + S)  # cu:995-997, after the __syncwarp
                cta.commit(w)
            yield
    cta.wait(w, 0)  # cu:1000


def merge_store(F, Ws, G):
    """cu:635-682: the warps' states merged; returns o [G, D] and lse [G]."""
    sm = []
    for W in Ws:
        l_i = [xor_red(W.l_i[c], np.add) for c in range(2)]
        acc_c = [xor_red(W.acc_c[c], np.add) for c in range(2)]
        mm, ll, oo = np.full(8, NEG_INF), np.zeros(8), np.zeros((8, F.D))
        g0 = G_ == 0
        mm[2 * Q_[g0]], mm[2 * Q_[g0] + 1] = W.m_i[0][g0], W.m_i[1][g0]
        ll[2 * Q_[g0]], ll[2 * Q_[g0] + 1] = l_i[0][g0], l_i[1][g0]
        for mt in range(F.KS):
            ch = 16 * mt + 2 * G_
            oo[2 * Q_, ch] = W.acc[mt][:, 0] + acc_c[0]
            oo[2 * Q_ + 1, ch] = W.acc[mt][:, 1] + acc_c[1]
            oo[2 * Q_, ch + 1] = W.acc[mt][:, 2] + acc_c[0]
            oo[2 * Q_ + 1, ch + 1] = W.acc[mt][:, 3] + acc_c[1]
        sm.append((mm, ll, oo))
    out_scale = 1.0 if F.INT4 else 1.0 / 64.0
    o, lse = np.zeros((G, F.D)), np.zeros(G)
    for hd in range(G):
        mx = max(x[0][hd] for x in sm)
        L, O = 0.0, np.zeros(F.D)
        if mx != NEG_INF:
            for mm, ll, oo in sm:
                f = 0.0 if mm[hd] == NEG_INF else 2.0 ** (mm[hd] - mx)
                L += f * ll[hd]
                O = O + f * oo[hd]
        o[hd] = O * out_scale / L if L > 0 else 0.0
        lse[hd] = mx + math.log2(L) if L > 0 else NEG_INF
    return o, lse


def run_cta(design, S, FMT, D, P, b, h, split, qbits, qs_rows, T, NW=4):
    """One CTA of the design (6 or 7): the NW warps' programs interleaved at every commit."""
    k = Kernel(FMT, D, NW, S, P, b, h, split)
    rng = np.random.default_rng([SEED, b, h, split])
    cta = Cta(k.F, NW, S, P["kflat"], P["vflat"], rng)
    Ws = [Warp(k.F, T, qbits, P["G"], qs_rows, P["qk_scale"]) for _ in range(NW)]
    prog = split_v6 if design == 6 else split_v7
    gens = [prog(k, cta, w, T, Ws[w]) for w in range(NW)]
    with np.errstate(all="ignore"):  # a perturbed model reads random bytes: inf, nan
        while gens:
            gens = [g for g in gens if next(g, StopIteration) is not StopIteration]
        return merge_store(k.F, Ws, P["G"])


def _flat(t):  # the elements of a (possibly strided) tensor's storage from its first one on
    n = t.untyped_storage().nbytes() // t.element_size() - t.storage_offset()
    return torch.as_strided(t, (n,), (1,)).numpy()


def fake_split(
    fmt_name, q, qs, lut16, kc, vc, bt, sl, o_part, lse, qk_scale, *, num_kv_heads, k_page_bytes,
    v_page_bytes, k_blk_stride, v_blk_stride, block_size, tokens_per_split, num_splits, skip=0,
    variant="v6",
):  # fmt: skip
    """``_cuda.split`` with the model in place of the kernel (the launcher's checks included)."""
    C.check_variant(variant)
    design, S = C.VARIANTS[variant]
    FMT = C.FORMATS[fmt_name]
    b, hq, d = q.shape
    G = hq // num_kv_heads
    PS = block_size
    # make_params (cu:1085-1088) and kvzd_split_launch_v7 (cu:1149)
    assert 1 <= G <= 8 and PS >= 16 and PS & (PS - 1) == 0 and tokens_per_split % 16 == 0
    assert k_blk_stride % 16 == 0 and v_blk_stride % 16 == 0
    assert k_page_bytes % 16 == 0 and v_page_bytes % 16 == 0
    if design == 7:
        assert max(k_blk_stride, v_blk_stride) < 1 << 31
    qbits = q.contiguous().view(torch.int16).numpy().astype(np.int64) & 0xFFFF
    qsn = None if qs is None else qs.numpy().astype(np.float64)
    lv = (
        None
        if lut16 is None
        else lut16.contiguous().view(torch.int16).numpy().ravel().astype(np.int64) & 0xFFFF
    )
    T = None if FMT == 0 else RepLut(FMT, lv.astype(np.int64))
    P = dict(
        sl=sl.numpy(), bt=_flat(bt), stride_btb=bt.stride(0), G=G,
        kflat=_flat(kc), vflat=_flat(vc), qk_scale=float(qk_scale), k_page_bytes=k_page_bytes,
        v_page_bytes=v_page_bytes, k_blk_stride=k_blk_stride, v_blk_stride=v_blk_stride, PS=PS,
        ps_log2=PS.bit_length() - 1, tokens_per_split=tokens_per_split, skip=skip,
    )  # fmt: skip
    op = o_part.view(b * hq, num_splits, d)
    lp = lse.view(b * hq, num_splits)
    for bi in range(b):
        for h in range(num_kv_heads):
            rows = slice((bi * num_kv_heads + h) * G, (bi * num_kv_heads + h + 1) * G)
            for s in range(num_splits):
                o, l = run_cta(design, S, FMT, d, P, bi, h, s, qbits[bi, h * G : (h + 1) * G],
                               None if qsn is None else qsn[rows], T)  # fmt: skip
                op[rows, s] = torch.tensor(o, dtype=torch.float32)
                lp[rows, s] = torch.tensor(l, dtype=torch.float32)


def supported(name, spec, g):
    if name not in C.FORMATS or g > C.MAX_GROUP:
        return False
    want = C.expected_groups(name, spec.layout.head_dim)
    return want is None or (spec.k_groups, spec.v_groups) == want


def fake_choose(backend, name, spec, g, dev):
    return "cuda" if supported(name, spec, g) else "triton"
