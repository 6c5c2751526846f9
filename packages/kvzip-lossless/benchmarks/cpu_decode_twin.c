/* The C twin of kvzip_lossless/_cpu_fast.py's _decode_rans and _or_mantissas (the same
 * algorithm, statement for statement, checksum included), built by bench_cpu_coder.py --compare-c with
 * gcc -O3 -march=native to choose between numba and a C extension by measurement.
 * Not part of the package. */
#include <stdint.h>

#define LANES 32
#define NSYM 32
#define RANS_L 65536
#define CLUT_SHIFT 4
#define CLUT_ROW 3
#define MODE_SLOT 12

static inline int64_t u32(const uint8_t *b, int64_t i) {
  return (int64_t)b[i] | ((int64_t)b[i + 1] << 8) | ((int64_t)b[i + 2] << 16) |
         ((int64_t)b[i + 3] << 24);
}
static inline int64_t u16(const uint8_t *b, int64_t i) {
  return (int64_t)b[i] | ((int64_t)b[i + 1] << 8);
}

static inline int64_t fmix(int64_t h) {
  h ^= h >> 16;
  h = (h * 0x85EBCA6B) & 0xFFFFFFFF;
  h ^= h >> 13;
  h = (h * 0xC2B2AE35) & 0xFFFFFFFF;
  return h ^ (h >> 16);
}
#define TERM(p, v) fmix(((p) * 0x9E3779B1LL + (v)) & 0xFFFFFFFF)

static int64_t or_mantissas(const uint8_t *b, int64_t mo, uint16_t *out, int64_t oo, int64_t n) {
  int64_t g8 = n / 8, acc = 0;
  for (int64_t g = 0; g < g8; g++) {
    int64_t by = mo + 7 * g, w = 0;
    for (int k = 0; k < 7; k++) w = (w << 8) | b[by + k];
    for (int k = 0; k < 8; k++) {
      int64_t p = 8 * g + k, v = out[oo + p] | ((w >> (49 - 7 * k)) & 127);
      out[oo + p] = (uint16_t)v;
      acc += TERM(p, v);
    }
  }
  for (int64_t p = 8 * g8; p < n; p++) {
    int64_t bit = 7 * p, by = mo + (bit >> 3);
    int64_t v = out[oo + p] | (((((int64_t)b[by] << 8) | b[by + 1]) >> (9 - (bit & 7))) & 127);
    out[oo + p] = (uint16_t)v;
    acc += TERM(p, v);
  }
  return acc;
}

int64_t decode_rans(const uint8_t *b, const uint16_t *b16, int64_t o, int64_t length,
                    int64_t nr, int64_t C, int64_t ne, const int64_t *packed,
                    const uint8_t *clut, const int64_t *cnext, const uint16_t *vt,
                    const int64_t *base, uint16_t *out, int64_t oo, int64_t *x, int64_t *r,
                    int64_t *sums) {
  int64_t nv = nr * C, nch = (C + LANES - 1) / LANES;
  int64_t st = o + 4 * nch, ei = st + 4 * C, evo = ei + 4 * ne, mo = evo + 2 * ne;
  int64_t wo = mo + (7 * nv + 7) / 8 + 1;
  wo += wo & 1;
  int64_t nw = 0;
  for (int64_t ch = 0; ch < nch; ch++) nw += u32(b, o + 4 * ch);
  if ((wo - o + 2 * nw + 3) / 4 * 4 != length) return 1;
  int64_t last = -1;
  for (int64_t k = 0; k < ne; k++) {
    int64_t q = u32(b, ei + 4 * k);
    if (q >= nv || q <= last) return 3;
    last = q;
  }
  for (int64_t c = 0; c < C; c++) {
    x[c] = u32(b, st + 4 * c);
    if (x[c] < RANS_L) return 4;
  }
  int64_t wp = wo / 2, nesc = 0;
  for (int64_t ch = 0; ch < nch; ch++) {
    int64_t c0 = ch * LANES, c1 = C < c0 + LANES ? C : c0 + LANES;
    int64_t wend = wp + u32(b, o + 4 * ch);
    for (int64_t c = c0; c < c1; c++) r[c] = cnext[c * NSYM];
    for (int64_t t = 0; t < nr; t++) {
      int64_t row = t * C;
      for (int64_t c = c0; c < c1; c++) {
        int64_t rc = r[c], xc = x[c], slot = xc & 4095;
        int64_t s = clut[(rc << CLUT_ROW) + (slot >> CLUT_SHIFT)];
        int64_t e = packed[rc + s];
        while ((e >> 16) + (e & 0xFFFF) <= slot) e = packed[rc + ++s];
        xc = (e & 0xFFFF) * (xc >> 12) + slot - (e >> 16);
        int64_t need = xc < RANS_L;
        int64_t w = b16[wp < wend - 1 ? wp : wend - 1];
        xc = need ? ((xc << 16) | w) : xc;
        wp += need;
        x[c] = xc;
        r[c] = cnext[c * NSYM + s];
        nesc += (s & 15) == 0;
        out[oo + row + c] = vt[c * NSYM + s];
      }
    }
    if (wp != wend) return 5;
  }
  for (int64_t c = 0; c < C; c++)
    if (x[c] != RANS_L) return 5;
  int64_t acc = or_mantissas(b, mo, out, oo, nv);
  if (nesc != ne) return 6;
  for (int64_t k = 0; k < ne; k++) {
    int64_t q = u32(b, ei + 4 * k), c = q % C, old = out[oo + q];
    if (((old >> 7) & 255) != ((base[c] - MODE_SLOT) & 255)) return 6;
    int64_t v = u16(b, evo + 2 * k);
    out[oo + q] = (uint16_t)v;
    acc += TERM(q, v) - TERM(q, old);
  }
  sums[0] = acc & 0xFFFFFFFF;
  return 0;
}
