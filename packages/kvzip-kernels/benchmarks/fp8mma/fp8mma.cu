// fp8mma: a research split-KV paged decode (issue 36 item 3), not wired into the product.
// A research variant of `4bit` at head_dim 128, page size 16, GQA group <= 8, one query token:
// codebook levels are e4m3 bit patterns, decoded from the code nibbles by register PRMT (no
// shared-memory table) straight into mma operands. fp8mma.py has the layout, the packer, the
// reference and the numpy model of every lane's fragments; NOTES.md ("fp8 tensor-core decode")
// the design and its SASS.
//
// Two compile-time variants of the same loop, same bytes, same decoded e4m3 levels:
//   F8  = true : mma.sync.m16n8k32.e4m3.e4m3.f32, Q and P split hi + lo in e4m3 (two MMAs each).
//                A QMMA.16832 on sm_89 and sm_120 only: sm_90a and sm_100a have no synchronous
//                fp8 MMA (their fp8 tensor cores are wgmma / tcgen05), and ptxas lowers it to
//                F2FP.F16.E4M3.UNPACK_B of every operand register, 2 HMMA.16816 from zero and 4
//                FADD into the accumulator (nvcc 13.0 SASS).
//   F8  = false: ("cvt") the same e4m3 A registers converted by cvt.rn.f16x2.e4m3x2 (F2FP, 2 per
//                register), Q and P in fp16, mma m16n8k16 f16: the Hopper form of the design.
// U: 32-token units per warp tile (1 or 2) sharing one online-softmax update and ring stage.
//
// SWAP_AB as v6: tokens are M, the query heads of the KV head are N = 8.
//   scores S^T [16 tok x 8] = K [16 x 128] . Q^T       (A = K levels, B = q)
//   output O^T [128 x 8]  += V^T [128 x 32 tok] . P^T  (A = V levels, B = p * v_scale)
//
// The code word (K and V): 32 bits = 8 sign-magnitude codes. "lo" codes i = 0..3 (the mma's
// k-elements 4q+i) and "hi" codes i (k-elements 16+4q+i):
//   magnitude of lo i: bits 4i..4i+2      sign of lo i: bit 8i+7
//   magnitude of hi i: bits 16+4i..+2     sign of hi i: bit 8i+3
// decode (7 instructions per 8 codes, no table in memory; T0, T1 = the 8 e4m3 magnitudes):
//   m = w & 0x77777777; lo = prmt(T0, T1, m); hi = prmt(T0, T1, m >> 16);
//   A_lo = lo ^ (w & 0x80808080); A_hi = hi ^ ((w << 4) & 0x80808080)
//
// A 32-token unit = two consecutive 16-token pages A, B. 8-token "blocks" b = 0..3: block row r
// is page r >> 2, position 4b + (r & 3). Score m-tile t: rows 0..7 = block 2t, 8..15 = 2t+1.
// After movmatrix.trans of p (per block) lane (g, q) holds block rows 2q, 2q+1 of head g: page
// q >> 1, positions 4b + 2(q & 1) + {0, 1}: the 8 tokens of one V word (half h = q & 1 of a
// channel of page q >> 1): lo codes i <-> block i >> 1, hi codes i <-> block 2 + (i >> 1),
// token e = i & 1.
//
// A page (16 tokens of one KV head): 1024 bytes of K codes, 1024 of V codes, 16 + 16 fp16
// scales: 132 bytes per token and head, as today's `4bit` (2 x 66).
//   K codes [16 tokens][64 bytes] (lane q's 16 bytes: channels 32q..32q+31, word ks: lo i =
//      channel 32q + 8ks + i, hi i = 32q + 8ks + 4 + i).
//   V codes [64 channel pairs][16 bytes]: word (2j, h=0), (2j+1, 0), (2j, 1), (2j+1, 1).
//   Value = scale * e4m3(code).
// The cache (codes and scales as separate arrays of each block, spec/4bit.md section 5 allows
// it): block = [kv_heads][K codes, V codes] (2048 bytes per head) then [kv_heads][K scales,
// V scales] (64 bytes per head); blocks blk_stride bytes apart. A page's codes are then 128
// chunks of 16 bytes, 4 per lane, and the 2U pages' scales of a tile 4 chunks each.
#include <stdint.h>

#define FULL_MASK 0xffffffffu

