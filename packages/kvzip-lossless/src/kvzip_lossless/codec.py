"""compress / decompress: validation, tiling, raw fallback, and dispatch to the CPU or GPU coder."""

from __future__ import annotations

import math
import zlib

import numpy as np
import torch

from kvzip_lossless import _cpu
from kvzip_lossless.blob import (
    MODE_RANS,
    MODE_RAW,
    CorruptBlobError,
    Header,
    choose_columns,
    load_embedded,
    pack_header,
    pad4,
    parse_header,
    tile_layout,
)
from kvzip_lossless.tables import BUCKETS_NONE, Table, TableSet, fit_table

#: Rows per tile. Each lane pays a 4-byte final state per tile: 1,024 rows keep that at
#: 0.4% of a tile of ~10-bit values while leaving ~10^4+ lanes for a GPU on a 131k context.
ROWS_PER_TILE = 1024


def coder(device="cpu") -> str:
    """Which coder :func:`compress` / :func:`decompress` run for tensors on ``device``:
    ``"cuda"`` (the CUDA C coder, built for that GPU), ``"triton"``, or on the CPU ``"numpy"``.
    On CUDA the choice is logged (logger ``kvzip_lossless``) with its reason."""
    dev = torch.device(device)
    if dev.type == "cuda":
        from kvzip_lossless import gpu

        if gpu.available():
            return gpu.default_backend(dev)
    return "numpy"


def _as_u16(x: torch.Tensor) -> np.ndarray:
    return x.detach().contiguous().cpu().view(torch.int16).numpy().view(np.uint16).ravel()


