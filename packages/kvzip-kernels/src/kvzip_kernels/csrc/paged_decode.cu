// Split-KV paged decode attention for kvzip's paged layout (kvzip_formats/spec/paged_layout.md),
// `int4` and the compact `4bit`, with mma.sync m16n8k16 (sm_80 and newer; tuned for sm_90).
//
// One CTA = one (sequence, KV head, split); NW warps take 16-token tiles in turn and keep
// their own online-softmax state, merged through shared memory at the end. The CTA writes
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
// The depth (head_dim) order of the first product is free (a dot product): thread q (= lane
// % 4) takes the bytes [q*D/8, (q+1)*D/8) of a K row, one 16- or 8-byte load, and k-step ks
// uses its bytes 2ks and 2ks+1 (channels c = q*D/4 + 4ks + 0..3: for 4bit a table lookup per
// byte gives the pairs (c, c+1), (c+2, c+3); for int4 one PRMT per byte pair gives the low
// nibbles (c, c+2) and the high nibbles (c+1, c+3)); the query fragment is loaded in the
// same channel order. The V rows are channel-major (byte j of token t at j*PS + t):
// a 16-bit load gives one byte row for two consecutive tokens, its low nibbles are output
// channel 2j and its high nibbles channel 2j+1 (rows g and g+8 of the m-tile).
//
// Dequantisation is folded into the products as in the Triton kernels:
//   int4:  a code c becomes the bf16 128 + c (0x4300 | c); q.k = s (q.(c+128)) +
//          (z - 128 s) sum(q); the V side adds sum_t (p_t z_t - 128 (p s)_t) per head, with
//          the bf16-rounded p s in both terms.
//   4bit:  a byte of two codes becomes two fp16 levels by one shared-memory table lookup
//          (256 entries); q' = B_k^T q comes scaled per row into fp16 (qs undoes it) and
//          p s is multiplied by 64 before its fp16 rounding (out of the subnormals).
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

template <int D>
struct KChunk;  // a thread's D/8 bytes of one K row
template <>
struct KChunk<128> {
  uint4 v;
  __device__ __forceinline__ void load(const uint8_t* p) { v = *reinterpret_cast<const uint4*>(p); }
  __device__ __forceinline__ uint32_t word(int ks) const {  // holds bytes 2ks, 2ks+1
    return ks < 2 ? v.x : ks < 4 ? v.y : ks < 6 ? v.z : v.w;
  }
};
template <>
struct KChunk<64> {
  uint2 v;
  __device__ __forceinline__ void load(const uint8_t* p) { v = *reinterpret_cast<const uint2*>(p); }
  __device__ __forceinline__ uint32_t word(int ks) const { return ks < 2 ? v.x : v.y; }
};

struct Params {
  const void* q;          // int4: bf16 q [b, hq, D]; 4bit: fp16 q' [b, hq, D] (contiguous)
  const float* qs;        // 4bit: per-row scale of q' [b * hq]; int4: unused
  const uint16_t* lut16;  // 4bit: the 16 fp16 levels, ascending; int4: unused
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
  int tokens_per_split;
  int num_splits;
  int skip;  // sink tokens (attended elsewhere): positions below are not read
};

