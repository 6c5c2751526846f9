"""The compiled CPU coder (numba): the same bytes as the numpy reference coder (``_cpu.py``),
one lane at a time instead of one numpy operation per row over all lanes.

Decoding a tile walks each 32-lane chunk row by row, lanes in ascending order, which is the
order its words are stored in (spec/blob.md section 5), so a chunk reads its words with one
pointer. One int64 load of the decode table gives all a symbol needs (its interval, its value
less the mantissa, the next context's row: :func:`_table_arrays`), and the rows that cannot
read past the chunk's words skip the clamp on the read (measured about 4% faster). The
mantissas are added after, in one pass over the tile (measured 15% faster than unpacking each
in the lane loop), and the checksum is summed in a second pass that LLVM vectorises (measured
about 12% faster for the whole decode than summing while unpacking). Encoding walks the same
order backwards and reverses each chunk's words. Every read of a blob is bounds-checked against
the tile directory first (the header parser has checked the directory against the blob's
length); a failed check returns an error code that the caller turns into
:class:`~kvzip_lossless.CorruptBlobError`.

Why numba and not a C extension: README ("The CPU coder"). Without numba (it is a dependency,
but a platform without its wheels may lack it) the numpy coder runs: :func:`available`.
"""

from __future__ import annotations

import numpy as np

from kvzip_lossless.blob import MODE_RAW, CorruptBlobError, Header
from kvzip_lossless.tables import MODE_SLOT, NSYM, PROB_BITS, Table

try:
    import numba
except ImportError:  # pragma: no cover - exercised where numba has no wheel
    numba = None

RANS_L = 1 << 16
LANES = 32
#: The coarse symbol lookup keeps every 16th slot: 256 bytes a context (measured fastest of
#: 4, 16 and 64 on real KV; the full 4,096-slot table is 16x larger and slower for keys).
CLUT_SHIFT = 4
CLUT_ROW = PROB_BITS - CLUT_SHIFT - 5  # packed row offset (ctx * 32) -> clut row offset
_NO_TABLE: dict = {}
#: the most context rows (columns x buckets x 32) that a decode-table entry can name
MAX_ROWS = 1 << 22
_KEY = "cpu_fast_dec"  # the cache key of _table_arrays on a table
#: error codes of the compiled decoder -> message (each names the tile)
ERRORS = {
    1: "tile {t}: word counts do not match its length",
    2: "raw tile {t}: length does not match its values",
    3: "tile {t}: escape positions out of range or unsorted",
    4: "tile {t}: lane state out of range (rANS stream damaged)",
    5: "tile {t}: rANS stream does not decode to its recorded end (truncated or damaged)",
    6: "tile {t}: escape list does not match the escape symbols",
    7: "tile {t} checksum mismatch: damaged blob",
}


def available() -> bool:
    return numba is not None


