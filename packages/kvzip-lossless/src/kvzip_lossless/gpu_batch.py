"""The GPU side of the batched API (``batch.py``; spec/blob.md section 9): Triton kernels and
the CUDA C ones (``csrc/kvzl.cu``) behind one set of descriptors.

Encode (:func:`encode_batch`): the inputs are gathered into one flat bf16 buffer (``torch.cat``);
one encode launch over every (tile, 32-lane chunk) of every tensor writes each chunk's words
(in encoder order) to scratch, each lane's final state, each tile's checksum and escape count,
and appends every escape's position to one list; one device-to-host read of those counts (the
call's one synchronisation) lets the host lay out every blob (numpy over tiles, one
``pack_header`` per blob); then one launch writes every chunk's word count, states and words
(or a raw tile's values), one launch packs the mantissas, and a few torch operations place
the (sorted) escapes. Decode (:func:`decode_batch`): one launch checks every header against
its plan (with its CRC-32), one launch decodes every (blob, tile, chunk), escapes by binary
search in the tile's list, raw tiles copied, checksums summed per tile; the damage flags are
reduced on the device.

Kernels index one table *bank* per table set list: every slot's ``cum << 16 | freq`` rows,
bucket maps and bases concatenated, with per-slot offsets (so tables differ per blob in one
launch).
"""

from __future__ import annotations

import threading
import zlib
from collections import OrderedDict, deque

import numpy as np
import torch

from kvzip_lossless import _cuda, settings
from kvzip_lossless._prepared import PreparedDecode
from kvzip_lossless.blob import HEAD
from kvzip_lossless.tables import TableSet

try:
    import triton
    import triton.language as tl

    from kvzip_lossless._triton_rans import MASK32_C, fmix, rans_rows, symbol
except ImportError:  # pragma: no cover
    triton = None

LANES = 32
ENC_W = 12  # int64 fields of an encode descriptor row
ASM_W = 12  # int64 fields of an assembly descriptor row
BLOB_W = 16  # int64 fields of a decode blob row
MASK32 = 0xFFFFFFFF
HEAD_SIZE = HEAD.size  # 40
#: The CUDA batched decoders (csrc/kvzl.cu): ``l1``, each lane reading its column's frequency
#: rows from global memory (the first design); ``smem``, the item's 32 columns' rows staged in
#: shared memory first, lane-interleaved. Same output and flags.
CUDA_DECODERS = settings.DECODER.choices  # ("l1", "smem")
DEFAULT_DECODER = settings.DECODER.default  # "l1"
#: The CUDA batched encoders: ``l1`` (table entries per lane through L1, integer division; the
#: first design) and ``smem`` (entries staged per lane in shared memory, division by a float
#: reciprocal with one correction). Same bytes.
CUDA_ENCODERS = settings.ENCODER.choices  # ("l1", "smem")
DEFAULT_ENCODER = settings.ENCODER.default  # "l1"


def _choice(name, setting, allowed, what) -> str:
    name = setting.value(name)
    if name not in allowed:
        raise ValueError(f"unknown CUDA {what} {name!r} ({setting.name}): {allowed}")
    return name


def cuda_encoder(encoder: str | None = None) -> str:
    """The CUDA batched encoder: ``encoder``, else ``$KVZIP_LOSSLESS_ENCODER``, else
    :data:`DEFAULT_ENCODER` (both write the same bytes)."""
    return _choice(encoder, settings.ENCODER, CUDA_ENCODERS, "encoder")


# ---------------------------------------------------------------------------- table banks
class Bank:
    """Every table of one or more table sets on a device, concatenated (int32)."""

    def __init__(self, sets: list[TableSet], device):
        self.ids = [ts.table_id for ts in sets]
        tabs, cums, bmaps, bases = [], [], [], []
        self.tab_off, self.base_off, self.nb, self.cols = {}, {}, {}, {}
        t_at = b_at = k = 0
        self.bmap_off = {}
        for si, ts in enumerate(sets):
            for s, t in enumerate(ts.tables):
                key = (si, s)
                self.tab_off[key], self.base_off[key] = t_at, b_at
                self.bmap_off[key] = 32 * k
                self.nb[key], self.cols[key] = t.n_buckets, t.columns
                tabs.append(t.packed().astype(np.int32).ravel())
                cums.append(t.cum().astype(np.uint16).ravel().view(np.int16))
                bmaps.append(np.asarray(t.buckets, np.int32))
                bases.append(t.base.astype(np.int32))
                t_at += tabs[-1].size
                b_at += t.columns
                k += 1
        cat = lambda a: np.concatenate(a) if a else np.zeros(1, np.int32)  # noqa: E731
        self.tab = torch.from_numpy(cat(tabs)).to(device)
        self.cum16 = torch.from_numpy(np.concatenate(cums) if cums else np.zeros(32, np.int16))
        self.cum16 = self.cum16.to(device)  # the CUDA decoder's two-round search reads these
        self.bmap = torch.from_numpy(cat(bmaps)).to(device)
        self.base = torch.from_numpy(cat(bases)).to(device)
        # [5, sets, max slots + 1] int64: slot_arrays' values of (set, slot); the last column
        # zeros (slot -1 indexes it)
        n_slots = 1 + max((key[1] for key in self.tab_off), default=-1)
        self._lut = np.zeros((5, max(len(sets), 1), n_slots + 1), np.int64)
        for key in self.tab_off:
            self._lut[:, key[0], key[1]] = (
                self.tab_off[key], self.bmap_off[key], self.base_off[key], self.nb[key],
                self.cols[key],
            )  # fmt: skip

    def slot_arrays(self, set_idx: np.ndarray, slots: np.ndarray):
        """(tab_off, bmap_off, base_off, n_buckets, columns) int64 per blob; zeros where the
        slot is -1 (no table). One lookup over every blob (no loop over the slots)."""
        lut = self._lut
        slots = np.asarray(slots, np.int64)
        s = np.where(slots < 0, lut.shape[2] - 1, slots)
        k = np.where(slots < 0, 0, np.asarray(set_idx, np.int64))
        if len(s) and (s.max() >= lut.shape[2] or k.min() < 0 or k.max() >= lut.shape[1]):
            raise ValueError("a blob names a table slot or set this bank does not hold")
        return lut[:, k, s]


