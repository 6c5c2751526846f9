// CUDA coder for kvzip-lossless blobs (spec/blob.md): the same bytes as the numpy and Triton
// coders. One warp per chunk of 32 lanes; words are exchanged with __ballot_sync/__popc, which
// Triton only reaches through a 32-element scan and reduction per row (135 GB/s measured).
#include <cstdint>
#include <cuda_runtime.h>

#define FULL 0xffffffffu

__device__ __forceinline__ uint32_t fmix32(uint32_t h) {
  h ^= h >> 16; h *= 0x85EBCA6Bu; h ^= h >> 13; h *= 0xC2B2AE35u; h ^= h >> 16;
  return h;
}

__device__ __forceinline__ int symbol_of(uint32_t v, int cb) {
  int es = (int)((v >> 7) & 255) - cb + 12;
  es = (es >= 1 && es <= 15) ? es : 0;
  return (int)(v >> 15) * 16 + es;
}

__device__ __forceinline__ uint32_t warp_sum_u32(uint32_t v) {
  for (int k = 16; k >= 1; k >>= 1) v += __shfl_xor_sync(FULL, v, k);
  return v;
}
__device__ __forceinline__ unsigned long long warp_sum_u64(unsigned long long v) {
  for (int k = 16; k >= 1; k >>= 1) v += __shfl_xor_sync(FULL, v, k);
  return v;
}

// The rANS row loop of one chunk (spec/blob.md section 5): one warp, lane l decoding column
// col (= the chunk's first column + l) of rows 0..nr-1 of a tile from its state x. Both
// decoders run it: kvzl_decode (one blob) and bdec_item (the batched one). Each lane finds its
// symbol in two rounds over its context's cumulative frequencies (crow0: uint16, 32 a row;
// entries 8, 16, 24, then 8 in one 16-byte read); the lanes that renormalise take consecutive
// words of the chunk's stream W (n_words) through a ballot, from two 32-word windows held
// across the warp. kSmem: the rows are read from the item's shared-memory copy
// (lane-interleaved, see bdec_item) instead of through L1. kInlineEscapes: an escape's value is
// looked up in the tile's sorted list (eidx, evals; ne entries) and every value enters the
// checksum acc; otherwise escapes are written as decoded (the caller patches them) and left
// out of acc. Returns true when the stream runs short, is not used up, or ends in another
// state (a damaged tile).
template <bool kSmem, bool kInlineEscapes>
__device__ __forceinline__ bool rans_rows(const int nr, const int C, const int col,
    const bool active, uint32_t x, const int cb, const uint16_t* crow0,
    const int mybm, const uint16_t* W, const uint32_t n_words,
    const uint8_t* mant, uint16_t* o,
    const uint32_t* eidx, const uint16_t* evals, const uint32_t ne,
    uint32_t& acc, int& nesc) {
  extern __shared__ uint16_t st[];
  bool badv = false;

  const int lane = threadIdx.x & 31;
  const uint32_t lt = (1u << lane) - 1u;
  uint32_t ptr = 0, wb = 0;
  uint32_t cur = lane < n_words ? W[lane] : 0u;
  uint32_t nxt = 32u + lane < n_words ? W[32 + lane] : 0u;
  int prev = 0;
  for (int r = 0; r < nr; ++r) {
    const int bucket = __shfl_sync(FULL, mybm, prev);
    const uint32_t slot = x & 4095u;
    uint32_t c8, c16, c24, cs[8];
    if constexpr (kSmem) {  // lane l reads only its column: st[(bucket*32 + k)*32 + l]
      const uint16_t* row = st + bucket * 1024 + lane;
      c8 = row[8 * 32], c16 = row[16 * 32], c24 = row[24 * 32];
    } else {
      const uint16_t* row = crow0 + bucket * 32;
      c8 = row[8], c16 = row[16], c24 = row[24];
    }
    const bool h16 = c16 <= slot;
    const int seg = h16 ? (c24 <= slot ? 24 : 16) : (c8 <= slot ? 8 : 0);
    if constexpr (kSmem) {
      const uint16_t* row = st + bucket * 1024 + lane;
#pragma unroll
      for (int k = 0; k < 8; ++k) cs[k] = row[(seg + k) * 32];
    } else {
      const uint4 q = *reinterpret_cast<const uint4*>(crow0 + bucket * 32 + seg);
      cs[0] = q.x & 0xffffu, cs[1] = q.x >> 16, cs[2] = q.y & 0xffffu, cs[3] = q.y >> 16;
      cs[4] = q.z & 0xffffu, cs[5] = q.z >> 16, cs[6] = q.w & 0xffffu, cs[7] = q.w >> 16;
    }
    int j = 0;
#pragma unroll
    for (int k = 1; k < 8; ++k) j += cs[k] <= slot;
    uint32_t lo = cs[0], hi = seg == 24 ? 4096u : (h16 ? c24 : (seg == 8 ? c16 : c8));
#pragma unroll
    for (int k = 1; k < 8; ++k) {
      if (j == k) lo = cs[k];
      if (j == k - 1) hi = cs[k];
    }
    const int s = seg + j;
    x = (hi - lo) * (x >> 12) + slot - lo;
    const bool need = active && x < 65536u;
    const uint32_t m = __ballot_sync(FULL, need);
    const uint32_t pos = ptr + __popc(m & lt);
    const uint32_t idx = pos - wb;
    const uint32_t w0 = __shfl_sync(FULL, cur, idx & 31u);
    const uint32_t w1 = __shfl_sync(FULL, nxt, idx & 31u);
    if (need) {
      if (pos < n_words) x = (x << 16) | (idx < 32u ? w0 : w1);
      else badv = true;
    }
    ptr += __popc(m);
    if (ptr - wb >= 32u) {
      wb += 32u;
      cur = nxt;
      nxt = wb + 32u + lane < n_words ? W[wb + 32u + lane] : 0u;
    }
    if (active) {
      const uint32_t p = (uint32_t)r * (uint32_t)C + (uint32_t)col;
      const uint32_t bit = p * 7u;
      const uint32_t mw = ((uint32_t)mant[bit >> 3] << 8) | mant[(bit >> 3) + 1];
      const uint32_t mm = (mw >> (9u - (bit & 7u))) & 127u;
      const int es = s & 15;
      uint32_t v =
          ((uint32_t)(s >> 4) << 15) | ((uint32_t)((es + cb - 12) & 255) << 7) | mm;
      if constexpr (kInlineEscapes) {
        if (es == 0) {  // an escape: its value from the tile's sorted list
          ++nesc;
          uint32_t a = 0, z = ne;
          while (a < z) {
            const uint32_t mid = (a + z) >> 1;
            if (eidx[mid] < p) a = mid + 1; else z = mid;
          }
          if (a < ne && eidx[a] == p) v = evals[a];
          else badv = true;
        }
        o[p] = (uint16_t)v;
        acc += fmix32(p * 0x9E3779B1u + v);
      } else {  // escapes are patched after the launch; the checksum leaves them out
        o[p] = (uint16_t)v;
        if (es != 0) acc += fmix32(p * 0x9E3779B1u + v);
      }
    }
    prev = s;
  }
  if (active && x != 65536u) badv = true;
  if (ptr != n_words) badv = true;
  return badv;
}