template <int D, bool INT4, int NW>
__global__ void __launch_bounds__(NW * 32)
    split_kernel(const Params P) {
  constexpr int KS = D / 16;   // k-steps of the score product = m-tiles of the output
  constexpr int CB = D / 2;    // code bytes per row (4-bit codes)
  constexpr bool BF16 = INT4;

  __shared__ uint32_t lut[INT4 ? 1 : 256];
  __shared__ float sm_m[NW][8], sm_l[NW][8];
  __shared__ float sm_o[NW][8][D];

  const int bh = blockIdx.x;
  const int split = blockIdx.y;
  const int b = bh / P.num_kv_heads;
  const int h = bh % P.num_kv_heads;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int g = lane >> 2;  // groupID: token row g (and g+8), head g of the B operands
  const int q = lane & 3;   // thread in group: heads 2q, 2q+1 of the accumulators

  if (!INT4) {
    for (int i = threadIdx.x; i < 256; i += NW * 32) {
      uint32_t lo = P.lut16[i & 15], hi = P.lut16[i >> 4];
      lut[i] = lo | (hi << 16);
    }
  }

  const int seq_len = P.sl[b];
  const int tok_lo = max(split * P.tokens_per_split, P.skip);
  const int tok_hi = min(seq_len, split * P.tokens_per_split + P.tokens_per_split);

  // query fragments (B of the score product): head g, channels q*D/4 + 4ks + 0..3
  const int64_t row0 = (int64_t)bh * P.G;  // = b * hq + h * G: first query row of this KV head
  uint32_t bq[KS][2];
  {
    const uint16_t* qp =
        reinterpret_cast<const uint16_t*>(P.q) + (row0 + g) * D + q * (D / 4);
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      if (g < P.G) {
        const uint2 v = *reinterpret_cast<const uint2*>(qp + 4 * ks);  // channels c..c+3
        // in the order of the K fragments: int4 (c, c+2), (c+1, c+3); 4bit (c, c+1), (c+2, c+3)
        bq[ks][0] = INT4 ? prmt(v.x, v.y, 0x5410) : v.x;
        bq[ks][1] = INT4 ? prmt(v.x, v.y, 0x7632) : v.y;
      } else {
        bq[ks][0] = bq[ks][1] = 0u;
      }
    }
  }
  // per accumulator column (heads 2q, 2q+1): int4 sum(q); 4bit the row scale of q'
  float colc[2];
  if (INT4) {
    float s = 0.f;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks)
      s += lo_f32<true>(bq[ks][0]) + hi_f32<true>(bq[ks][0]) + lo_f32<true>(bq[ks][1]) +
           hi_f32<true>(bq[ks][1]);
    s += __shfl_xor_sync(FULL_MASK, s, 1);
    s += __shfl_xor_sync(FULL_MASK, s, 2);  // lanes 4g..4g+3: sum(q) of head g
    colc[0] = __shfl_sync(FULL_MASK, s, 4 * (2 * q));
    colc[1] = __shfl_sync(FULL_MASK, s, 4 * (2 * q + 1));
  } else {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      int hd = 2 * q + i;
      colc[i] = hd < P.G ? P.qs[row0 + hd] * P.qk_scale : 0.f;
    }
  }
  if (!INT4) __syncthreads();  // the level table

  float m_i[2] = {neg_inf(), neg_inf()};
  float l_i[2] = {0.f, 0.f};
  float acc_c[2] = {0.f, 0.f};
  float acc[KS][4];
