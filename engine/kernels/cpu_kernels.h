// Shared by the C++ CPU kernels (cpu_kernels.cpp, cpu_fused.cpp): float32 helpers.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

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

}  // namespace splitserve
