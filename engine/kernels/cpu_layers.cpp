// Layers whose glue cost more than their kernels, each as one call of the kernels the
// layer's Python would call one by one, in the same order on the same buffers, so the results
// are the same bits (engine.models.layers.SparseMoE and GatedMLP, engine.models.ssm.MambaMixer,
// engine.models.mamba2.Mamba2Mixer, engine.models.short_conv.ShortConvMixer,
// engine.models.attention.PagedAttention and NormedAttention, Zamba2's SharedBlock.mlp, whose
// exact GELU is this library's, not torch's: within float32 rounding). Built with the other C++ kernels
// into one library (engine.kernels.native).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_kernels.h"

extern "C" {

// The SwiGLU experts of an MoE layer (engine.models.layers.SparseMoE) over its routed rows x,
// grouped by expert (counts[e] rows for expert e, in expert order): for each, [gate | up] =
// gate_up_e(x), out = down_e(silu(gate) * up), with expert e's packed panels at panels[2e]
// (gate_up) and panels[2e + 1] (down), each GEMM over all the experts at once (grouped_linear).
// One call for what takes six Python-level calls an expert; scratch holds [rows, 3 * inter] floats.
void moe_silu_experts(const float* x, const int64_t* counts, const int64_t* panels, float* scratch, float* out,
                      int64_t experts, int64_t hidden, int64_t inter, int threads) {
  int64_t rows = 0;
  for (int64_t e = 0; e < experts; ++e) rows += counts[e];
  float* gate_up = scratch;
  float* act = scratch + rows * 2 * inter;
  if (inter % splitserve::PANEL_COLUMNS == 0) {
    grouped_silu_gate_up(x, hidden, counts, panels, 2, act, experts, inter, hidden, threads);
  } else {
    grouped_linear(x, hidden, counts, panels, 2, gate_up, 2 * inter, experts, 2 * inter, hidden, threads);
    silu_mul(gate_up, gate_up + inter, act, rows, inter, 2 * inter, threads);
  }
  grouped_linear(act, inter, counts, panels + 1, 2, out, hidden, experts, hidden, inter, threads);
}

// An MoE router's choice per token from its logits [tokens, experts]: the softmax, its top_k
// probabilities largest first (the first expert among equal ones) into ids and weights
// [tokens, top_k], divided by their sum where `normalize` (what torch.softmax, torch.topk and the
// division give, up to the last bits of exp).
void moe_route(const float* logits, int64_t tokens, int64_t experts, int64_t top_k, int64_t normalize, int64_t* ids,
               float* weights, int) {
  std::vector<float> probs(experts);
  std::vector<char> taken(experts);
  for (int64_t t = 0; t < tokens; ++t) {
    const float* l = logits + t * experts;
    const float top = splitserve::max_of(l + 1, experts - 1, l[0]);
    float total = 0.f;
    for (int64_t e = 0; e < experts; ++e) total += probs[e] = std::exp(l[e] - top);
    for (int64_t e = 0; e < experts; ++e) probs[e] /= total;
    std::fill(taken.begin(), taken.end(), 0);
    float chosen = 0.f;
    for (int64_t k = 0; k < top_k; ++k) {
      int64_t best = -1;
      for (int64_t e = 0; e < experts; ++e)
        if (!taken[e] && (best < 0 || probs[e] > probs[best])) best = e;
      taken[best] = 1;
      ids[t * top_k + k] = best;
      chosen += weights[t * top_k + k] = probs[best];
    }
    if (normalize)
      for (int64_t k = 0; k < top_k; ++k) weights[t * top_k + k] /= chosen;
  }
}

// A SwiGLU MoE layer (engine.models.layers.SparseMoE) over rows x [rows, hidden]: router logits by
// its packed weight, moe_route, moe_group, each pick's row of x gathered into expert order,
// moe_silu_experts, moe_combine into out. ids holds rows * (3 top_k) + experts int64s; scratch
// rows * (experts + top_k + 2 top_k hidden + 3 top_k inter) floats.
void moe_layer(const float* x, int64_t rows, int64_t hidden, const float* router_panels, int64_t experts,
               int64_t top_k, int64_t normalize, const int64_t* expert_panels, int64_t inter, int64_t* ids,
               float* scratch, float* out, int threads) {
  const int64_t picks = rows * top_k;
  int64_t* chosen = ids;
  int64_t* token_of_row = chosen + picks;
  int64_t* position = token_of_row + picks;
  int64_t* counts = position + picks;
  float* logits = scratch;                 // [rows, experts]
  float* weights = logits + rows * experts;  // [rows, top_k]
  float* routed = weights + picks;         // [picks, hidden], grouped by expert
  float* grouped = routed + picks * hidden;  // [picks, hidden]: each pick's expert output
  float* expert_scratch = grouped + picks * hidden;
  packed_linear(x, hidden, router_panels, nullptr, logits, experts, rows, experts, hidden, threads);
  moe_route(logits, rows, experts, top_k, normalize, chosen, weights, threads);
  moe_group(chosen, counts, token_of_row, position, picks, top_k, experts, threads);
  for (int64_t i = 0; i < picks; ++i)
    std::memcpy(routed + i * hidden, x + token_of_row[i] * hidden, hidden * sizeof(float));
  moe_silu_experts(routed, counts, expert_panels, expert_scratch, grouped, experts, hidden, inter, threads);
  moe_combine(grouped, position, weights, out, rows, top_k, hidden, threads);
}

// Mamba's mixer (Mamba1, Jamba) over rows that are all decodes, one token each: [x | gate] =
// in_proj(h); x = silu(conv_update(x)); [dt | B | C] = x_proj(x), RMS-normed block by block where
// dt_norm is given (Jamba); dt = softplus(dt_proj(dt)); y = ssm_state_update(x, dt, A, B, C);
// y = (y + x D) silu(gate); out = out_proj(y). The states update in place at their slots;
// scratch holds rows * (5 d_inner + 2 dt_rank + 4 d_state) floats.
void mamba_decode(const float* h, int64_t rows, int64_t hidden, int64_t d_inner, int64_t d_state, int64_t dt_rank,
                  int64_t d_conv, const float* in_panels, const float* in_bias, float* conv_state, float* ssm_state,
                  const int64_t* slots, const float* conv_weight, const float* conv_bias, const float* x_panels,
                  const float* dt_norm, const float* b_norm, const float* c_norm, float norm_eps,
                  const float* dt_panels, const float* dt_bias, const float* A, const float* D,
                  const float* out_panels, const float* out_bias, float* scratch, float* out, int threads) {
  const int64_t di = d_inner, n = d_state, r = dt_rank, dbc_width = r + 2 * n;
  float* proj = scratch;                  // [rows, 2 di]: x, then gate
  float* x = proj + rows * 2 * di;        // [rows, di]
  float* dbc = x + rows * di;             // [rows, r + 2n]
  float* dt_in = dbc + rows * dbc_width;  // [rows, r]
  float* B = dt_in + rows * r;            // [rows, n]
  float* C = B + rows * n;                // [rows, n]
  float* dt = C + rows * n;               // [rows, di]
  float* y = dt + rows * di;              // [rows, di]
  packed_linear(h, hidden, in_panels, in_bias, proj, 2 * di, rows, 2 * di, hidden, threads);
  conv_update(conv_state, slots, proj, 2 * di, conv_weight, conv_bias, x, rows, di, d_conv, 1, threads);
  packed_linear(x, di, x_panels, nullptr, dbc, dbc_width, rows, dbc_width, di, threads);
  const float* dt_rows = dt_in;
  int64_t dt_stride = r;
  if (dt_norm != nullptr) {
    rms_norm_3(dbc, dbc_width, dt_norm, b_norm, c_norm, r, n, n, dt_in, B, C, rows, norm_eps, threads);
  } else {  // dt_proj reads its block in place; the state update takes B and C contiguous
    dt_rows = dbc;
    dt_stride = dbc_width;
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        B[i * n + j] = dbc[i * dbc_width + r + j];
        C[i * n + j] = dbc[i * dbc_width + r + n + j];
      }
    }
  }
  packed_linear(dt_rows, dt_stride, dt_panels, dt_bias, dt, di, rows, di, r, threads);
  bias_softplus(dt, nullptr, rows, di, threads);
  ssm_state_update(ssm_state, slots, x, dt, A, B, C, y, rows, di, n, threads);
  gated_skip(y, x, di, D, proj + di, 2 * di, y, rows, di, threads);
  packed_linear(y, di, out_panels, out_bias, out, hidden, rows, hidden, di, threads);
}

