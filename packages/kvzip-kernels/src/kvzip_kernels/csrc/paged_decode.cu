// Split-KV paged decode attention for kvzip's paged layout (kvzip_formats/spec/paged_layout.md):
// `int4` and the compact `4bit`, `3.5bit`, `3bit` (spec/4bit.md section 5), head_dim 64 and
// 128, with mma.sync m16n8k16 (sm_80 and newer; tuned for sm_90). Design v6 (NOTES.md has
// its history, and that of v5 and v4a, the designs before it; their sources are in git
// history): each warp streams 32-token tiles through its own ring of 2 stages in shared
// memory by cp.async (16-byte, L2-only): one tile (K codes, V codes, metadata) in flight while
// it computes the other; fragments are read from shared memory.
//
// One CTA = one (sequence, KV head, split); NW warps take 32-token tiles in turn and keep
// their own online-softmax state, merged through shared memory at the end. A tile is two
// 16-token units (each within one page) that share one online-softmax update. The CTA writes
// the same partial output and base-2 log-sum-exp per (query head, split) as the Triton split
// kernels (_decode_kernels.py, _decode_codebook.py), so the Triton merge, the compact formats'
// output transform and the sink merge run unchanged after it.
//
// "SWAP_AB": tokens are the M dimension of both products and the G <= 8 query heads of the
// KV head the N = 8 dimension, so no GQA group is padded to 16 rows.
//   scores  S^T [16 tokens x 8 heads] = K [16 x D] . Q^T [D x 8]      (A = K codes, B = q)
//   output  O^T [D x 8 heads]        += V^T [D x 16 tokens] . P^T [16 x 8]
// P^T comes out of the first product's accumulator layout by one movmatrix.trans per 8x8
// half: the accumulator holds (token g, heads 2q, 2q+1), the B operand wants (tokens 2q, 2q+1,
// head g), exactly the transpose. Every thread holds the softmax state of heads 2q, 2q+1,
// the same columns as its output accumulator, so rescaling needs no shuffle.
//
// K: the depth (channel) order of the score product is free (a dot product). Each row group
// of n channels is split into 4 runs of n/4 channels, thread q (= lane % 4) takes run q, and
// k-step kk of the group takes its channels c = q*n/4 + 4kk + 0..3 as the pairs (c, c+1) and
// (c+2, c+3) (int4: (c, c+2) and (c+1, c+3), the order its PRMT expansion gives); the query
// fragment is loaded in the same order. A thread's bytes of a row are then one contiguous run
// per bit plane: 4-bit nibbles n/8 bytes, 3-bit groups n/16 bytes of the 2-bit plane and n/32
// of the 1-bit plane.
// V (channel-major: byte j of token t at j*PS + t): m-tile mt holds channels 16mt + 2g (row g)
// and 16mt + 2g + 1 (row g+8); a 32-bit load gives one byte row for 4 tokens (v_pairs).
//
// Dequantisation:
//   int4:  a code c becomes the bf16 128 + c (0x4300 | c); q.k = s (q.(c+128)) +
//          (z - 128 s) sum(q); the V side adds sum_t (p_t z_t - 128 (p s)_t) per head, with
//          the bf16-rounded p s in both terms.
//   compact: codes become fp16 levels through tables of level pairs in shared memory (each
//          entry replicated per lane, so a lookup is conflict-free: RepLut, 3 instructions: one
//          PRMT for the index byte, one IMAD for the address, one LDS): a byte of two 4-bit
//          codes (256 entries), two 3-bit codes from 4 bits of the 2-bit plane and 2 of the
//          1-bit plane (64 entries), two 2-bit codes (16 entries); q' = B_k^T q comes scaled
//          per row into fp16 (qs undoes it) and p s is multiplied by 64 before its fp16
//          rounding (out of the subnormals).
// No CUDA headers beyond the runtime: conversions are PTX, so the file builds with the
// nvcc of the nvidia-cuda-nvcc wheel alone.
#include <stdint.h>

#define FULL_MASK 0xffffffffu

