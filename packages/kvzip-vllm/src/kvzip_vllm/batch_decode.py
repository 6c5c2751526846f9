"""Many small kvzip-lossless blobs decoded together on the GPU: one kernel launch per table.

The tier keeps one blob per (block, layer, K/V): at vLLM's CUDA block size of 16 tokens and
Llama-8B shapes a blob holds 32 KB of bf16, and a 1,024-token prefix is 3,840 blobs. Decoding
them one by one (``kvzip_lossless.decompress``) costs per blob a header parse and decode plan
on the host (14 + 49 us measured here, 2 shared cores), a handful of small host-to-device
copies, five launches and a synchronisation. So:

- the host side of a blob's decode (header checks, chunk descriptors, tile checksums, escape
  patches: ``kvzip_lossless.gpu.decode_plan``) is computed once when a block is stored
  (:func:`plan_block`, kept beside its blobs) and reused at every load;
- a load step (:class:`DecodeStep`) stages the blobs slot-major (layer 0 K of every block, then
  layer 0 V, ...), shifts every chunk descriptor to where its blob and output sit with a few
  numpy operations over all of them, and decodes each table-set slot's blobs, every block, by
  one launch of kvzip-lossless's decode kernel; tile checksums are compared on the GPU into one
  damage flag per blob, read back once per step.

The kernels, the descriptor format and the checksum are kvzip-lossless's own (``gpu.py``,
``_cuda.py``): this module only batches their launches. Blobs that embed their own table (those
stored before the table set was fitted) get a launch each, with device tables that are not
cached (kvzip-lossless's per-table cache keeps every embedded table alive).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

import kvzip_lossless
from kvzip_lossless import blob as _blob
from kvzip_lossless import codec as _codec
from kvzip_lossless import gpu as _gpu

#: The kernel reads 32-bit states at 4-aligned byte offsets and 16-bit words at even ones.
#: Blob lengths are multiples of 4 (header, tiles and embedded table are each padded to 4:
#: spec/blob.md), so blobs placed back to back from a 4-aligned start stay aligned.
ALIGN = 4
OWN_TABLE = -1  # slot code: the blob embeds its table
NO_TABLE = -2  # slot code: every tile raw, no table


@dataclass(frozen=True)
class BlockPlan:
    """The host side of the GPU decode of one block's blobs, offsets relative to each blob."""

    sizes: np.ndarray  # int64 [S] blob lengths
    numel: np.ndarray  # int64 [S] values each blob decodes to
    slots: np.ndarray  # int32 [S] table-set slot, OWN_TABLE or NO_TABLE
    desc: np.ndarray  # int32 [R, 8] kvzip_lossless.gpu.decode_plan's chunk descriptors
    row_blob: np.ndarray  # int32 [R] the blob of each descriptor
    tile_blob: np.ndarray  # int32 [T] the blob of each tile
    tile_local: np.ndarray  # int32 [T] the tile's index in its blob
    expect: np.ndarray  # int32 [T] each tile's checksum less its escapes' share
    exc_blob: np.ndarray  # int32 [X]
    eidx: np.ndarray  # int32 [X] escape positions in their blob's output
    evals: np.ndarray  # int16 [X] escape values
    raw: np.ndarray  # int64 [k, 5] raw tiles: blob, tile, byte offset, values, output offset

    @property
    def host_bytes(self) -> int:
        """Memory the plan holds (counted against the tier's budget beside the blobs)."""
        return sum(getattr(self, f).nbytes for f in self.__dataclass_fields__) + 256


