"""Reference CPU coder: interleaved rANS over many lanes at once, in numpy.

One lane per (tile, column): lane state 32 bits, renormalised 16 bits at a time, 12-bit
probabilities. Every numpy operation in the step loop acts on all lanes of all tiles of a
blob together, so Python overhead is paid once per row, not once per value.
Words are stored per chunk of 32 lanes in decoder order (row ascending, lane ascending),
which is the order a GPU warp reads them with one ballot/prefix count per step.
"""

from __future__ import annotations

import numpy as np

from kvzip_lossless.checksum import tile_checksums
from kvzip_lossless.tables import NSYM, PROB_BITS, Table, symbolize

RANS_L = 1 << 16
LANES = 32
MANT_BITS = 7


class DecodeError(Exception):
    """Raised inside the coder; the public layer turns it into CorruptBlobError."""


def pack_mantissas(vals: np.ndarray) -> np.ndarray:
    """7-bit mantissa fields of ``vals[tiles, n]``, MSB first, ``ceil(7n/8)`` bytes per tile."""
    m = (vals & 0x7F).astype(np.uint8)
    bits = np.unpackbits(m[..., None], axis=-1)[..., 1:]
    return np.packbits(bits.reshape(vals.shape[0], -1), axis=-1)


def unpack_mantissas(buf: np.ndarray, n: int) -> np.ndarray:
    bits = np.unpackbits(buf, axis=-1)[..., : MANT_BITS * n]
    bits = bits.reshape(buf.shape[0], n, MANT_BITS)
    return np.packbits(np.concatenate([np.zeros_like(bits[..., :1]), bits], -1), axis=-1)[..., 0]


def _contexts(sym: np.ndarray, table: Table) -> np.ndarray:
    """Table row per value: column * n_buckets + bucket(previous row's symbol in the tile)."""
    nb = table.n_buckets
    bmap = np.asarray(table.buckets, np.int32)
    prev = np.zeros_like(sym)
    prev[:, 1:] = sym[:, :-1]
    cols = np.arange(sym.shape[-1], dtype=np.int32) * nb
    return cols + bmap[prev]