// desc: 8 int64 per chunk: state_off (u32 units), word_off (u16 units), n_words, mant_off
// (bytes), out_off (elements), rows, col0, tile. The table: cum16 (uint16 [C, NB, 32]). The
// row loop is the batched decoder's (rans_rows), escapes left to the caller.
__global__ void kvzl_decode(const uint8_t* __restrict__ blob, const int64_t* __restrict__ desc,
                            int n_chunks, const uint16_t* __restrict__ cum16,
                            const int32_t* __restrict__ bmap, const int32_t* __restrict__ base,
                            int C, int NB, uint16_t* __restrict__ out, uint32_t* sums,
                            int32_t* err) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int chunk = blockIdx.x * (blockDim.x >> 5) + warp;
  if (chunk >= n_chunks) return;
  const int64_t* d = desc + 8 * (int64_t)chunk;
  const uint32_t* blob32 = reinterpret_cast<const uint32_t*>(blob);
  const int col = (int)d[6] + lane;
  const bool active = col < C;
  const uint32_t x = active ? blob32[d[0] + col] : 65536u;
  const int cb = active ? base[col] : 0;
  const uint16_t* crow0 = cum16 + (size_t)(active ? col : 0) * NB * 32;
  uint32_t acc = 0;
  int nesc = 0;
  const bool bad = rans_rows<false, false>(
      (int)d[5], C, col, active, x, cb, crow0, bmap[lane],
      reinterpret_cast<const uint16_t*>(blob) + d[1], (uint32_t)d[2], blob + d[3], out + d[4],
      nullptr, nullptr, 0u, acc, nesc);
  acc = warp_sum_u32(acc);
  const bool anybad = __any_sync(FULL, bad);
  if (lane == 0) {
    atomicAdd(sums + d[7], acc);
    err[chunk] = anybad ? 1 : 0;
  }
}

// desc: 4 int64 per chunk: in_off (elements), rows, col0, state_off (u32 units).
// Words go to scratch[chunk * RPT * 32 + ...] in encoder (reverse) order.
__global__ void kvzl_encode(const uint16_t* __restrict__ in, const int64_t* __restrict__ desc,
                            int n_chunks, const uint32_t* __restrict__ tab,
                            const int32_t* __restrict__ bmap, const int32_t* __restrict__ base,
                            int C, int NB, int RPT, uint16_t* __restrict__ scratch,
                            int32_t* counts, uint32_t* states) {
  __shared__ int32_t sb[32];
  if (threadIdx.x < 32) sb[threadIdx.x] = bmap[threadIdx.x];
  __syncthreads();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int chunk = blockIdx.x * (blockDim.x >> 5) + warp;
  if (chunk >= n_chunks) return;
  const int64_t* d = desc + 4 * (int64_t)chunk;
  const uint16_t* src = in + d[0];
  const int rows = (int)d[1];
  const int col = (int)d[2] + lane;
  const bool active = col < C;
  const int cb = active ? base[col] : 0;
  const uint32_t* trow0 = tab + (size_t)(active ? col : 0) * NB * 32;
  uint16_t* sc = scratch + (int64_t)chunk * RPT * 32;
  const uint32_t gt = ~((2u << lane) - 1u);
  uint32_t x = 65536u;
  int cnt = 0;
  int cur = active ? symbol_of(src[(size_t)(rows - 1) * C + col], cb) : 0;
  for (int t = rows - 1; t >= 0; --t) {
    const int sp = (active && t > 0) ? symbol_of(src[(size_t)(t - 1) * C + col], cb) : 0;
    const uint32_t e = __ldg(trow0 + sb[sp] * 32 + cur);
    const uint32_t f = e & 0xffffu;
    const bool emit = active && x >= (f << 20);
    const uint32_t m = __ballot_sync(FULL, emit);
    if (emit) {
      sc[cnt + __popc(m & gt)] = (uint16_t)(x & 0xffffu);
      x >>= 16;
    }
    cnt += __popc(m);
    if (active) {
      const uint32_t q = x / f;
      x = (q << 12) + (x - q * f) + (e >> 16);
    }
    cur = sp;
  }
  if (active) states[d[3] + col] = x;
  if (lane == 0) counts[chunk] = cnt;
}