// Mamba2's mixer (engine.models.mamba2.Mamba2Mixer) over rows that are all decodes, one token
// each: [z | xBC | dt] = in_proj(h); xBC = silu(conv_update(xBC)), split into x, B, C; dt =
// mamba2_dt(dt); y = mamba2_state_update(x, dt, A, B, C); y = (y + x D) silu(z), D one per
// channel, then group_rms_norm(y) where norm_weight is given (with norm_first, skip_norm_gate:
// the norm before the gate); out = out_proj(y). The states update in place at their slots;
// scratch holds rows * (width + conv_dim + heads + 3 d_ssm + 2 groups d_state) floats, width
// being in_proj's.
void mamba2_decode(const float* h, int64_t rows, int64_t hidden, int64_t heads, int64_t head_dim, int64_t groups,
                   int64_t d_state, int64_t d_conv, const float* in_panels, const float* in_bias, float* conv_state,
                   float* ssm_state, const int64_t* slots, const float* conv_weight, const float* conv_bias,
                   const float* dt_bias, float dt_lo, float dt_hi, const float* A, const float* D,
                   const float* norm_weight, int64_t norm_group, int64_t norm_first, float norm_eps,
                   const float* out_panels, const float* out_bias, float* scratch, float* out, int threads) {
  const int64_t d_ssm = heads * head_dim, bc = groups * d_state, conv_dim = d_ssm + 2 * bc;
  const int64_t width = d_ssm + conv_dim + heads;
  float* proj = scratch;                  // [rows, width]: z, xBC, dt
  float* conv = proj + rows * width;      // [rows, conv_dim]: x, B, C after the conv
  float* dt = conv + rows * conv_dim;     // [rows, heads]
  float* x = dt + rows * heads;           // [rows, d_ssm], contiguous as the state update reads it
  float* B = x + rows * d_ssm;            // [rows, bc]
  float* C = B + rows * bc;               // [rows, bc]
  float* y = C + rows * bc;               // [rows, d_ssm]
  float* normed = y + rows * d_ssm;       // [rows, d_ssm]
  packed_linear(h, hidden, in_panels, in_bias, proj, width, rows, width, hidden, threads);
  conv_update(conv_state, slots, proj + d_ssm, width, conv_weight, conv_bias, conv, rows, conv_dim, d_conv, 1,
              threads);
  mamba2_dt(proj + d_ssm + conv_dim, width, dt_bias, 1, dt_lo, dt_hi, dt, rows, heads, threads);
  for (int64_t i = 0; i < rows; ++i) {
    std::memcpy(x + i * d_ssm, conv + i * conv_dim, d_ssm * sizeof(float));
    std::memcpy(B + i * bc, conv + i * conv_dim + d_ssm, bc * sizeof(float));
    std::memcpy(C + i * bc, conv + i * conv_dim + d_ssm + bc, bc * sizeof(float));
  }
  mamba2_state_update(ssm_state, slots, x, dt, A, B, C, y, rows, heads, head_dim, groups, d_state, threads);
  if (norm_weight != nullptr && norm_first) {
    skip_norm_gate(y, conv, conv_dim, D, proj, width, norm_weight, norm_group, norm_eps, normed, rows, d_ssm, threads);
    y = normed;
  } else {
    gated_skip(y, conv, conv_dim, D, proj, width, y, rows, d_ssm, threads);
    if (norm_weight != nullptr) {
      group_rms_norm(y, norm_weight, normed, rows, d_ssm, norm_group, norm_eps, threads);
      y = normed;
    }
  }
  packed_linear(y, d_ssm, out_panels, out_bias, out, hidden, rows, hidden, d_ssm, threads);
}

