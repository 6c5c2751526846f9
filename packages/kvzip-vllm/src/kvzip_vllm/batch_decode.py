"""Many small kvzip-lossless blobs decoded together on the GPU: one kernel launch per table.

The tier keeps one blob per (block, layer, K/V): at vLLM's CUDA block size of 16 tokens and
Llama-8B shapes a blob holds 32 KB of bf16, and a 1,024-token prefix is 3,840 blobs. Decoding
them one by one (``kvzip_lossless.decompress``) costs per blob a header parse and decode plan
on the host (14 + 49 us measured here, 2 shared cores), a handful of small host-to-device
copies, five launches and a synchronisation: about a second for that prefix, against 2.3 ms
for a pinned copy of its raw bytes. So:

- the host side of a blob's decode (header checks, chunk descriptors, tile checksums, escape
  patches: ``kvzip_lossless.gpu.decode_plan``) is computed once when the blob is stored
  (:func:`plan_blob`, kept beside the blob) and reused at every load;
- at load, the blobs sharing a table (the same slot of the per-model table set: one layer's
  K or V, every block) are decoded by one launch of kvzip-lossless's decode kernel, their
  descriptors shifted to where each blob sits in one device staging buffer and where its output
  goes; the checksums of every tile are compared on the GPU into one flag per blob, read back
  once per step.

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

# Offsets inside a staged blob are in bytes; the kernel reads 32-bit states at 4-aligned
# addresses and 16-bit words at even ones. Blob lengths are multiples of 4 (header, tiles and
# embedded table are each padded to 4: spec/blob.md), so blobs placed back to back stay aligned.
ALIGN = 4


@dataclass(frozen=True)
class BlobPlan:
    """The host side of one blob's GPU decode, with offsets relative to the blob itself."""

    nbytes: int  # the blob's length
    numel: int  # bf16 values it decodes to
    slot: int | None  # slot in the table set; None when the blob embeds its table
    desc: np.ndarray  # int32 [chunks, 8]: kvzip_lossless.gpu.decode_plan's chunk descriptors
    expect: np.ndarray  # int32 [tiles]: each tile's checksum less its escapes' share
    raw: tuple[tuple[int, int, int, int], ...]  # raw tiles: (tile, byte offset, values, out offset)
    eidx: np.ndarray  # int32 escape positions in the output
    evals: np.ndarray  # int16 escape values

    @property
    def n_tiles(self) -> int:
        return int(self.expect.size)

    @property
    def host_bytes(self) -> int:
        """Memory the plan holds (counted against the tier's budget beside the blob)."""
        return self.desc.nbytes + self.expect.nbytes + self.eidx.nbytes + self.evals.nbytes + 64


def plan_blob(blob, tables: kvzip_lossless.TableSet | None) -> BlobPlan:
    """Check a blob's header and table reference and plan its decode (CorruptBlobError if
    damaged, or coded with a table set other than ``tables``)."""
    buf = memoryview(blob).cast("B")
    if len(buf) % ALIGN:
        raise kvzip_lossless.CorruptBlobError(f"blob length {len(buf)} is not a multiple of 4")
    h = _blob.parse_header(buf)
    table = _codec.table_for(h, tables)
    if table is None:  # every tile raw: no table needed
        slot = -1
    else:
        slot = None if h.embedded is not None else int(h.table_slot)
    desc, expect, raw, eidx, evals = _gpu.decode_plan(buf, h)
    if desc.size and int(np.abs(desc).max()) >= 1 << 31:
        raise kvzip_lossless.CorruptBlobError("blob too large for a batched decode plan")
    return BlobPlan(
        nbytes=len(buf),
        numel=h.numel,
        slot=slot,
        desc=desc.astype(np.int32).reshape(-1, 8),
        expect=expect.view(np.int32).copy(),
        raw=tuple((int(t), int(o), int(n), int(oo)) for t, o, n, oo in raw),
        eidx=eidx.astype(np.int32),
        evals=evals.view(np.int16).copy(),
    )


def _to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on ``device`` without blocking the host: from pageable memory a CUDA copy
    first waits for the stream's earlier work, which would serialise staging with decoding."""
    t = torch.from_numpy(np.ascontiguousarray(a))
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def _table_tensors(table: kvzip_lossless.Table, device) -> tuple[torch.Tensor, ...]:
    """Device copies of a table as the decode kernels read them (kvzip_lossless.gpu's layout)."""
    return (
        _to_device(table.packed().astype(np.int32), device),
        _to_device(np.asarray(table.buckets, np.int32), device),
        _to_device(table.base.astype(np.int32), device),
    )