def plan_block(blobs, tables: kvzip_lossless.TableSet | None) -> BlockPlan:
    """Check each blob's header and table reference and plan their decode (CorruptBlobError if
    one is damaged, or coded with a table set other than ``tables``)."""
    parts = {k: [] for k in ("desc", "row", "tb", "tl", "exp", "xb", "ei", "ev", "raw")}
    sizes, numel, slots = [], [], []
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
        desc, expect, raw, eidx, evals = _gpu.decode_plan(buf, h)
        if buf.nbytes >= 1 << 31 or h.numel >= 1 << 31:
            raise kvzip_lossless.CorruptBlobError("blob too large for a batched decode plan")
        sizes.append(len(buf))
        numel.append(h.numel)
        parts["desc"].append(desc.reshape(-1, 8))
        parts["row"].append(np.full(len(desc), i))
        parts["tb"].append(np.full(h.n_tiles, i))
        parts["tl"].append(np.arange(h.n_tiles))
        parts["exp"].append(expect.view(np.int32))
        parts["xb"].append(np.full(len(eidx), i))
        parts["ei"].append(eidx)
        parts["ev"].append(evals.view(np.int16))
        parts["raw"].extend((i, *r) for r in raw)

    def cat(k, dt):
        return np.concatenate(parts[k]).astype(dt) if parts[k] else np.zeros(0, dt)

    return BlockPlan(
        sizes=np.array(sizes, np.int64),
        numel=np.array(numel, np.int64),
        slots=np.array(slots, np.int32),
        desc=cat("desc", np.int32).reshape(-1, 8),
        row_blob=cat("row", np.int32),
        tile_blob=cat("tb", np.int32),
        tile_local=cat("tl", np.int32),
        expect=cat("exp", np.int32),
        exc_blob=cat("xb", np.int32),
        eidx=cat("ei", np.int32),
        evals=cat("ev", np.int16),
        raw=np.array(parts["raw"], np.int64).reshape(-1, 5),
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


class DecodeStep:
    """One load step: ``n`` blocks of ``S`` blobs each, staged and decoded slot-major.

    Item ``s * n + j`` is blob ``s`` of block ``j``; it sits at byte ``offsets[item]`` of the
    staging buffer and decodes to values ``[item * numel, (item + 1) * numel)`` of the output
    (``[S, n, *block shape]`` when every blob holds ``numel`` values).
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
        self.sizes = np.stack([p.sizes for p in plans]).T.ravel()  # per item
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)])
        self.total = -(-int(self.offsets[-1]) // ALIGN) * ALIGN
        slots = np.stack([p.slots for p in plans]).T.ravel()
        if ((slots >= 0) & (slots != np.arange(S * n) // n)).any():
            raise kvzip_lossless.CorruptBlobError("blob s of a block must use table-set slot s")
        tiles = np.stack([np.bincount(p.tile_blob, minlength=S) for p in plans]).T.ravel()
        tile0 = np.concatenate([[0], np.cumsum(tiles)])
        self.n_tiles = int(tile0[-1])

        def items(per_plan: str) -> np.ndarray:  # item of each row/tile/escape, all blocks
            return np.concatenate([getattr(p, per_plan) * n + j for j, p in enumerate(plans)])

        # chunk descriptors, shifted; set-table rows sorted by item (so a slot's rows are
        # contiguous), rows of blobs with their own table after them
        item = items("row_blob").astype(np.int64)
        d = np.concatenate([p.desc for p in plans]).astype(np.int64)
        base = self.offsets[item]
        d[:, 0] += base // 4  # state offset, 32-bit units
        d[:, 1] += base // 2  # word offset, 16-bit units
        d[:, 3] += base  # mantissa offset, bytes
        d[:, 4] += item * numel  # output offset, values
        d[:, 7] += tile0[item]  # tile index into the step's checksum array
        own = slots[item] == OWN_TABLE
        order = np.argsort(np.where(own, S * n + item, item), kind="stable")
        self.desc, self.row_item = d[order], item[order]
        n_set = int((~own).sum())
        self.slot_rows = np.searchsorted(self.row_item[:n_set], np.arange(S + 1) * n)
        own_items, own_start = np.unique(self.row_item[n_set:], return_index=True)
        self.own = list(zip(own_items.tolist(), (own_start + n_set).tolist(), strict=True))
        self.own_end = len(order)
        # tiles, escapes, raw tiles
        t_item = items("tile_blob").astype(np.int64)
        gt = tile0[t_item] + np.concatenate([p.tile_local for p in plans])
        self.expect = np.empty(self.n_tiles, np.int32)
        self.expect[gt] = np.concatenate([p.expect for p in plans])
        self.tile_item = np.empty(self.n_tiles, np.int64)
        self.tile_item[gt] = t_item
        x_item = items("exc_blob").astype(np.int64)
        self.eidx = np.concatenate([p.eidx for p in plans]).astype(np.int64) + x_item * numel
        self.evals = np.concatenate([p.evals for p in plans])
        raw = [np.c_[p.raw[:, 0] * n + j, p.raw[:, 1:]] for j, p in enumerate(plans) if p.raw.size]
        self.raw = np.concatenate(raw) if raw else np.zeros((0, 5), np.int64)
        self.slots = slots
        self._dev = None

    def fill(self, host: np.ndarray, i0: int, i1: int) -> tuple[int, int]:
        """Copy items ``[i0, i1)`` into the staging buffer ``host``; returns their byte range."""
        for i in range(i0, i1):
            a = int(self.offsets[i])
            blob = self.blobs[i % self.n][i // self.n]
            host[a : a + self.sizes[i]] = np.frombuffer(blob, np.uint8)
        return int(self.offsets[i0]), int(self.offsets[i1])

    def upload(self) -> None:
        """Descriptors and checks to the device (on the current stream)."""
        dev = self.device
        self._dev = {
            k: to_device(getattr(self, k), dev)
            for k in ("desc", "row_item", "expect", "tile_item", "eidx", "evals")
        }
        self.sums = torch.zeros(self.n_tiles, dtype=torch.int32, device=dev)
        self.err = torch.zeros(max(len(self.desc), 1), dtype=torch.int32, device=dev)

    def decode(self, s0: int, s1: int, blob_dev: torch.Tensor, out: torch.Tensor) -> None:
        """Launch the decode of slots ``[s0, s1)`` (every block), on the current stream."""
        o16 = out.view(-1).view(torch.int16)
        desc = self._dev["desc"]
        for s in range(s0, s1):
            r0, r1 = int(self.slot_rows[s]), int(self.slot_rows[s + 1])
            if r1 > r0:
                key = s
                if key not in self.slot_tables:
                    self.slot_tables[key] = _table_tensors(self.tables.tables[key], self.device)
                table = self.tables.tables[key]
                _launch(blob_dev, desc[r0:r1], self.slot_tables[key], table, o16, self.sums,
                        self.err[r0:])  # fmt: skip
        for k, (item, r0) in enumerate(self.own):
            if s0 * self.n <= item < s1 * self.n:
                r1 = self.own[k + 1][1] if k + 1 < len(self.own) else self.own_end
                blob = self.blobs[item % self.n][item // self.n]
                table = _codec.table_for(_blob.parse_header(memoryview(blob)), None)
                _launch(blob_dev, desc[r0:r1], _table_tensors(table, self.device), table, o16,
                        self.sums, self.err[r0:])  # fmt: skip

    def finish(self, blob_dev: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """After every slot's decode: raw tiles, escapes, checks. Returns int32 ``[S * n]`` on
        the device, nonzero where an item failed (its output is then unspecified)."""
        o16, dev, d = out.view(-1).view(torch.int16), self.device, self._dev
        if len(self.raw):
            self._raw_tiles(blob_dev, o16)
        if len(self.eidx):
            o16[d["eidx"]] = d["evals"]
        bad = torch.zeros(self.S * self.n, dtype=torch.int32, device=dev)
        if len(self.desc):
            bad.index_add_(0, d["row_item"], self.err[: len(self.desc)])
        bad.index_add_(0, d["tile_item"], (self.sums != d["expect"]).to(torch.int32))
        return bad

    def _raw_tiles(self, blob_dev, o16) -> None:
        """Tiles stored raw: copied and checksummed in one pass for all of them (kvzip-lossless
        does it tile by tile)."""
        dev, r = self.device, self.raw
        item, tile, byte, lens, out_off = r.T
        src = to_device(self.offsets[item] + byte, dev)
        dst = to_device(item * self.numel + out_off, dev)
        tiles = to_device(self.expect_index(item, tile), dev)
        lens_d = to_device(lens, dev)
        total = int(lens.sum())
        seg = torch.repeat_interleave(torch.arange(len(r), device=dev), lens_d, output_size=total)
        pos = torch.arange(total, device=dev) - (torch.cumsum(lens_d, 0) - lens_d)[seg]
        vals = blob_dev.view(torch.int16)[src[seg] // 2 + pos]
        o16[dst[seg] + pos] = vals
        s = torch.zeros(len(r), dtype=torch.int64, device=dev)
        s.index_add_(0, seg, _fmix(pos * 0x9E3779B1 + (vals.to(torch.int64) & 0xFFFF)))
        s &= 0xFFFFFFFF
        self.sums[tiles] = torch.where(s >= 1 << 31, s - (1 << 32), s).to(torch.int32)

    def expect_index(self, item: np.ndarray, tile: np.ndarray) -> np.ndarray:
        """Global tile index of (item, tile in the blob)."""
        tiles = np.bincount(self.tile_item, minlength=self.S * self.n)
        return (np.cumsum(tiles) - tiles)[item] + tile


def _launch(blob_dev, desc, tabs, table, o16, sums, err) -> None:
    tab, bmap, base = tabs
    nch = desc.shape[0]
    if _gpu.default_backend(blob_dev.device) == "cuda":
        from kvzip_lossless import _cuda

        _cuda.decode(blob_dev, desc, nch, tab, bmap, base, table.columns, table.n_buckets,
                     o16, sums, err)  # fmt: skip
    else:
        _gpu._decode_kernel[(nch,)](
            blob_dev,
            blob_dev.view(torch.int16),
            blob_dev.view(torch.int32),
            tab,
            bmap,
            base,
            desc,
            o16,
            sums,
            err,
            table.columns,
            table.n_buckets,
            num_warps=1,
        )