if numba is not None:
    _jit = numba.njit(cache=True, nogil=True, boundscheck=False, error_model="numpy")

    @_jit
    def _u32(b, i):
        return (
            np.int64(b[i])
            | (np.int64(b[i + 1]) << 8)
            | (np.int64(b[i + 2]) << 16)
            | (np.int64(b[i + 3]) << 24)
        )

    @_jit
    def _u16(b, i):
        return np.int64(b[i]) | (np.int64(b[i + 1]) << 8)

    @_jit
    def _fmix(h):
        h ^= h >> 16
        h = (h * 0x85EBCA6B) & 0xFFFFFFFF
        h ^= h >> 13
        h = (h * 0xC2B2AE35) & 0xFFFFFFFF
        return h ^ (h >> 16)

    @_jit
    def _tile_sum(out, o, n):
        s = np.int64(0)
        for p in range(n):
            s += _fmix((p * 0x9E3779B1 + np.int64(out[np.uint64(o + p)])) & 0xFFFFFFFF)
        return s & 0xFFFFFFFF

    @_jit
    def _or_mantissas(b, mo, out, oo, n):
        """``out[oo + p] |= `` the 7-bit mantissa field ``p`` of the bytes at ``mo`` (MSB
        first): 8 fields from every 7 bytes, then the last few one by one. Returns the tile
        checksum of the values so completed, in a second pass (the loop that LLVM vectorises:
        measured faster than summing in the unpacking loop)."""
        g8 = n // 8
        for g in range(g8):
            by = mo + 7 * g
            w = np.int64(0)
            for k in range(7):
                w = (w << 8) | np.int64(b[np.uint64(by + k)])
            for k in range(8):
                q = np.uint64(oo + 8 * g + k)
                out[q] = np.int64(out[q]) | ((w >> (49 - 7 * k)) & 127)
        for p in range(8 * g8, n):
            bit = 7 * p
            by = mo + (bit >> 3)
            m = (((np.int64(b[by]) << 8) | np.int64(b[by + 1])) >> (9 - (bit & 7))) & 127
            out[oo + p] = np.int64(out[oo + p]) | m
        return _tile_sum(out, oo, n)

    @_jit
    def _decode_rans(b, b16, o, length, nr, C, ne, dec, clut, nbs, base, out, oo, x, r,
                     sums):  # fmt: skip
        """One rANS tile at byte ``o`` of ``b`` into ``out[oo:oo + nr*C]``, its checksum into
        ``sums[0]``; returns 0 or an error.

        ``r[c]``: the decode-table row of lane ``c``'s next context; a symbol is found from
        ``clut`` (the symbol at every 16th slot of the row) and a short forward scan. One
        entry of ``dec`` holds all a decoded symbol needs (layout: :func:`_table_arrays`)."""
        nv = nr * C
        nch = (C + LANES - 1) // LANES
        st = o + 4 * nch
        ei = st + 4 * C
        evo = ei + 4 * ne
        mo = evo + 2 * ne
        wo = mo + (7 * nv + 7) // 8 + 1
        wo += wo & 1
        nw = np.int64(0)
        for ch in range(nch):
            nw += _u32(b, o + 4 * ch)
        if (wo - o + 2 * nw + 3) // 4 * 4 != length:
            return 1
        last = -1
        for k in range(ne):
            q = _u32(b, ei + 4 * k)
            if q >= nv or q <= last:
                return 3
            last = q
        for c in range(C):
            x[c] = _u32(b, st + 4 * c)
            if x[c] < RANS_L:
                return 4
        wp = wo // 2  # in 16-bit words; tiles start 4-aligned, words at an even offset
        nesc = 0
        for ch in range(nch):
            c0 = ch * LANES
            c1 = min(C, c0 + LANES)
            wend = wp + _u32(b, o + 4 * ch)
            for c in range(c0, c1):
                r[c] = dec[c * nbs] >> 41  # no previous token: as after symbol 0
            for t in range(nr):
                orow = oo + t * C
                # A row reads at most one word a lane. While the chunk has that many left,
                # no read can pass its end; else (the last rows) every read is clamped to
                # the chunk's last word: past it only in a damaged tile (then error 5).
                # Each decoded value less its mantissa goes to ``out`` (the mantissas
                # follow in one pass).
                if wend - wp >= c1 - c0:
                    for c in range(c0, c1):
                        uc = np.uint64(c)
                        rc = r[uc]
                        xc = x[uc]
                        slot = xc & 4095
                        s = np.int64(clut[np.uint64((rc << CLUT_ROW) + (slot >> CLUT_SHIFT))])
                        e = dec[np.uint64(rc + s)]
                        while (e & 0x1FFF) <= slot:  # the symbol's end (cum + freq) <= slot
                            s += 1
                            e = dec[np.uint64(rc + s)]
                        cum = (e >> 13) & 4095
                        xc = ((e & 0x1FFF) - cum) * (xc >> PROB_BITS) + slot - cum
                        need = xc < RANS_L
                        w = np.int64(b16[np.uint64(wp)])
                        xc = ((xc << 16) | w) if need else xc
                        wp += need
                        x[uc] = xc
                        r[uc] = e >> 41
                        nesc += (s & 15) == 0
                        out[np.uint64(orow + c)] = (e >> 25) & 0xFFFF
                else:
                    for c in range(c0, c1):
                        uc = np.uint64(c)
                        rc = r[uc]
                        xc = x[uc]
                        slot = xc & 4095
                        s = np.int64(clut[np.uint64((rc << CLUT_ROW) + (slot >> CLUT_SHIFT))])
                        e = dec[np.uint64(rc + s)]
                        while (e & 0x1FFF) <= slot:  # the symbol's end (cum + freq) <= slot
                            s += 1
                            e = dec[np.uint64(rc + s)]
                        cum = (e >> 13) & 4095
                        xc = ((e & 0x1FFF) - cum) * (xc >> PROB_BITS) + slot - cum
                        need = xc < RANS_L
                        w = np.int64(b16[np.uint64(min(wp, wend - 1))])
                        xc = ((xc << 16) | w) if need else xc
                        wp += need
                        x[uc] = xc
                        r[uc] = e >> 41
                        nesc += (s & 15) == 0
                        out[np.uint64(orow + c)] = (e >> 25) & 0xFFFF
            if wp != wend:  # read past its words, or left some
                return 5
        for c in range(C):
            if x[c] != RANS_L:
                return 5
        acc = _or_mantissas(b, mo, out, oo, nv)
        if nesc != ne:
            return 6
        for k in range(ne):
            q = _u32(b, ei + 4 * k)
            c = q % C
            old = np.int64(out[oo + q])
            if (old >> 7) & 255 != (base[c] - MODE_SLOT) & 255:
                return 6
            new = _u16(b, evo + 2 * k)
            out[oo + q] = new
            acc += _fmix((q * 0x9E3779B1 + new) & 0xFFFFFFFF)
            acc -= _fmix((q * 0x9E3779B1 + old) & 0xFFFFFFFF)
        sums[0] = acc & 0xFFFFFFFF
        return 0

    @_jit
    def _decode_blob(b, b16, offs, lengths, modes, n_exc, checks, rows, C, rpt, dec, clut, nbs,
                     base, out):  # fmt: skip
        """Every tile of a blob into ``out``; returns (0, 0) or (error code, tile)."""
        x = np.zeros(C, np.int64)
        r = np.zeros(C, np.int64)
        sums = np.zeros(1, np.int64)
        for ti in range(len(offs)):
            nr = min(rpt, rows - ti * rpt)
            nv = nr * C
            oo = ti * rpt * C
            o = offs[ti]
            if modes[ti] == MODE_RAW:
                if lengths[ti] != (2 * nv + 3) // 4 * 4:
                    return 2, ti
                for p in range(nv):
                    out[oo + p] = _u16(b, o + 2 * p)
                sums[0] = _tile_sum(out, oo, nv)
            else:
                err = _decode_rans(b, b16, o, lengths[ti], nr, C, n_exc[ti], dec, clut, nbs, base,
                                   out, oo, x, r, sums)  # fmt: skip
                if err:
                    return err, ti
            if sums[0] != checks[ti]:
                return 7, ti
        return 0, 0

    @_jit
    def _encode_tile(v, nr, C, packed, bmap, base, nb, counts, states, words, scratch, esc,
                     mant):  # fmt: skip
        """Encode one tile ``v[nr*C]`` (int64 bit patterns). Fills counts, states, words
        (decoder order), the escape positions (returns their number after the word count)
        and the packed mantissas; returns (words, escapes, checksum)."""
        nch = (C + LANES - 1) // LANES
        nw = 0
        for ch in range(nch):
            c0 = ch * LANES
            c1 = min(C, c0 + LANES)
            k = 0
            for c in range(c0, c1):
                states[c] = RANS_L
            for t in range(nr - 1, -1, -1):
                for c in range(c1 - 1, c0 - 1, -1):
                    uc = np.uint64(c)
                    val = v[np.uint64(t * C + c)]
                    bc = base[uc]
                    es = ((val >> 7) & 255) - bc + MODE_SLOT
                    s = (val >> 15) * 16 + (es if 1 <= es <= 15 else 0)
                    sp = 0
                    if t > 0:
                        vp = v[np.uint64((t - 1) * C + c)]
                        ep = ((vp >> 7) & 255) - bc + MODE_SLOT
                        sp = (vp >> 15) * 16 + (ep if 1 <= ep <= 15 else 0)
                    e = np.int64(packed[np.uint64((c * nb + bmap[np.uint64(sp)]) * 32 + s)])
                    f = e & 0xFFFF
                    xc = states[uc]
                    if xc >= f << (32 - PROB_BITS):
                        scratch[np.uint64(k)] = xc & 0xFFFF
                        k += 1
                        xc >>= 16
                    q = xc // f
                    states[uc] = (q << PROB_BITS) + (xc - q * f) + (e >> 16)
            counts[ch] = k
            for j in range(k):
                words[nw + j] = scratch[k - 1 - j]
            nw += k
        ne = 0
        n = nr * C
        for p in range(n):
            val = v[np.uint64(p)]
            es = ((val >> 7) & 255) - base[np.uint64(p % C)] + MODE_SLOT
            if not 1 <= es <= 15:
                esc[ne] = p
                ne += 1
        acc = np.int64(0)
        nbits = 0
        j = 0
        for p in range(n):
            acc = (acc << 7) | (v[np.uint64(p)] & 127)
            nbits += 7
            while nbits >= 8:
                nbits -= 8
                mant[j] = (acc >> nbits) & 255
                j += 1
            acc &= (1 << nbits) - 1
        if nbits:
            mant[j] = (acc << (8 - nbits)) & 255
        s = np.int64(0)
        for p in range(n):
            s += _fmix((p * 0x9E3779B1 + v[np.uint64(p)]) & 0xFFFFFFFF)
        return nw, ne, s & 0xFFFFFFFF