namespace {

constexpr int D = 128;
constexpr int PS = 16;              // page size (tokens)
constexpr int CODES = 2048;          // a page's K and V codes
constexpr int NW = 4;               // warps per CTA
constexpr int S = 2;                // ring stages per warp
// A ring stage of U units (2U pages): page k's codes at pg_off(k) (K, then V at +1024; each
// odd page 64 bytes after the page before it, so that a unit's two pages' 64-bit V loads of a
// half-warp fall in different banks), then the scales: page k's K scales at scale_off(U) +
// 64 k, V at + 32. (The padding accumulates: a padding of 64 (k & 1) alone put page 2 inside
// page 1's last 64 bytes, which only U = 2 has: its GPU checks failed, U = 1's passed.)
__host__ __device__ constexpr int pg_off(int k) { return k * CODES + 64 * ((k + 1) / 2); }
__host__ __device__ constexpr int scale_off(int U) { return pg_off(2 * U - 1) + CODES; }
__host__ __device__ constexpr int stage_bytes(int U) { return scale_off(U) + 2 * U * 64; }
// no page overlaps the next, nor the scales; a unit's odd page 64 bytes past the bank of its
// even one; every offset 16-byte aligned (cp.async)
template <int U>
constexpr bool stage_ok() {
  for (int k = 0; k + 1 < 2 * U; ++k)
    if (pg_off(k) + CODES > pg_off(k + 1) || pg_off(k) % 16) return false;
  for (int e = 0; e < U; ++e)
    if (pg_off(2 * e + 1) - pg_off(2 * e) != CODES + 64) return false;
  return pg_off(2 * U - 1) + CODES <= scale_off(U) && scale_off(U) % 16 == 0 &&
         stage_bytes(U) % 16 == 0;
}
static_assert(stage_ok<1>() && stage_ok<2>(), "a ring stage's pages overlap or are misaligned");

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint32_t pack_f16x2(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

// e4m3 pair (bits 0-15 of x, or 16-31 with HI) -> f16x2
template <bool HI>
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t x) {
  uint32_t r;
  if (HI)
    asm("{ .reg .b16 l, h; mov.b32 {l, h}, %1; cvt.rn.f16x2.e4m3x2 %0, h; }\n" : "=r"(r) : "r"(x));
  else
    asm("{ .reg .b16 l, h; mov.b32 {l, h}, %1; cvt.rn.f16x2.e4m3x2 %0, l; }\n" : "=r"(r) : "r"(x));
  return r;
}

// f16x2 -> e4m3x2 (round to nearest even, saturating), in bits 0-15
__device__ __forceinline__ uint32_t f16x2_to_e4m3x2(uint32_t x) {
  uint32_t r;
  asm("{ .reg .b16 t; cvt.rn.satfinite.e4m3x2.f16x2 t, %1; cvt.u32.u16 %0, t; }\n"
      : "=r"(r)
      : "r"(x));
  return r;
}

__device__ __forceinline__ uint32_t hsub2(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("sub.rn.f16x2 %0, %1, %2;\n" : "=r"(r) : "r"(a), "r"(b));
  return r;
}

__device__ __forceinline__ void mma_f8(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void mma_f16(float c[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                        uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The decode of one code word into the e4m3 A registers of its lo and hi codes
__device__ __forceinline__ void decode(uint32_t w, uint32_t t0, uint32_t t1, uint32_t& alo,
                                       uint32_t& ahi) {
  const uint32_t m = w & 0x77777777u;
  alo = prmt(t0, t1, m) ^ (w & 0x80808080u);
  ahi = prmt(t0, t1, m >> 16) ^ ((w << 4) & 0x80808080u);
}

// One k32 product: a = {lo(row g), lo(row g+8), hi(row g), hi(row g+8)}. F8: one e4m3 mma per
// B operand given (hi, then lo). cvt: two f16 mma: k-pairs (0, 1) of every register, then (2, 3).
template <bool F8>
__device__ __forceinline__ void k32(float c[4], const uint32_t a[4], const uint32_t* b) {
  if constexpr (F8) {
    mma_f8(c, a, b[0], b[1]);  // hi
    mma_f8(c, a, b[2], b[3]);  // lo
  } else {
    mma_f16(c, e4m3x2_to_f16x2<false>(a[0]), e4m3x2_to_f16x2<false>(a[1]),
            e4m3x2_to_f16x2<false>(a[2]), e4m3x2_to_f16x2<false>(a[3]), b[0], b[1]);
    mma_f16(c, e4m3x2_to_f16x2<true>(a[0]), e4m3x2_to_f16x2<true>(a[1]),
            e4m3x2_to_f16x2<true>(a[2]), e4m3x2_to_f16x2<true>(a[3]), b[2], b[3]);
  }
}

__device__ __forceinline__ void cp_async16(uint32_t s, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
// shared-memory loads on 32-bit shared-window addresses (the stage base is computed once)
__device__ __forceinline__ uint4 lds128(uint32_t a) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(a));
  return v;
}
__device__ __forceinline__ uint2 lds64(uint32_t a) {
  uint2 v;
  asm volatile("ld.shared.v2.u32 {%0,%1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "r"(a));
  return v;
}
__device__ __forceinline__ float lds_f16(uint32_t a) {  // an fp16 in shared memory, as float
  float f;
  asm volatile("{ .reg .b16 t; ld.shared.b16 t, [%1]; cvt.f32.f16 %0, t; }\n" : "=f"(f) : "r"(a));
  return f;
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

struct Params {
  const uint8_t* q;  // F8: e4m3 [rows][2][D] (hi, lo); cvt: fp16 [rows][D]
  const float* qs;   // [rows]: score = acc * qs * k_scale (qk_scale folded in)
  const uint8_t* kv;  // [blocks][kv_heads][K page, V page]
  const int32_t* bt;
  const int32_t* sl;
  float* o_part;  // [rows, splits, D]
  float* lse;     // [rows, splits] base 2
  uint32_t t0, t1;  // the 8 e4m3 magnitudes, ascending
  float pscale;     // P' = p * v_scale * pscale (into e4m3's range)
  int64_t stride_btb;
  int num_kv_heads;
  int G;
  uint32_t blk_stride;  // bytes between blocks (< 4 GiB)
  int tokens_per_split;
  int num_splits;
};

extern __shared__ __align__(16) uint8_t dyn_smem[];

// U 32-token units (each two consecutive pages, the layout above) per warp tile, sharing one
// online-softmax update and one ring stage (U = 2: 64 tokens, 4 pages)
template <bool F8, int U>
__global__ void __launch_bounds__(NW * 32, (F8 || U > 1) ? 3 : 4) fp8mma_split(const Params P) {
  constexpr int TT = 32 * U;          // tokens per tile
  constexpr int STG = stage_bytes(U);  // bytes per ring stage
  constexpr int BIDT = 32 / (2 * U);  // tiles whose block ids one load holds (a lane per page)
  const uint32_t ring = static_cast<uint32_t>(__cvta_generic_to_shared(dyn_smem)) +
                        (threadIdx.x / 32) * (S * STG);  // this warp's ring
  __shared__ float sm_m[NW][8], sm_l[NW][8];

  const int bh = blockIdx.x, split = blockIdx.y;
  const int b = bh / P.num_kv_heads, h = bh % P.num_kv_heads;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane >> 2, q = lane & 3;

  const int seq_len = P.sl[b];
  const int tok_lo = split * P.tokens_per_split;
  const int tok_hi = min(seq_len, tok_lo + P.tokens_per_split);
  const int tile_lo = tok_lo / TT;
  const int tile_hi = tok_lo < tok_hi ? (tok_hi + TT - 1) / TT : tile_lo;
  const int npages = (seq_len + PS - 1) / PS;
  const int32_t* btrow = P.bt + (int64_t)b * P.stride_btb;
  const int first = tile_lo + warp;
  const int ntiles = first < tile_hi ? (tile_hi - first + NW - 1) / NW : 0;
  const uint8_t* kvh = P.kv + h * CODES + 16 * lane;  // + block * blk_stride
  const uint8_t* sch = P.kv + P.num_kv_heads * CODES + h * 64 + 16 * (lane & 3);

  // lane l: the block of page l % (2U) of this warp's tile base + l / (2U); a page past the
  // sequence's last reads the last one again (its tokens are masked): no branch per page
  uint32_t bid = 0;
  auto load_bids = [&](int base) {
    const int u = first + (base + lane / (2 * U)) * NW;
    const int page = min(2 * U * u + lane % (2 * U), npages - 1);
    bid = u < tile_hi ? btrow[page] : 0u;
  };
  auto issue = [&](int n) {
    const int u = first + n * NW;
    if (u >= tile_hi) return;  // warp-uniform
    const uint32_t dst = ring + (n % S) * STG;
    const int base = (n % BIDT) * 2 * U;
    // the scales: lane l < 8U copies chunk l % 4 of page l / 4
    const uint32_t bs = __shfl_sync(FULL_MASK, bid, base + (lane >> 2) % (2 * U));
    if (lane < 8 * U) cp_async16(dst + scale_off(U) + 16 * lane, sch + (uint64_t)bs * P.blk_stride);
#pragma unroll
    for (int k = 0; k < 2 * U; ++k) {  // a page's codes: 4 chunks per lane
      const uint32_t bk = __shfl_sync(FULL_MASK, bid, base + k);
      const uint8_t* src = kvh + (uint64_t)bk * P.blk_stride;
#pragma unroll
      for (int i = 0; i < 4; ++i) cp_async16(dst + pg_off(k) + 16 * lane + 512 * i, src + 512 * i);
    }
  };

  load_bids(0);
#pragma unroll
  for (int n = 0; n < S - 1; ++n) {
    if (n < ntiles) issue(n);
    cp_async_commit();
  }

  // the query's B fragments: k-step ks takes channels 32q + 8ks + 0..7 of head g
  const int64_t row0 = (int64_t)bh * P.G;
  uint32_t bq[4][4];
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) {
    const int c = 32 * q + 8 * ks;
    if (g < P.G) {
      if constexpr (F8) {
        const uint8_t* qp = P.q + (row0 + g) * 2 * D;
        const uint2 hi = *reinterpret_cast<const uint2*>(qp + c);
        const uint2 lo = *reinterpret_cast<const uint2*>(qp + D + c);
        bq[ks][0] = hi.x, bq[ks][1] = hi.y, bq[ks][2] = lo.x, bq[ks][3] = lo.y;
      } else {  // (c, c+1) (c+4, c+5); (c+2, c+3) (c+6, c+7)
        const uint4 v = *reinterpret_cast<const uint4*>(P.q + ((row0 + g) * D + c) * 2);
        bq[ks][0] = v.x, bq[ks][1] = v.z, bq[ks][2] = v.y, bq[ks][3] = v.w;
      }
    } else {
      bq[ks][0] = bq[ks][1] = bq[ks][2] = bq[ks][3] = 0u;
    }
  }
  float colc[2];  // F8: the row scale of q (cvt: folded into the fp16 q)
#pragma unroll
  for (int i = 0; i < 2; ++i) colc[i] = F8 && 2 * q + i < P.G ? P.qs[row0 + 2 * q + i] : 1.f;
  float m_i[2] = {neg_inf(), neg_inf()}, l_i[2] = {0.f, 0.f};
  float acc[8][4];
#pragma unroll
  for (int mt = 0; mt < 8; ++mt) acc[mt][0] = acc[mt][1] = acc[mt][2] = acc[mt][3] = 0.f;
  const uint32_t T0 = P.t0, T1 = P.t1;
  const float pscale = P.pscale;

  for (int n = 0; n < ntiles; ++n) {
    cp_async_wait<S - 2>();
    __syncwarp();
    const int nn = n + S - 1;
    if (nn % BIDT == 0) load_bids(nn);
    if (nn < ntiles) issue(nn);
    cp_async_commit();

    const uint32_t st0 = ring + (n % S) * STG;
    const int pg = g >> 2;
    // scores of unit e: m-tile t, rows g (position 8t + (g & 3) of the unit's page g >> 2) and
    // g+8 (8t + 4 + ..): s = acc * k_scale (* q's row scale) + (0 or -inf outside the split)
    float s[U][2][4], vsc[U][2][2];
#pragma unroll
    for (int e = 0; e < U; ++e) {
      const int t0 = (first + n * NW) * TT + 32 * e;
      const uint32_t kpage = st0 + pg_off(2 * e + pg);
      const uint32_t ksc0 = st0 + scale_off(U) + 64 * (2 * e + pg);
#pragma unroll
      for (int t = 0; t < 2; ++t) {
        uint4 kw[2];
        float kk[2], bias[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int pos = 8 * t + 4 * r + (g & 3);
          const int tok = t0 + 16 * pg + pos;
          const bool valid = tok < tok_hi;  // tok >= tok_lo: tiles start at split starts
          kw[r] = lds128(kpage + pos * 64 + 16 * q);
          const float ksc = lds_f16(ksc0 + 2 * pos);
          const float v = lds_f16(ksc0 + 32 + 2 * pos);
          kk[r] = valid ? ksc : 0.f;
          bias[r] = valid ? 0.f : neg_inf();
          vsc[e][t][r] = valid ? v * pscale : 0.f;
        }
        float acc_s[4] = {0.f, 0.f, 0.f, 0.f};
        const uint32_t w0[4] = {kw[0].x, kw[0].y, kw[0].z, kw[0].w};
        const uint32_t w1[4] = {kw[1].x, kw[1].y, kw[1].z, kw[1].w};
#pragma unroll
        for (int ks = 0; ks < 4; ++ks) {
          uint32_t a[4];
          decode(w0[ks], T0, T1, a[0], a[2]);
          decode(w1[ks], T0, T1, a[1], a[3]);
          k32<F8>(acc_s, a, bq[ks]);
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float k = F8 ? kk[i >> 1] * colc[i & 1] : kk[i >> 1];
          s[e][t][i] = fmaf(acc_s[i], k, bias[i >> 1]);
        }
      }
    }
    // online softmax over the tile (columns = heads 2q, 2q+1)
    float alpha[2], p[U][2][4];
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      float mx = neg_inf();
#pragma unroll
      for (int e = 0; e < U; ++e)
        mx = fmaxf(mx, fmaxf(fmaxf(s[e][0][c], s[e][0][2 + c]), fmaxf(s[e][1][c], s[e][1][2 + c])));
      mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 4));
      mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 8));
      mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 16));
      const float m_new = fmaxf(m_i[c], mx);
      const bool none = m_new == neg_inf();
      const float m_use = none ? 0.f : m_new;
      alpha[c] = none ? 1.f : fast_exp2(m_i[c] - m_use);
      float sum = 0.f;