def _check_input(x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor of dtype bfloat16, got {type(x).__name__}")
    if x.dtype != torch.bfloat16:
        raise ValueError(
            f"x must be bfloat16, got {x.dtype} with shape {tuple(x.shape)}; "
            "kvzip-lossless codes the bf16 KV cache only"
        )
    if x.dim() > 8:
        raise ValueError(
            f"x has {x.dim()} dimensions (shape {tuple(x.shape)}); at most 8 supported"
        )


def _resolve_table(tables: TableSet | None, slot: int | None, shape, numel: int):
    if tables is None:
        return None
    if not isinstance(tables, TableSet):
        raise TypeError(f"tables must be a kvzip_lossless.TableSet, got {type(tables).__name__}")
    if slot is None or not 0 <= slot < len(tables):
        raise ValueError(f"slot must be in [0, {len(tables)}) for this table set, got {slot}")
    t = tables.tables[slot]
    if numel % t.columns:
        raise ValueError(
            f"x of shape {tuple(shape)} ({numel} values) is not a whole number of "
            f"rows of the table's {t.columns} columns (slot {slot})"
        )
    return t


def plan_tiles(rows: int, rpt: int) -> list[tuple[int, int, int]]:
    """Batches of equal-height tiles: (first tile, number of tiles, rows each)."""
    full, last = divmod(rows, rpt)
    out = [(0, full, rpt)] if full else []
    if last:
        out.append((full, 1, last))
    return out


def compress(
    x: torch.Tensor,
    *,
    tables: TableSet | None = None,
    slot: int | None = None,
    rows_per_tile: int = ROWS_PER_TILE,
) -> bytes:
    """Compress a bf16 tensor of any shape (CPU or CUDA) into a self-describing blob.

    With ``tables`` (a per-model :class:`TableSet`) and ``slot`` (``kv_slot(layer, kind)``) the
    blob references the set by id; without, it fits and embeds its own table (one context per
    column, no previous-row context). CUDA tensors are coded on the GPU (same bytes).
    """
    _check_input(x)
    shape = tuple(int(s) for s in x.shape)
    numel = math.prod(shape)
    table = _resolve_table(tables, slot, shape, numel)
    if x.is_cuda and numel:
        from kvzip_lossless import gpu

        if gpu.available():
            return gpu.compress(x, tables=tables, slot=slot, rows_per_tile=rows_per_tile)
    vals = _as_u16(x)
    return compress_u16(vals, shape, table, tables, slot, rows_per_tile)


def prepare_table(vals, shape, table, tables, slot):
    """(table, columns, table_id, slot, embedded bytes) for a blob."""
    if table is not None:
        return table, table.columns, tables.table_id, slot, None
    cols = choose_columns(shape)
    table = (
        fit_table([vals.reshape(-1, cols)], BUCKETS_NONE)
        if vals.size
        else Table(np.zeros(cols, np.uint8), BUCKETS_NONE, np.full((cols, 1, 32), 128, np.uint16))
    )
    return table, cols, table.table_id(), 0, zlib.compress(table.to_bytes(), 9)


def compress_u16(vals, shape, table, tables, slot, rows_per_tile=ROWS_PER_TILE) -> bytes:
    if not 1 <= rows_per_tile < 1 << 31:
        raise ValueError(f"rows_per_tile must be a positive int32, got {rows_per_tile}")
    table, cols, table_id, slot_, embedded = prepare_table(vals, shape, table, tables, slot)
    rows = vals.size // cols
    parts = []
    for t0, nt, nr in plan_tiles(rows, rows_per_tile):
        tv = vals[t0 * rows_per_tile * cols :][: nt * nr * cols].reshape(nt, nr, cols)
        enc = _cpu.encode_tiles(tv, table)
        offs = np.concatenate([[0], np.cumsum(enc["counts"].sum(1, dtype=np.int64))])
        for i in range(nt):
            parts.append(
                dict(
                    vals=tv[i].ravel(),
                    counts=enc["counts"][i],
                    states=enc["states"][i],
                    words=enc["words"][offs[i] : offs[i + 1]],
                    escapes=np.flatnonzero(enc["escapes"][i]),
                    mant=enc["mant"][i],
                    checksum=int(enc["checksum"][i]),
                )
            )
    return assemble(shape, cols, rows_per_tile, table_id, slot_, embedded, parts)


def assemble(shape, cols, rows_per_tile, table_id, slot, embedded, parts) -> bytes:
    """Blob bytes from per-tile coder output (shared by the CPU and GPU encoders)."""
    tiles: list[bytes] = []
    modes, n_exc, checks = [], [], []
    for p in parts:
        flat, words = p["vals"], p["words"]
        idx = np.asarray(p["escapes"]).astype("<u4")
        lay = tile_layout(flat.size, cols, idx.size)
        body = bytearray(lay["words"] + 2 * words.size)
        body[0 : lay["states"]] = np.asarray(p["counts"]).astype("<u4").tobytes()
        body[lay["states"] : lay["exc_idx"]] = np.asarray(p["states"]).astype("<u4").tobytes()
        body[lay["exc_idx"] : lay["exc_val"]] = idx.tobytes()
        body[lay["exc_val"] : lay["mant"]] = flat[idx].astype("<u2").tobytes()
        mant = np.asarray(p["mant"]).tobytes()
        body[lay["mant"] : lay["mant"] + len(mant)] = mant
        body[lay["words"] :] = words.astype("<u2").tobytes()
        if len(body) >= 2 * flat.size:  # raw fallback: the tile does not shrink
            body, mode, ne = bytearray(flat.astype("<u2").tobytes()), MODE_RAW, 0
        else:
            mode, ne = MODE_RANS, idx.size
        body += b"\0" * (pad4(len(body)) - len(body))
        tiles.append(bytes(body))
        modes.append(mode)
        n_exc.append(ne)
        checks.append(p["checksum"])
    if embedded is not None and all(m == MODE_RAW for m in modes):
        embedded, table_id, slot = None, 0, 0  # no table needed: table id 0 (spec 2)
    head = pack_header(
        shape,
        cols,
        rows_per_tile,
        table_id,
        slot,
        embedded,
        [len(t) for t in tiles],
        modes,
        n_exc,
        checks,
    )
    return head + b"".join(tiles)


def table_for(h: Header, tables: TableSet | None) -> Table | None:
    if h.embedded is None and h.table_id == 0:
        if (h.modes != MODE_RAW).any():
            raise CorruptBlobError("blob has coded tiles but no table (table id 0)")
        return None
    if h.embedded is not None:
        return load_embedded(h)
    if tables is None:
        raise CorruptBlobError(
            f"blob was coded with table set {h.table_id:016x}; pass it as "
            "decompress(..., tables=...)"
        )
    if tables.table_id != h.table_id:
        raise CorruptBlobError(
            f"blob was coded with table set {h.table_id:016x}, got table set {tables.table_id:016x}"
        )
    if h.table_slot >= len(tables) or tables.tables[h.table_slot].columns != h.columns:
        raise CorruptBlobError(
            f"blob's table slot {h.table_slot} / {h.columns} columns do not exist in its table set"
        )
    return tables.tables[h.table_slot]


def decode_u16(buf: memoryview, h: Header, table: Table) -> np.ndarray:
    """Decode every tile on the CPU and verify each checksum; returns the values (uint16)."""
    cols = h.columns
    out = np.empty(h.numel, np.uint16)
    offs = h.offsets()
    arr = np.frombuffer(buf, np.uint8)
    for t0, nt, nr in plan_tiles(h.rows, h.rows_per_tile):
        nv = nr * cols
        rans = [t0 + i for i in range(nt) if h.modes[t0 + i] == MODE_RANS]
        for ti in range(t0, t0 + nt):
            if h.modes[ti] == MODE_RAW:
                if h.lengths[ti] != pad4(2 * nv):
                    raise CorruptBlobError(
                        f"raw tile {ti}: length {h.lengths[ti]} != {pad4(2 * nv)}"
                    )
                out[ti * h.rows_per_tile * cols :][:nv] = arr[offs[ti] : offs[ti] + 2 * nv].view(
                    "<u2"
                )
        if rans:
            _decode_rans_tiles(arr, h, table, rans, offs, nr, out)
    for t0, nt, nr in plan_tiles(h.rows, h.rows_per_tile):
        seg = out[t0 * h.rows_per_tile * cols : (t0 + nt) * h.rows_per_tile * cols]
        got = _cpu.checksum(seg[: nt * nr * cols].reshape(nt, nr * cols))
        bad = np.flatnonzero(got != h.checksums[t0 : t0 + nt])
        if bad.size:
            raise CorruptBlobError(f"tile {t0 + int(bad[0])} checksum mismatch: damaged blob")
    return out


def _decode_rans_tiles(arr, h: Header, table: Table, tiles, offs, nr, out) -> None:
    cols = h.columns
    nch = -(-cols // 32)
    nv = nr * cols
    states, counts, mants, exc, words, starts = [], [], [], [], [], []
    wpos = 0
    for ti in tiles:
        o, ne = int(offs[ti]), int(h.n_exc[ti])
        lay = tile_layout(nv, cols, ne)
        c = arr[o : o + 4 * nch].view("<u4").astype(np.int64)
        nw = int(c.sum())
        if pad4(lay["words"] + 2 * nw) != h.lengths[ti]:
            raise CorruptBlobError(f"tile {ti}: word counts do not match its length")
        counts.append(c)
        states.append(arr[o + lay["states"] : o + lay["exc_idx"]].view("<u4"))
        idx = arr[o + lay["exc_idx"] : o + lay["exc_val"]].view("<u4").astype(np.int64)
        if ne and (idx.max() >= nv or (np.diff(idx) <= 0).any()):
            raise CorruptBlobError(f"tile {ti}: escape positions out of range or unsorted")
        exc.append((idx, arr[o + lay["exc_val"] : o + lay["mant"]].view("<u2")))
        mants.append(arr[o + lay["mant"] : o + lay["mant"] + (7 * nv + 7) // 8])
        words.append(arr[o + lay["words"] : o + lay["words"] + 2 * nw].view("<u2"))
        starts.append(wpos + np.concatenate([[0], np.cumsum(c)[:-1]]))
        wpos += nw
    try:
        vals = _cpu.decode_tiles(
            np.stack(states),
            np.stack(counts),
            np.concatenate(words),
            np.stack(starts),
            np.stack(mants),
            exc,
            nr,
            table,
        )
    except _cpu.DecodeError as e:
        raise CorruptBlobError(f"tiles {tiles[0]}..{tiles[-1]}: {e}") from None
    for i, ti in enumerate(tiles):
        out[ti * h.rows_per_tile * cols :][:nv] = vals[i].ravel()


def _as_buffer(blob) -> memoryview:
    if isinstance(blob, (bytes, bytearray, memoryview)):
        return memoryview(blob).cast("B")
    if isinstance(blob, np.ndarray) and blob.dtype == np.uint8:
        return memoryview(blob.ravel())
    raise TypeError(
        f"blob must be bytes, bytearray, memoryview or uint8 ndarray, got {type(blob).__name__}"
    )


def decompress(
    blob, *, tables: TableSet | None = None, device=None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Restore the exact tensor from a blob (bit for bit).

    Raises :class:`CorruptBlobError` for a truncated, damaged or mismatched blob (or one coded
    with another table set). On the CPU every tile is decoded to scratch and checksummed before
    anything is written to ``out``. ``device='cuda'`` (or a CUDA ``out``) decodes on the GPU,
    straight into ``out`` when given: there the checksums are verified after the write, and on
    error ``out``'s contents are unspecified (an error is always raised).
    """
    buf = _as_buffer(blob)
    h = parse_header(buf)
    table = table_for(h, tables)
    if out is not None:
        if (
            not isinstance(out, torch.Tensor)
            or out.dtype != torch.bfloat16
            or out.numel() != h.numel
            or not out.is_contiguous()
        ):
            desc = (
                f"{out.dtype} {tuple(out.shape)}"
                if isinstance(out, torch.Tensor)
                else type(out).__name__
            )
            raise ValueError(
                f"out must be a contiguous bfloat16 tensor of {h.numel} values "
                f"(blob shape {h.shape}), got {desc}"
            )
        device = out.device
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda" and h.numel:
        from kvzip_lossless import gpu

        if gpu.available():
            return gpu.decompress(buf, h, table, device=dev, out=out)
    vals = decode_u16(buf, h, table)
    res = torch.from_numpy(vals.view(np.int16)).view(torch.bfloat16).reshape(h.shape)
    if out is not None:
        out.view(-1).copy_(res.view(-1))
        return out
    return res.to(dev) if dev.type != "cpu" else res
