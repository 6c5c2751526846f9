"""GPU coder (Triton, imported lazily): the same bytes as the CPU coder, one warp per chunk.

A program owns one chunk: 32 lanes (columns) of one tile. Each step handles one row: a lane
finds its symbol by a 5-step binary search in its context's packed ``cum << 16 | freq`` row
(128 bytes, L1-resident), renormalises, and the lanes that need a word take consecutive words
through a prefix sum over the 32 lanes (what a warp ballot does). Triton reaches this with no
shared-memory tables: a chunk touches at most 32 columns x 8 buckets x 128 B = 32 KB of table.
The row loop is ``_triton_rans.rans_rows``, the batched decoder's too (``gpu_batch.py``).
"""

from __future__ import annotations

import logging
import math
import os

import numpy as np
import torch

from kvzip_lossless import _cuda, settings, tiles
from kvzip_lossless._torch import (
    as_u16,
    checksum,
    cum_tensor,
    encode_desc,
    pack_mantissas,
    table_tensors,
    tile_checksums,
)
from kvzip_lossless.blob import MODE_RAW, CorruptBlobError, Header, tile_layout
from kvzip_lossless.checksum import partial_sum
from kvzip_lossless.tables import BUCKETS_NONE, MODE_SLOT, NSYM, Table, normalize_counts

try:  # Triton comes with CUDA builds of torch; the CPU package never needs it.
    import triton
    import triton.language as tl

    from kvzip_lossless._triton_rans import rans_rows, symbol
except ImportError:  # pragma: no cover - exercised on machines without Triton
    triton = None

LANES = 32
logger = logging.getLogger("kvzip_lossless")


def available() -> bool:
    return triton is not None and (
        torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
    )


if triton is not None:

    @triton.jit
    def _decode_kernel(blob8, blob16, blob32, tab, bmap, base, desc, out16, sums, err, C, NB):
        pid = tl.program_id(0)
        d = desc + pid * 8
        state_off = tl.load(d)
        word_off = tl.load(d + 1)
        n_words = tl.load(d + 2).to(tl.int32)
        mant_off = tl.load(d + 3)
        out_off = tl.load(d + 4)
        nr = tl.load(d + 5).to(tl.int32)
        col0 = tl.load(d + 6).to(tl.int32)
        tile = tl.load(d + 7)
        lanes = tl.arange(0, 32)
        col = col0 + lanes
        lm = col < C
        x = tl.load(blob32 + state_off + col, mask=lm, other=65536).to(tl.uint32)
        colbase = tl.load(base + col, mask=lm, other=0).to(tl.int32)
        x, ptr, badl, acc, _ = rans_rows(
            x, nr, C, col, lm, colbase, col * NB, tab, bmap, blob16 + word_off, n_words,
            blob8 + mant_off, out16 + out_off, blob32, blob16, 0, INLINE_ESCAPES=False,
        )  # fmt: skip
        badl = badl | ((x != 65536) & lm)
        bad = tl.sum(badl.to(tl.int32), 0) + (ptr != n_words).to(tl.int32)
        tl.atomic_add(sums + tile, tl.sum(acc, 0).to(tl.int32, bitcast=True))
        tl.store(err + pid, bad)

    @triton.jit
    def _encode_kernel(in16, tab, bmap, base, desc, scratch16, counts, states, C, NB, RPT):
        pid = tl.program_id(0)
        d = desc + pid * 4
        in_off = tl.load(d)
        nr = tl.load(d + 1).to(tl.int32)
        col0 = tl.load(d + 2).to(tl.int32)
        state_off = tl.load(d + 3)
        lanes = tl.arange(0, 32)
        col = col0 + lanes
        lm = col < C
        colbase = tl.load(base + col, mask=lm, other=0).to(tl.int32)
        ctx0 = col * NB
        x = tl.full([32], 65536, tl.uint32)
        cnt = nr * 0
        sbase = pid.to(tl.int64) * RPT * 32
        v = tl.load(in16 + in_off + (nr - 1) * C + col, mask=lm, other=0).to(tl.int32) & 0xFFFF
        cur = symbol(v, colbase)
        for i in range(nr):
            t = nr - 1 - i
            vp = tl.load(in16 + in_off + (t - 1) * C + col, mask=lm & (t > 0), other=0)
            sp = tl.where(t > 0, symbol(vp.to(tl.int32) & 0xFFFF, colbase), 0)
            b = tl.load(bmap + sp)
            e = tl.load(tab + (ctx0 + b) * 32 + cur, mask=lm, other=1)
            cum = (e >> 16).to(tl.uint32)
            f = (e & 0xFFFF).to(tl.uint32)
            emit = (x >= (f << 20)) & lm
            ni = emit.to(tl.int32)
            tot = tl.sum(ni, 0)
            rev = cnt + tot - tl.cumsum(ni, 0)
            tl.store(scratch16 + sbase + rev, (x & 0xFFFF).to(tl.int32).to(tl.int16), mask=emit)
            cnt = cnt + tot
            x = tl.where(emit, x >> 16, x)
            q = x // f
            x = (q << 12) + (x - q * f) + cum
            cur = sp
        tl.store(states + state_off + col, x.to(tl.int32, bitcast=True), mask=lm)
        tl.store(counts + pid, cnt)


