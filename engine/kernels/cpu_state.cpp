// Recurrent state stored at half width (engine/state_format.py): the load into float32 working
// rows and the stochastically rounded store back, compiled with the other CPU kernels by
// engine/kernels/native.py.
//
// The store computes exactly what engine.state_format.stochastic_round computes with torch ops
// (the GPU's path): the same hash of the same 32-bit words, the same round-to-nearest, the same
// neighbour, the same comparison. Every step of that comparison is exact in float32 (the error
// of a nearest rounding, and a 24-bit integer times a power-of-two gap), so the two agree bit for
// bit (tests/test_state_format.py).

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr int kBFloat16 = 1, kFloat16 = 2;  // 0: none (a LayerPlan's default)

inline uint32_t mix32(uint32_t x) {  // murmur3's finaliser, as state_format._hash32
  x = (x ^ (x >> 16)) * 0x85EBCA6Bu;
  x = (x ^ (x >> 13)) * 0xC2B2AE35u;
  return x ^ (x >> 16);
}

inline uint32_t bits_of(float v) {
  uint32_t b;
  std::memcpy(&b, &v, 4);
  return b;
}

inline float float_of(uint32_t b) {
  float v;
  std::memcpy(&v, &b, 4);
  return v;
}

// The half-width bits nearest to v (ties to even; finite v: the caller keeps inf and nan). Float16
// by integer arithmetic, not the compiler's _Float16, whose conversions vectorised wrongly here.
template <int Format>
inline uint16_t nearest_bits(float v) {
  if constexpr (Format == kFloat16) {
    const uint32_t b = bits_of(v);
    const uint32_t sign = (b >> 16) & 0x8000u;
    const uint32_t a = b & 0x7FFFFFFFu;
    // below 2^-14 (a float16 subnormal): adding 0.5 puts the subnormal's bits, rounded to even
    // by the float adder, at the bottom of the sum's mantissa
    const uint32_t subnormal = bits_of(float_of(a) + 0.5f) - 0x3F000000u;
    // normal: rebias the exponent, round the 13 dropped bits to even
    const uint32_t normal = (a + 0xC8000FFFu + ((a >> 13) & 1u)) >> 13;  // 0xC8000000: (15 - 127) << 23
    const uint32_t out = a > 0x7F800000u ? 0x7E00u : a >= 0x47800000u ? 0x7C00u : a < 0x38800000u ? subnormal : normal;
    return static_cast<uint16_t>(out | sign);
  } else {
    const uint32_t b = bits_of(v);
    return static_cast<uint16_t>((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
  }
}

template <int Format>
inline float value_of(uint16_t h) {
  if constexpr (Format == kFloat16) {
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    const uint32_t magnitude = h & 0x7FFFu;
    const uint32_t normal = (magnitude << 13) + 0x38000000u;  // (127 - 15) << 23
    const uint32_t subnormal = bits_of(static_cast<float>(magnitude) * 5.9604644775390625e-8f);  // 2^-24
    const uint32_t special = (magnitude << 13) | 0x7F800000u;  // inf, nan
    return float_of(sign | (magnitude < 0x400u ? subnormal : magnitude >= 0x7C00u ? special : normal));
  } else {
    return float_of(static_cast<uint32_t>(h) << 16);
  }
}

template <int Format>
inline bool inf_or_nan(uint16_t h) {
  constexpr uint16_t exponent = Format == kFloat16 ? 0x7C00u : 0x7F80u;
  return (h & exponent) == exponent;
}

// Branch-free, in 32-bit integers, so that the row loop vectorises (with branches, a random up or
// down is a mispredicted branch per element). `salt`: the row's position and the element's
// index, mixed as state_format.stochastic_round mixes them.
template <int Format>
inline uint16_t round_one(float v, uint32_t salt) {
  const uint32_t vb = bits_of(v);
  const uint32_t nearest = nearest_bits<Format>(v);
  const float base = value_of<Format>(static_cast<uint16_t>(nearest));
  const float error = v - base;
  // nextafter(nearest, error > 0 ? inf : -inf): from a zero the smallest subnormal of that sign,
  // else one step of the magnitude, which grows when moving away from zero (0/1 integers, not
  // bools: a select between bools does not vectorise)
  const uint32_t up = error > 0.f ? 1u : 0u;
  const uint32_t magnitude = nearest & 0x7FFFu, sign = nearest & 0x8000u;
  const uint32_t from_zero = magnitude == 0 ? 1u : 0u;
  const uint32_t grows = from_zero | (up ^ (sign >> 15));
  const uint32_t other = (from_zero ? (1u - up) << 15 : sign) | (magnitude + 2 * grows - 1);
  const float gap = std::fabs(value_of<Format>(static_cast<uint16_t>(other)) - base);
  const uint32_t uniform = mix32(vb ^ salt) >> 8;  // 24 random bits
  const bool away = static_cast<float>(uniform) * (1.f / 16777216.f) * gap < std::fabs(error);
  // inf and nan stay; so does a value past the format's largest (nearest: inf), and one whose
  // other neighbour is inf (torch's path: an infinite gap never rounds away)
  const bool keep = (vb & 0x7F800000u) == 0x7F800000u || inf_or_nan<Format>(static_cast<uint16_t>(nearest)) ||
                    inf_or_nan<Format>(static_cast<uint16_t>(other));
  return static_cast<uint16_t>(away && !keep ? other : nearest);
}

template <int Format>
void store_rows(const float* working, uint16_t* pool, const int64_t* slots, const int64_t* positions, int64_t rows,
                int64_t row_numel, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * row_numel >= 32768)
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = working + slots[r] * row_numel;
    uint16_t* dst = pool + slots[r] * row_numel;
    const uint32_t row_salt = static_cast<uint32_t>(static_cast<uint64_t>(positions[r]) * 0x9E3779B1ull);
#pragma omp simd
    for (int64_t e = 0; e < row_numel; ++e)
      dst[e] = round_one<Format>(src[e], row_salt + static_cast<uint32_t>(e) * 0x85EBCA77u);
  }
}

template <int Format>
void load_rows(const uint16_t* pool, float* working, const int64_t* slots, int64_t rows, int64_t row_numel,
               int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * row_numel >= 32768)
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* src = pool + slots[r] * row_numel;
    float* dst = working + slots[r] * row_numel;
#pragma omp simd
    for (int64_t e = 0; e < row_numel; ++e) dst[e] = value_of<Format>(src[e]);
  }
}

}  // namespace

extern "C" {

// working[slots[r]] (float32 rows of `row_numel`) into pool[slots[r]] (16-bit rows), each element
// stochastically rounded with positions[r] and its index in the row; format 1: bfloat16, 2: float16.
void state_store(const float* working, uint16_t* pool, const int64_t* slots, const int64_t* positions,
                 int64_t rows, int64_t row_numel, int64_t format, int threads) {
  if (format == kFloat16)
    store_rows<kFloat16>(working, pool, slots, positions, rows, row_numel, threads);
  else
    store_rows<kBFloat16>(working, pool, slots, positions, rows, row_numel, threads);
}

// pool[slots[r]] (16-bit rows) into working[slots[r]] (float32), exactly.
void state_load(const uint16_t* pool, float* working, const int64_t* slots, int64_t rows, int64_t row_numel,
                int64_t format, int threads) {
  if (format == kFloat16)
    load_rows<kFloat16>(pool, working, slots, rows, row_numel, threads);
  else
    load_rows<kBFloat16>(pool, working, slots, rows, row_numel, threads);
}

}  // extern "C"