// Mantissa packing, checksums and escape flags for n_tiles tiles of n values (n % 8 == 0).
// Thread i handles values 8i..8i+7 of the flat input (tile = i / (n / 8)).
__global__ void kvzl_pack(const uint16_t* __restrict__ in, int64_t total8, int64_t n,
                          const int32_t* __restrict__ base, int C, uint8_t* __restrict__ mant,
                          uint32_t* sums, uint8_t* __restrict__ esc) {
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  uint32_t acc = 0;
  int64_t tile = 0;
  if (i < total8) {
    const int64_t g = i * 8;
    tile = g / n;
    const uint32_t p0 = (uint32_t)(g - tile * n);
    uint64_t bits = 0;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const uint32_t v = in[g + k];
      bits = (bits << 7) | (v & 127u);
      acc += fmix32((p0 + k) * 0x9E3779B1u + v);
      const int c = (int)((g + k) % C);
      int es = (int)((v >> 7) & 255) - base[c] + 12;
      esc[g + k] = (es < 1 || es > 15) ? 1 : 0;
    }
    uint8_t* dst = mant + tile * (n / 8 * 7) + (int64_t)p0 / 8 * 7;
#pragma unroll
    for (int k = 0; k < 7; ++k) dst[k] = (uint8_t)(bits >> (8 * (6 - k)));
  }
  // tiles are multiples of 8 values and warps of 32 threads may straddle two tiles: atomics
  // per thread when that happens, one per warp otherwise.
  const int64_t t0 = __shfl_sync(FULL, tile, 0);
  const bool same = __all_sync(FULL, i >= total8 || tile == t0);
  if (same) {
    for (int k = 16; k >= 1; k >>= 1) acc += __shfl_xor_sync(FULL, acc, k);
    if ((threadIdx.x & 31) == 0 && acc) atomicAdd(sums + t0, acc);
  } else if (i < total8) {
    atomicAdd(sums + tile, acc);
  }
}

// Words in decoder order: out[start_c + j] = scratch[c * RPT * 32 + count_c - 1 - j].
__global__ void kvzl_compact(const uint16_t* __restrict__ scratch, const int32_t* counts,
                             const int64_t* starts, int n_chunks, int RPT,
                             uint16_t* __restrict__ out) {
  const int chunk = blockIdx.x;
  if (chunk >= n_chunks) return;
  const int c = counts[chunk];
  const uint16_t* s = scratch + (int64_t)chunk * RPT * 32;
  uint16_t* o = out + starts[chunk];
  for (int j = threadIdx.x; j < c; j += blockDim.x) o[j] = s[c - 1 - j];
}

extern "C" {
int kvzl_decode_launch(const void* blob, const void* desc, int n_chunks, const void* cum16,
                       const void* bmap, const void* base, int C, int NB, void* out, void* sums,
                       void* err, void* stream) {
  const int warps = 4;
  kvzl_decode<<<(n_chunks + warps - 1) / warps, 32 * warps, 0, (cudaStream_t)stream>>>(
      (const uint8_t*)blob, (const int64_t*)desc, n_chunks, (const uint16_t*)cum16,
      (const int32_t*)bmap, (const int32_t*)base, C, NB, (uint16_t*)out, (uint32_t*)sums,
      (int32_t*)err);
  return (int)cudaGetLastError();
}
int kvzl_encode_launch(const void* in, const void* desc, int n_chunks, const void* tab,
                       const void* bmap, const void* base, int C, int NB, int RPT, void* scratch,
                       void* counts, void* states, void* stream) {
  const int warps = 4;
  kvzl_encode<<<(n_chunks + warps - 1) / warps, 32 * warps, 0, (cudaStream_t)stream>>>(
      (const uint16_t*)in, (const int64_t*)desc, n_chunks, (const uint32_t*)tab,
      (const int32_t*)bmap, (const int32_t*)base, C, NB, RPT, (uint16_t*)scratch,
      (int32_t*)counts, (uint32_t*)states);
  return (int)cudaGetLastError();
}
int kvzl_pack_launch(const void* in, long long total8, long long n, const void* base, int C,
                     void* mant, void* sums, void* esc, void* stream) {
  const int threads = 256;
  const long long blocks = (total8 + threads - 1) / threads;
  if (blocks > 0)
    kvzl_pack<<<(unsigned)blocks, threads, 0, (cudaStream_t)stream>>>(
        (const uint16_t*)in, total8, n, (const int32_t*)base, C, (uint8_t*)mant,
        (uint32_t*)sums, (uint8_t*)esc);
  return (int)cudaGetLastError();
}
int kvzl_compact_launch(const void* scratch, const void* counts, const void* starts,
                        int n_chunks, int RPT, void* out, void* stream) {
  if (n_chunks > 0)
    kvzl_compact<<<n_chunks, 256, 0, (cudaStream_t)stream>>>(
        (const uint16_t*)scratch, (const int32_t*)counts, (const int64_t*)starts, n_chunks, RPT,
        (uint16_t*)out);
  return (int)cudaGetLastError();
}
}