#pragma unroll
  for (int mt = 0; mt < KS; ++mt) acc[mt][0] = acc[mt][1] = acc[mt][2] = acc[mt][3] = 0.f;

  const int tile_lo = tok_lo / 16;
  const int tile_hi = tok_lo < tok_hi ? (tok_hi + 15) / 16 : tile_lo;
  const int64_t kho = (int64_t)h * P.k_page_bytes;
  const int64_t vho = (int64_t)h * P.v_page_bytes;
  const int32_t* btrow = P.bt + (int64_t)b * P.stride_btb;

  // One tile ahead: the next tile's block id, K codes and metadata are loaded while this
  // tile's softmax and PV run (and its block id one tile earlier still), so the loop waits
  // on one memory latency per tile at most.
  const int first = tile_lo + warp;
  auto block_of = [&](int tile) -> int64_t { return tile < tile_hi ? btrow[tile * 16 / P.PS] : 0; };
  auto load_raw = [&](int tile, int64_t blk, KChunk<D> kr[2], uint32_t km[2], uint32_t vm[2]) {
    const int t0 = tile * 16, toff = t0 % P.PS;
    const uint8_t* kpage = P.kc + blk * P.k_blk_stride + kho;
    const uint8_t* vpage = P.vc + blk * P.v_blk_stride + vho;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int t = toff + g + 8 * r, tok = t0 + g + 8 * r;
      const bool ok = tok >= tok_lo && tok < tok_hi;
      kr[r].load(kpage + (int64_t)t * CB + q * (CB / 4));
      if (INT4) {
        km[r] = ok ? *reinterpret_cast<const uint32_t*>(kpage + P.PS * CB + t * 4) : 0u;
        vm[r] = ok ? *reinterpret_cast<const uint32_t*>(vpage + P.PS * CB + t * 4) : 0u;
      } else {
        km[r] = ok ? *reinterpret_cast<const uint16_t*>(kpage + P.PS * CB + t * 2) : 0u;
        vm[r] = ok ? *reinterpret_cast<const uint16_t*>(vpage + P.PS * CB + t * 2) : 0u;
      }
    }
  };
  int64_t blk_cur = block_of(first);
  int64_t blk_nxt = block_of(first + NW);
  KChunk<D> kr[2];
  uint32_t km[2] = {0u, 0u}, vm[2] = {0u, 0u};
  if (first < tile_hi) load_raw(first, blk_cur, kr, km, vm);

  for (int tile = first; tile < tile_hi; tile += NW) {
    const int t0 = tile * 16;
    const int toff = t0 % P.PS;
    const uint8_t* vpage = P.vc + blk_cur * P.v_blk_stride + vho;

    // ---- scores S^T = K Q^T: rows g and g+8 of the tile ----
    float ks_r[2], kz_r[2], vs_r[2], vz_r[2];
    bool valid[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int tok = t0 + g + 8 * r;
      valid[r] = tok >= tok_lo && tok < tok_hi;
      if (INT4) {
        ks_r[r] = f16_to_f32(km[r] & 0xFFFFu);
        kz_r[r] = f16_to_f32(km[r] >> 16);
        vs_r[r] = f16_to_f32(vm[r] & 0xFFFFu);
        vz_r[r] = f16_to_f32(vm[r] >> 16);
      } else {
        ks_r[r] = f16_to_f32(km[r] & 0xFFFFu);
        vs_r[r] = f16_to_f32(vm[r] & 0xFFFFu) * 64.f;
        kz_r[r] = vz_r[r] = 0.f;
      }
    }
    float s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      const uint32_t w0 = kr[0].word(ks), w1 = kr[1].word(ks);
      uint32_t a[4];
      if (INT4) {  // a[0]: channels c, c+2 (low nibbles); a[2]: c+1, c+3 (high nibbles)
        if (ks & 1) {
          int4_pairs<true>(w0, a[0], a[2]);
          int4_pairs<true>(w1, a[1], a[3]);
        } else {
          int4_pairs<false>(w0, a[0], a[2]);
          int4_pairs<false>(w1, a[1], a[3]);
        }
      } else {  // a[0]: channels c, c+1 (byte 2ks); a[2]: c+2, c+3 (byte 2ks+1)
        const uint32_t h0 = (ks & 1) ? w0 >> 16 : w0 & 0xFFFFu;
        const uint32_t h1 = (ks & 1) ? w1 >> 16 : w1 & 0xFFFFu;
        a[0] = lut[h0 & 0xFFu];
        a[1] = lut[h1 & 0xFFu];
        a[2] = lut[h0 >> 8];
        a[3] = lut[h1 >> 8];
      }
      mma16816<BF16>(s, a, bq[ks][0], bq[ks][1]);
    }
    // ---- prefetch the next tile (its K codes and metadata replace this tile's) ----
    if (tile + NW < tile_hi) {
      load_raw(tile + NW, blk_nxt, kr, km, vm);
      blk_cur = blk_nxt;
      blk_nxt = block_of(tile + 2 * NW);
    }
    // s[0], s[1]: token g, heads 2q, 2q+1; s[2], s[3]: token g+8
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = i >> 1, c = i & 1;
      float v = INT4 ? (s[i] * ks_r[r] + (kz_r[r] - 128.f * ks_r[r]) * colc[c]) * P.qk_scale
                     : s[i] * ks_r[r] * colc[c];
      s[i] = valid[r] ? v : neg_inf();
    }
    // ---- online softmax per head column ----
    float alpha[2], p[4];
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      float mx = fmaxf(s[c], s[2 + c]);
      mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 4));
      mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 8));
      mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 16));
      const float m_new = fmaxf(m_i[c], mx);
      const bool none = m_new == neg_inf();
      const float m_use = none ? 0.f : m_new;
      alpha[c] = none ? 1.f : fast_exp2(m_i[c] - m_use);
      p[c] = fast_exp2(s[c] - m_use);
      p[2 + c] = fast_exp2(s[2 + c] - m_use);
      l_i[c] = l_i[c] * alpha[c] + p[c] + p[2 + c];
      m_i[c] = m_new;
    }
    // P' = p * (scale of the token's V row), 16-bit; int4 keeps the zero-point term aside
    uint32_t plo = pack2<BF16>(p[0] * vs_r[0], p[1] * vs_r[0]);
    uint32_t phi = pack2<BF16>(p[2] * vs_r[1], p[3] * vs_r[1]);
    if (INT4) {
      acc_c[0] = acc_c[0] * alpha[0] + p[0] * vz_r[0] + p[2] * vz_r[1] -
                 128.f * (lo_f32<true>(plo) + lo_f32<true>(phi));
      acc_c[1] = acc_c[1] * alpha[1] + p[1] * vz_r[0] + p[3] * vz_r[1] -
                 128.f * (hi_f32<true>(plo) + hi_f32<true>(phi));
    }
    const uint32_t bp0 = movmatrix_trans(plo);  // tokens 2q, 2q+1 of head g
    const uint32_t bp1 = movmatrix_trans(phi);  // tokens 8+2q, 9+2q
    // ---- O^T += V^T P'^T ----
    const uint8_t* vrow = vpage + toff + 2 * q;