#pragma unroll
      for (int e = 0; e < U; ++e)
#pragma unroll
        for (int t = 0; t < 2; ++t) {
          p[e][t][c] = fast_exp2(s[e][t][c] - m_use);
          p[e][t][2 + c] = fast_exp2(s[e][t][2 + c] - m_use);
          sum += p[e][t][c] + p[e][t][2 + c];
        }
      l_i[c] = l_i[c] * alpha[c] + sum;
      m_i[c] = m_new;
    }
    if (__any_sync(FULL_MASK, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
      for (int mt = 0; mt < 8; ++mt) {
        acc[mt][0] *= alpha[0];
        acc[mt][1] *= alpha[1];
        acc[mt][2] *= alpha[0];
        acc[mt][3] *= alpha[1];
      }
    }
#pragma unroll
    for (int e = 0; e < U; ++e) {
      // P' = p v_scale pscale per block (fp16), transposed: M[blk] = (rows 2q, 2q+1; head g)
      uint32_t M[4];
#pragma unroll
      for (int t = 0; t < 2; ++t) {
        M[2 * t] = movmatrix_trans(
            pack_f16x2(p[e][t][0] * vsc[e][t][0], p[e][t][1] * vsc[e][t][0]));
        M[2 * t + 1] = movmatrix_trans(
            pack_f16x2(p[e][t][2] * vsc[e][t][1], p[e][t][3] * vsc[e][t][1]));
      }
      uint32_t bp[4];
      if constexpr (F8) {  // b0 = blocks 0, 1; b1 = blocks 2, 3; hi then lo
        uint32_t hi8[4], lo8[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          hi8[k] = f16x2_to_e4m3x2(M[k]);
          lo8[k] = f16x2_to_e4m3x2(hsub2(M[k], e4m3x2_to_f16x2<false>(hi8[k])));
        }
        bp[0] = hi8[0] | (hi8[1] << 16);
        bp[1] = hi8[2] | (hi8[3] << 16);
        bp[2] = lo8[0] | (lo8[1] << 16);
        bp[3] = lo8[2] | (lo8[3] << 16);
      } else {  // k-pairs (0, 1): lo codes 0, 1 = block 0, hi 0, 1 = block 2; (2, 3): 1, 3
        bp[0] = M[0], bp[1] = M[2], bp[2] = M[1], bp[3] = M[3];
      }
      // O^T += V^T P'^T: m-tile mt rows g (channel 2j), g+8 (2j+1), j = 8 mt + g; words of
      // half q & 1 of the unit's page q >> 1
      const uint32_t vrow = st0 + pg_off(2 * e + (q >> 1)) + 1024 + 16 * g + 8 * (q & 1);
#pragma unroll
      for (int mt = 0; mt < 8; ++mt) {
        const uint2 w = lds64(vrow + 128 * mt);
        uint32_t a[4];
        decode(w.x, T0, T1, a[0], a[2]);
        decode(w.y, T0, T1, a[1], a[3]);
        k32<F8>(acc[mt], a, bp);
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();

  // merge the warps (as v6)
  float(*sm_o)[8][D] = reinterpret_cast<float(*)[8][D]>(dyn_smem);
#pragma unroll
  for (int c = 0; c < 2; ++c)
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) l_i[c] += __shfl_xor_sync(FULL_MASK, l_i[c], o);
  if (g == 0) {
    sm_m[warp][2 * q] = m_i[0];
    sm_m[warp][2 * q + 1] = m_i[1];
    sm_l[warp][2 * q] = l_i[0];
    sm_l[warp][2 * q + 1] = l_i[1];
  }
#pragma unroll
  for (int mt = 0; mt < 8; ++mt) {
    const int ch = 16 * mt + 2 * g;
    sm_o[warp][2 * q][ch] = acc[mt][0];
    sm_o[warp][2 * q + 1][ch] = acc[mt][1];
    sm_o[warp][2 * q][ch + 1] = acc[mt][2];
    sm_o[warp][2 * q + 1][ch + 1] = acc[mt][3];
  }
  __syncthreads();
  const float out_scale = 1.f / pscale;
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

template <int U>
constexpr int smem_bytes() { return NW * S * stage_bytes(U); }
static_assert(smem_bytes<1>() >= (int)sizeof(float) * NW * 8 * D, "merge buffer");

template <bool F8, int U>
int launch(const Params& p, int batch, cudaStream_t stream) {
  static bool attr = false;
  if (!attr) {
    const cudaError_t e = cudaFuncSetAttribute(
        fp8mma_split<F8, U>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes<U>());
    if (e != cudaSuccess) return (int)e;
    attr = true;
  }
  dim3 grid(batch * p.num_kv_heads, p.num_splits);
  fp8mma_split<F8, U><<<grid, NW * 32, smem_bytes<U>(), stream>>>(p);
  return (int)cudaGetLastError();
}

}  // namespace

extern "C" {

// variant: 1 = F8 (e4m3 mma, q = e4m3 [rows][2][128] hi, lo), 0 = cvt (f16 mma, q = fp16
// [rows][128]); units: 32-token units per warp tile (1 or 2; tokens_per_split a multiple of
// 32 units). Returns a cudaError_t, or 1000 + x for an unsupported argument.
int fp8mma_split_launch(int variant, const void* q, const float* qs, const uint8_t* kv,
                        const int32_t* bt, const int32_t* sl, float* o_part,
                        float* lse, unsigned t0, unsigned t1, float pscale, long long stride_btb,
                        int batch, int num_kv_heads, int G, long long blk_stride,
                        int tokens_per_split, int num_splits, int units, void* stream) {
  if (G < 1 || G > 8) return 1001;
  if ((units != 1 && units != 2) || tokens_per_split % (32 * units)) return 1002;
  if (blk_stride % 16 || blk_stride >= (1ll << 32)) return 1004;
  Params p{static_cast<const uint8_t*>(q), qs, kv, bt, sl, o_part, lse, t0, t1, pscale,
           stride_btb, num_kv_heads, G, (uint32_t)blk_stride, tokens_per_split, num_splits};
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  if (units == 2) return variant ? launch<true, 2>(p, batch, s) : launch<false, 2>(p, batch, s);
  return variant ? launch<true, 1>(p, batch, s) : launch<false, 1>(p, batch, s);
}

int fp8mma_smem_bytes(int units) { return units == 2 ? smem_bytes<2>() : smem_bytes<1>(); }

}  // extern "C"