// ------------------------------------------------------------------------------------------
// Batched kernels (spec/blob.md section 9; descriptors built by gpu_batch.py). Tables come
// from one bank: every slot's rows concatenated, per-blob offsets in the descriptors.

// Encode: one warp per (tile, 32-lane chunk). desc: 12 int64 per item: in_off, rows, col0,
// state_off, C, tab_off, bmap_off, base_off, NB, scratch_off, tile, unused. Input rows are
// loaded 8 at a time ahead of the state updates (their table entries too: they depend on the
// values only), so the loads of 8 rows are in flight together.
template <bool kSmem>
__device__ __forceinline__ void benc_item(int item, const uint16_t* __restrict__ in, const int64_t* __restrict__ desc, int n_items,
    const uint32_t* __restrict__ tab, const int32_t* __restrict__ bmap,
    const int32_t* __restrict__ base, uint16_t* __restrict__ scratch, int32_t* counts,
    uint32_t* states, uint32_t* sums, int32_t* ecnt, long long* ebuf, long long ecap) {
  extern __shared__ uint32_t se[];  // kSmem: [bucket * 32 + symbol][32 lanes], lane l in bank l

  const int lane = threadIdx.x & 31;
  if (item >= n_items) return;
  const int64_t* d = desc + 12 * (int64_t)item;
  const int64_t in_off = d[0];
  const int rows = (int)d[1];
  const int C = (int)d[4];
  const int col = (int)d[2] + lane;
  const bool active = col < C;
  const int NB = (int)d[8];
  const int mybm = bmap[d[6] + lane];
  const int cb = active ? base[d[7] + col] : 0;
  const uint32_t* trow0 = tab + d[5] + (size_t)(active ? col : 0) * NB * 32;
  if constexpr (kSmem) {  // this lane's column's entries into its own bank (reads in order)
    for (int j = 0; j < NB * 32; ++j) se[j * 32 + lane] = active ? __ldg(trow0 + j) : 1u;
    __syncwarp();
  }
  const uint16_t* src = in + in_off;
  uint16_t* sc = scratch + d[9];
  const int64_t tile = d[10];
  const uint32_t gt = ~((2u << lane) - 1u);
  uint32_t x = 65536u, acc = 0;
  int cnt = 0, ne = 0;
  uint32_t vc = active ? src[(size_t)(rows - 1) * C + col] : 0u;
  for (int t0 = rows - 1; t0 >= 0; t0 -= 8) {
    uint32_t vb[8], eb[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int tt = t0 - 1 - k;
      vb[k] = (active && tt >= 0) ? src[(size_t)tt * C + col] : 0u;
    }
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int t = t0 - k;
      const uint32_t v = k == 0 ? vc : vb[k - 1];
      const int cur = symbol_of(v, cb);
      const int sp = t > 0 ? symbol_of(vb[k], cb) : 0;
      const int bk = __shfl_sync(FULL, mybm, sp);
      if constexpr (kSmem)
        eb[k] = (active && t >= 0) ? se[(bk * 32 + cur) * 32 + lane] : 1u;
      else
        eb[k] = (active && t >= 0) ? __ldg(trow0 + bk * 32 + cur) : 1u;
    }
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int t = t0 - k;
      if (t < 0) continue;  // uniform over the warp
      const uint32_t v = k == 0 ? vc : vb[k - 1];
      if (active) {
        const uint32_t p = (uint32_t)t * (uint32_t)C + (uint32_t)col;
        acc += fmix32(p * 0x9E3779B1u + v);
        if ((symbol_of(v, cb) & 15) == 0) {
          ++ne;
          const long long at = atomicAdd(ecnt, 1);
          if (at < ecap) ebuf[at] = in_off + p;
        }
      }
      const uint32_t e = eb[k];
      const uint32_t f = e & 0xffffu;
      const bool emit = active && x >= (f << 20);
      const uint32_t m = __ballot_sync(FULL, emit);
      if (emit) {
        sc[cnt + __popc(m & gt)] = (uint16_t)(x & 0xffffu);
        x >>= 16;
      }
      cnt += __popc(m);
      if (active) {
        if constexpr (kSmem) {  // x / f by a float reciprocal: x < f << 20, so q < 2^20 and
          // the estimate is within 1 of it (relative error < 2^-21); one correction: exact
          uint32_t q = __float2uint_rz(__uint2float_rz(x) * __frcp_rn(__uint2float_rn(f)));
          int32_t r = (int32_t)(x - q * f);
          if (r < 0) { --q; r += (int32_t)f; }
          else if (r >= (int32_t)f) { ++q; r -= (int32_t)f; }
          x = (q << 12) + (uint32_t)r + (e >> 16);
        } else {
          const uint32_t q = x / f;
          x = (q << 12) + (x - q * f) + (e >> 16);
        }
      }
    }
    vc = vb[7];
  }
  if (active) states[d[3] + col] = x;
  acc = warp_sum_u32(acc);
  ne = (int)warp_sum_u32((uint32_t)ne);
  if (lane == 0) {
    counts[item] = cnt;
    atomicAdd(sums + tile, acc);
    if (ne) atomicAdd(ecnt + 1 + tile, ne);
  }
}
__global__ void __launch_bounds__(128, 8) kvzl_benc(
    const uint16_t* __restrict__ in, const int64_t* __restrict__ desc, int n_items,
    const uint32_t* __restrict__ tab, const int32_t* __restrict__ bmap,
    const int32_t* __restrict__ base, uint16_t* __restrict__ scratch, int32_t* counts,
    uint32_t* states, uint32_t* sums, int32_t* ecnt, long long* ebuf, long long ecap) {
  benc_item<false>(blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), in, desc, n_items, tab, bmap, base, scratch, counts, states, sums, ecnt, ebuf, ecap);
}
// Second design: one warp per CTA; each lane's column's table entries staged in shared memory
// in the lane's own bank (every entry read conflict-free, instead of one scattered L1 line per
// lane), and the state's division by the frequency by a float reciprocal with one integer
// correction (exact: the same words and states as the first design).
__global__ void __launch_bounds__(32) kvzl_benc_smem(
    const uint16_t* __restrict__ in, const int64_t* __restrict__ desc, int n_items,
    const uint32_t* __restrict__ tab, const int32_t* __restrict__ bmap,
    const int32_t* __restrict__ base, uint16_t* __restrict__ scratch, int32_t* counts,
    uint32_t* states, uint32_t* sums, int32_t* ecnt, long long* ebuf, long long ecap) {
  benc_item<true>(blockIdx.x, in, desc, n_items, tab, bmap, base, scratch, counts, states, sums, ecnt, ebuf, ecap);
}



