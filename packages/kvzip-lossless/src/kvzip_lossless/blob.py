"""The blob container (spec/blob.md): header, tile directory, tables, tiles.

All integers little-endian. Every read is bounds-checked first; any inconsistency raises
:class:`CorruptBlobError` before a single value is written to the caller's memory.
"""

from __future__ import annotations

import math
import struct
import zlib
from dataclasses import dataclass

import numpy as np

from kvzip_lossless.tables import NSYM, TABLE_HEAD, Table

MAGIC = b"KVZL"
FORMAT_VERSION = 1
DTYPE_BF16 = 1
FLAG_EMBEDDED_TABLE = 1
MODE_RAW, MODE_RANS = 0, 1
MAX_NDIM = 8
MAX_COLUMNS = 1 << 16
HEAD = struct.Struct("<4sHBBIIIIQII")  # 40 bytes, spec section 2
DIR = struct.Struct("<IBxxxII")  # 16 bytes per tile, spec section 3


class CorruptBlobError(ValueError):
    """A blob is truncated, damaged, of another version, or coded with other tables."""


def pad4(n: int) -> int:
    return (n + 3) & ~3


@dataclass
class Header:
    shape: tuple[int, ...]
    columns: int
    rows_per_tile: int
    n_tiles: int
    table_id: int
    table_slot: int
    embedded: bytes | None  # zlib-compressed table bytes, when embedded
    lengths: np.ndarray  # uint32 [n_tiles] bytes of each tile (multiple of 4)
    modes: np.ndarray  # uint8
    n_exc: np.ndarray  # uint32
    checksums: np.ndarray  # uint32
    tiles_start: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def rows(self) -> int:
        return self.numel // self.columns if self.columns else 0

    def tile_rows(self, i: int) -> int:
        return min(self.rows_per_tile, self.rows - i * self.rows_per_tile)

    def offsets(self) -> np.ndarray:
        o = np.zeros(self.n_tiles + 1, np.int64)
        np.cumsum(self.lengths, out=o[1:])
        return o + self.tiles_start


def choose_columns(shape: tuple[int, ...]) -> int:
    """Lanes per row when no table fixes them (an encoder choice; decoders read the header).

    KV tensors end in ``[..., heads, head_dim]``: a lane per channel, so a lane's previous row
    is the previous token. Rows (tokens, blocks) are never folded into the columns.
    """
    numel = math.prod(shape)
    for c in (math.prod(shape[-2:]) if len(shape) >= 3 else 0, shape[-1] if len(shape) >= 2 else 0):
        if 1 <= c <= 4096:
            return c
    return max(math.gcd(numel, 1024), 1)


def pack_header(
    shape,
    columns,
    rows_per_tile,
    table_id,
    table_slot,
    embedded: bytes | None,
    lengths,
    modes,
    n_exc,
    checksums,
) -> bytes:
    n_tiles = len(lengths)
    flags = FLAG_EMBEDDED_TABLE if embedded is not None else 0
    emb_len = len(embedded) if embedded is not None else 0
    out = bytearray(
        HEAD.pack(
            MAGIC,
            FORMAT_VERSION,
            DTYPE_BF16,
            len(shape),
            flags,
            columns,
            rows_per_tile,
            n_tiles,
            table_id,
            table_slot,
            emb_len,
        )
    )
    out += struct.pack(f"<{len(shape)}Q", *shape)
    for i in range(n_tiles):
        out += DIR.pack(int(lengths[i]), int(modes[i]), int(n_exc[i]), int(checksums[i]))
    out += struct.pack("<I", zlib.crc32(out))
    if embedded is not None:
        out += embedded + b"\0" * (pad4(emb_len) - emb_len)
    return bytes(out)


