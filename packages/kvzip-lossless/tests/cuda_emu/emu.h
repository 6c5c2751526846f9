// CPU emulation of the CUDA subset csrc/kvzl.cu uses: one std::thread per CUDA thread, warp
// collectives through a per-warp barrier. Only for checking kernels on a machine without a GPU.
#pragma once
#include <atomic>
#include <barrier>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>
#include <algorithm>
#include <cmath>
#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __shared__ static
struct dim3 { unsigned x, y, z; dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {} };
struct uint3_ { unsigned x, y, z; };
struct uint4 { uint32_t x, y, z, w; };
typedef void* cudaStream_t;
typedef int cudaError_t;
constexpr cudaError_t cudaSuccess = 0;
enum { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
template <class K> inline cudaError_t cudaFuncSetAttribute(K, int, int) { return cudaSuccess; }
inline int cudaGetLastError() { return 0; }
// float conversions with the rounding the intrinsic names (IEEE float: multiply, divide round
// to nearest on both sides)
inline float __uint2float_rn(uint32_t x) { return (float)x; }
inline float __uint2float_rz(uint32_t x) {
  float f = (float)x;
  if ((double)f > (double)x) f = std::nextafter(f, 0.0f);
  return f;
}
inline uint32_t __float2uint_rz(float f) { return f <= 0.0f ? 0u : (uint32_t)f; }
inline float __frcp_rn(float f) { return 1.0f / f; }
struct WarpState { std::barrier<> bar{32}; uint64_t slot[32]; };
thread_local uint3_ threadIdx, blockIdx;
thread_local dim3 blockDim, gridDim;
thread_local WarpState* g_warp;
thread_local uint8_t* g_smem;  // the block's dynamic shared memory
inline void* emu_dynamic_smem() { return g_smem; }
inline void __syncwarp(unsigned = 0xffffffffu) { g_warp->bar.arrive_and_wait(); }
using std::min;
using std::max;
template <class T> inline T emu_exchange(T v, int src) {
  int lane = threadIdx.x & 31;
  uint64_t u = 0; std::memcpy(&u, &v, sizeof(T));
  g_warp->slot[lane] = u;
  g_warp->bar.arrive_and_wait();
  uint64_t r = g_warp->slot[src & 31];
  g_warp->bar.arrive_and_wait();
  T out; std::memcpy(&out, &r, sizeof(T));
  return out;
}
template <class T> inline T __shfl_sync(unsigned, T v, int src) { return emu_exchange(v, src); }
template <class T> inline T __shfl_sync(unsigned, T v, unsigned src) { return emu_exchange(v, (int)src); }
template <class T> inline T __shfl_xor_sync(unsigned, T v, int k) { return emu_exchange(v, (threadIdx.x & 31) ^ k); }
inline uint32_t __ballot_sync(unsigned, bool p) {
  int lane = threadIdx.x & 31;
  g_warp->slot[lane] = p;
  g_warp->bar.arrive_and_wait();
  uint32_t m = 0;
  for (int k = 0; k < 32; ++k) m |= (uint32_t)(g_warp->slot[k] != 0) << k;
  g_warp->bar.arrive_and_wait();
  return m;
}
inline bool __any_sync(unsigned m, bool p) { return __ballot_sync(m, p) != 0; }
inline bool __all_sync(unsigned m, bool p) { return __ballot_sync(m, p) == 0xffffffffu; }
inline int __popc(uint32_t x) { return __builtin_popcount(x); }
template <class T> inline T __ldg(const T* p) { return *p; }
template <class T> inline T atomicAdd(T* p, T v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline uint32_t atomicAdd(uint32_t* p, uint32_t v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
template <class T> inline T atomicOr(T* p, T v) { return __atomic_fetch_or(p, v, __ATOMIC_SEQ_CST); }
inline void __syncthreads() {}
template <class K, class... A> void emu_launch(K k, dim3 g, dim3 b, size_t smem, A... a) {
  for (unsigned by = 0; by < g.y; ++by)
    for (unsigned bx = 0; bx < g.x; ++bx) {
      unsigned n = b.x;
      std::vector<WarpState> warps((n + 31) / 32);
      std::vector<uint8_t> dyn(smem + 16);
      std::vector<std::thread> ts;
      for (unsigned t = 0; t < n; ++t)
        ts.emplace_back([&, t] {
          threadIdx = {t, 0, 0}; blockIdx = {bx, by, 0}; blockDim = b; gridDim = g;
          g_warp = &warps[t / 32];
          g_smem = dyn.data();
          k(a...);
          // a thread that returned early keeps its warp's barrier counts: drop it
          g_warp->bar.arrive_and_drop();
        });
      for (auto& th : ts) th.join();
    }
}