// Assembly: one warp per item. desc: 12 int64: tile_abs (byte), mode, C, nch, col0, rows,
// state_off, scratch_off, count, word_dst (16-bit units), in_off, chunk.
__global__ void kvzl_basm(const uint16_t* __restrict__ in, uint8_t* __restrict__ data,
                          const uint16_t* __restrict__ scratch, const uint32_t* __restrict__ states,
                          const int64_t* __restrict__ desc, int n_items) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int item = blockIdx.x * (blockDim.x >> 5) + warp;
  if (item >= n_items) return;
  const int64_t* d = desc + 12 * (int64_t)item;
  const int64_t tile_abs = d[0];
  const int C = (int)d[2];
  const int col = (int)d[4] + lane;
  const bool active = col < C;
  if (d[1] == 1) {
    uint32_t* t32 = reinterpret_cast<uint32_t*>(data + tile_abs);
    const int count = (int)d[8];
    if (lane == 0) t32[d[11]] = (uint32_t)count;
    if (active) t32[d[3] + col] = states[d[6] + col];
    const uint16_t* s = scratch + d[7];
    uint16_t* o = reinterpret_cast<uint16_t*>(data) + d[9];
    for (int j = lane; j < count; j += 32) o[j] = s[count - 1 - j];
  } else if (active) {
    uint16_t* o = reinterpret_cast<uint16_t*>(data + tile_abs);
    const uint16_t* s = in + d[10];
    const int rows = (int)d[5];
    for (int r = 0; r < rows; ++r) o[(size_t)r * C + col] = s[(size_t)r * C + col];
  }
}

// Mantissas of the rANS tiles: thread g of tile blockIdx.x packs values 8g..8g+7 into bytes
// 7g..7g+6 of the tile's mantissa field (striding by the grid's y extent). tdesc: 4 int64 per
// tile: in_off, nv, mant (byte), mode.
__global__ void kvzl_bmant(const uint16_t* __restrict__ in, uint8_t* __restrict__ data,
                           const int64_t* __restrict__ tdesc) {
  const int64_t* d = tdesc + 4 * (int64_t)blockIdx.x;
  if (d[3] != 1) return;
  const int64_t nv = d[1];
  const int64_t nbytes = (7 * nv + 7) / 8;
  for (int64_t g = blockIdx.y * (int64_t)blockDim.x + threadIdx.x; g * 8 < nv;
       g += (int64_t)gridDim.y * blockDim.x) {
    const uint16_t* s = in + d[0] + g * 8;
    uint64_t bits = 0;
#pragma unroll
    for (int k = 0; k < 8; ++k) bits = (bits << 7) | ((g * 8 + k < nv ? s[k] : 0u) & 127u);
    uint8_t* o = data + d[2] + g * 7;
#pragma unroll
    for (int k = 0; k < 7; ++k)
      if (g * 7 + k < nbytes) o[k] = (uint8_t)(bits >> (8 * (6 - k)));
  }
}