namespace {

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

template <bool BF16>
__device__ __forceinline__ void mma16816(float c[4], const uint32_t a[4], uint32_t b0,
                                         uint32_t b1) {
  if (BF16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
        "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, "
        "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

// two float32 -> (lo, hi) packed 16-bit floats, round to nearest even
template <bool BF16>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  uint32_t r;
  if (BF16) {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  }
  return r;
}

template <bool BF16>
__device__ __forceinline__ float lo_f32(uint32_t x) {  // the low 16-bit float of x
  if (BF16) return __uint_as_float(x << 16);
  float f;
  asm("{ .reg .b16 l, h; mov.b32 {l, h}, %1; cvt.f32.f16 %0, l; }\n" : "=f"(f) : "r"(x));
  return f;
}

template <bool BF16>
__device__ __forceinline__ float hi_f32(uint32_t x) {
  if (BF16) return __uint_as_float(x & 0xffff0000u);
  float f;
  asm("{ .reg .b16 l, h; mov.b32 {l, h}, %1; cvt.f32.f16 %0, h; }\n" : "=f"(f) : "r"(x));
  return f;
}

__device__ __forceinline__ float f16_to_f32(uint16_t x) {
  float f;
  asm("{ .reg .b16 t; mov.b16 t, %1; cvt.f32.f16 %0, t; }\n" : "=f"(f) : "h"(x));
  return f;
}

__device__ __forceinline__ float fast_exp2(float x) {  // ex2.approx: 2**-inf = +0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}

__device__ __forceinline__ uint32_t ld16(const uint8_t* p) {
  return *reinterpret_cast<const uint16_t*>(p);
}

// cp.async of 16 bytes, global -> shared, cached in L2 only (the codes are read once)
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// int4: two code bytes (x0, x1 in bits 0-15 of x; or 16-31 with HI) -> the bf16 pairs
// (128 + low nibble of x0, 128 + low nibble of x1) and (128 + high nibble of x0, of x1):
// one PRMT interleaves the bytes with 0x43 (bf16 128's high byte), one LOP3 keeps the low
// nibbles, a shift and one LOP3 the high ones (the Triton kernel's PTX, 1 op per element).
template <bool HI>
__device__ __forceinline__ void int4_pairs(uint32_t x, uint32_t& lo, uint32_t& hi) {
  const uint32_t t = prmt(x, 0x43u, HI ? 0x4342u : 0x4140u);
  lo = t & 0xFF0FFF0Fu;
  hi = ((t >> 4) & 0x000F000Fu) | 0x43004300u;
}

// ---- formats -------------------------------------------------------------------------------
// FMT 0 int4; 1 4bit (K, V: one 4-bit group); 2 3.5bit (K 4-bit, V one 3-bit group);
// 3 3bit (K: 4-bit D/2 + 3-bit D/2; V: 3-bit D/2 + 2-bit D/2). Byte offsets of the planes
// follow spec/4bit.md section 5 (widest planes first, in group order); _cuda.py checks them
// against the format's own layout before it sends a call here.
enum : int { FMT_INT4 = 0, FMT_4BIT = 1, FMT_35BIT = 2, FMT_3BIT = 3 };

// level-pair table regions (the tags RepLut maps to its tables by code width)
constexpr int T_K4 = 0;     // K 4-bit group: 256 entries (byte of two codes)
constexpr int T_K3 = 256;   // K 3-bit group (3bit): 64 entries
constexpr int T_V0 = 320;   // V group 0: 256 (4-bit) or 64 (3-bit) entries
constexpr int T_V2 = 576;   // V 2-bit group (3bit): 16 entries

// The lookup: every entry stored 32 times, entry e of lane l at word 32 e + l (bank l), so a
// lookup is one conflict-free wavefront whatever the indices. Tables by code width (the levels
// of a width are the same for K and V: codebook.levels(bits)): 4-bit pairs at entry 0 (256),
// 3-bit at 256 (64), 2-bit at 320 (16).
// The dynamic shared memory: the replicated tables, then the ring
extern __shared__ __align__(16) uint8_t dyn_smem[];

__device__ __forceinline__ uint32_t byte_of(uint32_t w, int k) {  // byte k of w, zero-extended
  return prmt(w, 0u, 0x4440u | (uint32_t)k);
}

// A lookup: the index byte times 128 plus this lane's base (the region folded into it), one
// LDS on a 32-bit shared address
template <int FMT>
struct RepLut {
  static constexpr int ENTRIES = FMT == FMT_4BIT ? 256 : FMT == FMT_35BIT ? 320 : FMT == FMT_3BIT ? 336 : 0;
  uint32_t base;  // shared-window address of the tables + 4 * lane
  __device__ __forceinline__ uint32_t operator()(int region, uint32_t idx) const {
    const uint32_t off = region == T_K4                     ? 0u
                         : region == T_K3                   ? 256u * 128u
                         : region == T_V0                   ? (FMT == FMT_4BIT ? 0u : 256u * 128u)
                                                            : 320u * 128u;
    uint32_t r;
    asm("ld.shared.b32 %0, [%1];\n" : "=r"(r) : "r"(idx * 128u + (base + off)));
    return r;
  }
};

__device__ __forceinline__ uint32_t level_pair(const uint16_t* lv, int e) {
  // replicated-table entry e: 4-bit byte (e < 256), 3-bit 6-bit index, 2-bit 4-bit index
  uint32_t lo, hi;
  if (e < 256) {
    lo = lv[e & 15], hi = lv[e >> 4];
  } else if (e < 320) {
    const int x = e - 256;
    lo = lv[16 + ((x & 3) | (((x >> 4) & 1) << 2))];
    hi = lv[16 + (((x >> 2) & 3) | (((x >> 5) & 1) << 2))];
  } else {
    const int x = e - 320;
    lo = lv[48 + (x & 3)], hi = lv[48 + (x >> 2)];
  }
  return lo | (hi << 16);
}

// lv: the [4][16] levels with row 1 the 3-bit levels (3.5bit's are in row 2: the host passes
// a table whose row 1 holds them, see _cuda.level_table). The replicated tables, 16 bytes
// per store: 8 threads per entry, each writing 4 of its 32 copies
template <int FMT>
__device__ void fill_rep(uint32_t* rep, const uint16_t* lv, int tid, int nthreads) {
  for (int i = tid; i < RepLut<FMT>::ENTRIES * 8; i += nthreads) {
    const uint32_t v = level_pair(lv, i >> 3);
    reinterpret_cast<uint4*>(rep)[i] = make_uint4(v, v, v, v);
  }
}

template <int FMT, int D>
struct Fmt {
  static constexpr bool INT4 = FMT == FMT_INT4;
  static constexpr bool K3 = FMT == FMT_3BIT;  // K has a second, 3-bit group of D/2 channels
  static constexpr int KCB = K3 ? 7 * D / 16 : D / 2;  // code bytes of a K row
  static constexpr int VCB = FMT <= FMT_4BIT ? D / 2 : FMT == FMT_35BIT ? 3 * D / 8 : 5 * D / 16;
  static constexpr int MB = INT4 ? 4 : 2;  // metadata bytes per token: (scale, zero) or scale
  static constexpr int KS = D / 16;        // k-steps of the score product = m-tiles of PV
  static constexpr int KS4 = K3 ? D / 32 : D / 16;  // k-steps in K's 4-bit group
  static constexpr int NW4 = K3 ? D / 64 : D / 32;  // 32-bit words of a thread's nibbles
  static constexpr int MT3 = FMT == FMT_35BIT ? D / 16 : FMT == FMT_3BIT ? D / 32 : 0;  // V 3-bit m-tiles
};

// A thread's bytes of one K row (thread q of its group of 4): see the file comment.
template <int FMT, int D>
struct KRow {
  using F = Fmt<FMT, D>;
  uint32_t w[F::NW4];  // nibbles of the 4-bit group (int4: all codes)
  uint32_t lo, hi;     // 3bit: the 3-bit group's 2-bit-plane and 1-bit-plane bytes

  __device__ __forceinline__ void load(const uint8_t* row, int q) {
    const uint8_t* p = row + q * (F::NW4 * 4);
    if constexpr (F::NW4 == 4) {
      const uint4 v = *reinterpret_cast<const uint4*>(p);
      w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
    } else if constexpr (F::NW4 == 2) {
      const uint2 v = *reinterpret_cast<const uint2*>(p);
      w[0] = v.x, w[1] = v.y;
    } else {
      w[0] = *reinterpret_cast<const uint32_t*>(p);
    }
    if constexpr (F::K3) {
      const uint8_t* pl = row + D / 4 + q * (D / 32);
      const uint8_t* ph = row + D / 4 + D / 8 + q * (D / 64);
      if constexpr (D == 128) {
        lo = *reinterpret_cast<const uint32_t*>(pl);
        hi = ld16(ph);
      } else {
        lo = ld16(pl);
        hi = *ph;
      }
    } else {
      lo = hi = 0u;
    }
  }
  // first channel of k-step ks for thread q (the query fragment's order)
  static __device__ __forceinline__ int chan(int ks, int q) {
    if constexpr (F::K3)
      return ks < F::KS4 ? q * (D / 8) + 4 * ks : D / 2 + q * (D / 8) + 4 * (ks - F::KS4);
    return q * (D / 4) + 4 * ks;
  }
  // int4: (c, c+2) low nibbles -> lo, (c+1, c+3) high nibbles -> hi
  __device__ __forceinline__ void int4(int ks, uint32_t& a_lo, uint32_t& a_hi) const {
    const uint32_t x = w[ks >> 1];
    if (ks & 1)
      int4_pairs<true>(x, a_lo, a_hi);
    else
      int4_pairs<false>(x, a_lo, a_hi);
  }
};

// The two token pairs of byte row j a thread reads for its V fragment: k-rows (2q, 2q+1) in
// bits 0-15 of w0 and (2q+8, 2q+9) in w1. The tile's tokens are permuted so that the k-rows
// 2q, 2q+1, 2q+8, 2q+9 are tokens 4q .. 4q+3: one 32-bit load at vrow = row 0 + token 4q.
__device__ __forceinline__ void v_pairs(const uint8_t* p, uint32_t& w0, uint32_t& w1) {
  const uint32_t x = *reinterpret_cast<const uint32_t*>(p);
  w0 = x & 0xFFFFu;
  w1 = x >> 16;
}

// 3bit's K 3-bit group: the 6-bit indices of a thread's row, all at once: byte kk of x0 holds
// that of channels (c, c+1) of k-step KS4 + kk (low 4 bits from byte kk of the 2-bit plane,
// bits 4-5 from nibble kk of the 1-bit plane), byte kk of x1 that of (c+2, c+3): 4 at a time
__device__ __forceinline__ void k3_indices(uint32_t lo, uint32_t hi, uint32_t& x0, uint32_t& x1) {
  const uint32_t t = prmt(hi, 0u, 0x1100u);  // bytes: hi.b0, hi.b0, hi.b1, hi.b1
  const uint32_t hs = (t & 0x000F000Fu) | ((t >> 4) & 0x0F000F00u);  // nibble kk -> byte kk
  x0 = (lo & 0x0F0F0F0Fu) + ((hs & 0x03030303u) << 4);
  x1 = ((lo >> 4) & 0x0F0F0F0Fu) + ((hs & 0x0C0C0C0Cu) << 2);
}

// compact formats: level pairs (c, c+1) -> p0 and (c+2, c+3) -> p1 of k-step ks, the bytes
// taken by byte_of; x0/x1: k3_indices of the row (3bit)
template <int FMT, int D, typename LUT>
__device__ __forceinline__ void k_pairs(const KRow<FMT, D>& kr, uint32_t x0, uint32_t x1,
                                         int ks, const LUT& T, uint32_t& p0, uint32_t& p1) {
  using F = Fmt<FMT, D>;
  if (ks < F::KS4) {
    const uint32_t w = kr.w[ks >> 1];
    const int b = 2 * (ks & 1);
    p0 = T(T_K4, byte_of(w, b));
    p1 = T(T_K4, byte_of(w, b + 1));
  } else {
    p0 = T(T_K3, byte_of(x0, ks - F::KS4));
    p1 = T(T_K3, byte_of(x1, ks - F::KS4));
  }
}

// A fragment of V^T for m-tile mt: rows g (channel 16mt + 2g) and g+8 (channel 16mt + 2g + 1),
// k-rows 2q, 2q+1 (a[0], a[1]) and 2q+8, 2q+9 (a[2], a[3]); vrow and the token order: v_pairs.
// ST: the distance of byte rows (16 in a shared-memory stage).
template <int FMT, int D, typename LUT>
__device__ __forceinline__ void v_frag(const uint8_t* vrow, int ST, int mt, int g, const LUT& T,
                                        uint32_t a[4]) {
  if constexpr (FMT == FMT_4BIT) {
    const int j = 8 * mt + g;  // byte row: channels 2j (low nibbles), 2j+1 (high)
    const uint32_t x = *reinterpret_cast<const uint32_t*>(vrow + j * ST);
    const uint32_t t0l = T(T_V0, byte_of(x, 0)), t0h = T(T_V0, byte_of(x, 1));
    const uint32_t t1l = T(T_V0, byte_of(x, 2)), t1h = T(T_V0, byte_of(x, 3));
    a[0] = prmt(t0l, t0h, 0x5410);
    a[1] = prmt(t0l, t0h, 0x7632);
    a[2] = prmt(t1l, t1h, 0x5410);
    a[3] = prmt(t1l, t1h, 0x7632);
  } else if constexpr (FMT == FMT_INT4) {
    uint32_t w0, w1;
    v_pairs(vrow + (8 * mt + g) * ST, w0, w1);
    int4_pairs<false>(w0, a[0], a[1]);
    int4_pairs<false>(w1, a[2], a[3]);
  } else {
    // 3.5bit / 3bit: the 4 tokens' indices at once in the bytes of one word:
    // X byte k = the index of token 4q + k (the token order of v_pairs)
    using F = Fmt<FMT, D>;
    uint32_t X;
    int tab;
    if (mt < F::MT3) {  // 3-bit group 0: 2-bit plane at 0, 1-bit plane at D/4
      const int j = 4 * mt + (g >> 1), j1 = D / 4 + 2 * mt + (g >> 2);
      const int sl = 4 * (g & 1), sh = 2 * (g & 3);
      const uint32_t W = *reinterpret_cast<const uint32_t*>(vrow + j * ST);
      const uint32_t H = *reinterpret_cast<const uint32_t*>(vrow + j1 * ST);
      X = ((W >> sl) & 0x0F0F0F0Fu) + (((H >> sh) & 0x03030303u) << 4);
      tab = T_V0;
    } else {  // 3bit's 2-bit group: its plane at D/8
      const int j = D / 8 + 4 * (mt - F::MT3) + (g >> 1);
      const int sl = 4 * (g & 1);
      X = (*reinterpret_cast<const uint32_t*>(vrow + j * ST) >> sl) & 0x0F0F0F0Fu;
      tab = T_V2;
    }
    const uint32_t t0l = T(tab, byte_of(X, 0)), t0h = T(tab, byte_of(X, 1));
    const uint32_t t1l = T(tab, byte_of(X, 2)), t1h = T(tab, byte_of(X, 3));
    a[0] = prmt(t0l, t0h, 0x5410);
    a[1] = prmt(t0l, t0h, 0x7632);
    a[2] = prmt(t1l, t1h, 0x5410);
    a[3] = prmt(t1l, t1h, 0x7632);
  }
}

struct Params {
  const void* q;          // int4: bf16 q [b, hq, D]; compact: fp16 q' [b, hq, D] (contiguous)
  const float* qs;        // compact: per-row scale of q' [b * hq]; int4: unused
  const uint16_t* lut16;  // compact: fp16 levels [4][16] (K0, K1, V0, V1); int4: unused
  const uint8_t* kc;
  const uint8_t* vc;
  const int32_t* bt;
  const int32_t* sl;
  float* o_part;  // [b * hq, splits, D]
  float* lse;     // [b * hq, splits]
  float qk_scale;  // sm_scale * log2(e)
  int64_t stride_btb;
  int num_kv_heads;
  int G;
  int64_t k_page_bytes, v_page_bytes, k_blk_stride, v_blk_stride;
  int PS;
  int ps_log2;  // PS = 1 << ps_log2 (16 .. 128)
  int tokens_per_split;
  int num_splits;
  int skip;  // sink tokens (attended elsewhere): positions below are not read
};

// One warp's running state and the per-tile step.
template <int FMT, int D>
struct Warp {
  using F = Fmt<FMT, D>;
  static constexpr bool BF16 = F::INT4;
  uint32_t bq[F::KS][2];
  float colc[2];
  float m_i[2], l_i[2], acc_c[2];
  float acc[F::KS][4];

  __device__ __forceinline__ void init(const Params& P, int64_t row0, int g, int q) {
    const uint16_t* qp = reinterpret_cast<const uint16_t*>(P.q) + (row0 + g) * D;
#pragma unroll
    for (int ks = 0; ks < F::KS; ++ks) {
      if (g < P.G) {
        const uint2 v = *reinterpret_cast<const uint2*>(qp + KRow<FMT, D>::chan(ks, q));
        // int4: (c, c+2), (c+1, c+3); compact: (c, c+1), (c+2, c+3)
        bq[ks][0] = F::INT4 ? prmt(v.x, v.y, 0x5410) : v.x;
        bq[ks][1] = F::INT4 ? prmt(v.x, v.y, 0x7632) : v.y;
      } else {
        bq[ks][0] = bq[ks][1] = 0u;
      }
    }
    if constexpr (F::INT4) {  // per accumulator column (heads 2q, 2q+1): sum(q)
      float s = 0.f;
#pragma unroll
      for (int ks = 0; ks < F::KS; ++ks)
        s += lo_f32<true>(bq[ks][0]) + hi_f32<true>(bq[ks][0]) + lo_f32<true>(bq[ks][1]) +
             hi_f32<true>(bq[ks][1]);
      s += __shfl_xor_sync(FULL_MASK, s, 1);
      s += __shfl_xor_sync(FULL_MASK, s, 2);  // lanes 4g..4g+3: sum(q) of head g
      colc[0] = __shfl_sync(FULL_MASK, s, 4 * (2 * q));
      colc[1] = __shfl_sync(FULL_MASK, s, 4 * (2 * q + 1));
    } else {  // the row scale of q'
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int hd = 2 * q + i;
        colc[i] = hd < P.G ? P.qs[row0 + hd] * P.qk_scale : 0.f;
      }
    }
#pragma unroll
    for (int c = 0; c < 2; ++c) m_i[c] = neg_inf(), l_i[c] = 0.f, acc_c[c] = 0.f;
#pragma unroll
    for (int mt = 0; mt < F::KS; ++mt) acc[mt][0] = acc[mt][1] = acc[mt][2] = acc[mt][3] = 0.f;
  }

  // score: kr = this thread's K bytes of rows g, g+8 of a 16-token unit, km their metadata
  // words (0 where invalid) -> s (base-2 scaled scores of tokens g, g+8 for heads 2q, 2q+1;
  // -inf if invalid)
  template <typename LUT>
  __device__ __forceinline__ void score(const KRow<FMT, D> kr[2], const uint32_t km[2],
                                         const bool valid[2], float qk_scale, const LUT& T,
                                         float s[4]) const {
    float ks_r[2], kz_r[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      ks_r[r] = f16_to_f32(km[r] & 0xFFFFu);
      kz_r[r] = F::INT4 ? f16_to_f32(km[r] >> 16) : 0.f;
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) s[i] = 0.f;
    uint32_t x0[2] = {0u, 0u}, x1[2] = {0u, 0u};
    if constexpr (F::K3) {
#pragma unroll
      for (int r = 0; r < 2; ++r) k3_indices(kr[r].lo, kr[r].hi, x0[r], x1[r]);
    }
#pragma unroll
    for (int ks = 0; ks < F::KS; ++ks) {
      uint32_t a[4];
      if constexpr (F::INT4) {
        kr[0].int4(ks, a[0], a[2]);
        kr[1].int4(ks, a[1], a[3]);
      } else {
        k_pairs<FMT, D>(kr[0], x0[0], x1[0], ks, T, a[0], a[2]);
        k_pairs<FMT, D>(kr[1], x0[1], x1[1], ks, T, a[1], a[3]);
      }
      mma16816<BF16>(s, a, bq[ks][0], bq[ks][1]);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = i >> 1, c = i & 1;
      float v = F::INT4 ? (s[i] * ks_r[r] + (kz_r[r] - 128.f * ks_r[r]) * colc[c]) * qk_scale
                        : s[i] * ks_r[r] * colc[c];
      s[i] = valid[r] ? v : neg_inf();
    }
  }

  // vm -> the V scale (compact: times 64) and zero of rows g, g+8 of a unit
  __device__ __forceinline__ void v_meta(const uint32_t vm[2], float vs_r[2], float vz_r[2]) const {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if constexpr (F::INT4) {
        vs_r[r] = f16_to_f32(vm[r] & 0xFFFFu);
        vz_r[r] = f16_to_f32(vm[r] >> 16);
      } else {
        vs_r[r] = f16_to_f32(vm[r] & 0xFFFFu) * 64.f;
        vz_r[r] = 0.f;
      }
    }
  }

  // v7's steps (v6's pv below does the same for 2 units in one piece; it is kept as it was, so
  // that v6's machine code stays what was measured): the online softmax of NU units' scores at
  // once (v7: the 4 units of a 64-token tile), p against the new running maximum, l_i and m_i
  // updated, the accumulators rescaled only when some lane's running maximum moved
  template <int NU>
  __device__ __forceinline__ void softmax(float (*s)[4], float (*p)[4]) {
    static_assert(NU == 2 || NU == 4, "units per softmax update");
    float alpha[2];
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      float mh[NU];
#pragma unroll
      for (int h = 0; h < NU; ++h) mh[h] = fmaxf(s[h][c], s[h][2 + c]);
      float mx = NU == 2 ? fmaxf(mh[0], mh[1])
                         : fmaxf(fmaxf(mh[0], mh[1]), fmaxf(mh[NU - 2], mh[NU - 1]));
      mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 4));
      mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 8));
      mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 16));
      const float m_new = fmaxf(m_i[c], mx);
      const bool none = m_new == neg_inf();
      const float m_use = none ? 0.f : m_new;
      alpha[c] = none ? 1.f : fast_exp2(m_i[c] - m_use);
      float sum = 0.f;
