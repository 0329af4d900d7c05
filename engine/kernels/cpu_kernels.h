// Shared by the C++ CPU kernels (every cpu_*.cpp): float32 helpers, the loop that shares work
// between threads, and the kernels the files call across each other.
#pragma once

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace splitserve {

// The output columns of one panel of a packed weight (cpu_gemm.cpp; engine.models.packed_linear).
constexpr int64_t PANEL_COLUMNS = 16;

// exp(v), inlined into vector loops where the libm vector exp is a call that spills every live
// vector register: Cephes' expf (range reduction by ln 2
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

// The largest of `start` and x[0, n). Written as a compare, not std::max, which GCC left as a
// scalar chain of maxss (a fifth of prefill attention's time); a max is exact in any order.
inline float max_of(const float* x, int64_t n, float start) {
  float top = start;
#pragma omp simd reduction(max : top)
  for (int64_t i = 0; i < n; ++i) top = x[i] > top ? x[i] : top;
  return top;
}

// SwiGLU's product for one value: silu(gate) * up. Every kernel that computes it calls this, so
// the fused GEMM (cpu_gemm.cpp grouped_silu_gate_up) and silu_mul give the same bits.
inline float silu_times(float gate, float up) { return gate / (1.f + fast_exp(-gate)) * up; }

// GELU's product for one value: gelu(gate) * up, the exact GELU, x/2 (1 + erf(x / sqrt 2)) (with
// -ffast-math and omp simd, GCC calls glibc's vector erff).
inline float gelu_times(float gate, float up) {
  return gate * 0.5f * (1.f + std::erf(gate * 0.70710678118654752f)) * up;
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

// The kernels one file calls from another, declared once here so that each definition is checked
// against its declaration by the compiler (a mismatch is an error, not a misread argument).
extern "C" {

// cpu_gemm.cpp
void packed_linear(const float* x, int64_t ldx, const float* panels, const float* bias, float* out, int64_t ldo,
                   int64_t rows, int64_t out_features, int64_t in_features, int threads);
void grouped_linear(const float* x, int64_t ldx, const int64_t* counts, const int64_t* weights, int64_t stride,
                    float* out, int64_t ldo, int64_t groups, int64_t out_features, int64_t in_features, int threads);
void grouped_silu_gate_up(const float* x, int64_t ldx, const int64_t* counts, const int64_t* weights,
                          int64_t stride, float* act, int64_t groups, int64_t inter, int64_t in_features, int threads);

// cpu_kernels.cpp
void ssm_state_update(float* state, const int64_t* slots, const float* x, const float* dt, const float* A,
                      const float* B, const float* C, float* y, int64_t batch, int64_t d_inner, int64_t d_state,
                      int threads);
void conv_update(float* state, const int64_t* slots, const float* x, int64_t x_stride, const float* weight,
                 const float* bias, float* y, int64_t batch, int64_t channels, int64_t width, int64_t silu,
                 int threads);
void mamba2_state_update(float* state, const int64_t* slots, const float* x, const float* dt, const float* A,
                         const float* B, const float* C, float* y, int64_t batch, int64_t heads, int64_t head_dim,
                         int64_t groups, int64_t d_state, int threads);
void gated_delta_step(float* state, const int64_t* slots, const float* q, const float* k, const float* v,
                      const float* g, const float* beta, float* o, int64_t batch, int64_t heads, int64_t k_dim,
                      int64_t v_dim, int64_t g_per_channel, int threads);
void paged_attention_decode(const float* q, const float* k_cache, const float* v_cache, const int64_t* tables,
                            int64_t table_width, const int64_t* lens, float* out, int64_t batch, int64_t heads,
                            int64_t kv_heads, int64_t head_dim, int64_t block_size, float scale, int64_t window,
                            int threads);

// cpu_fused.cpp
void rms_norm(float* x, const float* add, const float* weight, float* out, int64_t rows, int64_t cols,
              int64_t x_stride, float eps, int threads);
void rms_norm_3(const float* x, int64_t x_stride, const float* w0, const float* w1, const float* w2, int64_t n0,
                int64_t n1, int64_t n2, float* o0, float* o1, float* o2, int64_t rows, float eps, int threads);
void skip_norm_gate(const float* y, const float* x, int64_t x_stride, const float* D, const float* z,
                    int64_t z_stride, const float* weight, int64_t group, float eps, float* out, int64_t rows,
                    int64_t cols, int threads);
void group_rms_norm(const float* x, const float* weight, float* out, int64_t rows, int64_t cols, int64_t group,
                    float eps, int threads);
void silu_mul(const float* gate, const float* up, float* out, int64_t rows, int64_t cols, int64_t in_stride,
              int threads);
void rotary(float* x, int64_t x_stride, const float* cos, const float* sin, int64_t tokens, int64_t heads,
            int64_t head_dim, int64_t rotary_dim, int threads);
void gated_skip(const float* y, const float* x, int64_t x_stride, const float* D, const float* z, int64_t z_stride,
                float* out, int64_t rows, int64_t cols, int threads);
void bias_softplus(float* dt, const float* bias, int64_t rows, int64_t cols, int threads);
void mamba2_dt(const float* dt, int64_t dt_stride, const float* bias, int64_t softplus, float lo, float hi,
               float* out, int64_t rows, int64_t heads, int threads);
void moe_group(const int64_t* experts, int64_t* counts, int64_t* token_of_row, int64_t* position, int64_t picks,
               int64_t top_k, int64_t num_experts, int threads);
void moe_combine(const float* picks, const int64_t* position, const float* weights, float* out, int64_t tokens,
                 int64_t top_k, int64_t hidden, int threads);

// cpu_layers.cpp
void moe_silu_experts(const float* x, const int64_t* counts, const int64_t* panels, float* scratch, float* out,
                      int64_t experts, int64_t hidden, int64_t inter, int threads);
void moe_layer(const float* x, int64_t rows, int64_t hidden, const float* router_panels, int64_t experts,
               int64_t top_k, int64_t normalize, const int64_t* expert_panels, int64_t inter, int64_t* ids,
               float* scratch, float* out, int threads);
void mamba_decode(const float* h, int64_t rows, int64_t hidden, int64_t d_inner, int64_t d_state, int64_t dt_rank,
                  int64_t d_conv, const float* in_panels, const float* in_bias, float* conv_state, float* ssm_state,
                  const int64_t* slots, const float* conv_weight, const float* conv_bias, const float* x_panels,
                  const float* dt_norm, const float* b_norm, const float* c_norm, float norm_eps,
                  const float* dt_panels, const float* dt_bias, const float* A, const float* D,
                  const float* out_panels, const float* out_bias, float* scratch, float* out, int threads);
void mamba2_decode(const float* h, int64_t rows, int64_t hidden, int64_t heads, int64_t head_dim, int64_t groups,
                   int64_t d_state, int64_t d_conv, const float* in_panels, const float* in_bias, float* conv_state,
                   float* ssm_state, const int64_t* slots, const float* conv_weight, const float* conv_bias,
                   const float* dt_bias, float dt_lo, float dt_hi, const float* A, const float* D,
                   const float* norm_weight, int64_t norm_group, int64_t norm_first, float norm_eps,
                   const float* out_panels, const float* out_bias, float* scratch, float* out, int threads);
void short_conv_decode(const float* h, int64_t rows, int64_t hidden, int64_t kernel, const float* in_panels,
                       const float* in_bias, float* conv_state, const int64_t* slots, const float* conv_weight,
                       const float* conv_bias, const float* out_panels, const float* out_bias, float* scratch,
                       float* out, int threads);
void adapter_gelu_mlp(const float* x, int64_t rows, int64_t hidden, const float* gate_up_panels,
                      const float* gate_up_bias, const float* lora_down_panels, int64_t rank,
                      const float* lora_up_panels, int64_t inter, const float* down_panels, const float* down_bias,
                      float* scratch, float* out, int threads);
void attention_decode(const float* h, int64_t rows, int64_t hidden, int64_t out_width, int64_t heads,
                      int64_t kv_heads, int64_t head_dim, const float* qkv_panels, const float* qkv_bias,
                      const float* cos, const float* sin, int64_t rotary_dim, float* k_cache, float* v_cache,
                      const int64_t* write_index, const int64_t* tables, int64_t table_width, const int64_t* lens,
                      int64_t block_size, float scale, int64_t window, const float* o_panels, const float* o_bias,
                      float* scratch, float* out, int threads);
void sigmoid_gated_add(float* out, const float* gate, const float* x, int64_t rows, int64_t cols, int threads);
void normed_attention_decode(const float* h, int64_t rows, int64_t hidden, int64_t out_width, int64_t heads,
                             int64_t kv_heads, int64_t head_dim, const float* qkv_panels, const float* qkv_bias,
                             const float* cos, const float* sin, int64_t rotary_dim, float* k_cache, float* v_cache,
                             const int64_t* write_index, const int64_t* tables, int64_t table_width,
                             const int64_t* lens, int64_t block_size, float scale, int64_t window,
                             const float* o_panels, const float* o_bias, const float* q_norm, const float* k_norm,
                             float norm_eps, int64_t gated, float* scratch, float* out, int threads);

// cpu_state.cpp
void state_store(const float* working, uint16_t* pool, const int64_t* slots, const int64_t* positions,
                 int64_t rows, int64_t row_numel, int64_t format, int threads);
void state_load(const uint16_t* pool, float* working, const int64_t* slots, int64_t rows, int64_t row_numel,
                int64_t format, int threads);

// cpu_deltanet.cpp
void gdn_decode(const float* h, int64_t rows, int64_t hidden, int64_t k_heads, int64_t v_heads, int64_t k_dim,
                int64_t v_dim, int64_t d_conv, const float* qkvz_panels, const float* ba_panels, float* conv_state,
                float* recurrent_state, const int64_t* slots, const float* conv_weight, const float* A,
                const float* dt_bias, const float* norm_weight, float norm_eps, const float* out_panels,
                float* scratch, float* out, int threads);

}  // extern "C"
