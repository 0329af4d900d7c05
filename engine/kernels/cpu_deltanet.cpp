// Gated DeltaNet (engine.models.gated_deltanet.GatedDeltaNetMixer, Qwen3-Next's linear attention):
// the elementwise steps around the delta rule, and a decode step's whole mixer as one call of the
// kernels its forward calls one by one, in the same order on the same values, so both give the
// same bits. Built with the other C++ kernels into one library (engine.kernels.native).

#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_kernels.h"

extern "C" {

// The two projections' outputs, grouped by key head as Qwen3-Next stores them (per key head: q
// [dk], k [dk], then v and z of its r = v_heads / k_heads value heads [r dv each]; in ba its r
// b's, then its r a's), into qkv [rows, 2 k_heads dk + v_heads dv] as q | k | v, each head-major
// (the conv's input), z [rows, v_heads dv] and b, a [rows, v_heads]: split_projections' copies.
static void gdn_split(const float* qkvz, const float* ba, int64_t rows, int64_t k_heads, int64_t v_heads,
                      int64_t k_dim, int64_t v_dim, float* qkv, float* z, float* b, float* a) {
  const int64_t r = v_heads / k_heads, group = 2 * k_dim + 2 * r * v_dim, key_dim = k_heads * k_dim;
  const int64_t value_dim = v_heads * v_dim, conv_dim = 2 * key_dim + value_dim, block = r * v_dim;
  for (int64_t i = 0; i < rows; ++i) {
    const float* src = qkvz + i * k_heads * group;
    float* q = qkv + i * conv_dim;
    for (int64_t j = 0; j < k_heads; ++j, src += group) {
      std::memcpy(q + j * k_dim, src, k_dim * sizeof(float));
      std::memcpy(q + key_dim + j * k_dim, src + k_dim, k_dim * sizeof(float));
      std::memcpy(q + 2 * key_dim + j * block, src + 2 * k_dim, block * sizeof(float));
      std::memcpy(z + i * value_dim + j * block, src + 2 * k_dim + block, block * sizeof(float));
      std::memcpy(b + i * v_heads + j * r, ba + i * 2 * v_heads + j * 2 * r, r * sizeof(float));
      std::memcpy(a + i * v_heads + j * r, ba + i * 2 * v_heads + j * 2 * r + r, r * sizeof(float));
    }
  }
}

// The delta rule's gates per value head: beta = sigmoid(b), g = A[h] softplus(a + dt_bias[h]), A
// being -exp(A_log) (softplus as torch's: the input itself above 20). b, a, beta, g [rows, heads].
void gdn_gates(const float* b, const float* a, const float* A, const float* dt_bias, float* beta, float* g,
               int64_t rows, int64_t heads, int) {
  for (int64_t i = 0; i < rows * heads; ++i) {
    const int64_t h = i % heads;
    beta[i] = 1.f / (1.f + std::exp(-b[i]));
    const float v = a[i] + dt_bias[h];
    g[i] = A[h] * (v > 20.f ? v : std::log1p(std::exp(v)));
  }
}

// q and k as the delta rule takes them: each head L2-normalised (x / sqrt(|x|^2 + 1e-6)), q then
// scaled by dk^-1/2, key head j repeated to serve value heads j r .. j r + r - 1. q, k: rows
// `stride` apart, k_heads heads of k_dim each; q_out, k_out [rows, v_heads, k_dim].
void gdn_prepare_qk(const float* q, const float* k, int64_t stride, int64_t rows, int64_t k_heads, int64_t v_heads,
                    int64_t k_dim, float* q_out, float* k_out, int) {
  const int64_t r = v_heads / k_heads;
  const float scale = 1.f / std::sqrt(static_cast<float>(k_dim));
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < k_heads; ++j) {
      const float* qh = q + i * stride + j * k_dim;
      const float* kh = k + i * stride + j * k_dim;
      float* qo = q_out + (i * v_heads + j * r) * k_dim;
      float* ko = k_out + (i * v_heads + j * r) * k_dim;
      float qq = 0.f, kk = 0.f;
#pragma omp simd reduction(+ : qq, kk)
      for (int64_t c = 0; c < k_dim; ++c) {
        qq += qh[c] * qh[c];
        kk += kh[c] * kh[c];
      }
      const float q_inv = 1.f / std::sqrt(qq + 1e-6f), k_inv = 1.f / std::sqrt(kk + 1e-6f);
#pragma omp simd
      for (int64_t c = 0; c < k_dim; ++c) {
        qo[c] = (qh[c] * q_inv) * scale;
        ko[c] = kh[c] * k_inv;
      }
      for (int64_t copy = 1; copy < r; ++copy) {
        std::memcpy(qo + copy * k_dim, qo, k_dim * sizeof(float));
        std::memcpy(ko + copy * k_dim, ko, k_dim * sizeof(float));
      }
    }
  }
}

