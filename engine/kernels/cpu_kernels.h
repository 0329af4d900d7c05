// Shared by the C++ CPU kernels (cpu_kernels.cpp, cpu_fused.cpp, cpu_gemm.cpp): float32 helpers and
// the loop that shares work between threads.
#pragma once

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace splitserve {

// exp(v), inlined into vector loops where the libm vector exp is a call that spills every live
// vector register (the Mamba scan ran 3x faster with this): Cephes' expf (range reduction by ln 2
// in two parts, a degree-6 polynomial, the exponent built in the bits), within 1 ulp of exp on
// [-87, 88] in a sampled sweep. v is clamped to that range: below, 2^-126 instead of a denormal
// or 0 (a decay to nothing), above, 1.6e38 instead of infinity.
inline float fast_exp(float v) {
  v = std::min(std::max(v, -87.0f), 88.0f);
  const float k = std::nearbyint(v * 1.44269504088896341f);
  // Fused multiply-adds: fast math may not fold the two parts of ln 2 into one constant.
  const float r = std::fma(k, 2.12194440e-4f, std::fma(k, -0.693359375f, v));
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return e * scale;
}

// One thread's share of a loop, [front, back) packed in one word so a take is one compare-and-swap
// (so a loop has fewer than 2^32 items: a GEMM's chunks times panels are far fewer).
struct alignas(64) Share {
  std::atomic<uint64_t> range{0};
  void set(int64_t front, int64_t back) {
    range.store(static_cast<uint64_t>(back) << 32 | static_cast<uint64_t>(front));
  }
  int64_t take(bool from_back) {
    uint64_t r = range.load(std::memory_order_relaxed);
    while (true) {
      const uint64_t front = r & 0xffffffffu, back = r >> 32;
      if (front >= back) return -1;
      const uint64_t next = from_back ? (back - 1) << 32 | front : back << 32 | (front + 1);
      if (range.compare_exchange_weak(r, next)) return static_cast<int64_t>(from_back ? back - 1 : front);
    }
  }
};

// run(i) for i in [0, items) on up to `threads` threads. Each thread starts with a contiguous
// share, taken in order (so what it reads streams as one run, as under schedule(static)); a thread
// done with its own takes items from the back of the others'. On the 2-vCPU box the two threads
// rarely ran at the same speed: under a static split the faster one waited at the end of each
// GEMM (about 10% of the decode step's CPU time, sampled), and schedule(dynamic) balanced it but
// broke each thread's stream into every other panel (slower where memory was contended).
template <class Run>
void steal_for(int64_t items, int threads, Run&& run) {
  const int team = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, items)));
  if (team == 1) {
    for (int64_t i = 0; i < items; ++i) run(i);
    return;
  }
  std::vector<Share> shares(team);
  for (int t = 0; t < team; ++t) shares[t].set(items * t / team, items * (t + 1) / team);
#pragma omp parallel num_threads(team)
  {
    const int me = omp_get_thread_num();
    for (int64_t i; (i = shares[me].take(false)) >= 0;) run(i);
    for (int other = (me + 1) % team; other != me; other = (other + 1) % team) {
      for (int64_t i; (i = shares[other].take(true)) >= 0;) run(i);
    }
  }
}

}  // namespace splitserve