// LFM2's gated short convolution (engine.models.short_conv.ShortConvMixer) over rows that are all
// decodes: [b | c | x] = in_proj(h); y = conv_update(b * x) (no activation); out = out_proj(c * y).
// The state updates in place at the slots; scratch holds rows * 6 hidden floats.
void short_conv_decode(const float* h, int64_t rows, int64_t hidden, int64_t kernel, const float* in_panels,
                       const float* in_bias, float* conv_state, const int64_t* slots, const float* conv_weight,
                       const float* conv_bias, const float* out_panels, const float* out_bias, float* scratch,
                       float* out, int threads) {
  float* proj = scratch;                // [rows, 3 hidden]: b, c, x
  float* bx = proj + rows * 3 * hidden;  // [rows, hidden]
  float* y = bx + rows * hidden;         // [rows, hidden]
  float* cy = y + rows * hidden;         // [rows, hidden]
  packed_linear(h, hidden, in_panels, in_bias, proj, 3 * hidden, rows, 3 * hidden, hidden, threads);
  for (int64_t i = 0; i < rows; ++i) {
    const float* p = proj + i * 3 * hidden;
#pragma omp simd
    for (int64_t c = 0; c < hidden; ++c) bx[i * hidden + c] = p[c] * p[2 * hidden + c];
  }
  conv_update(conv_state, slots, bx, hidden, conv_weight, conv_bias, y, rows, hidden, kernel, 0, threads);
  for (int64_t i = 0; i < rows; ++i) {
    const float* p = proj + i * 3 * hidden;
#pragma omp simd
    for (int64_t c = 0; c < hidden; ++c) cy[i * hidden + c] = p[hidden + c] * y[i * hidden + c];
  }
  packed_linear(cy, hidden, out_panels, out_bias, out, hidden, rows, hidden, hidden, threads);
}