#pragma unroll
      for (int h = 0; h < NU; ++h) {
        p[h][c] = fast_exp2(s[h][c] - m_use);
        p[h][2 + c] = fast_exp2(s[h][2 + c] - m_use);
        sum += p[h][c] + p[h][2 + c];
      }
      l_i[c] = l_i[c] * alpha[c] + sum;
      m_i[c] = m_new;
    }
    if (__any_sync(FULL_MASK, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
      for (int mt = 0; mt < F::KS; ++mt) {
        acc[mt][0] *= alpha[0];
        acc[mt][1] *= alpha[1];
        acc[mt][2] *= alpha[0];
        acc[mt][3] *= alpha[1];
      }
      if constexpr (F::INT4) {
        acc_c[0] *= alpha[0];
        acc_c[1] *= alpha[1];
      }
    }
  }

  // O^T += V^T P'^T of one unit: p its probabilities (rows g, g+8; heads 2q, 2q+1), vs_r / vz_r
  // its V metadata (v_meta), vrow its V tile (v_frag)
  template <typename LUT>
  __device__ __forceinline__ void pv_unit(const float p[4], const float vs_r[2],
                                          const float vz_r[2], const uint8_t* vrow, int g,
                                          const LUT& T) {
    const uint32_t plo = pack2<BF16>(p[0] * vs_r[0], p[1] * vs_r[0]);
    const uint32_t phi = pack2<BF16>(p[2] * vs_r[1], p[3] * vs_r[1]);
    if constexpr (F::INT4) {
      acc_c[0] += p[0] * vz_r[0] + p[2] * vz_r[1] - 128.f * (lo_f32<true>(plo) + lo_f32<true>(phi));
      acc_c[1] += p[1] * vz_r[0] + p[3] * vz_r[1] - 128.f * (hi_f32<true>(plo) + hi_f32<true>(phi));
    }
    const uint32_t bp0 = movmatrix_trans(plo);
    const uint32_t bp1 = movmatrix_trans(phi);
#pragma unroll
    for (int mt = 0; mt < F::KS; ++mt) {
      uint32_t a[4];
      v_frag<FMT, D>(vrow, 16, mt, g, T, a);
      mma16816<BF16>(acc[mt], a, bp0, bp1);
    }
  }

  // pv: the online softmax of the two units' scores at once, then O^T += V^T P'^T per unit;
  // vm the V metadata words of rows g, g+8 (0 where invalid), vrow the V tile (v_frag). The
  // accumulators are rescaled only when some lane's running maximum moved (alpha != 1;
  // exact: skipping a multiply by 1)
  template <typename LUT>
  __device__ __forceinline__ void pv(float s[2][4], const uint32_t vm[2][2],
                                      const uint8_t* const vrow[2], int g, const LUT& T) {
    float vs_r[2][2], vz_r[2][2];
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        if constexpr (F::INT4) {
          vs_r[h][r] = f16_to_f32(vm[h][r] & 0xFFFFu);
          vz_r[h][r] = f16_to_f32(vm[h][r] >> 16);
        } else {
          vs_r[h][r] = f16_to_f32(vm[h][r] & 0xFFFFu) * 64.f;
          vz_r[h][r] = 0.f;
        }
      }
    float alpha[2], p[2][4];
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      float mx = fmaxf(fmaxf(s[0][c], s[0][2 + c]), fmaxf(s[1][c], s[1][2 + c]));
      mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 4));
      mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 8));
      mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 16));
      const float m_new = fmaxf(m_i[c], mx);
      const bool none = m_new == neg_inf();
      const float m_use = none ? 0.f : m_new;
      alpha[c] = none ? 1.f : fast_exp2(m_i[c] - m_use);
      float sum = 0.f;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        p[h][c] = fast_exp2(s[h][c] - m_use);
        p[h][2 + c] = fast_exp2(s[h][2 + c] - m_use);
        sum += p[h][c] + p[h][2 + c];
      }
      l_i[c] = l_i[c] * alpha[c] + sum;
      m_i[c] = m_new;
    }
    if (__any_sync(FULL_MASK, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
      for (int mt = 0; mt < F::KS; ++mt) {
        acc[mt][0] *= alpha[0];
        acc[mt][1] *= alpha[1];
        acc[mt][2] *= alpha[0];
        acc[mt][3] *= alpha[1];
      }
      if constexpr (F::INT4) {
        acc_c[0] *= alpha[0];
        acc_c[1] *= alpha[1];
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t plo = pack2<BF16>(p[h][0] * vs_r[h][0], p[h][1] * vs_r[h][0]);
      const uint32_t phi = pack2<BF16>(p[h][2] * vs_r[h][1], p[h][3] * vs_r[h][1]);
      if constexpr (F::INT4) {
        acc_c[0] += p[h][0] * vz_r[h][0] + p[h][2] * vz_r[h][1] -
                          128.f * (lo_f32<true>(plo) + lo_f32<true>(phi));
        acc_c[1] += p[h][1] * vz_r[h][0] + p[h][3] * vz_r[h][1] -
                          128.f * (hi_f32<true>(plo) + hi_f32<true>(phi));
      }
      const uint32_t bp0 = movmatrix_trans(plo);
      const uint32_t bp1 = movmatrix_trans(phi);
#pragma unroll
      for (int mt = 0; mt < F::KS; ++mt) {
        uint32_t a[4];
        v_frag<FMT, D>(vrow[h], 16, mt, g, T, a);
        mma16816<BF16>(acc[mt], a, bp0, bp1);
      }
    }
  }
};

