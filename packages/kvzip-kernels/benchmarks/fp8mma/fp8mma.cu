// fp8mma: a research split-KV paged decode (issue 36 item 3), not wired into the product.
// A research variant of `4bit` at head_dim 128, page size 16, GQA group <= 8, one query token:
// codebook levels are e4m3 bit patterns, decoded from the code nibbles by register PRMT (no
// shared-memory table) straight into mma operands. fp8mma.py has the layout, the packer, the
// reference and the numpy model of every lane's fragments; NOTES.md ("fp8 tensor-core decode")
// the design and its SASS.
//
// Two compile-time variants of the same loop, same bytes, same decoded e4m3 levels:
//   F8  = true : mma.sync.m16n8k32.e4m3.e4m3.f32, Q and P split hi + lo in e4m3 (two MMAs each).
//                sm_89 and sm_100+: QMMA. sm_90 has no synchronous fp8 MMA: ptxas lowers it to
//                F2FP.F16.E4M3.UNPACK_B of every operand register + 2 HMMA.16816.
//   F8  = false: ("cvt") the same e4m3 A registers converted by cvt.rn.f16x2.e4m3x2 (what ptxas
//                does for sm_90 anyway), Q and P in fp16, mma m16n8k16 f16 (one product each).
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
// A 32-token tile = two consecutive 16-token pages A, B. 8-token "blocks" b = 0..3: block row r
// is page r >> 2, position 4b + (r & 3). Score m-tile t: rows 0..7 = block 2t, 8..15 = 2t+1.
// After movmatrix.trans of p (per block) lane (g, q) holds block rows 2q, 2q+1 of head g: page
// q >> 1, positions 4b + 2(q & 1) + {0, 1}: the 8 tokens of one V word (half h = q & 1 of a
// channel of page q >> 1): lo codes i <-> block i >> 1, hi codes i <-> block 2 + (i >> 1),
// token e = i & 1.
//
// Pages (1056 bytes each, as today's 66 bytes per token):
//   K: codes [16 tokens][64 bytes] (lane q's 16 bytes: channels 32q..32q+31, word ks: lo i =
//      channel 32q + 8ks + i, hi i = 32q + 8ks + 4 + i), then fp16 scales [16].
//   V: codes [64 channel pairs][16 bytes]: word (2j, h=0), (2j+1, 0), (2j, 1), (2j+1, 1), then
//      fp16 scales [16]. Value = scale * e4m3(code).
// The cache: uint8 [num_blocks][kv_heads][2][PAGE]: a head's K page, then its V page (one base
// address per page and head; blocks strided by blk_stride bytes).
#include <stdint.h>

#define FULL_MASK 0xffffffffu

namespace {

constexpr int D = 128;
constexpr int PS = 16;              // page size (tokens)
constexpr int PAGE = 16 * 64 + 32;  // K and V page bytes
constexpr int NW = 4;               // warps per CTA
constexpr int S = 2;                // ring stages per warp
// a stage: pages A and B, each its K page then its V page, as the cache holds them (page B's
// V codes start 2 PAGE = 64 mod 128 bytes after page A's: the two pages' 64-bit V loads of a
// half-warp fall in different banks)
constexpr int STAGE = 4 * PAGE;
constexpr int KOFF0 = 0, VOFF0 = PAGE, KOFF1 = 2 * PAGE, VOFF1 = 3 * PAGE;

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
  int64_t blk_stride;  // bytes between blocks (K and V caches alike)
  int tokens_per_split;
  int num_splits;
};

extern __shared__ __align__(16) uint8_t dyn_smem[];