_banks: OrderedDict = OrderedDict()


def bank(sets: list[TableSet], device) -> Bank:
    """The bank of ``sets`` on ``device`` (the last 4 kept)."""
    key = (tuple(ts.table_id for ts in sets), str(device))
    b = _banks.get(key)
    if b is None:
        b = _banks[key] = Bank(sets, device)
        while len(_banks) > 4:
            _banks.popitem(last=False)
    _banks.move_to_end(key)
    return b


def _backend(device, backend: str | None) -> str:
    if backend:
        return backend
    from kvzip_lossless import gpu

    return gpu.default_backend(device)


def _pinned(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a)).pin_memory()


#: Page-locked host buffers that launched kernels still read, each with an event recorded
#: after those kernels: torch's pinned allocator knows only of copies, so a buffer freed at
#: once could be handed out again (and overwritten) before a pending kernel has read it.
_PENDING: deque = deque()


def _hold_until_done(buffers) -> None:
    event = torch.cuda.Event()
    event.record()
    _PENDING.append((event, buffers))
    while _PENDING and _PENDING[0][0].query():
        _PENDING.popleft()


def descriptors_in_host_memory(device, backend: str | None = None) -> bool:
    """True when :func:`prepare_decode` on ``device`` leaves the descriptors in page-locked
    host memory for the kernels to read (the CUDA C decoder): preparing then queues no
    host-to-device copy. False when it uploads them (Triton, the CPU)."""
    device = torch.device(device)
    return device.type == "cuda" and _backend(device, backend) == "cuda"


def _upload(a: np.ndarray, device) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(a))
    if torch.device(device).type != "cuda":
        return t.clone()
    return t.pin_memory().to(device, non_blocking=True)