// Merge the NW warps' states (sm_o may alias memory the loop used: the caller syncs first).
template <int FMT, int D, int NW>
__device__ __forceinline__ void merge_store(Warp<FMT, D>& W, const Params& P, float (*sm_m)[8],
                                            float (*sm_l)[8], float (*sm_o)[8][D], int64_t row0,
                                            int split, int warp, int g, int q) {
  using F = Fmt<FMT, D>;
#pragma unroll
  for (int c = 0; c < 2; ++c) {
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) {
      W.l_i[c] += __shfl_xor_sync(FULL_MASK, W.l_i[c], o);
      W.acc_c[c] += __shfl_xor_sync(FULL_MASK, W.acc_c[c], o);
    }
  }
  if (g == 0) {
    sm_m[warp][2 * q] = W.m_i[0];
    sm_m[warp][2 * q + 1] = W.m_i[1];
    sm_l[warp][2 * q] = W.l_i[0];
    sm_l[warp][2 * q + 1] = W.l_i[1];
  }
#pragma unroll
  for (int mt = 0; mt < F::KS; ++mt) {
    const int ch = 16 * mt + 2 * g;
    sm_o[warp][2 * q][ch] = W.acc[mt][0] + W.acc_c[0];
    sm_o[warp][2 * q + 1][ch] = W.acc[mt][1] + W.acc_c[1];
    sm_o[warp][2 * q][ch + 1] = W.acc[mt][2] + W.acc_c[0];
    sm_o[warp][2 * q + 1][ch + 1] = W.acc[mt][3] + W.acc_c[1];
  }
  __syncthreads();
  const float out_scale = F::INT4 ? 1.f : 1.f / 64.f;
  for (int idx = threadIdx.x; idx < P.G * D; idx += NW * 32) {
    const int hd = idx / D, d = idx % D;
    float mx = neg_inf();
#pragma unroll
    for (int w = 0; w < NW; ++w) mx = fmaxf(mx, sm_m[w][hd]);
    float L = 0.f, O = 0.f;
    if (mx != neg_inf()) {
#pragma unroll
      for (int w = 0; w < NW; ++w) {
        const float f = sm_m[w][hd] == neg_inf() ? 0.f : fast_exp2(sm_m[w][hd] - mx);
        L += f * sm_l[w][hd];
        O += f * sm_o[w][hd][d];
      }
    }
    const int64_t row = row0 + hd;
    P.o_part[(row * P.num_splits + split) * D + d] = L > 0.f ? O * out_scale / L : 0.f;
    if (d == 0) P.lse[row * P.num_splits + split] = L > 0.f ? mx + log2f(L) : neg_inf();
  }
}

