"""The Triton pieces both GPU coders share (``gpu.py``'s one-blob kernels, ``gpu_batch.py``'s
batched ones): the value hash of the tile checksum, a value's symbol and the rANS row loop of
one chunk (:func:`rans_rows`), so that one decode loop serves both paths (as ``rans_rows`` in
csrc/kvzl.cu serves the CUDA C decoders). Triton is imported lazily by the callers' modules;
here too it is optional (``triton`` is None without it)."""

from __future__ import annotations

from kvzip_lossless.tables import MODE_SLOT

try:  # Triton comes with CUDA builds of torch; the CPU package never needs it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without Triton
    triton = None

MASK32 = 0xFFFFFFFF

if triton is not None:
    MODE_SLOT_C = tl.constexpr(MODE_SLOT)
    MASK32_C = tl.constexpr(MASK32)

    @triton.jit
    def fmix(h):
        """The 32-bit finaliser of the tile checksum's value hash (spec/blob.md section 6)."""
        h = h ^ (h >> 16)
        h = h * 0x85EBCA6B
        h = h ^ (h >> 13)
        h = h * 0xC2B2AE35
        return h ^ (h >> 16)

    @triton.jit
    def symbol(v, colbase):
        """A bf16 bit pattern's symbol: sign * 16 + its exponent's slot (0: an escape)."""
        es = ((v >> 7) & 255) - colbase + MODE_SLOT_C
        es = tl.where((es >= 1) & (es <= 15), es, 0)
        return (v >> 15) * 16 + es

    @triton.jit
    def rans_rows(x, nr, C, col, lm, colbase, ctx0, tab, bmap, words, n_words, mant8, out16,
                  eidx32, evals16, ne, INLINE_ESCAPES: tl.constexpr):  # fmt: skip
        """Decode rows ``0..nr-1`` of one chunk (32 lanes, lane ``l`` column ``col[l]``, ``lm``
        the lanes inside the tile) from the lanes' states ``x`` (spec/blob.md section 5).

        Each row: a lane finds its symbol by a 5-step binary search in its context's packed
        ``cum << 16 | freq`` row (``tab`` from the table's first entry; context ``ctx0 +
        bmap[previous symbol]``), renormalises, and the lanes that need a word take
        consecutive ones of ``words`` (``n_words``) through a prefix sum over the lanes; the
        value is assembled with its 7-bit mantissa (``mant8``, packed) and stored at
        ``out16[r * C + col]``. ``INLINE_ESCAPES``: an escape's value comes from the tile's
        sorted list (``eidx32``, ``evals16``, ``ne`` entries) and every value enters the
        checksum; else escapes are stored as decoded (the caller patches them) and left out of
        the checksum. Returns ``(x, ptr, badl, acc, nesc)``: the final states, the words taken,
        per-lane damage (a word past the stream, an escape not in the list), the lanes'
        checksum sums and the escapes met."""
        golden = tl.full([32], 0x9E3779B1, tl.uint32)
        prev = tl.zeros([32], tl.int32)
        ptr = tl.full([], 0, tl.int64)
        badl = tl.zeros([32], tl.int1)
        acc = tl.zeros([32], tl.uint32)
        nesc = tl.full([], 0, tl.int32)
        for r in range(nr):
            bk = tl.load(bmap + prev)
            row = (ctx0 + bk) * 32
            slot = (x & 4095).to(tl.int32)
            s = tl.zeros([32], tl.int32)
            for k in tl.static_range(5):
                step = 16 >> k
                e = tl.load(tab + row + s + step, mask=lm, other=0)
                s = tl.where((e >> 16) <= slot, s + step, s)
            e = tl.load(tab + row + s, mask=lm, other=1)
            cum = (e >> 16).to(tl.uint32)
            f = (e & 0xFFFF).to(tl.uint32)
            x = f * (x >> 12) + slot.to(tl.uint32) - cum
            need = (x < 65536) & lm
            ni = need.to(tl.int32)
            pos = ptr + tl.cumsum(ni, 0) - ni
            okp = pos < n_words
            badl = badl | (need & (okp == 0))
            w = tl.load(words + pos, mask=need & okp, other=0).to(tl.int32)
            x = tl.where(need, (x << 16) | (w & 0xFFFF).to(tl.uint32), x)
            ptr += tl.sum(ni, 0)
            es = s & 15
            ex = (es + colbase - MODE_SLOT_C) & 255
            p = r * C + col
            bit = p.to(tl.int64) * 7
            byte = bit >> 3
            b0 = tl.load(mant8 + byte, mask=lm, other=0).to(tl.int32)
            b1 = tl.load(mant8 + byte + 1, mask=lm, other=0).to(tl.int32)
            m = (((b0 << 8) | b1) >> (9 - (bit & 7).to(tl.int32))) & 127
            v = ((s >> 4) << 15) | (ex << 7) | m
            if INLINE_ESCAPES:
                isesc = lm & (es == 0)
                nr_esc = tl.sum(isesc.to(tl.int32), 0)
                if nr_esc > 0:
                    nesc += nr_esc
                    lo = tl.zeros([32], tl.int64)
                    hi = tl.zeros([32], tl.int64) + ne
                    for _i in tl.static_range(32):  # lower bound of p in the list
                        live = isesc & (lo < hi)
                        mid = (lo + hi) // 2
                        q = tl.load(eidx32 + mid, mask=live, other=0)
                        less = live & ((q.to(tl.int64) & MASK32_C) < p)
                        lo = tl.where(less, mid + 1, lo)
                        hi = tl.where(live & (less == 0), mid, hi)
                    q = tl.load(eidx32 + lo, mask=isesc & (lo < ne), other=-1)
                    q = q.to(tl.int64) & MASK32_C
                    found = isesc & (lo < ne) & (q == p)
                    badl = badl | (isesc & (found == 0))
                    eval_ = tl.load(evals16 + lo, mask=found, other=0)
                    v = tl.where(found, eval_.to(tl.int32) & 0xFFFF, v)
                tl.store(out16 + p, v.to(tl.int16), mask=lm)
                acc += tl.where(lm, fmix(p.to(tl.uint32) * golden + v.to(tl.uint32)), 0)
            else:
                tl.store(out16 + p, v.to(tl.int16), mask=lm)
                h = fmix(p.to(tl.uint32) * golden + v.to(tl.uint32))
                acc += tl.where(lm & (es != 0), h, 0)
            prev = s
        return x, ptr, badl, acc, nesc