// Header check: one thread per blob. bdesc: 16 int64 per blob: off, length, C, rpt, n_tiles,
// dir_off, tiles_start, tab_off, bmap_off, base_off, NB, out_off, numel, tile0, table_id, slot.
__global__ void kvzl_bhead(const uint8_t* __restrict__ data, const int64_t* __restrict__ bdesc,
                           int n, int32_t* bad) {
  const int b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b >= n) return;
  const int64_t* d = bdesc + 16 * (int64_t)b;
  const uint8_t* h = data + d[0];
  const uint32_t* w = reinterpret_cast<const uint32_t*>(h);
  const int64_t dir_off = d[5], nt = d[4];
  const int64_t ndim = (dir_off - 40) / 8;
  bool ok = w[0] == 0x4C5A564Bu && (w[1] & 0xffffu) == 1u && ((w[1] >> 16) & 255u) == 1u &&
            (int64_t)(w[1] >> 24) == ndim && w[2] == 0u && (int64_t)w[3] == d[2] &&
            (int64_t)w[4] == d[3] && (int64_t)w[5] == nt &&
            (long long)((uint64_t)w[6] | ((uint64_t)w[7] << 32)) == d[14] &&
            (int64_t)w[8] == (d[15] < 0 ? 0 : d[15]) && w[9] == 0u &&
            d[6] == dir_off + 16 * nt + 4;
  uint64_t prod = 1;
  for (int64_t k = 0; k < ndim; ++k) {
    prod *= w[10 + 2 * k];
    ok = ok && w[11 + 2 * k] == 0u;
  }
  ok = ok && (int64_t)prod == d[12];
  const int64_t end = dir_off + 16 * nt;
  uint32_t crc = 0xffffffffu;
  for (int64_t i = 0; i < end; ++i) {
    crc ^= h[i];
#pragma unroll
    for (int k = 0; k < 8; ++k) crc = (crc >> 1) ^ (0xEDB88320u & (0u - (crc & 1u)));
  }
  ok = ok && (crc ^ 0xffffffffu) == w[end / 4];
  int64_t tot = 0;
  const uint32_t* dir = w + dir_off / 4;
  for (int64_t k = 0; k < nt; ++k) {
    ok = ok && (dir[4 * k] & 3u) == 0u && (dir[4 * k + 1] & 255u) <= 1u;
    tot += dir[4 * k];
  }
  ok = ok && tot == d[1] - d[6];
  bad[b] = ok ? 0 : 1;
}