__device__ __forceinline__ uint32_t ld_meta(const uint8_t* p, bool int4) {
  return int4 ? *reinterpret_cast<const uint32_t*>(p) : ld16(p);
}

// ---- the kernel: 32-token tiles through a per-warp ring of S stages (cp.async) ------------
template <int FMT, int D>
struct Stage {  // one 16-token unit: K codes (token-major), V codes (channel-major, 16 per row),
                // K and V metadata (token-major), each a multiple of 16 bytes
  using F = Fmt<FMT, D>;
  static constexpr int K = 16 * F::KCB, V = 16 * F::VCB, M = 16 * F::MB;
  static constexpr int BYTES = K + V + 2 * M;
  static_assert(K % 16 == 0 && V % 16 == 0 && M % 16 == 0, "16-byte cp.async chunks");
};

// CTAs per SM the launch bound asks registers for: int4 (no tables) 4; the compact formats 3
// (their 66-71 KB of shared memory at d128 allow no more)
template <int FMT, int D>
constexpr int min_ctas() { return FMT == FMT_INT4 ? 4 : 3; }

// Shared memory of a CTA (dynamic: past the 48 KB of static shared memory): the replicated
// level tables (32 KB at 4bit, 40 KB at 3.5bit, 42 KB at 3bit), then the ring of NW x S stages
// of two 16-token units
template <int FMT, int D, int NW, int S>
constexpr int smem_bytes() { return RepLut<FMT>::ENTRIES * 128 + NW * S * 2 * Stage<FMT, D>::BYTES; }

