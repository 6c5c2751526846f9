"""Tiles and tables of a blob, for every coder: which table codes a tensor (a table set's slot
or an embedded table fitted on it), how its rows are cut into tiles, and the blob's bytes
assembled from per-tile coder output (the CPU and the GPU encoders hand this module the same
parts, so they write the same bytes); on decode, the table a blob names.

Depends on ``blob`` and ``tables`` only (numpy): the coders import it, never the reverse.
"""

from __future__ import annotations

import zlib

import numpy as np

from kvzip_lossless.blob import (
    MODE_RANS,
    MODE_RAW,
    CorruptBlobError,
    Header,
    choose_columns,
    load_embedded,
    pack_header,
    pad4,
    tile_layout,
)
from kvzip_lossless.tables import BUCKETS_NONE, Table, TableSet, fit_table

#: Rows per tile. Each lane pays a 4-byte final state per tile: 1,024 rows keep that at
#: 0.4% of a tile of ~10-bit values while leaving ~10^4+ lanes for a GPU on a 131k context.
ROWS_PER_TILE = 1024


def resolve_table(tables: TableSet | None, slot: int | None, shape, numel: int):
    """The table of ``slot`` in ``tables`` for a tensor of ``shape`` (None without a set)."""
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