class BatchDecoder:
    """Decodes a list of planned blobs staged in one device buffer, one launch per table.

    ``tables`` is the per-model table set (its device tables are cached per slot); blobs that
    embed a table are re-read from ``blobs`` for it.
    """

    def __init__(self, device, tables: kvzip_lossless.TableSet | None, backend: str | None = None):
        self.device = torch.device(device)
        self.tables = tables
        self.backend = backend or _gpu.default_backend(self.device)
        self._slot_tabs: dict[int, tuple[torch.Tensor, ...]] = {}

    def _tabs(self, slot: int) -> tuple[torch.Tensor, ...]:
        if slot not in self._slot_tabs:
            self._slot_tabs[slot] = _table_tensors(self.tables.tables[slot], self.device)
        return self._slot_tabs[slot]

    def run(
        self,
        plans: list[BlobPlan],
        offsets: np.ndarray,
        blob_dev: torch.Tensor,
        out: torch.Tensor,
        out_offsets: np.ndarray,
        blobs=None,
    ) -> torch.Tensor:
        """Decode blob ``i`` (staged at byte ``offsets[i]`` of ``blob_dev``, uint8) into the
        flat bf16 ``out`` at value ``out_offsets[i]``, on the current stream.

        Returns int32 ``[len(plans)]`` on the device, nonzero where a blob failed its checks
        (its output is then unspecified); nothing is synchronised. ``blobs[i]`` (host bytes)
        is needed only for blobs that embed their table.
        """
        n = len(plans)
        bad = torch.zeros(n, dtype=torch.int32, device=self.device)
        if n == 0:
            return bad
        o16 = out.view(-1).view(torch.int16)
        tiles = np.array([p.n_tiles for p in plans], np.int64)
        tile0 = np.concatenate([[0], np.cumsum(tiles)])
        sums = torch.zeros(int(tile0[-1]), dtype=torch.int32, device=self.device)
        expect = np.concatenate([p.expect for p in plans])
        tile_item = np.repeat(np.arange(n), tiles)
        # group blobs by table: a launch per set slot, one per embedded table
        groups: dict[object, list[int]] = {}
        for i, p in enumerate(plans):
            if p.desc.shape[0]:
                groups.setdefault(p.slot if p.slot is not None else ("own", i), []).append(i)
        descs, chunk_items, launches = [], [], []
        row = 0
        for key, items in groups.items():
            d = np.concatenate([plans[i].desc for i in items]).astype(np.int64)
            counts = np.array([plans[i].desc.shape[0] for i in items])
            base = np.repeat(np.asarray(offsets[items], np.int64), counts)
            d[:, 0] += base // 4  # state offset, 32-bit units
            d[:, 1] += base // 2  # word offset, 16-bit units
            d[:, 3] += base  # mantissa offset, bytes
            d[:, 4] += np.repeat(np.asarray(out_offsets[items], np.int64), counts)  # values
            d[:, 7] += np.repeat(tile0[items], counts)  # tile index into the step's checksums
            descs.append(d)
            chunk_items.append(np.repeat(np.asarray(items, np.int64), counts))
            launches.append((key, row, d.shape[0]))
            row += d.shape[0]
        err = torch.zeros(max(row, 1), dtype=torch.int32, device=self.device)
        if row:
            desc_dev = _to_device(np.concatenate(descs), self.device)
            for key, r0, nch in launches:
                if isinstance(key, tuple):
                    table = _codec.table_for(_blob.parse_header(memoryview(blobs[key[1]])), None)
                    tabs = _table_tensors(table, self.device)
                else:
                    table = self.tables.tables[key]
                    tabs = self._tabs(key)
                self._launch(
                    blob_dev, desc_dev[r0 : r0 + nch], nch, tabs, table, o16, sums, err[r0:]
                )
            bad.index_add_(0, _to_device(np.concatenate(chunk_items), self.device), err[:row])
        for i, p in enumerate(plans):
            for ti, o, nv, out_off in p.raw:
                a = int(offsets[i]) + o
                seg = blob_dev[a : a + 2 * nv].view(torch.int16)
                b = int(out_offsets[i]) + out_off
                o16[b : b + nv] = seg
                sums[int(tile0[i]) + ti] = _gpu._gpu_checksum(seg).to(torch.int32)
        with_exc = [i for i, p in enumerate(plans) if p.eidx.size]
        if with_exc:
            eidx = np.concatenate(
                [plans[i].eidx.astype(np.int64) + out_offsets[i] for i in with_exc]
            )
            evals = np.concatenate([plans[i].evals for i in with_exc])
            o16[_to_device(eidx, self.device)] = _to_device(evals, self.device)
        mismatch = (sums != _to_device(expect, self.device)).to(torch.int32)
        bad.index_add_(0, _to_device(tile_item, self.device), mismatch)
        return bad

    def _launch(self, blob_dev, desc, nch, tabs, table, o16, sums, err) -> None:
        tab, bmap, base = tabs
        if self.backend == "cuda":
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