template <int FMT, int D, int NW, int S>
__global__ void __launch_bounds__(NW * 32, min_ctas<FMT, D>()) split_v6(const Params P) {
  using F = Fmt<FMT, D>;
  using ST = Stage<FMT, D>;
  static_assert(NW * S * 2 * ST::BYTES >= (int)sizeof(float) * NW * 8 * D, "merge buffer");
  uint32_t* rep = reinterpret_cast<uint32_t*>(dyn_smem);
  auto ring = reinterpret_cast<uint8_t(*)[S][2 * ST::BYTES]>(dyn_smem + RepLut<FMT>::ENTRIES * 128);
  __shared__ float sm_m[NW][8], sm_l[NW][8];

  const int bh = blockIdx.x, split = blockIdx.y;
  const int b = bh / P.num_kv_heads, h = bh % P.num_kv_heads;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane >> 2, q = lane & 3;

  const int seq_len = P.sl[b];
  const int tok_lo = max(split * P.tokens_per_split, P.skip);
  const int tok_hi = min(seq_len, split * P.tokens_per_split + P.tokens_per_split);
  const int tile_lo = tok_lo / 16;  // units of 16 tokens
  const int tile_hi = tok_lo < tok_hi ? (tok_hi + 15) / 16 : tile_lo;
  const int64_t kho = (int64_t)h * P.k_page_bytes;
  const int64_t vho = (int64_t)h * P.v_page_bytes;
  const int32_t* btrow = P.bt + (int64_t)b * P.stride_btb;
  // this warp's tile n: units first + 2 n NW and the next one
  const int first = tile_lo + 2 * warp;
  const int ntiles = first < tile_hi ? (tile_hi - first + 2 * NW - 1) / (2 * NW) : 0;

  int bids0 = 0, bids1 = 0;  // lane l: the blocks of tile base + l's two units
  auto load_bids = [&](int base) {
    const int u = first + 2 * (base + lane) * NW;
    bids0 = u < tile_hi ? btrow[(u * 16) >> P.ps_log2] : 0;
    bids1 = u + 1 < tile_hi ? btrow[((u + 1) * 16) >> P.ps_log2] : 0;
  };
  constexpr int MC = ST::M / 16;
  const uint8_t* ksrc = P.kc + kho + 16 * lane;
  const uint8_t* vsrc = P.vc + vho + (int64_t)lane * P.PS;
  const bool kmeta = lane < MC;
  const uint8_t* msrc = kmeta ? P.kc + kho + P.PS * F::KCB + 16 * lane
                              : P.vc + vho + P.PS * F::VCB + 16 * (lane - MC);
  const int64_t mstride = kmeta ? P.k_blk_stride : P.v_blk_stride;
  const int mdst = ST::K + ST::V + 16 * lane;
  auto issue = [&](int n) {
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int u = first + 2 * n * NW + hf;
      if (u >= tile_hi) break;  // warp-uniform
      const int64_t blk = __shfl_sync(FULL_MASK, hf ? bids1 : bids0, n & 31);
      const int toff = (u * 16) & (P.PS - 1);
      uint8_t* dst = ring[warp][n % S] + hf * ST::BYTES;
      const uint8_t* kp = ksrc + blk * P.k_blk_stride + toff * F::KCB;
#pragma unroll
      for (int i = 0; i < ST::K / 16; i += 32)
        if (ST::K / 16 % 32 == 0 || i + lane < ST::K / 16)
          cp_async16(dst + 16 * (i + lane), kp + 16 * i);
      const uint8_t* vp = vsrc + blk * P.v_blk_stride + toff;
#pragma unroll
      for (int j = 0; j < F::VCB; j += 32)
        if (F::VCB % 32 == 0 || j + lane < F::VCB)
          cp_async16(dst + ST::K + 16 * (j + lane), vp + (int64_t)j * P.PS);
      if (lane < 2 * MC) cp_async16(dst + mdst, msrc + blk * mstride + toff * F::MB);
    }
  };

  load_bids(0);
#pragma unroll
  for (int n = 0; n < S - 1; ++n) {
    if (n < ntiles) issue(n);
    cp_async_commit();
  }
  if constexpr (!F::INT4) fill_rep<FMT>(rep, P.lut16, threadIdx.x, NW * 32);
  const RepLut<FMT> lut{static_cast<uint32_t>(__cvta_generic_to_shared(dyn_smem)) + 4u * lane};
  const int64_t row0 = (int64_t)bh * P.G;
  Warp<FMT, D> W;
  W.init(P, row0, g, q);
  if constexpr (!F::INT4) __syncthreads();

  for (int n = 0; n < ntiles; ++n) {
    cp_async_wait<S - 2>();
    __syncwarp();
    const int nn = n + S - 1;
    if ((nn & 31) == 0) load_bids(nn);
    if (nn < ntiles) issue(nn);
    cp_async_commit();

    const uint8_t* st0 = ring[warp][n % S];
    float s[2][4];
    uint32_t vm[2][2];
    const uint8_t* vrow[2];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const uint8_t* st = st0 + hf * ST::BYTES;
      const int t0 = (first + 2 * n * NW + hf) * 16;
      KRow<FMT, D> kr[2];
      uint32_t km[2];
      bool valid[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int t = 4 * (g >> 1) + 2 * r + (g & 1), tok = t0 + t;
        valid[r] = tok >= tok_lo && tok < tok_hi;
        kr[r].load(st + t * F::KCB, q);
        km[r] = valid[r] ? ld_meta(st + ST::K + ST::V + t * F::MB, F::INT4) : 0u;
        vm[hf][r] = valid[r] ? ld_meta(st + ST::K + ST::V + ST::M + t * F::MB, F::INT4) : 0u;
      }
      W.score(kr, km, valid, P.qk_scale, lut, s[hf]);
      vrow[hf] = st + ST::K + 4 * q;
    }
    W.pv(s, vm, vrow, g, lut);
  }
  cp_async_wait<0>();
  __syncthreads();
  merge_store<FMT, D, NW>(W, P, sm_m, sm_l, reinterpret_cast<float(*)[8][D]>(&ring[0][0][0]),
                          row0, split, warp, g, q);
}

// ---- v7: 64-token softmax tiles in the same layout (NOTES.md "v7") ------------------------
// v6's bytes, units, fragments, lookups and per-unit code; what changes is the schedule and the
// copies. A warp's softmax tile is two of its v6 tiles ("pairs" of two 16-token units: pair m
// = units first + 2 m NW and the next, v6's tile m), so the max reduction, the exp2 of the
// correction, the rescale test and rescale are paid per 64 tokens. The ring keeps S slots of
// one pair (S = 2: v6's shared memory and CTAs per SM; S = 4: two tiles in flight): pair m sits
// in slot m % S; after the PV of pair m the warp refills its slot with pair m + S. So a pair
// lands during the work of the S - 1 pairs' steps before it (S = 2: the other pair's PV or
// scores) where v6 gave it a whole 32-token tile. The copies are branch-free: the block offset
// is one 32 x 32 -> 64-bit multiply (block strides < 2^31, checked by the launcher), the
// per-lane metadata source and stride are loop-invariant, and the copies of units past the
// split's end are predicated off (no branch) instead of skipped by a branch. A warp's last tile
// with one pair skips the absent pair's work by one warp-uniform branch.

// cp.async of 16 bytes (global -> shared, L2 only) to a 32-bit shared-window address, issued only
// where p holds (a predicated LDGSTS)
__device__ __forceinline__ void cp_async16_if(uint32_t s, const void* gmem, bool p) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %2, 0;\n @p cp.async.cg.shared.global [%0], [%1], 16;\n}\n"
      ::"r"(s), "l"(gmem), "r"((uint32_t)p));
}

// v7's launch bound: the CTAs per SM its shared memory allows (at most 4; registers for them)
// base + a * b with a 32 x 32 -> 64-bit product (one IMAD.WIDE; the compiler makes a 64-bit
// multiply of (int64_t)a * b)
__device__ __forceinline__ const uint8_t* mad_wide(int a, int b, const uint8_t* base) {
  const uint8_t* r;
  asm("mad.wide.s32 %0, %1, %2, %3;\n" : "=l"(r) : "r"(a), "r"(b), "l"(base));
  return r;
}

template <int FMT, int D, int NW, int S>
constexpr int min_ctas_v7() {
  const int n = (228 * 1024) / (smem_bytes<FMT, D, NW, S>() + 1024 + 256);
  return n > 4 ? 4 : n;
}