def encode_tiles(vals: np.ndarray, table: Table):
    """Encode tiles ``vals[tiles, rows, C]`` (uint16) sharing one row count.

    Returns per tile: word counts ``[tiles, chunks]``, final states ``[tiles, C]`` (uint32),
    the words of all tiles (uint16, tile-major then chunk, row, lane), escape positions and
    values, packed mantissas ``[tiles, bytes]`` and checksums ``[tiles]``.
    """
    nt, nr, C = vals.shape
    sym = symbolize(vals, table.base)
    ctx = _contexts(sym, table)
    # uint32 throughout, as on the GPU: every frequency is < 4096 (32 symbols, each >= 1), so
    # freq << 20 fits, and every state stays below 2^32.
    e = table.packed().ravel()[ctx * NSYM + sym]
    freq = e & np.uint32(0xFFFF)
    cum = e >> np.uint32(16)
    x = np.full((nt, C), RANS_L, np.uint32)
    words = np.zeros((nt, nr, C), np.uint16)
    emit = np.zeros((nt, nr, C), bool)
    shift = np.uint32(32 - PROB_BITS)
    for t in range(nr - 1, -1, -1):
        f = freq[:, t]
        e = x >= (f << shift)
        emit[:, t] = e
        words[:, t] = x & np.uint32(0xFFFF)
        x = np.where(e, x >> np.uint32(16), x)
        q, r = np.divmod(x, f)
        x = (q << np.uint32(PROB_BITS)) + r + cum[:, t]
    nch = -(-C // LANES)
    pad = nch * LANES - C
    if pad:
        words = np.pad(words, ((0, 0), (0, 0), (0, pad)))
        emit = np.pad(emit, ((0, 0), (0, 0), (0, pad)))
    w4 = words.reshape(nt, nr, nch, LANES).transpose(0, 2, 1, 3)
    e4 = emit.reshape(nt, nr, nch, LANES).transpose(0, 2, 1, 3)
    counts = e4.sum(axis=(2, 3)).astype(np.uint32)
    flat = vals.reshape(nt, nr * C)
    esc = (sym.reshape(nt, -1) & 15) == 0
    return dict(
        counts=counts,
        states=x.astype(np.uint32),
        words=w4[e4],
        escapes=esc,
        mant=pack_mantissas(flat),
        checksum=tile_checksums(flat),
    )


def decode_tiles(states, counts, words, word_starts, mant, exc, nr: int, table: Table):
    """Decode tiles of one row count. Raises DecodeError on any inconsistency.

    states ``[tiles, C]`` uint32; counts ``[tiles, chunks]``; words: one uint16 array;
    word_starts ``[tiles, chunks]`` offsets of each chunk in ``words``; mant ``[tiles, bytes]``;
    exc: per tile ``(indices, values)``. Returns ``[tiles, nr, C]`` uint16.
    """
    nt, C = states.shape
    nch = -(-C // LANES)
    x = states.astype(np.uint32)
    if (x < RANS_L).any():
        raise DecodeError("lane state out of range")
    nb = table.n_buckets
    bmap = np.asarray(table.buckets, np.int64)
    lut = table.lut().ravel()
    packed = table.packed().ravel()  # cum << 16 | freq: one gather for both
    colctx = np.arange(C, dtype=np.int64) * nb
    ptr = word_starts.astype(np.int64).copy()
    end = ptr + counts.astype(np.int64)
    sym = np.zeros((nt, nr, C), np.uint8)
    prev = np.zeros((nt, C), np.int64)
    mask = np.uint32((1 << PROB_BITS) - 1)
    n4 = np.zeros((nt, nch * LANES), np.int64)  # lanes padded to whole chunks
    wlen = len(words)
    wpad = np.append(words, np.uint16(0)).astype(np.uint32)  # index wlen = out of range
    bad = False
    for t in range(nr):
        ctx = colctx + bmap[prev]
        slot = x & mask
        s = lut[(ctx << PROB_BITS) + slot]
        e = packed[ctx * NSYM + s]
        x = (e & np.uint32(0xFFFF)) * (x >> np.uint32(PROB_BITS)) + slot - (e >> np.uint32(16))
        need = x < RANS_L
        n4[:, :C] = need
        n3 = n4.reshape(nt, nch, LANES)
        incl = np.cumsum(n3, axis=-1)
        pos = (ptr[..., None] + incl - n3).reshape(nt, -1)[:, :C]
        ptr += incl[..., -1]
        pos = np.where(need, pos, wlen)
        bad |= bool((pos > wlen).any() | ((pos == wlen) & need).any())
        w = wpad[np.minimum(pos, wlen)]
        x = np.where(need, (x << np.uint32(16)) | w, x)
        sym[:, t] = s
        prev = s.astype(np.int64)
    if bad or (ptr != end).any() or (x != RANS_L).any():
        raise DecodeError("rANS stream does not decode to its recorded end (truncated or damaged)")
    es = (sym & 15).astype(np.int32)
    e = es + table.base.astype(np.int32) - 12
    mants = unpack_mantissas(mant, nr * C).reshape(nt, nr, C).astype(np.int32)
    vals = ((sym >> 4).astype(np.int32) << 15) | ((e & 255) << 7) | mants
    vals = vals.astype(np.uint16).reshape(nt, nr * C)
    esc = (es == 0).reshape(nt, nr * C)
    for i, (idx, v) in enumerate(exc):
        if len(idx) != int(esc[i].sum()) or (len(idx) and not esc[i][idx].all()):
            raise DecodeError("escape list does not match the escape symbols")
        vals[i, idx] = v
    return vals.reshape(nt, nr, C)