def launch_decode(backend, blob_dev, desc, tabs, table, columns, o16, sums, err) -> None:
    """One decode launch over the chunks ``desc`` (int64 ``[chunks, 8]``, from
    :func:`decode_plan`, offsets into ``blob_dev``) with ``table``'s device tensors ``tabs``:
    the CUDA C coder (``backend == "cuda"``) or the Triton one. Chunks of several blobs that
    share a table may go in one launch (kvzip-vllm's batched restore does)."""
    tab, bmap, base = tabs
    if backend == "cuda":  # the CUDA C decoder searches the cumulative frequencies
        cum16 = cum_tensor(table, blob_dev.device)
        _cuda.decode(blob_dev, desc, desc.shape[0], cum16, bmap, base, columns,
                     table.n_buckets, o16, sums, err)  # fmt: skip
    else:
        _decode_kernel[(desc.shape[0],)](
            blob_dev, blob_dev.view(torch.int16), blob_dev.view(torch.int32), tab, bmap, base,
            desc, o16, sums, err, columns, table.n_buckets, num_warps=1,
        )  # fmt: skip


def decode_plan(buf: memoryview, h: Header):
    """CPU side of a GPU decode: chunk descriptors, raw tiles and escape patches.

    Returns (desc int64 [chunks, 8], expected kernel sums per tile (uint32, escapes' share
    removed), raw tiles [(tile, byte offset, n values)], escape indices (in the tensor) and
    values).
    """
    cols = h.columns
    nch = -(-cols // LANES)
    arr = np.frombuffer(buf, np.uint8)
    offs = h.offsets()
    descs, raw, eidx, evals = [], [], [], []
    expect = h.checksums.astype(np.uint32).copy()
    for ti in range(h.n_tiles):
        nr = h.tile_rows(ti)
        nv = nr * cols
        o = int(offs[ti])
        out_off = ti * h.rows_per_tile * cols
        if h.modes[ti] == MODE_RAW:
            if h.lengths[ti] != (2 * nv + 3) & ~3:
                raise CorruptBlobError(f"raw tile {ti}: length {h.lengths[ti]} wrong")
            raw.append((ti, o, nv, out_off))
            continue
        ne = int(h.n_exc[ti])
        lay = tile_layout(nv, cols, ne)
        c = arr[o : o + 4 * nch].view("<u4").astype(np.int64)
        if (lay["words"] + 2 * int(c.sum()) + 3) & ~3 != h.lengths[ti]:
            raise CorruptBlobError(f"tile {ti}: word counts do not match its length")
        idx = arr[o + lay["exc_idx"] : o + lay["exc_val"]].view("<u4").astype(np.int64)
        if ne and (idx.max() >= nv or (np.diff(idx) <= 0).any()):
            raise CorruptBlobError(f"tile {ti}: escape positions out of range or unsorted")
        ev = arr[o + lay["exc_val"] : o + lay["mant"]].view("<u2")
        if ne:
            expect[ti] = np.uint32((int(expect[ti]) - partial_sum(idx, ev)) & 0xFFFFFFFF)
            eidx.append(idx + out_off)
            evals.append(ev)
        wstart = (o + lay["words"]) // 2 + np.concatenate([[0], np.cumsum(c)[:-1]])
        for ch in range(nch):
            descs.append(
                (o // 4 + nch, wstart[ch], c[ch], o + lay["mant"], out_off, nr, ch * LANES, ti)
            )
    desc = np.array(descs, np.int64).reshape(-1, 8)
    e_i = np.concatenate(eidx) if eidx else np.zeros(0, np.int64)
    e_v = np.concatenate(evals) if evals else np.zeros(0, np.uint16)
    return desc, expect, raw, e_i, e_v


class GpuBlob:
    """A blob staged on the GPU with its decode plan (reusable: the restore pipeline stages
    the plan once and streams the bytes)."""

    def __init__(
        self, buf: memoryview, h: Header, table: Table, device, backend: str | None = None
    ):
        self.h, self.table, self.device = h, table, device
        self.backend = backend or default_backend(device)
        desc, expect, raw, ei, ev = decode_plan(buf, h)
        self.desc = torch.from_numpy(desc).to(device)
        self.expect = torch.from_numpy(expect.view(np.int32)).to(device)
        self.raw, self.n_chunks = raw, len(desc)
        self.eidx = torch.from_numpy(ei).to(device)
        self.evals = torch.from_numpy(ev.view(np.int16)).to(device)

    def decode(self, blob_dev: torch.Tensor, out: torch.Tensor, check: bool = True):
        """Decode from ``blob_dev`` (uint8 on the GPU) into ``out``; returns a device flag
        tensor (nonzero = damaged) without synchronising unless ``check``."""
        h = self.h
        tab, bmap, base = table_tensors(self.table, self.device)
        o16 = out.view(-1).view(torch.int16)
        sums = torch.zeros(h.n_tiles, dtype=torch.int32, device=self.device)
        err = torch.zeros(max(self.n_chunks, 1), dtype=torch.int32, device=self.device)
        if self.n_chunks:
            launch_decode(
                self.backend, blob_dev, self.desc, (tab, bmap, base), self.table, h.columns,
                o16, sums, err,
            )  # fmt: skip
        for ti, o, nv, out_off in self.raw:
            seg = blob_dev[o : o + 2 * nv].view(torch.int16)
            o16[out_off : out_off + nv] = seg
            sums[ti] = checksum(seg).to(torch.int32)
        if self.eidx.numel():
            o16[self.eidx] = self.evals
        flag = err.sum() + (sums != self.expect).sum()
        if check and int(flag):
            raise CorruptBlobError("GPU decode: checksum or stream check failed (damaged blob)")
        return flag


def decompress(buf: memoryview, h: Header, table: Table, *, device, out=None) -> torch.Tensor:
    gb = GpuBlob(buf, h, table, device)
    blob_dev = torch.frombuffer(bytearray(buf), dtype=torch.uint8).to(device)
    if out is None:
        out = torch.empty(h.shape, dtype=torch.bfloat16, device=device)
    gb.decode(blob_dev, out, check=True)
    return out


BACKENDS = settings.BACKEND.choices  # ("cuda", "triton")
_logged: set = set()


def decide_backend(device_type: str, requested: str | None, cuda_c_failure) -> tuple[str, str]:
    """The GPU coder for a device, and why: ``(backend, reason)``.

    ``requested``: ``KVZIP_LOSSLESS_BACKEND`` (None/"" = choose); ``cuda_c_failure()``: None
    when the CUDA C coder is built for this device's GPU, else why not (called only when
    needed). The CUDA C coder is preferred on CUDA; Triton otherwise. Asking for ``cuda``
    where it cannot run raises RuntimeError (with the reason) rather than silently running
    another coder.
    """
    if requested and requested not in BACKENDS:
        raise ValueError(
            f"KVZIP_LOSSLESS_BACKEND={requested!r}: supported values are {', '.join(BACKENDS)}"
        )
    if requested == "triton":
        return "triton", "KVZIP_LOSSLESS_BACKEND=triton"
    if device_type != "cuda":
        if requested == "cuda":
            raise RuntimeError(f"KVZIP_LOSSLESS_BACKEND=cuda, but the device is {device_type}")
        return "triton", f"{device_type} device (Triton interpreter)"
    why = cuda_c_failure()
    if why is None:
        return "cuda", "CUDA C coder built for this GPU"
    if requested == "cuda":
        raise RuntimeError(f"KVZIP_LOSSLESS_BACKEND=cuda, but the CUDA C coder cannot run: {why}")
    return "triton", f"CUDA C coder unavailable ({why})"


def default_backend(device) -> str:
    """'cuda' (csrc/kvzl.cu, built with nvcc for this GPU) on a CUDA device when it builds
    and loads there, else 'triton'. The choice and its reason are logged once per device."""
    dev = torch.device(device)
    backend, why = decide_backend(dev.type, settings.BACKEND.raw(), lambda: _cuda.failure(dev))
    key = (str(dev), backend)
    if key not in _logged:
        _logged.add(key)
        log = logger.warning if "unavailable" in why else logger.info
        log("kvzip-lossless GPU coder on %s: %s (%s)", dev, backend, why)
    return backend


def encode_parts(
    x: torch.Tensor, table: Table, cols: int, rows_per_tile: int, backend: str | None = None
):
    """Run the GPU encoder; returns device tensors for every tile (no host transfer)."""
    dev = x.device
    if (backend or default_backend(dev)) == "cuda":
        return _cuda.encode_parts(x, table, cols, rows_per_tile, table_tensors(table, dev))
    flat16 = x.contiguous().view(-1).view(torch.int16)
    rows = flat16.numel() // cols
    tab, bmap, base = table_tensors(table, dev)
    desc, n_tiles, nch = encode_desc(rows, cols, rows_per_tile, dev)
    n_prog = n_tiles * nch
    scratch = torch.empty(n_prog * rows_per_tile * LANES, dtype=torch.int16, device=dev)
    counts = torch.empty(n_prog, dtype=torch.int32, device=dev)
    states = torch.empty(n_tiles * cols, dtype=torch.int32, device=dev)
    _encode_kernel[(n_prog,)](
        flat16,
        tab,
        bmap,
        base,
        desc,
        scratch,
        counts,
        states,
        cols,
        table.n_buckets,
        rows_per_tile,
        num_warps=1,
    )
    # words in decoder order: chunk c's j-th word is scratch[c * RPT * 32 + count_c - 1 - j]
    c64 = counts.to(torch.int64)
    starts = torch.cumsum(c64, 0) - c64
    total = int(c64.sum())
    ch_of = torch.repeat_interleave(torch.arange(n_prog, device=dev), c64, output_size=total)
    local = torch.arange(total, device=dev) - starts[ch_of]
    words = scratch[ch_of * rows_per_tile * LANES + c64[ch_of] - 1 - local]
    v = flat16.to(torch.int32) & 0xFFFF
    colidx = torch.arange(flat16.numel(), device=dev) % cols
    es = ((v >> 7) & 255) - base[colidx] + MODE_SLOT
    esc = (es < 1) | (es > 15)
    mant = pack_mantissas(v, rows, cols, rows_per_tile)
    sums = tile_checksums(v, rows, cols, rows_per_tile)
    return dict(
        counts=counts,
        states=states,
        words=words,
        esc=esc,
        mant=mant,
        sums=sums,
        n_tiles=n_tiles,
        nch=nch,
        rows=rows,
    )


def fit_table_gpu(x: torch.Tensor, cols: int) -> Table:
    """The embedded table of :func:`kvzip_lossless.tiles.prepare_table`, counted on the GPU
    (identical integer counts, so the identical table)."""
    v = x.contiguous().view(-1).view(torch.int16).to(torch.int32) & 0xFFFF
    col = torch.arange(v.numel(), device=v.device) % cols
    ecount = torch.bincount(col * 256 + ((v >> 7) & 255), minlength=cols * 256).view(cols, 256)
    base = torch.argmax(ecount, 1)  # first maximum, as numpy's argmax
    es = ((v >> 7) & 255) - base[col] + MODE_SLOT
    es = torch.where((es >= 1) & (es <= 15), es, 0)
    sym = (v >> 15) * 16 + es
    counts = torch.bincount(col * NSYM + sym, minlength=cols * NSYM).view(cols, 1, NSYM)
    return Table(
        base.to(torch.uint8).cpu().numpy(), BUCKETS_NONE, normalize_counts(counts.cpu().numpy())
    )


def compress(x: torch.Tensor, *, tables=None, slot=None, rows_per_tile: int) -> bytes:
    """GPU encode, then the blob assembled on the host (the same bytes as the CPU path)."""
    shape = tuple(int(s) for s in x.shape)
    table = tiles.resolve_table(tables, slot, shape, math.prod(shape))
    # Without a table set the embedded table is fitted on the host from the values.
    vals = as_u16(x) if table is None else None
    table, cols, table_id, slot_, embedded = tiles.prepare_table(vals, shape, table, tables, slot)
    p = encode_parts(x, table, cols, rows_per_tile)
    return assemble_host(x, p, shape, cols, rows_per_tile, table_id, slot_, embedded)


def assemble_host(x, p, shape, cols, rpt, table_id, slot, embedded) -> bytes:
    """The blob from :func:`encode_parts`' device tensors (copied to the host once)."""
    vals = as_u16(x)
    counts = p["counts"].cpu().numpy().view(np.uint32).reshape(p["n_tiles"], p["nch"])
    states = p["states"].cpu().numpy().view(np.uint32).reshape(p["n_tiles"], cols)
    words = p["words"].cpu().numpy().view(np.uint16)
    esc = p["esc"].cpu().numpy()
    sums = p["sums"].cpu().numpy()
    woff = np.concatenate([[0], np.cumsum(counts.sum(1, dtype=np.int64))])
    parts = []
    for i in range(p["n_tiles"]):
        a, b = i * rpt * cols, min(p["rows"], (i + 1) * rpt) * cols
        parts.append(
            dict(
                vals=vals[a:b],
                counts=counts[i],
                states=states[i],
                words=words[woff[i] : woff[i + 1]],
                escapes=np.flatnonzero(esc[a:b]),
                mant=p["mant"][i].cpu().numpy(),
                checksum=int(sums[i]),
            )
        )
    return tiles.assemble(shape, cols, rpt, table_id, slot, embedded, parts)