// Each row's k and v into the cache rows write_index[i], then paged attention of q [rows, heads,
// head_dim] contiguous over each row's blocks into attended. k and v rows k_stride and v_stride apart.
static void store_kv_and_attend(const float* q, const float* k, int64_t k_stride, const float* v, int64_t v_stride,
                                int64_t rows, int64_t heads, int64_t kv_heads, int64_t head_dim, float* k_cache,
                                float* v_cache, const int64_t* write_index, const int64_t* tables, int64_t table_width,
                                const int64_t* lens, int64_t block_size, float scale, int64_t window, float* attended,
                                int threads) {
  const int64_t kv_width = kv_heads * head_dim;
  for (int64_t i = 0; i < rows; ++i) {
    std::memcpy(k_cache + write_index[i] * kv_width, k + i * k_stride, kv_width * sizeof(float));
    std::memcpy(v_cache + write_index[i] * kv_width, v + i * v_stride, kv_width * sizeof(float));
  }
  paged_attention_decode(q, k_cache, v_cache, tables, table_width, lens, attended, rows, heads, kv_heads, head_dim,
                         block_size, scale, window, threads);
}

// An attention layer (engine.models.attention.PagedAttention) over rows that are all decodes, one
// token each: [q | k | v] = qkv(h) (the fused packed projection); rotate-half RoPE of q and k by
// cos and sin [rows, rotary_dim] where given; k and v into the cache rows write_index[i]; paged
// attention of q over each row's blocks; out = o_proj(attention) [rows, out_width] (the input's
// width `hidden` but for Zamba2's shared block, which reads [h | embeddings]). scratch holds
// rows * (3 heads + 2 kv_heads) * head_dim floats.
void attention_decode(const float* h, int64_t rows, int64_t hidden, int64_t out_width, int64_t heads,
                      int64_t kv_heads, int64_t head_dim, const float* qkv_panels, const float* qkv_bias,
                      const float* cos, const float* sin, int64_t rotary_dim, float* k_cache, float* v_cache,
                      const int64_t* write_index, const int64_t* tables, int64_t table_width, const int64_t* lens,
                      int64_t block_size, float scale, int64_t window, const float* o_panels, const float* o_bias,
                      float* scratch, float* out, int threads) {
  const int64_t q_width = heads * head_dim, kv_width = kv_heads * head_dim, width = q_width + 2 * kv_width;
  float* qkv = scratch;                 // [rows, width]
  float* q = qkv + rows * width;        // [rows, q_width]: q contiguous, as the attention reads it
  float* attended = q + rows * q_width;  // [rows, q_width]
  packed_linear(h, hidden, qkv_panels, qkv_bias, qkv, width, rows, width, hidden, threads);
  if (cos != nullptr) {
    rotary(qkv, width, cos, sin, rows, heads, head_dim, rotary_dim, threads);
    rotary(qkv + q_width, width, cos, sin, rows, kv_heads, head_dim, rotary_dim, threads);
  }
  for (int64_t i = 0; i < rows; ++i) std::memcpy(q + i * q_width, qkv + i * width, q_width * sizeof(float));
  store_kv_and_attend(q, qkv + q_width, width, qkv + q_width + kv_width, width, rows, heads, kv_heads, head_dim,
                      k_cache, v_cache, write_index, tables, table_width, lens, block_size, scale, window, attended,
                      threads);
  packed_linear(attended, q_width, o_panels, o_bias, out, out_width, rows, out_width, q_width, threads);
}

