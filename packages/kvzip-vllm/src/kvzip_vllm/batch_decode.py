"""Many small kvzip-lossless blobs decoded together on the GPU: one kernel launch per table.

The tier keeps one blob per (block, layer, K/V): at vLLM's CUDA block size of 16 tokens and
Llama-8B shapes a blob holds 32 KB of bf16, and a 1,024-token prefix is 3,840 blobs. Decoding
them one by one (``kvzip_lossless.decompress``) costs per blob a header parse and decode plan
on the host (14 + 49 us measured here, 2 shared cores), a handful of small host-to-device
copies, five launches and a synchronisation. So:

- the host side of a blob's decode (header checks, chunk descriptors, tile checksums, escape
  patches: ``kvzip_lossless.gpu.decode_plan``) is computed once when a block is stored
  (:func:`plan_block`); its bulk is kept after the blobs in the entry's record, so a load
  copies it to the GPU with them;
- a load step (:class:`DecodeStep`) does per blob only a few numpy operations over all the
  step's blobs (3,840 for 64 Llama-8B blocks: 0.7 ms on 2 shared cores, against 8-15 ms when
  the host shifted every descriptor row and escape); the rows are shifted to where their blob,
  output and tile sit on the device, and each table-set slot's blobs of a block group are
  decoded by one launch of kvzip-lossless's decode kernel; tile checksums are compared on the
  GPU into one damage flag per blob, read back once per step.

The kernels, the descriptor format and the checksum are kvzip-lossless's own (``gpu.py``,
``_cuda.py``): this module only batches their launches. Blobs that embed their own table (those
stored before the table set was fitted) get a launch each, with device tables that are not
cached (kvzip-lossless's per-table cache keeps every embedded table alive).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np
import torch

import kvzip_lossless
from kvzip_lossless import blob as _blob
from kvzip_lossless import codec as _codec
from kvzip_lossless import gpu as _gpu
from kvzip_vllm.store import RECORD_ALIGN, record_tail_offset

#: The kernel reads 32-bit states at 4-aligned byte offsets and 16-bit words at even ones.
#: Blob lengths are multiples of 4 (header, tiles and embedded table are each padded to 4:
#: spec/blob.md), so blobs placed back to back from a 4-aligned start stay aligned.
ALIGN = 4
OWN_TABLE = -1  # slot code: the blob embeds its table
NO_TABLE = -2  # slot code: every tile raw, no table


#: Int32 columns of the tail's three tables (rows, tiles, escapes); see :class:`BlockPlan`.
ROW_W, TILE_W, EXC_W = 9, 3, 3


@dataclass(frozen=True)
class BlockPlan:
    """The host side of the GPU decode of one block's blobs, offsets relative to each blob.

    The bulk (one row per chunk descriptor, tile and escape: 135 KB, 7% of the blobs, for a
    60-blob Llama-8B-shaped block of the synthetic test data: 1,920 rows, 60 tiles, 5,439
    escapes) is ``tail``: int32 rows ``[R, 9]`` (kvzip_lossless.gpu.decode_plan's 8 descriptor
    fields, then the blob), tiles ``[T, 3]`` (blob, tile in blob, checksum less its escapes'
    share), escapes ``[X, 3]`` (blob, position in the blob's output, value), back to back.
    The store keeps it after the blobs in the entry's record (``tail=None`` here then), so a
    load copies blobs and plan to the GPU in one copy and shifts the plan there
    (:meth:`DecodeStep.prepare`). The host keeps per-blob counts and the raw tiles (rare).
    """

    sizes: np.ndarray  # int64 [S] blob lengths
    numel: np.ndarray  # int64 [S] values each blob decodes to
    slots: np.ndarray  # int32 [S] table-set slot, OWN_TABLE or NO_TABLE
    rows: np.ndarray  # int64 [S] descriptor rows of each blob (tail rows in blob order)
    tiles: np.ndarray  # int64 [S] coded tiles of each blob
    excs: np.ndarray  # int64 [S] escapes of each blob
    raw: np.ndarray  # int64 [k, 5] raw tiles: blob, tile, byte offset, values, output offset
    tail: np.ndarray | None = None  # int32, the layout above

    @property
    def tail_bytes(self) -> int:
        counts = ROW_W * self.rows.sum() + TILE_W * self.tiles.sum() + EXC_W * self.excs.sum()
        return 4 * int(counts)

    @property
    def host_bytes(self) -> int:
        """Host memory the plan holds besides its tail (counted against the tier's budget)."""
        small = ("sizes", "numel", "slots", "rows", "tiles", "excs", "raw")
        return sum(getattr(self, f).nbytes for f in small) + 256

    def without_tail(self) -> BlockPlan:
        return replace(self, tail=None)

    @cached_property
    def shape_key(self) -> tuple:
        """(blob lengths, values per blob if all equal else -1, record bytes): what a load
        checks an entry against (a tuple comparison: 2.8 us a block here, 9.8 us in numpy)."""
        uniform = (
            int(self.numel[0]) if len(self.numel) and (self.numel == self.numel[0]).all() else -1
        )
        blob_bytes = int(self.sizes.sum())
        return tuple(self.sizes.tolist()), uniform, record_tail_offset(blob_bytes) + self.tail_bytes


def plan_block(blobs, tables: kvzip_lossless.TableSet | None) -> BlockPlan:
    """Check each blob's header and table reference and plan their decode (CorruptBlobError if
    one is damaged, or coded with a table set other than ``tables``)."""
    rows_t, tiles_t, exc_t, raw = [], [], [], []
    sizes, numel, slots, rows, tiles, excs = [], [], [], [], [], []
    for i, blob in enumerate(blobs):
        buf = memoryview(blob).cast("B")
        if len(buf) % ALIGN:
            raise kvzip_lossless.CorruptBlobError(f"blob length {len(buf)} is not a multiple of 4")
        h = _blob.parse_header(buf)
        table = _codec.table_for(h, tables)
        if table is None:
            slots.append(NO_TABLE)
        else:
            slots.append(OWN_TABLE if h.embedded is not None else int(h.table_slot))
        desc, expect, raw_i, eidx, evals = _gpu.decode_plan(buf, h)
        if buf.nbytes >= 1 << 31 or h.numel >= 1 << 31:
            raise kvzip_lossless.CorruptBlobError("blob too large for a batched decode plan")
        desc = desc.reshape(-1, 8)
        sizes.append(len(buf))
        numel.append(h.numel)
        rows.append(len(desc))
        tiles.append(h.n_tiles)
        excs.append(len(eidx))
        rows_t.append(np.c_[desc, np.full(len(desc), i)])
        tiles_t.append(np.c_[np.full(h.n_tiles, i), np.arange(h.n_tiles), expect.view(np.int32)])
        exc_t.append(np.c_[np.full(len(eidx), i), eidx, evals.view(np.int16)])
        raw.extend((i, *r) for r in raw_i)

    def cat(parts):  # tables' rows, flattened
        return np.concatenate(parts).astype(np.int32).ravel() if parts else np.zeros(0, np.int32)

    i64 = lambda x: np.array(x, np.int64)  # noqa: E731
    return BlockPlan(
        sizes=i64(sizes),
        numel=i64(numel),
        slots=np.array(slots, np.int32),
        rows=i64(rows),
        tiles=i64(tiles),
        excs=i64(excs),
        raw=np.array(raw, np.int64).reshape(-1, 5),
        tail=np.concatenate([cat(rows_t), cat(tiles_t), cat(exc_t)]),
    )


def to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on ``device`` without blocking the host: from pageable memory a CUDA copy
    first waits for the stream's earlier work, which would serialise staging with decoding."""
    t = torch.from_numpy(np.ascontiguousarray(a))
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def _fmix(h: torch.Tensor) -> torch.Tensor:
    """kvzip-lossless's per-value checksum hash (spec/blob.md), on int64 holding uint32s."""
    h = h & 0xFFFFFFFF
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


def _table_tensors(table: kvzip_lossless.Table, device) -> tuple[torch.Tensor, ...]:
    """Device copies of a table as the decode kernels read them (kvzip_lossless.gpu's layout)."""
    return (
        to_device(table.packed().astype(np.int32), device),
        to_device(np.asarray(table.buckets, np.int32), device),
        to_device(table.base.astype(np.int32), device),
    )


def _excl(a: np.ndarray, axis: int = -1) -> np.ndarray:
    """Exclusive cumulative sum (int64)."""
    c = np.cumsum(a, axis=axis, dtype=np.int64)
    return c - a


def _segments(lens: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Segment id and position in the segment of each of ``total`` elements split into
    segments of ``lens`` (on ``lens``' device; no synchronisation: ``total`` is known)."""
    dev = lens.device
    seg = torch.repeat_interleave(torch.arange(len(lens), device=dev), lens, output_size=total)
    return seg, torch.arange(total, device=dev) - (torch.cumsum(lens, 0) - lens)[seg]


class DecodeStep:
    """One load step: ``n`` blocks of ``S`` blobs each, decoded slot-major.

    Block ``j``'s record (the store's: blobs back to back, then the plan's tail at
    ``store.record_tail_offset``) is copied to byte ``rec_base[j]`` of the device buffer
    (``total`` bytes). Item ``s * n + j`` is blob ``s`` of block ``j``; it decodes to values
    ``[item * numel, (item + 1) * numel)`` of the output (``[S, n, *block shape]``).

    The host works per blob (O(n * S) numpy: 3,840 items for 64 Llama-8B blocks); per row,
    tile and escape (122,880 rows and 348,096 escapes for those) the plan is shifted on the
    device, block group by block group (:meth:`prepare`), so each group's decode launches as
    soon as its records have arrived.
    """

    def __init__(self, plans: list[BlockPlan], blobs: list, device, tables, slot_tables: dict):
        self.n = n = len(plans)
        self.S = S = int(plans[0].sizes.size)
        if any(p.sizes.size != S for p in plans):
            raise ValueError("every block of a step must hold the same number of blobs")
        self.numel = numel = int(plans[0].numel[0])
        if any((p.numel != numel).any() for p in plans):
            raise ValueError("every blob of a step must decode to the same number of values")
        self.device, self.tables, self.slot_tables = torch.device(device), tables, slot_tables
        self.blobs = blobs  # per block, per blob: host bytes (for tables embedded in blobs)
        stack = lambda f: np.stack([getattr(p, f) for p in plans]).astype(np.int64)  # noqa: E731
        sizes, rows, tiles, excs = (stack(f) for f in ("sizes", "rows", "tiles", "excs"))
        slots = np.stack([p.slots for p in plans])  # [n, S]
        if ((slots >= 0) & (slots != np.arange(S))).any():
            raise kvzip_lossless.CorruptBlobError("blob s of a block must use table-set slot s")
        # records: blobs, tail; each placed at a multiple of RECORD_ALIGN
        tail_off = -(-sizes.sum(1) // RECORD_ALIGN) * RECORD_ALIGN
        self.R, self.T, self.X = rows.sum(1), tiles.sum(1), excs.sum(1)  # per block
        self.rec_len = tail_off + 4 * (ROW_W * self.R + TILE_W * self.T + EXC_W * self.X)
        padded = -(-self.rec_len // RECORD_ALIGN) * RECORD_ALIGN
        self.rec_base = _excl(padded)
        self.total = int(padded.sum())
        tail32 = (self.rec_base + tail_off) // 4
        # per item (slot-major): blob byte offset, first descriptor row, first tile. Rows of
        # set-table items in item order (a slot's rows over a block range are contiguous),
        # those of blobs with their own table after them.
        boff = (self.rec_base[:, None] + _excl(sizes, 1)).T.ravel()
        self.slots = slots.T.ravel()
        own = self.slots == OWN_TABLE
        rows_i = rows.T.ravel()
        self.set_rows = np.concatenate([[0], np.cumsum(np.where(own, 0, rows_i))])
        n_set = int(self.set_rows[-1])
        row0 = np.where(own, n_set + _excl(np.where(own, rows_i, 0)), self.set_rows[:-1])
        self.own = [(int(i), int(row0[i]), int(row0[i] + rows_i[i]))
                    for i in np.flatnonzero(own & (rows_i > 0))]  # fmt: skip
        self.n_rows = int(rows_i.sum())
        tile0 = _excl(tiles.T.ravel())
        self.n_tiles = int(tiles.sum())
        self.n_exc = int(self.X.sum())
        self.exc0 = np.concatenate([[0], np.cumsum(self.X)])
        self._meta = {
            "boff": boff,
            "row0": row0,
            "tile0": tile0,
            "blobrow0": _excl(rows, 1).ravel(),  # [n * S] first row of blob s in block j
            "R": self.R,
            "T": self.T,
            "X": self.X,
            "rows32": tail32,
            "tiles32": tail32 + ROW_W * self.R,
            "exc32": tail32 + ROW_W * self.R + TILE_W * self.T,
        }
        raw = [np.c_[p.raw[:, 0] * n + j, p.raw[:, 1:]] for j, p in enumerate(plans) if p.raw.size]
        raw = np.concatenate(raw) if raw else np.zeros((0, 5), np.int64)
        if len(raw):  # item, global tile, byte offset, values, output offset
            self.raw = np.c_[raw[:, 0], tile0[raw[:, 0]] + raw[:, 1], boff[raw[:, 0]] + raw[:, 2],
                             raw[:, 3], raw[:, 0] * numel + raw[:, 4]]  # fmt: skip
        else:
            self.raw = raw
        self._dev = None

    def upload(self) -> None:
        """The per-item and per-block tables to the device (one copy, on the current stream)
        and the step's plan arrays allocated there."""
        dev, m = self.device, self._meta
        flat = to_device(np.concatenate(list(m.values())), dev)
        self._dev, a = {}, 0
        for k, v in m.items():
            self._dev[k] = flat[a : a + len(v)]
            a += len(v)
        i64 = dict(dtype=torch.int64, device=dev)
        self.desc = torch.empty((self.n_rows, 8), **i64)
        self.row_item = torch.empty(self.n_rows, **i64)
        self.expect = torch.empty(self.n_tiles, dtype=torch.int32, device=dev)
        self.tile_item = torch.empty(self.n_tiles, **i64)
        self.eidx = torch.empty(self.n_exc, **i64)
        self.evals = torch.empty(self.n_exc, dtype=torch.int16, device=dev)
        self.sums = torch.zeros(self.n_tiles, dtype=torch.int32, device=dev)
        self.err = torch.zeros(max(self.n_rows, 1), dtype=torch.int32, device=dev)
        # where each row of the three tables lies (int32 units), its block, its index in the
        # block: from the counts alone, once per step (so before any record has landed)
        self._where, self._cum = {}, {}
        for lens, start, width in (("R", "rows32", ROW_W), ("T", "tiles32", TILE_W),
                                   ("X", "exc32", EXC_W)):  # fmt: skip
            counts = getattr(self, lens)
            self._cum[lens] = np.concatenate([[0], np.cumsum(counts)])
            seg, pos = _segments(self._dev[lens], int(counts.sum()))
            self._where[lens] = (self._dev[start][seg] + pos * width, seg, pos)

    def _table(self, j0: int, j1: int, b32, lens: str, width: int):
        """Rows of one of the tails' tables, blocks ``[j0, j1)``: int64 ``[rows, width]``, the
        block of each row and the row's index in its block."""
        cum = self._cum[lens]
        a, b = int(cum[j0]), int(cum[j1])
        at, j, pos = (x[a:b] for x in self._where[lens])
        cols = torch.arange(width, device=self.device)
        return b32[at[:, None] + cols].to(torch.int64), j, pos

    def prepare(self, j0: int, j1: int, blob_dev: torch.Tensor) -> None:
        """Shift the plans of blocks ``[j0, j1)`` (their records on ``blob_dev`` already) to
        where their blobs, outputs and tiles sit in the step (on the current stream)."""
        d, n, S, numel = self._dev, self.n, self.S, self.numel
        b32 = blob_dev.view(torch.int32)
        t, j, pos = self._table(j0, j1, b32, "R", ROW_W)
        if len(t):
            s = t[:, 8]
            item = s * n + j
            dst = d["row0"][item] + pos - d["blobrow0"][j * S + s]
            desc, boff = t[:, :8], d["boff"][item]
            desc[:, 0] += boff // 4  # state offset, 32-bit units
            desc[:, 1] += boff // 2  # word offset, 16-bit units
            desc[:, 3] += boff  # mantissa offset, bytes
            desc[:, 4] += item * numel  # output offset, values
            desc[:, 7] += d["tile0"][item]  # tile index into the step's checksum array
            self.desc[dst] = desc
            self.row_item[dst] = item
        t, j, _ = self._table(j0, j1, b32, "T", TILE_W)
        if len(t):
            item = t[:, 0] * n + j
            gt = d["tile0"][item] + t[:, 1]
            self.expect[gt] = t[:, 2].to(torch.int32)
            self.tile_item[gt] = item
        t, j, _ = self._table(j0, j1, b32, "X", EXC_W)
        if len(t):
            x0, x1 = int(self.exc0[j0]), int(self.exc0[j1])
            self.eidx[x0:x1] = t[:, 1] + (t[:, 0] * n + j) * numel
            self.evals[x0:x1] = t[:, 2].to(torch.int16)

    def decode(self, j0: int, j1: int, blob_dev: torch.Tensor, out: torch.Tensor) -> None:
        """Launch the decode of blocks ``[j0, j1)``, one launch per table-set slot (and one per
        blob that embeds its table), on the current stream (after :meth:`prepare`)."""
        o16, n = out.view(-1).view(torch.int16), self.n
        for s in range(self.S):
            r0, r1 = int(self.set_rows[s * n + j0]), int(self.set_rows[s * n + j1])
            if r1 > r0:
                if s not in self.slot_tables:
                    self.slot_tables[s] = _table_tensors(self.tables.tables[s], self.device)
                table = self.tables.tables[s]
                _launch(blob_dev, self.desc[r0:r1], self.slot_tables[s], table, o16, self.sums,
                        self.err[r0:])  # fmt: skip
        for item, r0, r1 in self.own:
            if j0 <= item % n < j1:
                blob = self.blobs[item % n][item // n]
                table = _codec.table_for(_blob.parse_header(memoryview(blob).cast("B")), None)
                _launch(blob_dev, self.desc[r0:r1], _table_tensors(table, self.device), table,
                        o16, self.sums, self.err[r0:])  # fmt: skip

    def finish(self, blob_dev: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """After every block's decode: raw tiles, escapes, checks. Returns int32 ``[S * n]`` on
        the device, nonzero where an item failed (its output is then unspecified)."""
        o16, dev = out.view(-1).view(torch.int16), self.device
        if len(self.raw):
            self._raw_tiles(blob_dev, o16)
        if self.n_exc:
            o16[self.eidx] = self.evals
        bad = torch.zeros(self.S * self.n, dtype=torch.int32, device=dev)
        if self.n_rows:
            bad.index_add_(0, self.row_item, self.err[: self.n_rows])
        bad.index_add_(0, self.tile_item, (self.sums != self.expect).to(torch.int32))
        return bad

    def _raw_tiles(self, blob_dev, o16) -> None:
        """Tiles stored raw: copied and checksummed in one pass for all of them (kvzip-lossless
        does it tile by tile)."""
        dev = self.device
        src, dst, tiles, lens_d = (to_device(self.raw[:, c], dev) for c in (2, 4, 1, 3))
        seg, pos = _segments(lens_d, int(self.raw[:, 3].sum()))
        vals = blob_dev.view(torch.int16)[src[seg] // 2 + pos]
        o16[dst[seg] + pos] = vals
        s = torch.zeros(len(self.raw), dtype=torch.int64, device=dev)
        s.index_add_(0, seg, _fmix(pos * 0x9E3779B1 + (vals.to(torch.int64) & 0xFFFF)))
        s &= 0xFFFFFFFF
        self.sums[tiles] = torch.where(s >= 1 << 31, s - (1 << 32), s).to(torch.int32)


def _launch(blob_dev, desc, tabs, table, o16, sums, err) -> None:
    backend = _gpu.default_backend(blob_dev.device)
    _gpu.launch_decode(backend, blob_dev, desc, tabs, table, table.columns, o16, sums, err)