def _table_arrays(table: Table):
    """The table's arrays as the compiled coder reads them (cached on the table).

    ``dec``: one int64 per (column, bucket, symbol), all the decoder needs of a symbol in one
    load: bits 0-12 the symbol's end (cum + freq), 13-24 its cum, 25-40 its decoded value less
    the mantissa, 41-62 the row offset of the context that follows it (its column's row of
    the symbol's bucket); ``None`` where that offset does not fit (the decoder then runs the
    numpy coder). ``clut``: the coarse symbol lookup (the symbol at every
    ``2**CLUT_SHIFT``-th slot of each row, uint8). The encoder's: packed ``cum << 16 | freq``
    rows (int64), bucket map and base; ``cnext`` and ``vt`` (next row, value less mantissa
    per column and symbol) are the layout that ``benchmarks/cpu_decode_twin.c`` reads."""
    if _KEY not in table._derived:
        C, nb = table.columns, table.n_buckets
        sym = np.arange(NSYM)
        bmap = np.asarray(table.buckets, np.int64)
        base = table.base.astype(np.int64)
        es = (sym & 15)[None, :] + base[:, None] - MODE_SLOT
        vt = ((sym >> 4) << 15)[None, :] | ((es & 255) << 7)
        cnext = (np.arange(C)[:, None] * nb + bmap[None, :]) * NSYM
        packed = table.packed().astype(np.int64)
        dec = None
        if C * nb * NSYM <= MAX_ROWS:
            p3 = packed.reshape(C, nb, NSYM)
            cum, end = p3 >> 16, (p3 >> 16) + (p3 & 0xFFFF)
            dec = end | (cum << 13) | (vt[:, None, :] << 25) | (cnext[:, None, :] << 41)
            dec = np.ascontiguousarray(dec.ravel(), np.int64)
        table._derived[_KEY] = dict(
            dec=dec,
            nbs=nb * NSYM,
            packed=np.ascontiguousarray(packed.ravel()),
            clut=np.ascontiguousarray(table.lut()[:, :: 1 << CLUT_SHIFT].ravel(), np.uint8),
            cnext=cnext.ravel(),
            vt=vt.astype(np.uint16).ravel(),
            bmap=bmap,
            base=base,
            nb=nb,
        )
    return table._derived[_KEY]