// x[r, h, c] *= sigmoid(gate[r, h, c]) for x [rows, heads, head_dim] contiguous, gate rows
// `gate_row_stride` and heads `gate_head_stride` apart (Qwen3-Next's gate beside each head's query).
void head_gate(float* x, const float* gate, int64_t gate_row_stride, int64_t gate_head_stride, int64_t rows,
               int64_t heads, int64_t head_dim, int) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t hd = 0; hd < heads; ++hd) {
      float* xr = x + (r * heads + hd) * head_dim;
      const float* g = gate + r * gate_row_stride + hd * gate_head_stride;
#pragma omp simd
      for (int64_t c = 0; c < head_dim; ++c) xr[c] = xr[c] * (1.f / (1.f + std::exp(-g[c])));
    }
}

// out[r, c] += sigmoid(gate[r]) * x[r, c] for out and x [rows, cols] contiguous, gate [rows]:
// Qwen3-Next's shared expert, scaled by its one-column gate, added to the routed experts.
void sigmoid_gated_add(float* out, const float* gate, const float* x, int64_t rows, int64_t cols, int) {
  for (int64_t r = 0; r < rows; ++r) {
    const float s = 1.f / (1.f + std::exp(-gate[r]));
    float* o = out + r * cols;
    const float* xr = x + r * cols;
#pragma omp simd
    for (int64_t c = 0; c < cols; ++c) o[c] += s * xr[c];
  }
}