def parse_header(buf: memoryview) -> Header:
    n = len(buf)
    if n < HEAD.size:
        raise CorruptBlobError(f"blob truncated: {n} bytes, the header alone is {HEAD.size}")
    (magic, version, dtype, ndim, flags, columns, rpt, n_tiles, table_id, slot, emb_len) = (
        HEAD.unpack_from(buf, 0)
    )
    if magic != MAGIC:
        raise CorruptBlobError(
            f"not a kvzip-lossless blob (magic {bytes(magic)!r}, want {MAGIC!r})"
        )
    if version != FORMAT_VERSION:
        raise CorruptBlobError(
            f"blob format version {version}; this kvzip-lossless reads version {FORMAT_VERSION}"
        )
    if dtype != DTYPE_BF16:
        raise CorruptBlobError(f"blob dtype code {dtype}; only bf16 ({DTYPE_BF16}) is supported")
    if ndim > MAX_NDIM or flags & ~FLAG_EMBEDDED_TABLE:
        raise CorruptBlobError(f"blob header malformed (ndim {ndim}, flags {flags:#x})")
    dir_end = HEAD.size + 8 * ndim + DIR.size * n_tiles
    if n < dir_end + 4:
        raise CorruptBlobError(
            f"blob truncated: {n} bytes, header and directory need {dir_end + 4}"
        )
    (crc,) = struct.unpack_from("<I", buf, dir_end)
    if zlib.crc32(buf[:dir_end]) != crc:
        raise CorruptBlobError("blob header checksum mismatch (header or tile directory damaged)")
    shape = struct.unpack_from(f"<{ndim}Q", buf, HEAD.size)
    numel = math.prod(shape)
    if columns < 1 or columns > MAX_COLUMNS or numel % columns or rpt < 1:
        raise CorruptBlobError(
            f"blob header inconsistent (shape {shape}, columns {columns}, rows per tile {rpt})"
        )
    if n_tiles != -(-(numel // columns) // rpt):
        raise CorruptBlobError(f"blob header inconsistent: {n_tiles} tiles for shape {shape}")
    d = np.frombuffer(buf, np.uint8, DIR.size * n_tiles, HEAD.size + 8 * ndim)
    d = d.reshape(n_tiles, DIR.size)
    lengths = d[:, 0:4].copy().view("<u4").ravel()
    modes = d[:, 4].copy()
    n_exc = d[:, 8:12].copy().view("<u4").ravel()
    checks = d[:, 12:16].copy().view("<u4").ravel()
    pos = dir_end + 4
    embedded = None
    if flags & FLAG_EMBEDDED_TABLE:
        if n < pos + emb_len:
            raise CorruptBlobError("blob truncated inside its embedded table")
        embedded = bytes(buf[pos : pos + emb_len])
        pos += pad4(emb_len)
    h = Header(
        tuple(int(s) for s in shape),
        columns,
        rpt,
        n_tiles,
        table_id,
        slot,
        embedded,
        lengths,
        modes,
        n_exc,
        checks,
        pos,
    )
    if (modes > MODE_RANS).any() or (lengths % 4).any():
        raise CorruptBlobError("blob tile directory malformed (mode or length)")
    if int(lengths.astype(np.int64).sum()) + pos != n:
        raise CorruptBlobError(
            f"blob length {n} does not match its tile directory "
            f"({int(lengths.astype(np.int64).sum()) + pos}); truncated or padded"
        )
    for i in range(n_tiles):
        nv = h.tile_rows(i) * columns
        if n_exc[i] > nv or lengths[i] < expected_min_len(modes[i], nv, columns, n_exc[i]):
            raise CorruptBlobError(f"tile {i}: length {lengths[i]} too small for its contents")
    return h


def tile_layout(nvals: int, columns: int, n_exc: int) -> dict[str, int]:
    """Byte offsets inside a rANS tile (spec section 5); 'words' is the start of the words."""
    nch = -(-columns // 32)
    o = {"counts": 0, "states": 4 * nch}
    o["exc_idx"] = o["states"] + 4 * columns
    o["exc_val"] = o["exc_idx"] + 4 * n_exc
    o["mant"] = o["exc_val"] + 2 * n_exc
    o["words"] = o["mant"] + (7 * nvals + 7) // 8 + 1
    o["words"] += o["words"] & 1
    return o


def expected_min_len(mode: int, nvals: int, columns: int, n_exc: int) -> int:
    if mode == MODE_RAW:
        return pad4(2 * nvals)
    return tile_layout(nvals, columns, n_exc)["words"]


def embedded_table_size(columns: int, n_buckets: int) -> int:
    """Bytes of an uncompressed table (spec section 4) of ``columns`` and ``n_buckets``."""
    return TABLE_HEAD.size + NSYM + columns + 2 * columns * n_buckets * NSYM


def inflate_embedded(data: bytes, columns: int) -> bytes:
    """The embedded table's bytes, inflated no further than the size its own header declares
    for the blob's ``columns`` (a zlib bomb is refused after at most that many bytes)."""
    d = zlib.decompressobj()
    try:
        head = d.decompress(data, TABLE_HEAD.size)
        if len(head) < TABLE_HEAD.size:
            raise CorruptBlobError("blob's embedded table is damaged: shorter than its header")
        _, _, nb, cols = TABLE_HEAD.unpack(head)
        if cols != columns or not 1 <= nb <= NSYM:
            raise CorruptBlobError(
                f"blob's embedded table declares {cols} columns and {nb} buckets; the blob has "
                f"{columns} columns (buckets must be 1..{NSYM})"
            )
        size = embedded_table_size(cols, nb)
        raw = head + d.decompress(d.unconsumed_tail, size - len(head))
        if len(raw) < size:
            raise CorruptBlobError(
                f"blob's embedded table is damaged: {len(raw)} bytes, its header declares {size}"
            )
        if d.decompress(d.unconsumed_tail, 1):
            raise CorruptBlobError(
                f"blob's embedded table inflates to more than the {size} bytes its header "
                "declares (refused)"
            )
        if not d.eof:
            raise CorruptBlobError("blob's embedded table is damaged: its zlib stream is cut")
        if d.unused_data:
            raise CorruptBlobError("blob's embedded table is damaged: bytes after its zlib stream")
    except zlib.error as e:
        raise CorruptBlobError(f"blob's embedded table is damaged: {e}") from None
    return raw


def load_embedded(h: Header) -> Table:
    raw = inflate_embedded(h.embedded, h.columns)
    try:
        table, end = Table.from_bytes(raw)
    except (ValueError, struct.error) as e:
        raise CorruptBlobError(f"blob's embedded table is damaged: {e}") from None
    if end != len(raw) or table.table_id() != h.table_id:
        raise CorruptBlobError("blob's embedded table does not match its table id")
    return table