// The mixer over rows that are all decodes, one token each: qkvz = in_proj_qkvz(h), ba =
// in_proj_ba(h); gdn_split; qkv = silu(conv_update(qkv)); gdn_prepare_qk; gdn_gates; the delta
// rule's step on each row's recurrent state; the per-head norm of its output, times silu(z)
// (skip_norm_gate without a skip, norm_weight [v_heads dv]: the head's weight repeated);
// out = out_proj(y). The states update in place at their slots. scratch holds rows * (2 key_dim
// + 6 value_dim + 2 conv_dim + 6 v_heads + 2 v_heads k_dim) floats (key_dim = k_heads k_dim).
void gdn_decode(const float* h, int64_t rows, int64_t hidden, int64_t k_heads, int64_t v_heads, int64_t k_dim,
                int64_t v_dim, int64_t d_conv, const float* qkvz_panels, const float* ba_panels, float* conv_state,
                float* recurrent_state, const int64_t* slots, const float* conv_weight, const float* A,
                const float* dt_bias, const float* norm_weight, float norm_eps, const float* out_panels,
                float* scratch, float* out, int threads) {
  const int64_t key_dim = k_heads * k_dim, value_dim = v_heads * v_dim, conv_dim = 2 * key_dim + value_dim;
  const int64_t width = 2 * key_dim + 2 * value_dim;
  float* qkvz = scratch;                      // [rows, width]
  float* ba = qkvz + rows * width;            // [rows, 2 v_heads]
  float* mixed = ba + rows * 2 * v_heads;     // [rows, conv_dim]: q | k | v before the conv
  float* z = mixed + rows * conv_dim;         // [rows, value_dim]
  float* b = z + rows * value_dim;            // [rows, v_heads]
  float* a = b + rows * v_heads;              // [rows, v_heads]
  float* conv = a + rows * v_heads;           // [rows, conv_dim]
  float* q = conv + rows * conv_dim;          // [rows, v_heads, k_dim]
  float* k = q + rows * v_heads * k_dim;      // [rows, v_heads, k_dim]
  float* v = k + rows * v_heads * k_dim;      // [rows, value_dim]
  float* beta = v + rows * value_dim;         // [rows, v_heads]
  float* g = beta + rows * v_heads;           // [rows, v_heads]
  float* o = g + rows * v_heads;              // [rows, value_dim]
  float* normed = o + rows * value_dim;       // [rows, value_dim]
  packed_linear(h, hidden, qkvz_panels, nullptr, qkvz, width, rows, width, hidden, threads);
  packed_linear(h, hidden, ba_panels, nullptr, ba, 2 * v_heads, rows, 2 * v_heads, hidden, threads);
  gdn_split(qkvz, ba, rows, k_heads, v_heads, k_dim, v_dim, mixed, z, b, a);
  conv_update(conv_state, slots, mixed, conv_dim, conv_weight, nullptr, conv, rows, conv_dim, d_conv, 1, threads);
  gdn_prepare_qk(conv, conv + key_dim, conv_dim, rows, k_heads, v_heads, k_dim, q, k, threads);
  for (int64_t i = 0; i < rows; ++i)
    std::memcpy(v + i * value_dim, conv + i * conv_dim + 2 * key_dim, value_dim * sizeof(float));
  gdn_gates(b, a, A, dt_bias, beta, g, rows, v_heads, threads);
  gated_delta_step(recurrent_state, slots, q, k, v, g, beta, o, rows, v_heads, k_dim, v_dim, 0, threads);
  skip_norm_gate(o, nullptr, 0, nullptr, z, value_dim, norm_weight, v_dim, norm_eps, normed, rows, value_dim,
                 threads);
  packed_linear(normed, value_dim, out_panels, nullptr, out, hidden, rows, hidden, value_dim, threads);
}

}  // extern "C"
