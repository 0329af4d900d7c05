// A decode step's decoder layers in one call (engine.decode_stack): for each layer, the
// calls engine.models.hybrid.DecoderLayer makes through its one-call mixer and FFN (cpu_layers.cpp),
// with the same kernels in the same order on the same values, so the hidden states are the bits
// of the layer-by-layer path. What that saves is the Python between the calls, a sizeable share
// of a CPU decode step.

#include <algorithm>
#include <cstdint>

#include "cpu_kernels.h"

extern "C" {

enum Mixer : int64_t { MAMBA = 1, ATTENTION = 2, MAMBA2 = 3, RELU2_MLP = 4, GATED_DELTANET = 5, NORMED_ATTENTION = 6,
                       SHORT_CONV = 7, ZAMBA2_HYBRID = 8 };
enum Ffn : int64_t { NO_FFN = 0, SWIGLU_MLP = 1, MOE = 2 };

// One layer's weights, caches and sizes; mirrored field for field by engine.kernels.decode_plan.LayerPlan.
struct LayerPlan {
  int64_t mixer, ffn;
  const float* input_norm;
  const float* ffn_norm;  // null without an FFN
  float input_eps, ffn_eps;
  // Mamba (engine.models.ssm.MambaMixer)
  int64_t d_inner, d_state, dt_rank, d_conv;
  const float *in_panels, *in_bias;
  float *conv_state, *ssm_state;
  const float *conv_weight, *conv_bias, *x_panels, *dt_norm, *b_norm, *c_norm;
  const float *dt_panels, *dt_bias, *A, *D, *out_panels, *out_bias;
  float bcdt_eps;
  // attention (engine.models.attention.PagedAttention); cos and sin are this step's, or null
  float scale;
  int64_t heads, kv_heads, head_dim, rotary_dim, block_size, window;
  const float *qkv_panels, *qkv_bias, *cos, *sin, *o_panels, *o_bias;
  float *k_cache, *v_cache;
  // FFN: a SwiGLU MLP is the one-expert case of the MoE's experts
  int64_t experts, top_k, normalize, inter;
  const float* router_panels;
  const int64_t* expert_panels;
  // Mamba2 (engine.models.mamba2.Mamba2Mixer): heads and head_dim above, its own state and
  // projections in the Mamba fields (dt_bias its dt's bias, D one per channel)
  int64_t groups, gate_norm_group, gate_norm_first;
  const float* gate_norm;  // null without the norm
  float dt_lo, dt_hi, gate_norm_eps;
  // A shared SwiGLU expert added to the routed ones (engine.models.layers.SummedFFN), or null;
  // Granite's residual multiplier on the mixer's and the FFN's outputs (1: none)
  float residual_scale;
  int64_t shared_inter;
  const int64_t* shared_panels;
  // A squared-ReLU MLP in the mixer's place (Nemotron-H's MLP layers): down(relu(up(x))^2)
  int64_t mlp_inter;
  const float *up_panels, *up_bias, *down_panels, *down_bias;
  // Gated DeltaNet (engine.models.gated_deltanet): its sizes here; in_proj_qkvz in in_panels,
  // in_proj_ba in x_panels, its conv and recurrent states in conv_state and ssm_state, -exp(A_log)
  // in A, the output norm's weight (repeated per head) in gate_norm, gate_norm_eps, out_panels
  int64_t key_heads, value_heads, key_dim, value_dim;
  // attention with q and k normed per head (LFM2's, Qwen3-Next's gated one): the attention
  // fields, the norm weights (Qwen3-Next's folded), whether q_proj carries a gate per head
  const float *q_norm, *k_norm;
  float qk_norm_eps;
  int64_t gated;
  // The shared expert's sigmoid gate (a packed [1, hidden] linear), or null: no gate
  const float* shared_gate_panels;
  // Mamba2's head count and size (the attention fields keep theirs: Falcon-H1 runs both)
  int64_t ssm_heads, ssm_head_dim;
  // Falcon-H1: an attention (the attention fields) beside the mixer on the same normed input,
  // its output added to the mixer's
  int64_t parallel_attention;
  // Zamba2's hybrid layer (ZAMBA2_HYBRID): the step's embeddings (set each step), the shared
  // block's norms, its MLP (gate-up in up_panels and up_bias, down in the down fields, inter in
  // mlp_inter) with this use's adapter, the layer's own linear and the norm before its Mamba2
  // (the Mamba2 and attention fields as for those layers)
  const float *embeddings, *block_norm, *pre_ff_norm, *lora_down_panels, *lora_up_panels, *linear_panels, *mamba_norm;
  float block_eps, pre_ff_eps, mamba_norm_eps;
  int64_t lora_rank;
  // Recurrent state stored at half width (engine/state_format.py; cpu_state.cpp's format code,
  // 0: stored as computed): the
  // mixer's state fields point at float32 working rows; before it runs, the step's slots of each
  // of its (up to two) pool tensors are loaded into them, and after it they are stored back.
  int64_t narrow_format;
  uint16_t* narrow_pool[2];
  float* narrow_work[2];
  int64_t narrow_numel[2];
};

// The layer's narrow state in (store false) or out (store true), as state_format.NarrowState.
static void narrow_state(const LayerPlan& p, bool store, const int64_t* slots, const int64_t* lens, int64_t rows,
                         int threads) {
  if (p.narrow_format == 0) return;
  for (int t = 0; t < 2 && p.narrow_pool[t] != nullptr; ++t) {
    if (store)
      state_store(p.narrow_work[t], p.narrow_pool[t], slots, lens, rows, p.narrow_numel[t], p.narrow_format, threads);
    else
      state_load(p.narrow_pool[t], p.narrow_work[t], slots, rows, p.narrow_numel[t], p.narrow_format, threads);
  }
}

// x *= s, a pass of its own: as torch multiplies before it adds, not fused into the add.
__attribute__((noinline)) static void scale_rows(float* x, int64_t n, float s) {
  for (int64_t i = 0; i < n; ++i) x[i] *= s;
}

int64_t decoder_layer_plan_bytes() { return sizeof(LayerPlan); }  // checked against the Python mirror

// Zamba2's hybrid layer (engine.models.families_zamba2.HybridLayer.forward), the calls its Python
// makes in order: out = h + mamba2(norm(h + linear(mlp(norm(attention(norm([h | embeddings]))))))).
// scratch holds rows * (2 * 2 hidden + 3 hidden) floats and then what the attention, the MLP and
// the Mamba2 mixer each need.
static void zamba2_hybrid(const LayerPlan& p, const float* h, int64_t rows, int64_t hidden, const int64_t* slots,
                          const int64_t* write_index, const int64_t* tables, int64_t table_width, const int64_t* lens,
                          float* scratch, float* out, int threads) {
  const int64_t wide = 2 * hidden, size = rows * hidden;
  float* joined = scratch;              // [rows, wide]
  float* normed = joined + rows * wide;  // [rows, wide]
  float* a = normed + rows * wide;       // [rows, hidden], three of them
  float* b = a + size;
  float* c = b + size;
  float* work = c + size;
  for (int64_t r = 0; r < rows; ++r) {
    std::copy(h + r * hidden, h + (r + 1) * hidden, joined + r * wide);
    std::copy(p.embeddings + r * hidden, p.embeddings + (r + 1) * hidden, joined + r * wide + hidden);
  }
  rms_norm(joined, nullptr, p.block_norm, normed, rows, wide, wide, p.block_eps, threads);
  attention_decode(normed, rows, wide, hidden, p.heads, p.kv_heads, p.head_dim, p.qkv_panels, p.qkv_bias, p.cos,
                   p.sin, p.rotary_dim, p.k_cache, p.v_cache, write_index, tables, table_width, lens, p.block_size,
                   p.scale, p.window, p.o_panels, p.o_bias, work, a, threads);
  rms_norm(a, nullptr, p.pre_ff_norm, b, rows, hidden, hidden, p.pre_ff_eps, threads);
  adapter_gelu_mlp(b, rows, hidden, p.up_panels, p.up_bias, p.lora_down_panels, p.lora_rank, p.lora_up_panels,
                   p.mlp_inter, p.down_panels, p.down_bias, work, a, threads);
  packed_linear(a, hidden, p.linear_panels, nullptr, c, hidden, rows, hidden, hidden, threads);
  for (int64_t i = 0; i < size; ++i) c[i] = h[i] + c[i];
  rms_norm(c, nullptr, p.mamba_norm, b, rows, hidden, hidden, p.mamba_norm_eps, threads);
  mamba2_decode(b, rows, hidden, p.ssm_heads, p.ssm_head_dim, p.groups, p.d_state, p.d_conv, p.in_panels, p.in_bias,
                p.conv_state, p.ssm_state, slots, p.conv_weight, p.conv_bias, p.dt_bias, p.dt_lo, p.dt_hi, p.A, p.D,
                p.gate_norm, p.gate_norm_group, p.gate_norm_first, p.gate_norm_eps, p.out_panels, p.out_bias, work,
                a, threads);
  for (int64_t i = 0; i < size; ++i) out[i] = h[i] + a[i];
}

// h [rows, hidden] through `layers` layers into out; every row a decode of one token, at state
// slot slots[i], KV row write_index[i], with block table tables[i] and context lens[i] (lens is
// given where a layer attends or stores narrow state). scratch
// holds 7 rows * hidden floats plus the most any layer's mixer or FFN needs; ids the MoE's ints.
void decoder_layers(const LayerPlan* plan, int64_t layers, const float* h, int64_t rows, int64_t hidden,
                    const int64_t* slots, const int64_t* write_index, const int64_t* tables, int64_t table_width,
                    const int64_t* lens, float* scratch, int64_t* ids, float* out, int threads) {
  const int64_t size = rows * hidden;
  float* normed = scratch;
  float* mixed = normed + size;
  float* ffn_in = mixed + size;
  float* ffn_out = ffn_in + size;
  float* shared_out = ffn_out + size;
  float* states[2] = {shared_out + size, shared_out + 2 * size};
  float* work = shared_out + 3 * size;
  const float* current = h;
  for (int64_t l = 0; l < layers; ++l) {
    const LayerPlan& p = plan[l];
    float* next = l + 1 == layers ? out : states[l % 2];
    narrow_state(p, false, slots, lens, rows, threads);
    if (p.mixer == ZAMBA2_HYBRID) {
      zamba2_hybrid(p, current, rows, hidden, slots, write_index, tables, table_width, lens, work, next, threads);
      narrow_state(p, true, slots, lens, rows, threads);
      current = next;
      continue;
    }
    rms_norm(const_cast<float*>(current), nullptr, p.input_norm, normed, rows, hidden, hidden, p.input_eps, threads);
    if (p.mixer == MAMBA) {
      mamba_decode(normed, rows, hidden, p.d_inner, p.d_state, p.dt_rank, p.d_conv, p.in_panels, p.in_bias,
                   p.conv_state, p.ssm_state, slots, p.conv_weight, p.conv_bias, p.x_panels, p.dt_norm, p.b_norm,
                   p.c_norm, p.bcdt_eps, p.dt_panels, p.dt_bias, p.A, p.D, p.out_panels, p.out_bias, work, mixed,
                   threads);
    } else if (p.mixer == MAMBA2) {
      mamba2_decode(normed, rows, hidden, p.ssm_heads, p.ssm_head_dim, p.groups, p.d_state, p.d_conv, p.in_panels,
                    p.in_bias, p.conv_state, p.ssm_state, slots, p.conv_weight, p.conv_bias, p.dt_bias, p.dt_lo,
                    p.dt_hi, p.A, p.D, p.gate_norm, p.gate_norm_group, p.gate_norm_first, p.gate_norm_eps,
                    p.out_panels, p.out_bias, work, mixed, threads);
    } else if (p.mixer == RELU2_MLP) {
      packed_linear(normed, hidden, p.up_panels, p.up_bias, work, p.mlp_inter, rows, p.mlp_inter, hidden, threads);
      for (int64_t i = 0; i < rows * p.mlp_inter; ++i) {
        const float v = std::max(work[i], 0.f);  // torch.square(F.relu(x)): one rounding, the square's
        work[i] = v * v;
      }
      packed_linear(work, p.mlp_inter, p.down_panels, p.down_bias, mixed, hidden, rows, hidden, p.mlp_inter,
                    threads);
    } else if (p.mixer == GATED_DELTANET) {
      gdn_decode(normed, rows, hidden, p.key_heads, p.value_heads, p.key_dim, p.value_dim, p.d_conv, p.in_panels,
                 p.x_panels, p.conv_state, p.ssm_state, slots, p.conv_weight, p.A, p.dt_bias, p.gate_norm,
                 p.gate_norm_eps, p.out_panels, work, mixed, threads);
    } else if (p.mixer == SHORT_CONV) {  // LFM2's: the Mamba fields hold its projections, conv and state
      short_conv_decode(normed, rows, hidden, p.d_conv, p.in_panels, p.in_bias, p.conv_state, slots, p.conv_weight,
                        p.conv_bias, p.out_panels, p.out_bias, work, mixed, threads);
    } else if (p.mixer == NORMED_ATTENTION) {
      normed_attention_decode(normed, rows, hidden, hidden, p.heads, p.kv_heads, p.head_dim, p.qkv_panels, p.qkv_bias,
                              p.cos, p.sin, p.rotary_dim, p.k_cache, p.v_cache, write_index, tables, table_width,
                              lens, p.block_size, p.scale, p.window, p.o_panels, p.o_bias, p.q_norm, p.k_norm,
                              p.qk_norm_eps, p.gated, work, mixed, threads);
    } else {
      attention_decode(normed, rows, hidden, hidden, p.heads, p.kv_heads, p.head_dim, p.qkv_panels, p.qkv_bias,
                       p.cos, p.sin, p.rotary_dim, p.k_cache, p.v_cache, write_index, tables, table_width, lens,
                       p.block_size, p.scale, p.window, p.o_panels, p.o_bias, work, mixed, threads);
    }
    if (p.parallel_attention) {  // h + (ssm + attention): shared_out is free until the FFN
      attention_decode(normed, rows, hidden, hidden, p.heads, p.kv_heads, p.head_dim, p.qkv_panels, p.qkv_bias,
                       p.cos, p.sin, p.rotary_dim, p.k_cache, p.v_cache, write_index, tables, table_width, lens,
                       p.block_size, p.scale, p.window, p.o_panels, p.o_bias, work, shared_out, threads);
      for (int64_t i = 0; i < size; ++i) mixed[i] += shared_out[i];
    }
    narrow_state(p, true, slots, lens, rows, threads);
    if (p.residual_scale != 1.f) scale_rows(mixed, size, p.residual_scale);
    if (p.ffn == NO_FFN) {
      for (int64_t i = 0; i < size; ++i) next[i] = current[i] + mixed[i];
      current = next;
      continue;
    }
    // mixed += current, ffn_in = norm(mixed): RMSNorm.add_and_norm's one pass
    rms_norm(mixed, current, p.ffn_norm, ffn_in, rows, hidden, hidden, p.ffn_eps, threads);
    if (p.ffn == MOE) {
      moe_layer(ffn_in, rows, hidden, p.router_panels, p.experts, p.top_k, p.normalize, p.expert_panels, p.inter,
                ids, work, ffn_out, threads);
    } else {
      ids[0] = rows;
      moe_silu_experts(ffn_in, ids, p.expert_panels, work, ffn_out, 1, hidden, p.inter, threads);
    }
    if (p.shared_panels != nullptr) {
      ids[0] = rows;
      moe_silu_experts(ffn_in, ids, p.shared_panels, work, shared_out, 1, hidden, p.shared_inter, threads);
      if (p.shared_gate_panels != nullptr) {
        packed_linear(ffn_in, hidden, p.shared_gate_panels, nullptr, work, 1, rows, 1, hidden, threads);
        sigmoid_gated_add(ffn_out, work, shared_out, rows, hidden, threads);
      } else {
        for (int64_t i = 0; i < size; ++i) ffn_out[i] += shared_out[i];
      }
    }
    if (p.residual_scale != 1.f) scale_rows(ffn_out, size, p.residual_scale);
    for (int64_t i = 0; i < size; ++i) next[i] = mixed[i] + ffn_out[i];
    current = next;
  }
}

}  // extern "C"