#pragma unroll
    for (int mt = 0; mt < KS; ++mt) {
      const int j = 8 * mt + g;  // byte row: channels 2j (low nibbles), 2j+1 (high)
      const uint32_t w0 = *reinterpret_cast<const uint16_t*>(vrow + (int64_t)j * P.PS);
      const uint32_t w1 = *reinterpret_cast<const uint16_t*>(vrow + (int64_t)j * P.PS + 8);
      uint32_t a[4];
      if (INT4) {
        int4_pairs<false>(w0, a[0], a[1]);  // channel 2j (low nibbles), 2j+1; tokens 2q, 2q+1
        int4_pairs<false>(w1, a[2], a[3]);
      } else {
        const uint32_t t0l = lut[w0 & 0xFFu], t0h = lut[w0 >> 8];
        const uint32_t t1l = lut[w1 & 0xFFu], t1h = lut[w1 >> 8];
        a[0] = prmt(t0l, t0h, 0x5410);
        a[1] = prmt(t0l, t0h, 0x7632);
        a[2] = prmt(t1l, t1h, 0x5410);
        a[3] = prmt(t1l, t1h, 0x7632);
      }
      acc[mt][0] *= alpha[0];
      acc[mt][1] *= alpha[1];
      acc[mt][2] *= alpha[0];
      acc[mt][3] *= alpha[1];
      mma16816<BF16>(acc[mt], a, bp0, bp1);
    }
  }

  // ---- merge the warps ----
#pragma unroll
  for (int c = 0; c < 2; ++c) {
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) {
      l_i[c] += __shfl_xor_sync(FULL_MASK, l_i[c], o);
      acc_c[c] += __shfl_xor_sync(FULL_MASK, acc_c[c], o);
    }
  }
  if (g == 0) {
    sm_m[warp][2 * q] = m_i[0];
    sm_m[warp][2 * q + 1] = m_i[1];
    sm_l[warp][2 * q] = l_i[0];
    sm_l[warp][2 * q + 1] = l_i[1];
  }
#pragma unroll
  for (int mt = 0; mt < KS; ++mt) {
    const int ch = 16 * mt + 2 * g;
    sm_o[warp][2 * q][ch] = acc[mt][0] + acc_c[0];
    sm_o[warp][2 * q + 1][ch] = acc[mt][1] + acc_c[1];
    sm_o[warp][2 * q][ch + 1] = acc[mt][2] + acc_c[0];
    sm_o[warp][2 * q + 1][ch + 1] = acc[mt][3] + acc_c[1];
  }
  __syncthreads();
  const float out_scale = INT4 ? 1.f : 1.f / 64.f;
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

template <int D, bool INT4>
int launch(const Params& p, int grid_x, cudaStream_t stream) {
  constexpr int NW = 4;
  dim3 grid(grid_x, p.num_splits);
  split_kernel<D, INT4, NW><<<grid, NW * 32, 0, stream>>>(p);
  return (int)cudaGetLastError();
}

}  // namespace

extern "C" {

// fmt: 0 = int4 (bf16 q), 1 = 4bit (fp16 q' with per-row scale qs, fp16 level table).
// Returns a cudaError_t (0 = launched); 1000 + x for an unsupported argument.
int kvzd_split_launch(int fmt, int head_dim, const void* q, const float* qs,
                      const uint16_t* lut16, const uint8_t* kc, const uint8_t* vc,
                      const int32_t* bt, const int32_t* sl, float* o_part, float* lse,
                      float qk_scale, long long stride_btb, int batch, int num_kv_heads, int G,
                      long long k_page_bytes, long long v_page_bytes, long long k_blk_stride,
                      long long v_blk_stride, int PS, int tokens_per_split, int num_splits,
                      int skip, void* stream) {
  if (G < 1 || G > 8) return 1001;
  if (PS % 16 || tokens_per_split % 16) return 1002;
  Params p{q,
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
           tokens_per_split,
           num_splits,
           skip};
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  const int gx = batch * num_kv_heads;
  if (fmt == 0 && head_dim == 128) return launch<128, true>(p, gx, s);
  if (fmt == 0 && head_dim == 64) return launch<64, true>(p, gx, s);
  if (fmt == 1 && head_dim == 128) return launch<128, false>(p, gx, s);
  if (fmt == 1 && head_dim == 64) return launch<64, false>(p, gx, s);
  return 1000;
}

}  // extern "C"