# --------------------------------------------------------------------------------- kernels
if triton is not None:

    @triton.jit
    def _benc_kernel(in16, tab, bmap, base, desc, scratch16, counts, states, sums, ecnt, ebuf,
                     ecap):  # fmt: skip
        pid = tl.program_id(0)
        d = desc + pid * 12
        in_off = tl.load(d)
        nr = tl.load(d + 1).to(tl.int32)
        col0 = tl.load(d + 2).to(tl.int32)
        state_off = tl.load(d + 3)
        C = tl.load(d + 4).to(tl.int32)
        tab_off = tl.load(d + 5)
        bm_off = tl.load(d + 6)
        base_off = tl.load(d + 7)
        NB = tl.load(d + 8).to(tl.int32)
        sc_off = tl.load(d + 9)
        tile = tl.load(d + 10)
        lanes = tl.arange(0, 32)
        col = col0 + lanes
        lm = col < C
        colbase = tl.load(base + base_off + col, mask=lm, other=0)
        ctx0 = col * NB
        golden = tl.full([32], 0x9E3779B1, tl.uint32)
        x = tl.full([32], 65536, tl.uint32)
        acc = tl.zeros([32], tl.uint32)
        cnt = nr * 0
        ne = nr * 0
        v = tl.load(in16 + in_off + (nr - 1) * C + col, mask=lm, other=0).to(tl.int32) & 0xFFFF
        cur = symbol(v, colbase)
        for i in range(nr):
            t = nr - 1 - i
            p = t * C + col
            acc += tl.where(lm, fmix(p.to(tl.uint32) * golden + v.to(tl.uint32)), 0)
            isesc = lm & ((cur & 15) == 0)
            ne += tl.sum(isesc.to(tl.int32), 0)
            k = tl.atomic_add(ecnt + lanes * 0, 1, mask=isesc)
            tl.store(ebuf + k, in_off + p.to(tl.int64), mask=isesc & (k < ecap))
            vp = tl.load(in16 + in_off + (t - 1) * C + col, mask=lm & (t > 0), other=0)
            vp = vp.to(tl.int32) & 0xFFFF
            sp = tl.where(t > 0, symbol(vp, colbase), 0)
            b = tl.load(bmap + bm_off + sp)
            e = tl.load(tab + tab_off + (ctx0 + b) * 32 + cur, mask=lm, other=1)
            cum = (e >> 16).to(tl.uint32)
            f = (e & 0xFFFF).to(tl.uint32)
            emit = (x >= (f << 20)) & lm
            ni = emit.to(tl.int32)
            tot = tl.sum(ni, 0)
            rev = cnt + tot - tl.cumsum(ni, 0)
            tl.store(scratch16 + sc_off + rev, (x & 0xFFFF).to(tl.int32).to(tl.int16), mask=emit)
            cnt = cnt + tot
            x = tl.where(emit, x >> 16, x)
            q = x // f
            x = (q << 12) + (x - q * f) + cum
            cur = sp
            v = vp
        tl.store(states + state_off + col, x.to(tl.int32, bitcast=True), mask=lm)
        tl.store(counts + pid, cnt)
        tl.atomic_add(sums + tile, tl.sum(acc, 0).to(tl.int32, bitcast=True))
        tl.atomic_add(ecnt + 1 + tile, ne)

    @triton.jit
    def _basm_kernel(in16, data8, data16, data32, scratch16, states, desc):
        pid = tl.program_id(0)
        d = desc + pid * 12
        tile_abs = tl.load(d)
        mode = tl.load(d + 1).to(tl.int32)
        C = tl.load(d + 2).to(tl.int32)
        nch = tl.load(d + 3)
        col0 = tl.load(d + 4).to(tl.int32)
        nr = tl.load(d + 5).to(tl.int32)
        state_off = tl.load(d + 6)
        sc_off = tl.load(d + 7)
        count = tl.load(d + 8).to(tl.int32)
        wdst = tl.load(d + 9)
        in_off = tl.load(d + 10)
        chunk = tl.load(d + 11)
        lanes = tl.arange(0, 32)
        col = col0 + lanes
        lm = col < C
        if mode == 1:
            t32 = tile_abs // 4
            tl.store(data32 + t32 + chunk + lanes * 0, count + lanes * 0, mask=lanes == 0)
            st = tl.load(states + state_off + col, mask=lm, other=0)
            tl.store(data32 + t32 + nch + col, st, mask=lm)
            for j0 in range(0, count, 32):
                j = j0 + lanes
                w = tl.load(scratch16 + sc_off + count - 1 - j, mask=j < count, other=0)
                tl.store(data16 + wdst + j, w, mask=j < count)
        else:
            t16 = tile_abs // 2
            for r in range(nr):
                v = tl.load(in16 + in_off + r * C + col, mask=lm, other=0)
                tl.store(data16 + t16 + r * C + col, v, mask=lm)

    @triton.jit
    def _bmant_kernel(in16, data8, tdesc, BLOCK: tl.constexpr):
        tile = tl.program_id(0)
        d = tdesc + tile * 4
        in_off = tl.load(d)
        nv = tl.load(d + 1)
        mant = tl.load(d + 2)
        mode = tl.load(d + 3)
        g = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ng = (nv + 7) // 8
        gm = (g < ng) & (mode == 1)
        bits = tl.zeros([BLOCK], tl.int64)
        for k in tl.static_range(8):
            p = g * 8 + k
            v = tl.load(in16 + in_off + p, mask=gm & (p < nv), other=0).to(tl.int64)
            bits = (bits << 7) | (v & 127)
        nbytes = (7 * nv + 7) // 8
        for k in tl.static_range(7):
            byte = (bits >> (8 * (6 - k))) & 255
            pos = g * 7 + k
            tl.store(data8 + mant + pos, byte.to(tl.uint8), mask=gm & (pos < nbytes))

    @triton.jit
    def _crc_byte(crc, byte):
        crc = crc ^ byte
        for _k in tl.static_range(8):
            crc = (crc >> 1) ^ (0xEDB88320 & (0 - (crc & 1)))
        return crc

    @triton.jit
    def _bhead_kernel(data8, data32, bdesc, bad):
        b = tl.program_id(0)
        d = bdesc + b * 16
        off = tl.load(d)
        length = tl.load(d + 1)
        C = tl.load(d + 2)
        rpt = tl.load(d + 3)
        nt = tl.load(d + 4)
        dir_off = tl.load(d + 5)
        ts = tl.load(d + 6)
        numel = tl.load(d + 12)
        tid = tl.load(d + 14)
        slot = tl.load(d + 15)
        w = data32 + off // 4
        ok = (tl.load(w).to(tl.int64) & MASK32_C) == 0x4C5A564B  # "KVZL"
        w1 = tl.load(w + 1).to(tl.int64) & MASK32_C
        ndim = (dir_off - 40) // 8
        ok = ok & ((w1 & 0xFFFF) == 1) & (((w1 >> 16) & 255) == 1) & ((w1 >> 24) == ndim)
        ok = ok & (tl.load(w + 2) == 0) & ((tl.load(w + 3).to(tl.int64) & MASK32_C) == C)
        ok = ok & ((tl.load(w + 4).to(tl.int64) & MASK32_C) == rpt)
        ok = ok & ((tl.load(w + 5).to(tl.int64) & MASK32_C) == nt)
        lo = tl.load(w + 6).to(tl.int64) & MASK32_C
        hi = tl.load(w + 7).to(tl.int64) & MASK32_C
        ok = ok & ((lo | (hi << 32)) == tid)
        ok = ok & ((tl.load(w + 8).to(tl.int64) & MASK32_C) == tl.maximum(slot, 0))
        ok = ok & (tl.load(w + 9) == 0)
        prod = tl.full([], 1, tl.int64)
        for k in range(ndim):
            prod = prod * (tl.load(w + 10 + 2 * k).to(tl.int64) & MASK32_C)
            ok = ok & (tl.load(w + 11 + 2 * k) == 0)
        ok = ok & (prod == numel) & (ts == dir_off + 16 * nt + 4)
        crc = tl.full([], 0xFFFFFFFF, tl.int64)
        end = dir_off + 16 * nt
        for i in range(end):
            crc = _crc_byte(crc, tl.load(data8 + off + i).to(tl.int64))
        crc = crc ^ 0xFFFFFFFF
        ok = ok & (crc == (tl.load(w + end // 4).to(tl.int64) & MASK32_C))
        tot = tl.full([], 0, tl.int64)
        for k in range(nt):
            ln = tl.load(w + (dir_off // 4) + 4 * k).to(tl.int64) & MASK32_C
            md = tl.load(w + (dir_off // 4) + 4 * k + 1).to(tl.int64) & 255
            ok = ok & ((ln % 4) == 0) & (md <= 1)
            tot += ln
        ok = ok & (tot == length - ts)
        tl.store(bad + b, (ok == 0).to(tl.int32))

    @triton.jit
    def _bdec_kernel(data8, data16, data32, tab, bmap, base, bdesc, items, out16, sums, expect,
                     ecount, nexp, bad):  # fmt: skip
        pid = tl.program_id(0)
        it = items + pid * 3
        b = tl.load(it).to(tl.int64)
        t = tl.load(it + 1).to(tl.int64)
        chunk = tl.load(it + 2).to(tl.int64)
        d = bdesc + b * 16
        off = tl.load(d)
        length = tl.load(d + 1)
        C = tl.load(d + 2)
        rpt = tl.load(d + 3)
        dir_off = tl.load(d + 5)
        ts = tl.load(d + 6)
        tab_off = tl.load(d + 7)
        bm_off = tl.load(d + 8)
        base_off = tl.load(d + 9)
        NB = tl.load(d + 10)
        out_off = tl.load(d + 11)
        numel = tl.load(d + 12)
        g = tl.load(d + 13) + t
        lanes = tl.arange(0, 32)
        rows_all = numel // C
        nr = tl.minimum(rpt, rows_all - t * rpt)
        nv = nr * C
        dir32 = (off + dir_off) // 4
        pre = tl.full([], 0, tl.int64)
        for k0 in range(0, t, 32):
            kk = k0 + lanes
            ln = tl.load(data32 + dir32 + 4 * kk, mask=kk < t, other=0).to(tl.int64) & MASK32_C
            pre += tl.sum(ln, 0)
        e0 = dir32 + 4 * t
        tlen = tl.load(data32 + e0).to(tl.int64) & MASK32_C
        mode = tl.load(data32 + e0 + 1).to(tl.int64) & 255
        ne = tl.load(data32 + e0 + 2).to(tl.int64) & MASK32_C
        chk = tl.load(data32 + e0 + 3)
        rel = ts + pre
        okt = (rel + tlen <= length) & (tlen % 4 == 0) & (mode <= 1)
        first = chunk == 0
        tl.store(expect + g + lanes * 0, chk + lanes * 0, mask=(lanes == 0) & first)
        tl.store(nexp + g + lanes * 0, (ne * (mode == 1)).to(tl.int32) + lanes * 0,
                 mask=(lanes == 0) & first)  # fmt: skip
        T = off + rel
        col = chunk * 32 + lanes
        lm = col < C
        oo = out_off + t * rpt * C
        golden = tl.full([32], 0x9E3779B1, tl.uint32)
        acc = tl.zeros([32], tl.uint32)
        badv = (okt == 0).to(tl.int32)
        if okt:
            if mode == 0:
                badv = badv | (tlen != (2 * nv + 3) // 4 * 4).to(tl.int32)
                if badv == 0:
                    for r in range(nr):
                        p = r * C + col
                        v = tl.load(data16 + T // 2 + p, mask=lm, other=0)
                        tl.store(out16 + oo + p, v, mask=lm)
                        vv = v.to(tl.int32) & 0xFFFF
                        acc += tl.where(lm, fmix(p.to(tl.uint32) * golden + vv.to(tl.uint32)), 0)
            else:
                nch = (C + 31) // 32
                st = 4 * nch
                ei = st + 4 * C
                ev = ei + 4 * ne
                mo = ev + 2 * ne
                wo = mo + (7 * nv + 7) // 8 + 1
                wo += wo & 1
                badv = badv | ((wo > tlen) | (ne > nv)).to(tl.int32)
                tot = tl.full([], 0, tl.int64)
                wpre = tl.full([], 0, tl.int64)
                n_words = tl.full([], 0, tl.int64)
                if badv == 0:  # the fixed parts lie inside the tile: read the word counts
                    for k0 in range(0, nch, 32):
                        kk = k0 + lanes
                        c = tl.load(data32 + T // 4 + kk, mask=kk < nch, other=0).to(tl.int64)
                        c = c & MASK32_C
                        tot += tl.sum(c, 0)
                        wpre += tl.sum(tl.where(kk < chunk, c, 0), 0)
                    n_words = tl.load(data32 + T // 4 + chunk).to(tl.int64) & MASK32_C
                    badv = badv | ((wo + 2 * tot + 3) // 4 * 4 != tlen).to(tl.int32)
                if badv == 0:
                    if first:  # the escape list: in range and strictly increasing
                        for k0 in range(0, ne, 32):
                            kk = k0 + lanes
                            q = tl.load(data32 + (T + ei) // 4 + kk, mask=kk < ne, other=0)
                            q = q.to(tl.int64) & MASK32_C
                            qp = tl.load(data32 + (T + ei) // 4 + kk - 1, mask=(kk < ne) & (kk > 0),
                                         other=-1).to(tl.int64)  # fmt: skip
                            qp = tl.where(kk > 0, qp & MASK32_C, -1)
                            okq = (q < nv) & (q > qp)
                            badv = badv | tl.sum(((kk < ne) & (okq == 0)).to(tl.int32), 0)
                    x = tl.load(data32 + T // 4 + nch + col, mask=lm, other=65536)
                    x = x.to(tl.uint32, bitcast=True)
                    badv = badv | tl.sum((lm & (x < 65536)).to(tl.int32), 0)
                    colbase = tl.load(base + base_off + col, mask=lm, other=0)
                    x, ptr, badl, acc, nesc = rans_rows(
                        x, nr, C, col, lm, colbase, col * NB, tab + tab_off, bmap + bm_off,
                        data16 + (T + wo) // 2 + wpre, n_words, data8 + T + mo, out16 + oo,
                        data32 + (T + ei) // 4, data16 + (T + ev) // 2, ne, INLINE_ESCAPES=True,
                    )  # fmt: skip
                    badl = badl | ((x != 65536) & lm)
                    badv = badv | tl.sum(badl.to(tl.int32), 0) | (ptr != n_words).to(tl.int32)
                    tl.atomic_add(ecount + g, nesc)
        tl.atomic_add(sums + g, tl.sum(acc, 0).to(tl.int32, bitcast=True))
        tl.atomic_or(bad + b, badv)


# ---------------------------------------------------------------------------------- encode
def encode_batch(tensors, tables: TableSet, slots, rows_per_tile: int, backend=None, encoder=None):
    """The GPU path of :func:`kvzip_lossless.batch.encode_batch` (its contract); ``encoder``:
    the CUDA kernel design (:func:`cuda_encoder`)."""
    dev = tensors[0].device
    be = _backend(dev, backend)
    enc = cuda_encoder(encoder) if be == "cuda" else None
    n = len(tensors)
    bk = bank([tables], dev)
    slots = np.asarray(slots, np.int64)
    tab_off, bm_off, base_off, nbk, cols = bk.slot_arrays(np.zeros(n, np.int64), slots)
    numel = np.array([t.numel() for t in tensors], np.int64)
    rows = numel // cols
    rpt = rows_per_tile
    nt = -(-rows // rpt)
    nch = -(-cols // LANES)
    in_start = np.concatenate([[0], np.cumsum(numel)])
    # tiles
    T = int(nt.sum())
    t_blob = np.repeat(np.arange(n), nt)
    t_idx = np.arange(T) - np.repeat(np.concatenate([[0], np.cumsum(nt)[:-1]]), nt)
    t_rows = np.minimum(rpt, rows[t_blob] - t_idx * rpt)
    t_C = cols[t_blob]
    t_nv = t_rows * t_C
    t_in = in_start[t_blob] + t_idx * rpt * t_C
    t_state = np.concatenate([[0], np.cumsum(t_C)[:-1]]) if T else np.zeros(0, np.int64)
    # items: (tile, chunk)
    t_nch = nch[t_blob]
    n_items = int(t_nch.sum())
    i_tile = np.repeat(np.arange(T), t_nch)
    i_chunk = np.arange(n_items) - np.repeat(
        np.concatenate([[0], np.cumsum(t_nch)[:-1]]) if T else np.zeros(0, np.int64), t_nch
    )
    i_sc = np.concatenate([[0], np.cumsum(t_rows[i_tile] * 32)])
    ib = t_blob[i_tile]
    desc = np.stack(
        [t_in[i_tile], t_rows[i_tile], i_chunk * 32, t_state[i_tile], t_C[i_tile], tab_off[ib],
         bm_off[ib], base_off[ib], nbk[ib], i_sc[:-1], i_tile, np.zeros(n_items, np.int64)], 1,
    ).astype(np.int64)  # fmt: skip
    flat = flat_values(tensors) if n_items else torch.zeros(1, dtype=torch.int16, device=dev)
    total_vals = int(in_start[-1])
    ecap = max(4096, total_vals // 256)  # escapes are ~0.05% of KV values; more: a rerun
    i32 = dict(dtype=torch.int32, device=dev)
    scratch = torch.empty(max(int(i_sc[-1]), 1), dtype=torch.int16, device=dev)
    states = torch.empty(max(int(t_C.sum()), 1), **i32)
    # one buffer read back at once: item word counts, then per tile sums; ecnt: total, per tile
    small = torch.zeros(n_items + T + 1 + T, **i32)
    counts, sums, ecnt = small[:n_items], small[n_items : n_items + T], small[n_items + T :]
    ebuf = torch.empty(ecap, dtype=torch.int64, device=dev)
    desc_d = _upload(desc.reshape(-1, ENC_W), dev)
    args_ = (flat, bk.tab, bk.bmap, bk.base, desc_d, scratch, counts, states, sums, ecnt, ebuf)
    max_nb = int(nbk.max()) if n else 1
    if n_items:
        _launch_encode(be, args_, n_items, ecap, enc, max_nb)
    host = small.cpu().numpy()  # the one synchronisation
    h_counts = host[:n_items].astype(np.int64)
    h_sums = host[n_items : n_items + T].view(np.uint32).astype(np.int64)
    n_esc_all = int(host[n_items + T])
    t_ne = host[n_items + T + 1 :].astype(np.int64)
    if n_esc_all > ecap:  # more escapes than the list holds (a tensor far from its table)
        ebuf = torch.empty(n_esc_all, dtype=torch.int64, device=dev)
        small.zero_()
        _launch_encode(be, args_[:-1] + (ebuf,), n_items, n_esc_all, enc, max_nb)
        small.cpu()
    # layout of every tile
    t_nw = np.bincount(i_tile, weights=h_counts, minlength=T).astype(np.int64)
    mant_len = (7 * t_nv + 7) // 8
    t_mo = 4 * t_nch + 4 * t_C + 6 * t_ne
    t_wo = t_mo + mant_len + 1
    t_wo += t_wo & 1
    rans_len = t_wo + 2 * t_nw
    t_raw = rans_len >= 2 * t_nv
    t_len = np.where(t_raw, (2 * t_nv + 3) // 4 * 4, (rans_len + 3) // 4 * 4)
    t_mode = np.where(t_raw, 0, 1)
    t_nex = np.where(t_raw, 0, t_ne)
    # headers (numpy over the blobs of each (ndim, n_tiles); spec sections 2-3)
    heads = pack_headers(
        [tuple(t.shape) for t in tensors], cols, rpt, tables.table_id, slots, nt,
        t_len, t_mode, t_nex, h_sums,
    )  # fmt: skip
    h_len = np.array([len(h) for h in heads], np.int64)
    tile_sum = np.bincount(t_blob, weights=t_len, minlength=n).astype(np.int64)
    lengths = h_len + tile_sum
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    total = int(offsets[-1])
    t_abs = (
        offsets[t_blob] + h_len[t_blob] + (np.cumsum(t_len) - t_len)
        - (np.cumsum(tile_sum) - tile_sum)[t_blob]
    )  # fmt: skip
    # chunk assembly rows
    i_wpre = np.cumsum(h_counts) - h_counts
    i_wpre = i_wpre - i_wpre[np.concatenate([[0], np.cumsum(t_nch)[:-1]])][i_tile] if T else i_wpre
    asm = np.stack(
        [t_abs[i_tile], t_mode[i_tile], t_C[i_tile], t_nch[i_tile], i_chunk * 32, t_rows[i_tile],
         t_state[i_tile], i_sc[:-1], h_counts, (t_abs[i_tile] + t_wo[i_tile]) // 2 + i_wpre,
         t_in[i_tile], i_chunk], 1,
    ).astype(np.int64)  # fmt: skip
    tdesc = np.stack([t_in, t_nv, t_abs + t_mo, t_mode], 1).astype(np.int64)
    hdr = np.frombuffer(b"".join(heads), np.uint8).astype(np.int64)
    h_first = np.repeat(np.cumsum(h_len) - h_len, h_len)
    hidx = np.repeat(offsets[:-1], h_len) + (np.arange(hdr.size) - h_first)
    e_first = np.cumsum(t_ne) - t_ne
    dummy = total // 4  # escapes of raw tiles land past the blobs
    t_ei32 = np.where(t_raw, -1, (t_abs + 4 * t_nch + 4 * t_C) // 4)
    t_ev16 = np.where(t_raw, -1, (t_abs + 4 * t_nch + 4 * t_C + 4 * t_ne) // 2)
    parts = [asm.ravel(), tdesc.ravel(), hdr, hidx, t_in, e_first, t_ei32, t_ev16]
    sizes = [p.size for p in parts]
    up = _upload(np.concatenate(parts).astype(np.int64), dev)
    up_parts = torch.split(up, sizes)
    asm_d, tdesc_d, hdr_d, hidx_d, tin_d, efirst_d, tei_d, tev_d = up_parts
    data = torch.zeros(total + 8, dtype=torch.uint8, device=dev)
    if hdr.size:
        data[hidx_d] = hdr_d.to(torch.uint8)
    if n_items:
        _launch_assemble(be, flat, data, scratch, states, asm_d, n_items)
        _launch_mant(be, flat, data, tdesc_d, T, int(t_nv.max()))
    E = n_esc_all
    if E:
        pos = torch.sort(ebuf[:E]).values
        tile = torch.searchsorted(tin_d, pos, right=True) - 1
        rank = torch.arange(E, device=dev) - efirst_d[tile]
        ei, ev = tei_d[tile], tev_d[tile]
        d32, d16 = data.view(torch.int32), data.view(torch.int16)
        d32[torch.where(ei < 0, dummy, ei + rank)] = (pos - tin_d[tile]).to(torch.int32)
        d16[torch.where(ev < 0, 2 * dummy + 2, ev + rank)] = flat[pos]
    plans = np.stack(
        [lengths, numel, cols, np.full(n, rpt), nt, np.array([40 + 8 * t.dim() for t in tensors]),
         h_len, slots, np.full(n, _signed(tables.table_id))], 1,
    ).astype(np.int64)  # fmt: skip
    return data[:total], offsets[:-1].copy(), lengths, plans


_HEAD_DT = np.dtype(
    [("magic", "S4"), ("version", "<u2"), ("dtype", "u1"), ("ndim", "u1"), ("flags", "<u4"),
     ("columns", "<u4"), ("rpt", "<u4"), ("n_tiles", "<u4"), ("table_id", "<u8"),
     ("slot", "<u4"), ("emb", "<u4")]
)  # fmt: skip
_DIR_DT = np.dtype(
    [("length", "<u4"), ("mode", "u1"), ("pad", "V3"), ("n_exc", "<u4"), ("checksum", "<u4")]
)


def pack_headers(shapes, cols, rpt, table_id, slots, nt, t_len, t_mode, t_nex, t_sum):
    """``blob.pack_header`` for many blobs at once (no embedded table): numpy over the blobs
    of each (ndim, n_tiles), one ``zlib.crc32`` call per blob. Tile arrays are flat over all
    blobs' tiles in order."""
    n = len(shapes)
    out: list = [None] * n
    tile0 = np.cumsum(nt) - nt
    ndim = np.array([len(sh) for sh in shapes], np.int64)
    for nd, k in set(zip(ndim.tolist(), np.asarray(nt).tolist(), strict=True)):
        idx = np.flatnonzero((ndim == nd) & (nt == k))
        m = len(idx)
        hl = HEAD_SIZE + 8 * nd + _DIR_DT.itemsize * k + 4
        buf = np.zeros((m, hl), np.uint8)
        h = np.zeros(m, _HEAD_DT)
        h["magic"], h["version"], h["dtype"], h["ndim"] = b"KVZL", 1, 1, nd
        h["columns"], h["rpt"], h["n_tiles"] = cols[idx], rpt, k
        h["table_id"], h["slot"] = table_id, np.asarray(slots)[idx]
        buf[:, :HEAD_SIZE] = h.view(np.uint8).reshape(m, HEAD_SIZE)
        if nd:
            sh = np.array([shapes[i] for i in idx], "<u8").reshape(m, nd)
            buf[:, HEAD_SIZE : HEAD_SIZE + 8 * nd] = sh.view(np.uint8).reshape(m, 8 * nd)
        if k:
            ti = tile0[idx][:, None] + np.arange(k)
            d = np.zeros((m, k), _DIR_DT)
            d["length"], d["mode"] = t_len[ti], t_mode[ti]
            d["n_exc"], d["checksum"] = t_nex[ti], t_sum[ti]
            a = HEAD_SIZE + 8 * nd
            buf[:, a : hl - 4] = d.view(np.uint8).reshape(m, -1)
        crc = np.array([zlib.crc32(row[: hl - 4]) for row in buf], "<u4")
        buf[:, hl - 4 :] = crc.view(np.uint8).reshape(m, 4)
        for r, i in enumerate(idx.tolist()):
            out[i] = buf[r].tobytes()
    return out


def _signed(u: int) -> int:
    return u - (1 << 64) if u >= 1 << 63 else u


def flat_values(tensors) -> torch.Tensor:
    """Every tensor's values back to back, as int16 ``[sum of numel]``: a view where the
    tensors already lie so (each contiguous, each starting where the one before ends, in one
    storage: a store job's chunks as the tier stages them), else their concatenation. The view
    saves the batch's size in device memory and a copy of it per call."""
    first = tensors[0]
    storage, pos = first.untyped_storage().data_ptr(), first.data_ptr()
    for t in tensors:
        if (
            not t.is_contiguous()
            or t.dtype != first.dtype
            or t.data_ptr() != pos
            or t.untyped_storage().data_ptr() != storage
        ):
            return torch.cat([t.reshape(-1) for t in tensors]).view(torch.int16)
        pos += t.numel() * t.element_size()
    total = sum(t.numel() for t in tensors)
    return (
        first.new_empty(0)
        .set_(first.untyped_storage(), first.storage_offset(), (total,))
        .view(torch.int16)
    )


def _launch_encode(be, a, n_items, ecap, encoder=None, max_nb=1):
    flat, tab, bmap, base, desc, scratch, counts, states, sums, ecnt, ebuf = a
    if be == "cuda":
        _cuda.batch_encode(flat, desc, n_items, tab, bmap, base, scratch, counts, states, sums,
                           ecnt, ebuf, ecap, encoder or "l1", max_nb)  # fmt: skip
    else:
        _benc_kernel[(n_items,)](flat, tab, bmap, base, desc, scratch, counts, states, sums, ecnt,
                                 ebuf, ecap, num_warps=1)  # fmt: skip


def _launch_assemble(be, flat, data, scratch, states, asm, n_items):
    if be == "cuda":
        _cuda.batch_assemble(flat, data, scratch, states, asm, n_items)
    else:
        _basm_kernel[(n_items,)](flat, data, data.view(torch.int16), data.view(torch.int32),
                                 scratch, states, asm, num_warps=1)  # fmt: skip


def _launch_mant(be, flat, data, tdesc, n_tiles, max_nv):
    if be == "cuda":
        _cuda.batch_mant(flat, data, tdesc, n_tiles, max_nv)
    else:
        block = 256
        grid = (n_tiles, triton.cdiv(-(-max_nv // 8), block))  # tiles on the unbounded axis
        _bmant_kernel[grid](flat, data, tdesc, BLOCK=block, num_warps=4)


# ---------------------------------------------------------------------------------- decode
def decode_batch(data, offsets, plans, sets, set_idx, out, out_offsets, backend=None, decoder=None):
    """The GPU path of :func:`kvzip_lossless.batch.decode_batch` (inputs checked there)."""
    return prepare_decode(
        data, offsets, plans, sets, set_idx, out, out_offsets, backend, decoder
    ).run()


def cuda_decoder(decoder: str | None = None) -> str:
    """The CUDA batched decoder to use: ``decoder``, else ``$KVZIP_LOSSLESS_DECODER``, else
    :data:`DEFAULT_DECODER` (``"l1"`` or ``"smem"``; both give the same output and flags)."""
    return _choice(decoder, settings.DECODER, CUDA_DECODERS, "decoder")


def _decode_items(nt: np.ndarray, nch: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The decode's work items, int32 ``[n_items, 3]``: (blob, tile in the blob, 32-column
    chunk in the tile), blob by blob, tile by tile; and each tile's blob (int32 ``[T]``), for
    blobs of ``nt`` tiles of ``nch`` column chunks. Built by repeats in int32 straight into
    their columns (a restore's host time: 655k items, a group of 20 8B-shaped chunks, in about
    3 ms where int64 gathers and a stack took about 21 ms on the CPU tried)."""
    n, T = len(nt), int(nt.sum())
    t_nch = np.repeat(nch.astype(np.int64), nt)
    n_items = int(t_nch.sum())
    if n_items >= 1 << 31:
        raise ValueError(f"{n_items} decode work items in one batch; at most 2**31 - 1")
    t_blob = np.repeat(np.arange(n, dtype=np.int32), nt)
    gt0 = (np.cumsum(nt) - nt).astype(np.int32)
    t_idx = np.arange(T, dtype=np.int32) - np.repeat(gt0, nt)
    items = np.empty((n_items, 3), np.int32)
    items[:, 0] = np.repeat(np.arange(n, dtype=np.int32), nt * nch)
    items[:, 1] = np.repeat(t_idx, t_nch)
    t_first = (np.cumsum(t_nch) - t_nch).astype(np.int32)
    items[:, 2] = np.arange(n_items, dtype=np.int32) - np.repeat(t_first, t_nch)
    return items, t_blob


#: Work items of batches of like blobs (one tile count and width for all, as a tier's chunks
#: are), by (blobs, tiles, column chunks, page-locked): built once and reused, read only
#: (about 0.2 ms of host time per 8B-shaped chunk otherwise, and a page-locked copy of them)
_ITEMS: OrderedDict = OrderedDict()
ITEMS_CACHED = 8
_ITEMS_LOCK = threading.Lock()


def _work_items(nt: np.ndarray, nch: np.ndarray, pinned: bool):
    """:func:`_decode_items` (page-locked tensors where ``pinned``), from ``_ITEMS`` when every
    blob has one tile count and width."""
    n = len(nt)

    def build():
        items, t_blob = _decode_items(nt, nch)
        return (_pinned(items.ravel()), _pinned(t_blob)) if pinned else (items, t_blob)

    if not n or (nt != nt[0]).any() or (nch != nch[0]).any():
        return build()
    key = (n, int(nt[0]), int(nch[0]), pinned)
    with _ITEMS_LOCK:
        hit = _ITEMS.get(key)
        if hit is not None:
            _ITEMS.move_to_end(key)
            return hit
    hit = build()
    with _ITEMS_LOCK:
        _ITEMS[key] = hit
        while len(_ITEMS) > ITEMS_CACHED:
            _ITEMS.popitem(last=False)
    return hit


def prepare_decode(
    data, offsets, plans, sets, set_idx, out, out_offsets, backend=None, decoder=None
):
    """Host work, the descriptors' upload and the flags' buffers now (on the current stream);
    the kernels when the returned :class:`~kvzip_lossless.batch.PreparedDecode` runs.
    ``decoder``: the CUDA kernel design (:func:`cuda_decoder`)."""
    dev = data.device
    be = _backend(dev, backend)
    data = data[: data.numel() // 4 * 4]  # every blob lies inside (lengths, offsets: 4k)
    n = len(offsets)
    bk = bank(sets, dev) if sets else None
    length, numel, C, rpt, nt, dir_off, ts, slot, tid = plans.T
    if bk is not None:
        tab_off, bm_off, base_off, nbk, _ = bk.slot_arrays(set_idx, slot)
    else:
        tab_off = bm_off = base_off = nbk = np.zeros(n, np.int64)
    dec = cuda_decoder(decoder) if be == "cuda" else None
    max_nb = int(nbk.max()) if n else 1
    nch = -(-C // LANES)
    gt0 = np.cumsum(nt) - nt
    bdesc = np.stack([offsets, length, C, rpt, nt, dir_off, ts, tab_off, bm_off, base_off,
                      nbk, out_offsets, numel, gt0, tid, slot], 1).astype(np.int64)  # fmt: skip
    T = int(nt.sum())
    host_descriptors = be == "cuda" and dev.type == "cuda"
    if host_descriptors:
        # the CUDA kernels read the descriptors from page-locked host memory (same pointer on
        # the device: unified addressing): no host-to-device copy to queue on a copy engine,
        # so a restore's bulk copies can go first and the host prepares while they run
        bdesc_d = _pinned(bdesc.ravel())
        items_d, tblob_d = _work_items(nt, nch, pinned=True)
        n_items = items_d.numel() // 3
    else:
        items, t_blob = _work_items(nt, nch, pinned=False)
        n_items = len(items)
        up = _upload(np.concatenate([bdesc.ravel(), items.ravel(), t_blob]), dev)
        bdesc_d, items_d, tblob_d = torch.split(up, [bdesc.size, items.size, T])
        items_d = items_d.to(torch.int32)
        if be == "cuda":  # the fold kernel reads int32 blob indices
            tblob_d = tblob_d.to(torch.int32)
    i32 = dict(dtype=torch.int32, device=dev)
    bad = torch.zeros(n, **i32)
    tiles_buf = torch.zeros(4 * max(T, 1), **i32)
    sums, expect, ecount, nexp = tiles_buf.view(4, -1)
    o16 = out.view(-1).view(torch.int16)
    tab = bk.tab if bk is not None else torch.zeros(32, **i32)
    cum16 = bk.cum16 if bk is not None else torch.zeros(32, dtype=torch.int16, device=dev)
    bmap = bk.bmap if bk is not None else torch.zeros(32, **i32)
    base = bk.base if bk is not None else torch.zeros(1, **i32)

    def launch() -> torch.Tensor:
        if n:
            if be == "cuda":
                _cuda.batch_check(data, bdesc_d, n, bad)
            else:
                _bhead_kernel[(n,)](data, data.view(torch.int32), bdesc_d, bad, num_warps=1)
        if n_items:
            if be == "cuda":
                _cuda.batch_decode(data, cum16, bmap, base, bdesc_d, items_d, n_items, o16,
                                   sums, expect, ecount, nexp, bad, dec, max_nb)  # fmt: skip
            else:
                _bdec_kernel[(n_items,)](data, data.view(torch.int16), data.view(torch.int32),
                                         tab, bmap, base, bdesc_d, items_d, o16, sums, expect,
                                         ecount, nexp, bad, num_warps=1)  # fmt: skip
        if T and be == "cuda":
            _cuda.batch_fold(sums, expect, ecount, nexp, tblob_d, T, bad)
        elif T:
            tb = ((sums != expect) | (ecount != nexp)).to(torch.int32)
            bad.index_add_(0, tblob_d, tb)
        if host_descriptors:
            _hold_until_done((bdesc_d, items_d, tblob_d))
        return bad

    # (the prepared object holds the host descriptors until it is dropped: after its sync)
    return PreparedDecode(out, launch, keep=(bdesc_d, items_d, tblob_d))
