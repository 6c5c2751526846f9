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

// desc: 8 int64 per chunk: state_off (u32 units), word_off (u16 units), n_words, mant_off
// (bytes), out_off (elements), rows, col0, tile.
__global__ void kvzl_decode(const uint8_t* __restrict__ blob, const int64_t* __restrict__ desc,
                            int n_chunks, const uint32_t* __restrict__ tab,
                            const int32_t* __restrict__ bmap, const int32_t* __restrict__ base,
                            int C, int NB, uint16_t* __restrict__ out, uint32_t* sums,
                            int32_t* err) {
  __shared__ int32_t sb[32];
  if (threadIdx.x < 32) sb[threadIdx.x] = bmap[threadIdx.x];
  __syncthreads();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int chunk = blockIdx.x * (blockDim.x >> 5) + warp;
  if (chunk >= n_chunks) return;
  const int64_t* d = desc + 8 * (int64_t)chunk;
  const uint32_t* blob32 = reinterpret_cast<const uint32_t*>(blob);
  const uint16_t* words = reinterpret_cast<const uint16_t*>(blob) + d[1];
  const int n_words = (int)d[2];
  const uint8_t* mant = blob + d[3];
  uint16_t* o = out + d[4];
  const int rows = (int)d[5];
  const int col = (int)d[6] + lane;
  const bool active = col < C;
  uint32_t x = active ? blob32[d[0] + col] : 65536u;
  const int cb = active ? base[col] : 0;
  const uint32_t* trow0 = tab + (size_t)(active ? col : 0) * NB * 32;
  const uint32_t lt = (1u << lane) - 1u;
  int prev = 0, ptr = 0;
  bool bad = false;
  uint32_t acc = 0;
  for (int t = 0; t < rows; ++t) {
    const uint32_t* row = trow0 + sb[prev] * 32;
    const uint32_t slot = x & 4095u;
    int s = 0;
#pragma unroll
    for (int step = 16; step >= 1; step >>= 1)
      if ((__ldg(row + s + step) >> 16) <= slot) s += step;
    const uint32_t e = __ldg(row + s);
    x = (e & 0xffffu) * (x >> 12) + slot - (e >> 16);
    const bool need = active && x < 65536u;
    const uint32_t m = __ballot_sync(FULL, need);
    if (need) {
      const int pos = ptr + __popc(m & lt);
      if (pos < n_words) x = (x << 16) | words[pos];
      else bad = true;
    }
    ptr += __popc(m);
    if (active) {
      const uint32_t p = (uint32_t)t * (uint32_t)C + (uint32_t)col;
      const uint32_t bit = p * 7u;
      const uint32_t w = ((uint32_t)mant[bit >> 3] << 8) | mant[(bit >> 3) + 1];
      const uint32_t mm = (w >> (9u - (bit & 7u))) & 127u;
      const int es = s & 15;
      const uint32_t v = ((uint32_t)(s >> 4) << 15) | ((uint32_t)((es + cb - 12) & 255) << 7) | mm;
      o[p] = (uint16_t)v;
      if (es != 0) acc += fmix32(p * 0x9E3779B1u + v);
    }
    prev = s;
  }
  bad |= active && x != 65536u;
  for (int k = 16; k >= 1; k >>= 1) acc += __shfl_xor_sync(FULL, acc, k);
  const bool anybad = __any_sync(FULL, bad) || ptr != n_words;
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
int kvzl_decode_launch(const void* blob, const void* desc, int n_chunks, const void* tab,
                       const void* bmap, const void* base, int C, int NB, void* out, void* sums,
                       void* err, void* stream) {
  const int warps = 4;
  kvzl_decode<<<(n_chunks + warps - 1) / warps, 32 * warps, 0, (cudaStream_t)stream>>>(
      (const uint8_t*)blob, (const int64_t*)desc, n_chunks, (const uint32_t*)tab,
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