template <int FMT, int D, int NW, int S>
__global__ void __launch_bounds__(NW * 32, min_ctas_v7<FMT, D, NW, S>()) split_v7(const Params P) {
  using F = Fmt<FMT, D>;
  using ST = Stage<FMT, D>;
  static_assert(S >= 2 && S <= 32 && (S & (S - 1)) == 0, "ring slots: a power of two >= 2");
  static_assert(NW * S * 2 * ST::BYTES >= (int)sizeof(float) * NW * 8 * D, "merge buffer");
  uint32_t* rep = reinterpret_cast<uint32_t*>(dyn_smem);
  auto ring = reinterpret_cast<uint8_t(*)[S][2 * ST::BYTES]>(dyn_smem + RepLut<FMT>::ENTRIES * 128);
  __shared__ float sm_m[NW][8], sm_l[NW][8];

  const int bh = blockIdx.x, split = blockIdx.y;
  const int b = bh / P.num_kv_heads, h = bh % P.num_kv_heads;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane >> 2, q = lane & 3;

  const int seq_len = P.sl[b];
  const int tok_lo = max(split * P.tokens_per_split, P.skip);
  const int tok_hi = min(seq_len, split * P.tokens_per_split + P.tokens_per_split);
  const int tile_lo = tok_lo / 16;  // units of 16 tokens
  const int tile_hi = tok_lo < tok_hi ? (tok_hi + 15) / 16 : tile_lo;
  const int64_t kho = (int64_t)h * P.k_page_bytes;
  const int64_t vho = (int64_t)h * P.v_page_bytes;
  const int32_t* btrow = P.bt + (int64_t)b * P.stride_btb;
  // this warp's pair m: units first + 2 m NW and the next one (v6's tile m); tile n: pairs
  // 2n, 2n + 1
  const int first = tile_lo + 2 * warp;
  const int npairs = first < tile_hi ? (tile_hi - first + 2 * NW - 1) / (2 * NW) : 0;
  const int ntiles = (npairs + 1) / 2;

  int bids0 = 0, bids1 = 0;  // lane l: the blocks of pair base + l's two units
  auto load_bids = [&](int base) {
    const int u = first + 2 * (base + lane) * NW;
    bids0 = u < tile_hi ? btrow[(u * 16) >> P.ps_log2] : 0;
    bids1 = u + 1 < tile_hi ? btrow[((u + 1) * 16) >> P.ps_log2] : 0;
  };
  constexpr int MC = ST::M / 16;
  const uint8_t* ksrc = P.kc + kho + 16 * lane;
  const uint8_t* vsrc = P.vc + vho + (int64_t)lane * P.PS;
  const bool kmeta = lane < MC;
  const uint8_t* msrc = kmeta ? P.kc + kho + P.PS * F::KCB + 16 * lane
                              : P.vc + vho + P.PS * F::VCB + 16 * (lane - MC);
  const int kstr = (int)P.k_blk_stride, vstr = (int)P.v_blk_stride;
  const int mstr = kmeta ? kstr : vstr;
  const bool mlane = lane < 2 * MC;
  // this lane's 16 bytes of slot 0 (the destinations of v6's copies, as a 32-bit address)
  const uint32_t ring_s = static_cast<uint32_t>(__cvta_generic_to_shared(&ring[warp][0][0])) + 16u * lane;
  auto issue = [&](int m) {  // pair m into slot m % S; units past the end: no copy
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int u = first + 2 * m * NW + hf;
      const bool on = u < tile_hi;
      const int blk = __shfl_sync(FULL_MASK, hf ? bids1 : bids0, m & 31);
      const int toff = (u * 16) & (P.PS - 1);
      const uint32_t dst = ring_s + (uint32_t)((m & (S - 1)) * (2 * ST::BYTES) + hf * ST::BYTES);
      const uint8_t* kp = mad_wide(blk, kstr, ksrc) + toff * F::KCB;
#pragma unroll
      for (int i = 0; i < ST::K / 16; i += 32)
        cp_async16_if(dst + 16 * i, kp + 16 * i,
                      on && (ST::K / 16 % 32 == 0 || i + lane < ST::K / 16));
      const uint8_t* vp = mad_wide(blk, vstr, vsrc) + toff;
#pragma unroll
      for (int j = 0; j < F::VCB; j += 32)
        cp_async16_if(dst + ST::K + 16 * j, vp + (int64_t)j * P.PS,
                      on && (F::VCB % 32 == 0 || j + lane < F::VCB));
      cp_async16_if(dst + ST::K + ST::V, mad_wide(blk, mstr, msrc) + toff * F::MB, on && mlane);
    }
  };

  load_bids(0);
#pragma unroll
  for (int m = 0; m < S; ++m) {
    issue(m);  // pairs past this warp's last: nothing copied, the group still counted
    cp_async_commit();
  }
  if constexpr (!F::INT4) fill_rep<FMT>(rep, P.lut16, threadIdx.x, NW * 32);
  const RepLut<FMT> lut{static_cast<uint32_t>(__cvta_generic_to_shared(dyn_smem)) + 4u * lane};
  const int64_t row0 = (int64_t)bh * P.G;
  Warp<FMT, D> W;
  W.init(P, row0, g, q);
  if constexpr (!F::INT4) __syncthreads();

  for (int n = 0; n < ntiles; ++n) {
    const int m0 = 2 * n;
    // the block ids of this tile's two copies (pairs m0 + S, m0 + S + 1: one block of 32 pairs)
    if (((m0 + S) & 31) == 0) load_bids(m0 + S);
    const bool two = m0 + 1 < npairs;  // warp-uniform: the tile's second pair exists
    float s[4][4];
    uint32_t vm[4][2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      // committed: pairs up to m0 - 1 + S; pair m0 + j complete leaves S - 1 - j pending
      if (j == 0)
        cp_async_wait<S - 1>();
      else
        cp_async_wait<S - 2>();
      __syncwarp();
      if (j == 1 && !two) {
#pragma unroll
        for (int hf = 2; hf < 4; ++hf) {
#pragma unroll
          for (int i = 0; i < 4; ++i) s[hf][i] = neg_inf();
          vm[hf][0] = vm[hf][1] = 0u;
        }
        break;
      }
      const uint8_t* st0 = ring[warp][(m0 + j) & (S - 1)];
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const uint8_t* st = st0 + hf * ST::BYTES;
        const int t0 = (first + 2 * (m0 + j) * NW + hf) * 16;
        KRow<FMT, D> kr[2];
        uint32_t km[2];
        bool valid[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int t = 4 * (g >> 1) + 2 * r + (g & 1), tok = t0 + t;
          valid[r] = tok >= tok_lo && tok < tok_hi;
          kr[r].load(st + t * F::KCB, q);
          km[r] = valid[r] ? ld_meta(st + ST::K + ST::V + t * F::MB, F::INT4) : 0u;
          vm[2 * j + hf][r] = valid[r] ? ld_meta(st + ST::K + ST::V + ST::M + t * F::MB, F::INT4) : 0u;
        }
        W.score(kr, km, valid, P.qk_scale, lut, s[2 * j + hf]);
      }
    }
    float p[4][4];
    W.template softmax<4>(s, p);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      if (j == 0 || two) {
        const uint8_t* st0 = ring[warp][(m0 + j) & (S - 1)];
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          float vs_r[2], vz_r[2];
          W.v_meta(vm[2 * j + hf], vs_r, vz_r);
          W.pv_unit(p[2 * j + hf], vs_r, vz_r, st0 + hf * ST::BYTES + ST::K + 4 * q, g, lut);
        }
      }
      __syncwarp();  // every lane's reads of the slot are done before it is refilled
      issue(m0 + j + S);
      cp_async_commit();
    }
  }
  cp_async_wait<0>();
  __syncthreads();
  merge_store<FMT, D, NW>(W, P, sm_m, sm_l, reinterpret_cast<float(*)[8][D]>(&ring[0][0][0]),
                          row0, split, warp, g, q);
}

constexpr int NWARPS = 4;
constexpr int STAGES = 2;

// The kernel of design V (6 or 7) with S ring slots per warp
template <int V, int FMT, int D, int S>
constexpr auto kernel_of() {
  if constexpr (V == 6)
    return split_v6<FMT, D, NWARPS, S>;
  else
    return split_v7<FMT, D, NWARPS, S>;
}

// The instance's dynamic shared memory allowed past 48 KB, once per instance (per process: one
// GPU kind at a time)
template <int V, int FMT, int D, int S>
cudaError_t prepare() {
  static bool attr = false;
  if (!attr) {
    const cudaError_t e = cudaFuncSetAttribute(kernel_of<V, FMT, D, S>(),
                                               cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               smem_bytes<FMT, D, NWARPS, S>());
    if (e != cudaSuccess) return e;
    attr = true;
  }
  return cudaSuccess;
}