// Decode: one warp per item (blob, tile, chunk). Per row the symbol is found in two rounds of
// loads from the context's 32 cumulative frequencies (uint16): cum[8], cum[16], cum[24] pick
// a segment of 8, one 16-byte load holds it; words come from a 64-word window held in two
// registers per lane (next 32 loaded ahead), read with a shuffle.
// The decode of one item (blob, tile, chunk) by one warp, in two designs. kSmem false
// (kvzl_bdec) reads each lane's column's frequency rows from global memory through L1: a
// warp's table read touches 32 lines, one per lane. kSmem true (kvzl_bdec_smem: one warp per
// CTA, NB x 2 KB of dynamic shared memory) first copies the item's 32 columns' rows into
// shared memory, lane-interleaved ([bucket][entry][lane]), so each lane reads its own bank
// pair (at most 2-way conflicts). Same bytes read, same output, same flags.
template <bool kSmem>
__device__ __forceinline__ void bdec_item(int item, const uint8_t* __restrict__ data, const uint16_t* __restrict__ cum16,
    const int32_t* __restrict__ bmap, const int32_t* __restrict__ base,
    const int64_t* __restrict__ bdesc, const int32_t* __restrict__ items, int n_items,
    uint16_t* __restrict__ out, uint32_t* sums, uint32_t* expect, int32_t* ecount,
    int32_t* nexp, int32_t* bad) {
  extern __shared__ uint16_t st[];

  const int lane = threadIdx.x & 31;
  if (item >= n_items) return;
  const int b = items[3 * item], chunk = items[3 * item + 2];
  const int64_t t = items[3 * item + 1];
  const int64_t* d = bdesc + 16 * (int64_t)b;
  const int64_t off = d[0], length = d[1], rpt = d[3];
  const int C = (int)d[2];
  const int NB = (int)d[10];
  const int64_t g = d[13] + t;
  const int64_t nr64 = min(rpt, d[12] / C - t * rpt);
  const int nr = (int)nr64;
  const int64_t nv = nr64 * C;
  const uint32_t* dir = reinterpret_cast<const uint32_t*>(data + off + d[5]);
  unsigned long long pre = 0;
  for (int64_t k = lane; k < t; k += 32) pre += dir[4 * k];
  pre = warp_sum_u64(pre);
  const uint32_t tlen = dir[4 * t], mode = dir[4 * t + 1] & 255u, ne = dir[4 * t + 2];
  const int64_t rel = d[6] + (int64_t)pre;
  const bool okt = rel + tlen <= length && (tlen & 3u) == 0u && mode <= 1u;
  if (chunk == 0 && lane == 0) {
    expect[g] = dir[4 * t + 3];
    nexp[g] = mode == 1u ? (int32_t)ne : 0;
  }
  bool badv = !okt;
  uint32_t acc = 0;
  const int col = chunk * 32 + lane;
  const bool active = col < C;
  if (okt) {
    const uint8_t* T = data + off + rel;
    uint16_t* o = out + d[11] + t * rpt * C;
    if (mode == 0u) {
      if ((int64_t)tlen != (2 * nv + 3) / 4 * 4) {
        badv = true;
      } else if (active) {
        const uint16_t* s = reinterpret_cast<const uint16_t*>(T);
        for (int r = 0; r < nr; ++r) {
          const uint32_t p = (uint32_t)r * (uint32_t)C + (uint32_t)col;
          const uint32_t v = s[p];
          o[p] = (uint16_t)v;
          acc += fmix32(p * 0x9E3779B1u + v);
        }
      }
    } else {
      const int nch = (C + 31) / 32;
      const uint32_t* T32 = reinterpret_cast<const uint32_t*>(T);
      const int64_t ei = 4 * (int64_t)nch + 4 * (int64_t)C;
      const int64_t ev = ei + 4 * (int64_t)ne;
      const int64_t mo = ev + 2 * (int64_t)ne;
      int64_t wo = mo + (7 * nv + 7) / 8 + 1;
      wo += wo & 1;
      unsigned long long tot = 0, wpre = 0;
      if (wo <= (int64_t)tlen && (int64_t)ne <= nv)  // the fixed parts lie inside the tile
        for (int k = lane; k < nch; k += 32) {
          const uint32_t c = T32[k];
          tot += c;
          if (k < chunk) wpre += c;
        }
      else
        tot = 1ull << 40;  // flagged below
      tot = warp_sum_u64(tot);
      wpre = warp_sum_u64(wpre);
      if ((int64_t)((wo + 2 * (int64_t)tot + 3) / 4 * 4) != (int64_t)tlen) {
        badv = true;
      } else {
        const uint32_t n_words = T32[chunk];
        const uint32_t* eidx = reinterpret_cast<const uint32_t*>(T + ei);
        const uint16_t* evals = reinterpret_cast<const uint16_t*>(T + ev);
        if (chunk == 0)
          for (uint32_t k = lane; k < ne; k += 32)
            if (eidx[k] >= nv || (k > 0 && eidx[k] <= eidx[k - 1])) badv = true;
        uint32_t x = active ? T32[nch + col] : 65536u;
        if (x < 65536u) badv = true;
        const int cb = active ? base[d[9] + col] : 0;
        const int mybm = bmap[d[8] + lane];
        const uint16_t* crow0 = cum16 + d[7] + (size_t)(active ? col : 0) * NB * 32;
        if constexpr (kSmem) {  // the 32 columns' rows into shared memory, read coalesced
          const uint16_t* g0 = cum16 + d[7] + (size_t)(chunk * 32) * NB * 32;
          const int per = NB * 32, tot = 32 * per;
          for (int i = lane; i < tot; i += 32) {
            const int c = i / per, rem = i - c * per;
            st[rem * 32 + c] = chunk * 32 + c < C ? g0[i] : (uint16_t)0;
          }
          __syncwarp();
        }
        const uint16_t* W = reinterpret_cast<const uint16_t*>(T + wo) + wpre;
        int nesc = 0;
        if (rans_rows<kSmem, true>(nr, C, col, active, x, cb, crow0, mybm, W, n_words, T + mo,
                                   o, eidx, evals, ne, acc, nesc))
          badv = true;
        nesc = (int)warp_sum_u32((uint32_t)nesc);
        if (lane == 0 && nesc) atomicAdd(ecount + g, nesc);
      }
    }
  }
  acc = warp_sum_u32(acc);
  const bool anybad = __any_sync(FULL, badv);
  if (lane == 0) {
    if (acc) atomicAdd(sums + g, acc);
    if (anybad) atomicOr(bad + b, 1);
  }
}
__global__ void __launch_bounds__(128) kvzl_bdec(
    const uint8_t* __restrict__ data, const uint16_t* __restrict__ cum16,
    const int32_t* __restrict__ bmap, const int32_t* __restrict__ base,
    const int64_t* __restrict__ bdesc, const int32_t* __restrict__ items, int n_items,
    uint16_t* __restrict__ out, uint32_t* sums, uint32_t* expect, int32_t* ecount,
    int32_t* nexp, int32_t* bad) {
  bdec_item<false>(blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), data, cum16, bmap, base, bdesc, items, n_items, out, sums, expect, ecount, nexp, bad);
}
__global__ void __launch_bounds__(32) kvzl_bdec_smem(
    const uint8_t* __restrict__ data, const uint16_t* __restrict__ cum16,
    const int32_t* __restrict__ bmap, const int32_t* __restrict__ base,
    const int64_t* __restrict__ bdesc, const int32_t* __restrict__ items, int n_items,
    uint16_t* __restrict__ out, uint32_t* sums, uint32_t* expect, int32_t* ecount,
    int32_t* nexp, int32_t* bad) {
  bdec_item<true>(blockIdx.x, data, cum16, bmap, base, bdesc, items, n_items, out, sums, expect, ecount, nexp, bad);
}