def decode_u16(buf: memoryview, h: Header, table: Table | None) -> np.ndarray | None:
    """Every tile decoded and checksummed (uint16 values); CorruptBlobError on any damage.
    None when the table has more context rows than the packed decode entry can name (the
    caller, ``codec.decode_u16``, then decodes with the numpy coder)."""
    out = np.empty(h.numel, np.uint16)
    if not h.n_tiles:
        return out
    if table is None:  # every tile raw (tiles.table_for checked): no table is read
        if h.columns not in _NO_TABLE:
            flat = np.full((h.columns, 1, NSYM), 128, np.uint16)
            _NO_TABLE[h.columns] = Table(np.zeros(h.columns, np.uint8), (0,) * NSYM, flat)
        table = _NO_TABLE[h.columns]
    t = _table_arrays(table)
    if t["dec"] is None:  # more context rows than the packed entry can name
        return None
    b = np.frombuffer(buf, np.uint8)
    b16 = np.frombuffer(buf, np.uint16, len(buf) // 2)
    err, ti = _decode_blob(
        b, b16, h.offsets()[:-1], h.lengths.astype(np.int64), h.modes.astype(np.int64),
        h.n_exc.astype(np.int64), h.checksums.astype(np.int64), h.rows, h.columns,
        h.rows_per_tile, t["dec"], t["clut"], t["nbs"], t["base"], out,
    )  # fmt: skip
    if err:
        raise CorruptBlobError(ERRORS[int(err)].format(t=int(ti)))
    return out


def encode_parts(vals: np.ndarray, table: Table, cols: int, rows_per_tile: int) -> list[dict]:
    """Per tile, the parts :func:`kvzip_lossless.tiles.assemble` takes (as the numpy coder's)."""
    t = _table_arrays(table)
    packed, bmap, base, nb = t["packed"], t["bmap"], t["base"], t["nb"]
    rows = vals.size // cols
    nch = -(-cols // LANES)
    v64 = vals.astype(np.int64)
    parts = []
    scratch = np.empty(min(rows, rows_per_tile) * LANES, np.int64)
    for t0 in range(0, rows, rows_per_tile):
        nr = min(rows_per_tile, rows - t0)
        n = nr * cols
        tv = v64[t0 * cols : t0 * cols + n]
        counts = np.empty(nch, np.uint32)
        states = np.empty(cols, np.int64)
        words = np.empty(n, np.uint16)
        esc = np.empty(n, np.int64)
        mant = np.zeros((7 * n + 7) // 8, np.uint8)
        nw, ne, s = _encode_tile(tv, nr, cols, packed, bmap, base, nb, counts, states, words,
                                 scratch, esc, mant)  # fmt: skip
        parts.append(
            dict(
                vals=vals[t0 * cols : t0 * cols + n],
                counts=counts,
                states=states.astype(np.uint32),
                words=words[:nw],
                escapes=esc[:ne],
                mant=mant,
                checksum=int(s),
            )
        )
    return parts