template <int V, int FMT, int D, int S>
int launch(const Params& p, int grid_x, cudaStream_t stream) {
  dim3 grid(grid_x, p.num_splits);
  const cudaError_t e = prepare<V, FMT, D, S>();
  if (e != cudaSuccess) return (int)e;
  kernel_of<V, FMT, D, S>()<<<grid, NWARPS * 32, smem_bytes<FMT, D, NWARPS, S>(), stream>>>(p);
  return (int)cudaGetLastError();
}

template <int V, int S>
int launch_fmt(int fmt, int head_dim, const Params& p, int gx, cudaStream_t s) {
  if (head_dim != 64 && head_dim != 128) return 1000;
  const bool d128 = head_dim == 128;
  switch (fmt) {
    case FMT_INT4: return d128 ? launch<V, FMT_INT4, 128, S>(p, gx, s) : launch<V, FMT_INT4, 64, S>(p, gx, s);
    case FMT_4BIT: return d128 ? launch<V, FMT_4BIT, 128, S>(p, gx, s) : launch<V, FMT_4BIT, 64, S>(p, gx, s);
    case FMT_35BIT: return d128 ? launch<V, FMT_35BIT, 128, S>(p, gx, s) : launch<V, FMT_35BIT, 64, S>(p, gx, s);
    case FMT_3BIT: return d128 ? launch<V, FMT_3BIT, 128, S>(p, gx, s) : launch<V, FMT_3BIT, 64, S>(p, gx, s);
  }
  return 1000;
}

// CTAs of the instance resident per SM on the current device (0 on an error)
template <int V, int FMT, int D, int S>
int resident() {
  int n = 0;
  if (prepare<V, FMT, D, S>() != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel_of<V, FMT, D, S>(), NWARPS * 32,
                                                    smem_bytes<FMT, D, NWARPS, S>()) != cudaSuccess)
    return 0;
  return n;
}

template <int V, int S>
int resident_fmt(int fmt, int head_dim) {
  if (head_dim != 64 && head_dim != 128) return 0;
  const bool d128 = head_dim == 128;
  switch (fmt) {
    case FMT_INT4: return d128 ? resident<V, FMT_INT4, 128, S>() : resident<V, FMT_INT4, 64, S>();
    case FMT_4BIT: return d128 ? resident<V, FMT_4BIT, 128, S>() : resident<V, FMT_4BIT, 64, S>();
    case FMT_35BIT: return d128 ? resident<V, FMT_35BIT, 128, S>() : resident<V, FMT_35BIT, 64, S>();
    case FMT_3BIT: return d128 ? resident<V, FMT_3BIT, 128, S>() : resident<V, FMT_3BIT, 64, S>();
  }
  return 0;
}

// The launch arguments checked and gathered (0), or 1000 + x for an unsupported argument
int make_params(Params& p, const void* q, const float* qs, const uint16_t* lut16,
    const uint8_t* kc, const uint8_t* vc, const int32_t* bt, const int32_t* sl, float* o_part,
    float* lse, float qk_scale, long long stride_btb, int num_kv_heads, int G,
    long long k_page_bytes, long long v_page_bytes, long long k_blk_stride,
    long long v_blk_stride, int PS, int tokens_per_split, int num_splits, int skip) {
  if (G < 1 || G > 8) return 1001;
  if (PS < 16 || (PS & (PS - 1)) || tokens_per_split % 16) return 1002;
  if (k_blk_stride % 16 || v_blk_stride % 16 || k_page_bytes % 16 || v_page_bytes % 16)
    return 1004;  // cp.async and vector loads need 16-byte aligned pages
  p = Params{q,
             qs,
             lut16,
             kc,
             vc,
             bt,
             sl,
             o_part,
             lse,
             qk_scale,
             stride_btb,
             num_kv_heads,
             G,
             k_page_bytes,
             v_page_bytes,
             k_blk_stride,
             v_blk_stride,
             PS,
             31 - __builtin_clz((unsigned)PS),
             tokens_per_split,
             num_splits,
             skip};
  return 0;
}

}  // namespace

extern "C" {

// fmt: 0 = int4 (bf16 q), 1 = 4bit, 2 = 3.5bit, 3 = 3bit (fp16 q' with per-row scale qs, fp16
// level table [4][16]). Design v6 (2 ring stages). Returns a cudaError_t (0 = launched); 1000 +
// x for an unsupported argument.
int kvzd_split_launch(int fmt, int head_dim, const void* q, const float* qs, const uint16_t* lut16,
    const uint8_t* kc, const uint8_t* vc, const int32_t* bt, const int32_t* sl, float* o_part,
    float* lse, float qk_scale, long long stride_btb, int batch, int num_kv_heads, int G,
    long long k_page_bytes, long long v_page_bytes, long long k_blk_stride,
    long long v_blk_stride, int PS, int tokens_per_split, int num_splits, int skip, void* stream) {
  Params p;
  const int rc = make_params(p, q, qs, lut16, kc, vc, bt, sl, o_part, lse, qk_scale, stride_btb,
                             num_kv_heads, G, k_page_bytes, v_page_bytes, k_blk_stride,
                             v_blk_stride, PS, tokens_per_split, num_splits, skip);
  if (rc) return rc;
  return launch_fmt<6, STAGES>(fmt, head_dim, p, batch * num_kv_heads,
                               reinterpret_cast<cudaStream_t>(stream));
}

// Design v7 (NOTES.md "v7": 64-token softmax tiles, branch-free copies; the same arguments and
// results as kvzd_split_launch) with `slots` ring slots of 32 tokens per warp (2 or 4); block
// strides must be below 2^31 (1005 otherwise).
int kvzd_split_launch_v7(int fmt, int head_dim, const void* q, const float* qs,
    const uint16_t* lut16, const uint8_t* kc, const uint8_t* vc, const int32_t* bt,
    const int32_t* sl, float* o_part, float* lse, float qk_scale, long long stride_btb, int batch,
    int num_kv_heads, int G, long long k_page_bytes, long long v_page_bytes,
    long long k_blk_stride, long long v_blk_stride, int PS, int tokens_per_split, int num_splits,
    int skip, void* stream, int slots) {
  Params p;
  const int rc = make_params(p, q, qs, lut16, kc, vc, bt, sl, o_part, lse, qk_scale, stride_btb,
                             num_kv_heads, G, k_page_bytes, v_page_bytes, k_blk_stride,
                             v_blk_stride, PS, tokens_per_split, num_splits, skip);
  if (rc) return rc;
  if (k_blk_stride >= (1LL << 31) || v_blk_stride >= (1LL << 31)) return 1005;
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  const int gx = batch * num_kv_heads;
  if (slots == 2) return launch_fmt<7, 2>(fmt, head_dim, p, gx, s);
  if (slots == 4) return launch_fmt<7, 4>(fmt, head_dim, p, gx, s);
  return 1006;
}

// CTAs of the split kernel for (fmt, head_dim) resident per SM on the current device (the
// split-KV sizing fills whole rounds of them: decode_plan._num_splits); 0 on an error
int kvzd_ctas_per_sm(int fmt, int head_dim) { return resident_fmt<6, STAGES>(fmt, head_dim); }

// The same for design v7 with `slots` ring slots (2 or 4)
int kvzd_ctas_per_sm_v7(int fmt, int head_dim, int slots) {
  if (slots == 2) return resident_fmt<7, 2>(fmt, head_dim);
  if (slots == 4) return resident_fmt<7, 4>(fmt, head_dim);
  return 0;
}

}  // extern "C"