extern "C" {
int kvzl_benc_launch(const void* in, const void* desc, int n_items, const void* tab,
                     const void* bmap, const void* base, void* scratch, void* counts,
                     void* states, void* sums, void* ecnt, void* ebuf, long long ecap,
                     void* stream) {
  const int warps = 4;
  kvzl_benc<<<(n_items + warps - 1) / warps, 32 * warps, 0, (cudaStream_t)stream>>>(
      (const uint16_t*)in, (const int64_t*)desc, n_items, (const uint32_t*)tab,
      (const int32_t*)bmap, (const int32_t*)base, (uint16_t*)scratch, (int32_t*)counts,
      (uint32_t*)states, (uint32_t*)sums, (int32_t*)ecnt, (long long*)ebuf, ecap);
  return (int)cudaGetLastError();
}
int kvzl_benc_smem_launch(const void* in, const void* desc, int n_items, const void* tab,
                          const void* bmap, const void* base, int max_nb, void* scratch,
                          void* counts, void* states, void* sums, void* ecnt, void* ebuf,
                          long long ecap, void* stream) {
  const int smem = (max_nb < 1 ? 1 : max_nb) * 32 * 32 * 4;
  if (smem > 48 * 1024) {
    cudaError_t e = cudaFuncSetAttribute(kvzl_benc_smem,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) return (int)e;
  }
  if (n_items > 0)
    kvzl_benc_smem<<<n_items, 32, smem, (cudaStream_t)stream>>>(
        (const uint16_t*)in, (const int64_t*)desc, n_items, (const uint32_t*)tab,
        (const int32_t*)bmap, (const int32_t*)base, (uint16_t*)scratch, (int32_t*)counts,
        (uint32_t*)states, (uint32_t*)sums, (int32_t*)ecnt, (long long*)ebuf, ecap);
  return (int)cudaGetLastError();
}
int kvzl_basm_launch(const void* in, void* data, const void* scratch, const void* states,
                     const void* desc, int n_items, void* stream) {
  const int warps = 4;
  kvzl_basm<<<(n_items + warps - 1) / warps, 32 * warps, 0, (cudaStream_t)stream>>>(
      (const uint16_t*)in, (uint8_t*)data, (const uint16_t*)scratch, (const uint32_t*)states,
      (const int64_t*)desc, n_items);
  return (int)cudaGetLastError();
}
int kvzl_bmant_launch(const void* in, void* data, const void* tdesc, int n_tiles,
                      long long max_nv, void* stream) {
  const int threads = 256;
  const long long groups = (max_nv + 7) / 8;
  long long by = (groups + threads - 1) / threads;
  by = by > 65535 ? 65535 : by;
  if (by > 0 && n_tiles > 0)
    kvzl_bmant<<<dim3((unsigned)n_tiles, (unsigned)by), threads, 0, (cudaStream_t)stream>>>(
        (const uint16_t*)in, (uint8_t*)data, (const int64_t*)tdesc);
  return (int)cudaGetLastError();
}
int kvzl_bhead_launch(const void* data, const void* bdesc, int n, void* bad, void* stream) {
  if (n > 0)
    kvzl_bhead<<<(n + 127) / 128, 128, 0, (cudaStream_t)stream>>>(
        (const uint8_t*)data, (const int64_t*)bdesc, n, (int32_t*)bad);
  return (int)cudaGetLastError();
}
// Tile checks folded into blob flags: tile i of blob tblob[i] is damaged when its checksum or
// its escape count differs from its header's. (tblob may lie in page-locked host memory.)
__global__ void kvzl_bfold(const uint32_t* __restrict__ sums, const uint32_t* __restrict__ expect,
                           const int32_t* __restrict__ ecount, const int32_t* __restrict__ nexp,
                           const int32_t* __restrict__ tblob, int T, int32_t* bad) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < T && (sums[i] != expect[i] || ecount[i] != nexp[i])) atomicOr(bad + tblob[i], 1);
}
int kvzl_bfold_launch(const void* sums, const void* expect, const void* ecount,
                      const void* nexp, const void* tblob, int T, void* bad, void* stream) {
  if (T > 0)
    kvzl_bfold<<<(T + 255) / 256, 256, 0, (cudaStream_t)stream>>>(
        (const uint32_t*)sums, (const uint32_t*)expect, (const int32_t*)ecount,
        (const int32_t*)nexp, (const int32_t*)tblob, T, (int32_t*)bad);
  return (int)cudaGetLastError();
}
int kvzl_bdec_smem_launch(const void* data, const void* cum16, const void* bmap,
                          const void* base, const void* bdesc, const void* items, int n_items,
                          int max_nb, void* out, void* sums, void* expect, void* ecount,
                          void* nexp, void* bad, void* stream) {
  const int smem = (max_nb < 1 ? 1 : max_nb) * 32 * 32 * 2;
  if (smem > 48 * 1024) {
    cudaError_t e = cudaFuncSetAttribute(kvzl_bdec_smem,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) return (int)e;
  }
  if (n_items > 0)
    kvzl_bdec_smem<<<n_items, 32, smem, (cudaStream_t)stream>>>(
        (const uint8_t*)data, (const uint16_t*)cum16, (const int32_t*)bmap,
        (const int32_t*)base, (const int64_t*)bdesc, (const int32_t*)items, n_items,
        (uint16_t*)out, (uint32_t*)sums, (uint32_t*)expect, (int32_t*)ecount, (int32_t*)nexp,
        (int32_t*)bad);
  return (int)cudaGetLastError();
}
int kvzl_bdec_launch(const void* data, const void* cum16, const void* bmap, const void* base,
                     const void* bdesc, const void* items, int n_items, void* out, void* sums,
                     void* expect, void* ecount, void* nexp, void* bad, void* stream) {
  const int warps = 4;
  if (n_items > 0)
    kvzl_bdec<<<(n_items + warps - 1) / warps, 32 * warps, 0, (cudaStream_t)stream>>>(
        (const uint8_t*)data, (const uint16_t*)cum16, (const int32_t*)bmap,
        (const int32_t*)base, (const int64_t*)bdesc, (const int32_t*)items, n_items,
        (uint16_t*)out, (uint32_t*)sums, (uint32_t*)expect, (int32_t*)ecount, (int32_t*)nexp,
        (int32_t*)bad);
  return (int)cudaGetLastError();
}
}