// Attention with q and k RMS-normed per head (engine.models.attention.NormedAttention: LFM2's and
// Qwen3-Next's) over rows that are all decodes: [q | k | v] = qkv(h), where `gated` q holding
// per head its query, then its gate; each head's query and key normed (rms_norm); rotary on both;
// k and v into the cache; paged attention; where gated, head_gate by the gates; out = o_proj.
// scratch holds rows * (4 heads + 3 kv_heads) * head_dim floats.
void normed_attention_decode(const float* h, int64_t rows, int64_t hidden, int64_t out_width, int64_t heads,
                             int64_t kv_heads, int64_t head_dim, const float* qkv_panels, const float* qkv_bias,
                             const float* cos, const float* sin, int64_t rotary_dim, float* k_cache, float* v_cache,
                             const int64_t* write_index, const int64_t* tables, int64_t table_width,
                             const int64_t* lens, int64_t block_size, float scale, int64_t window,
                             const float* o_panels, const float* o_bias, const float* q_norm, const float* k_norm,
                             float norm_eps, int64_t gated, float* scratch, float* out, int threads) {
  const int64_t q_width = heads * head_dim, kv_width = kv_heads * head_dim, q_unit = (1 + gated) * head_dim;
  const int64_t q_block = heads * q_unit, width = q_block + 2 * kv_width;
  float* qkv = scratch;                  // [rows, width]
  float* q = qkv + rows * width;         // [rows, q_width]
  float* k = q + rows * q_width;         // [rows, kv_width]
  float* attended = k + rows * kv_width;  // [rows, q_width]
  packed_linear(h, hidden, qkv_panels, qkv_bias, qkv, width, rows, width, hidden, threads);
  for (int64_t i = 0; i < rows; ++i) {  // the norms read the queries and the keys in place
    rms_norm(qkv + i * width, nullptr, q_norm, q + i * q_width, heads, head_dim, q_unit, norm_eps, threads);
    rms_norm(qkv + i * width + q_block, nullptr, k_norm, k + i * kv_width, kv_heads, head_dim, head_dim, norm_eps,
             threads);
  }
  if (cos != nullptr) {
    rotary(q, q_width, cos, sin, rows, heads, head_dim, rotary_dim, threads);
    rotary(k, kv_width, cos, sin, rows, kv_heads, head_dim, rotary_dim, threads);
  }
  store_kv_and_attend(q, k, kv_width, qkv + q_block + kv_width, width, rows, heads, kv_heads, head_dim, k_cache,
                      v_cache, write_index, tables, table_width, lens, block_size, scale, window, attended, threads);
  if (gated) head_gate(attended, qkv + head_dim, width, q_unit, rows, heads, head_dim, threads);
  packed_linear(attended, q_width, o_panels, o_bias, out, out_width, rows, out_width, q_width, threads);
}

// A gated MLP with a low-rank adapter on its gate-up projection and the exact GELU (Zamba2's
// shared MLP at one hybrid use, engine.models.families_zamba2.SharedBlock.mlp):
// [gate | up] = gate_up(x) + lora_up(lora_down(x)); out = down(gelu(gate) * up), the sums taken in
// the activation's pass. scratch holds rows * (5 * inter + rank) floats.
void adapter_gelu_mlp(const float* x, int64_t rows, int64_t hidden, const float* gate_up_panels,
                      const float* gate_up_bias, const float* lora_down_panels, int64_t rank,
                      const float* lora_up_panels, int64_t inter, const float* down_panels, const float* down_bias,
                      float* scratch, float* out, int threads) {
  const int64_t width = 2 * inter;
  float* projected = scratch;                // [rows, width]
  float* adapted = projected + rows * width;  // [rows, width]
  float* act = adapted + rows * width;       // [rows, inter]
  float* low = act + rows * inter;           // [rows, rank]
  packed_linear(x, hidden, gate_up_panels, gate_up_bias, projected, width, rows, width, hidden, threads);
  packed_linear(x, hidden, lora_down_panels, nullptr, low, rank, rows, rank, hidden, threads);
  packed_linear(low, rank, lora_up_panels, nullptr, adapted, width, rows, width, rank, threads);
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * inter >= 32768)
  for (int64_t r = 0; r < rows; ++r) {
    const float *p = projected + r * width, *a = adapted + r * width;
    float* o = act + r * inter;
#pragma omp simd
    for (int64_t c = 0; c < inter; ++c) o[c] = splitserve::gelu_times(p[c] + a[c], p[inter + c] + a[inter + c]);
  }
  packed_linear(act, inter, down_panels, down_bias, out, hidden, rows, hidden, inter, threads);
}

}  // extern "C"