template <bool F8>
__global__ void __launch_bounds__(NW * 32, F8 ? 3 : 4) fp8mma_split(const Params P) {
  const uint32_t ring = static_cast<uint32_t>(__cvta_generic_to_shared(dyn_smem)) +
                        (threadIdx.x / 32) * (S * STAGE);  // this warp's ring
  __shared__ float sm_m[NW][8], sm_l[NW][8];

  const int bh = blockIdx.x, split = blockIdx.y;
  const int b = bh / P.num_kv_heads, h = bh % P.num_kv_heads;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane >> 2, q = lane & 3;

  const int seq_len = P.sl[b];
  const int tok_lo = split * P.tokens_per_split;
  const int tok_hi = min(seq_len, tok_lo + P.tokens_per_split);
  const int tile_lo = tok_lo / 32;
  const int tile_hi = tok_lo < tok_hi ? (tok_hi + 31) / 32 : tile_lo;
  const int npages = (seq_len + PS - 1) / PS;
  const int32_t* btrow = P.bt + (int64_t)b * P.stride_btb;
  const int first = tile_lo + warp;
  const int ntiles = first < tile_hi ? (tile_hi - first + NW - 1) / NW : 0;
  const uint8_t* kvh = P.kv + (int64_t)h * 2 * PAGE + 16 * lane;

  int bidA = 0, bidB = -1;  // lane l: the blocks of tile (base + l)'s two pages (-1: none)
  auto load_bids = [&](int base) {
    const int u = first + (base + lane) * NW;
    bidA = u < tile_hi ? btrow[2 * u] : 0;
    bidB = u < tile_hi && 2 * u + 1 < npages ? btrow[2 * u + 1] : -1;
  };
  auto issue = [&](int n) {
    const int u = first + n * NW;
    if (u >= tile_hi) return;  // warp-uniform
    const int ba = __shfl_sync(FULL_MASK, bidA, n & 31);
    const int bb = __shfl_sync(FULL_MASK, bidB, n & 31);
    const uint32_t dst = ring + (n % S) * STAGE + 16 * lane;
    // a page's K and V: 2 PAGE = 132 chunks of 16 bytes: 4 per lane, and 4 lanes one more
    const uint8_t* src = kvh + (int64_t)ba * P.blk_stride;
#pragma unroll
    for (int i = 0; i < 4; ++i) cp_async16(dst + 512 * i, src + 512 * i);
    if (lane < 4) cp_async16(dst + 2048, src + 2048);
    if (bb >= 0) {
      src = kvh + (int64_t)bb * P.blk_stride;
#pragma unroll
      for (int i = 0; i < 4; ++i) cp_async16(dst + 2 * PAGE + 512 * i, src + 512 * i);
      if (lane < 4) cp_async16(dst + 2 * PAGE + 2048, src + 2048);
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
    if ((nn & 31) == 0) load_bids(nn);
    if (nn < ntiles) issue(nn);
    cp_async_commit();

    const uint32_t st = ring + (n % S) * STAGE;
    const int t0 = (first + n * NW) * 32;
    const int pg = g >> 2;
    const uint32_t kpage = st + (pg ? KOFF1 : KOFF0), vpage = st + (pg ? VOFF1 : VOFF0);
    // scores: m-tile t, rows g (position 8t + (g & 3) of page g >> 2) and g+8 (8t + 4 + ..):
    // s = acc * k_scale (* q's row scale) + (0 or -inf where the token is not in the split)
    float s[2][4], vsc[2][2];
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      uint4 kw[2];
      float kk[2], bias[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int pos = 8 * t + 4 * r + (g & 3);
        const int tok = t0 + 16 * pg + pos;
        const bool valid = tok >= tok_lo && tok < tok_hi;
        kw[r] = lds128(kpage + pos * 64 + 16 * q);
        const float ksc = lds_f16(kpage + 1024 + 2 * pos);
        const float v = lds_f16(vpage + 1024 + 2 * pos);
        kk[r] = valid ? ksc : 0.f;
        bias[r] = valid ? 0.f : neg_inf();
        vsc[t][r] = valid ? v * pscale : 0.f;
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
        s[t][i] = fmaf(acc_s[i], k, bias[i >> 1]);
      }
    }
    // online softmax over the tile (columns = heads 2q, 2q+1)
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
      for (int t = 0; t < 2; ++t) {
        p[t][c] = fast_exp2(s[t][c] - m_use);
        p[t][2 + c] = fast_exp2(s[t][2 + c] - m_use);
        sum += p[t][c] + p[t][2 + c];
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
    // P' = p * v_scale * pscale per block (fp16), transposed: M[blk] = (rows 2q, 2q+1; head g)
    uint32_t M[4];
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      M[2 * t] = movmatrix_trans(pack_f16x2(p[t][0] * vsc[t][0], p[t][1] * vsc[t][0]));
      M[2 * t + 1] = movmatrix_trans(pack_f16x2(p[t][2] * vsc[t][1], p[t][3] * vsc[t][1]));
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
    } else {  // k-pairs (0, 1): lo codes 0, 1 = block 0, hi 0, 1 = block 2; (2, 3): blocks 1, 3
      bp[0] = M[0], bp[1] = M[2], bp[2] = M[1], bp[3] = M[3];
    }
    // O^T += V^T P'^T: m-tile mt rows g (channel 2j), g+8 (2j+1), j = 8 mt + g; words of half
    // q & 1 of page q >> 1
    const uint32_t vrow = st + ((q >> 1) ? VOFF1 : VOFF0) + 16 * g + 8 * (q & 1);
#pragma unroll
    for (int mt = 0; mt < 8; ++mt) {
      const uint2 w = lds64(vrow + 128 * mt);
      uint32_t a[4];
      decode(w.x, T0, T1, a[0], a[2]);
      decode(w.y, T0, T1, a[1], a[3]);
      k32<F8>(acc[mt], a, bp);
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

constexpr int SMEM = NW * S * STAGE;
static_assert(SMEM >= (int)sizeof(float) * NW * 8 * D, "merge buffer");

template <bool F8>
int launch(const Params& p, int batch, cudaStream_t stream) {
  static bool attr = false;
  if (!attr) {
    const cudaError_t e = cudaFuncSetAttribute(
        fp8mma_split<F8>, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM);
    if (e != cudaSuccess) return (int)e;
    attr = true;
  }
  dim3 grid(batch * p.num_kv_heads, p.num_splits);
  fp8mma_split<F8><<<grid, NW * 32, SMEM, stream>>>(p);
  return (int)cudaGetLastError();
}

}  // namespace

extern "C" {

// variant: 1 = F8 (e4m3 mma, q = e4m3 [rows][2][128] hi, lo), 0 = cvt (f16 mma, q = fp16
// [rows][128]). Returns a cudaError_t, or 1000 + x for an unsupported argument.
int fp8mma_split_launch(int variant, const void* q, const float* qs, const uint8_t* kv,
                        const int32_t* bt, const int32_t* sl, float* o_part,
                        float* lse, unsigned t0, unsigned t1, float pscale, long long stride_btb,
                        int batch, int num_kv_heads, int G, long long blk_stride,
                        int tokens_per_split, int num_splits, void* stream) {
  if (G < 1 || G > 8) return 1001;
  if (tokens_per_split % 32) return 1002;
  if (blk_stride % 16) return 1004;
  Params p{static_cast<const uint8_t*>(q), qs, kv, bt, sl, o_part, lse, t0, t1, pscale,
           stride_btb, num_kv_heads, G, blk_stride, tokens_per_split, num_splits};
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  return variant ? launch<true>(p, batch, s) : launch<false>(p, batch, s);
}

int fp8mma_smem_bytes() { return SMEM; }

}  // extern "C"
