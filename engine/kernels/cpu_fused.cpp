// Fused CPU passes for prefill and for any model's elementwise epilogues, compiled with
// cpu_kernels.cpp into one library by engine/kernels/native.py and called through ctypes; the same
// conventions (float32, contiguous or with the row strides passed, loops on torch's OpenMP threads).

#include <vector>

#include "cpu_kernels.h"

using splitserve::fast_exp;

extern "C" {

// Each replaces a chain of torch ops that each read and write the whole tensor; in decode the
// tensors are small and the chain costs its per-op dispatch more than its arithmetic.

// RMSNorm of each row: out = weight * x * (mean(x^2) + eps)^-1/2. With `add` non-null, x is
// first replaced in place by x + add (the residual stream) and that sum is normalised.
// x, add, out [rows, cols] (rows `x_stride` apart in x and add, `cols` apart in out).
void rms_norm(float* x, const float* add, const float* weight, float* out, int64_t rows, int64_t cols,
              int64_t x_stride, float eps, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * cols >= 32768)
  for (int64_t r = 0; r < rows; ++r) {
    float* xr = x + r * x_stride;
    float sum = 0.f;
    if (add != nullptr) {
      const float* ar = add + r * x_stride;
#pragma omp simd reduction(+ : sum)
      for (int64_t c = 0; c < cols; ++c) {
        xr[c] += ar[c];
        sum += xr[c] * xr[c];
      }
    } else {
#pragma omp simd reduction(+ : sum)
      for (int64_t c = 0; c < cols; ++c) sum += xr[c] * xr[c];
    }
    const float inv = 1.f / std::sqrt(sum / static_cast<float>(cols) + eps);
    float* o = out + r * cols;
#pragma omp simd
    for (int64_t c = 0; c < cols; ++c) o[c] = weight[c] * (xr[c] * inv);
  }
}

// Mamba2's output with the norm before the gate (a Falcon-H1 option): s = y + x D, then
// out = (weight * (s / sqrt(mean over the group of s^2 + eps))) * silu(z), within groups of `group`
// columns; x and z rows `x_stride` and `z_stride` apart (read in place), y and out [rows, cols].
// Without D (and x) there is no skip, s = y: Gated DeltaNet's norm of each head, then its gate.
void skip_norm_gate(const float* y, const float* x, int64_t x_stride, const float* D, const float* z,
                    int64_t z_stride, const float* weight, int64_t group, float eps, float* out, int64_t rows,
                    int64_t cols, int threads) {
  const int64_t groups = cols / group;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * cols >= 32768)
  for (int64_t i = 0; i < rows * groups; ++i) {
    const int64_t r = i / groups, c0 = (i - r * groups) * group;
    const float* xr = D != nullptr ? x + r * x_stride + c0 : nullptr;
    const float* zr = z + r * z_stride + c0;
    float* o = out + r * cols + c0;
    float sum = 0.f;
    if (D != nullptr) {
#pragma omp simd reduction(+ : sum)
      for (int64_t c = 0; c < group; ++c) {
        o[c] = y[r * cols + c0 + c] + xr[c] * D[c0 + c];
        sum += o[c] * o[c];
      }
    } else {
#pragma omp simd reduction(+ : sum)
      for (int64_t c = 0; c < group; ++c) {
        o[c] = y[r * cols + c0 + c];
        sum += o[c] * o[c];
      }
    }
    const float inv = 1.f / std::sqrt(sum / static_cast<float>(group) + eps);
#pragma omp simd
    for (int64_t c = 0; c < group; ++c)
      o[c] = (weight[c0 + c] * (o[c] * inv)) * (zr[c] / (1.f + fast_exp(-zr[c])));
  }
}

// RMSNorm within groups of `group` columns (Mamba2's gated norm, engine.models.layers.GatedRMSNorm):
// out[r, c] = weight[c] * (x[r, c] / sqrt(mean over c's group of x^2 + eps)); x, out [rows, cols]
// contiguous. One group is the whole row's RMSNorm.
void group_rms_norm(const float* x, const float* weight, float* out, int64_t rows, int64_t cols, int64_t group,
                    float eps, int threads) {
  const int64_t groups = cols / group;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * cols >= 32768)
  for (int64_t i = 0; i < rows * groups; ++i) {
    const float* xg = x + i * group;
    const float* w = weight + (i % groups) * group;
    float* o = out + i * group;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t c = 0; c < group; ++c) sum += xg[c] * xg[c];
    const float inv = 1.f / std::sqrt(sum / static_cast<float>(group) + eps);
#pragma omp simd
    for (int64_t c = 0; c < group; ++c) o[c] = w[c] * (xg[c] * inv);
  }
}

// Three RMSNorms of consecutive column blocks of each row, each with its own weight (Jamba's dt,
// B and C norms over one x_proj output): block i is columns [offset_i, offset_i + n_i), offsets
// running on from 0, of x (rows x_stride apart) and goes to out_i [rows, n_i].
void rms_norm_3(const float* x, int64_t x_stride, const float* w0, const float* w1, const float* w2, int64_t n0,
                int64_t n1, int64_t n2, float* o0, float* o1, float* o2, int64_t rows, float eps, int) {
  const float* weights[3] = {w0, w1, w2};
  const int64_t widths[3] = {n0, n1, n2};
  float* outs[3] = {o0, o1, o2};
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * x_stride;
    for (int i = 0; i < 3; ++i) {
      const int64_t cols = widths[i];
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t c = 0; c < cols; ++c) sum += xr[c] * xr[c];
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(cols) + eps);
      float* o = outs[i] + r * cols;
      const float* w = weights[i];
#pragma omp simd
      for (int64_t c = 0; c < cols; ++c) o[c] = w[c] * (xr[c] * inv);
      xr += cols;
    }
  }
}

// SwiGLU's product: out[r, c] = silu(gate[r, c]) * up[r, c]; gate and up rows are `in_stride`
// apart (one [rows, 2 * cols] projection read in place: up = gate + cols), out rows `cols` apart.
void silu_mul(const float* gate, const float* up, float* out, int64_t rows, int64_t cols, int64_t in_stride,
              int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * cols >= 32768)
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gate + r * in_stride;
    const float* u = up + r * in_stride;
    float* o = out + r * cols;
#pragma omp simd
    for (int64_t c = 0; c < cols; ++c) o[c] = splitserve::silu_times(g[c], u[c]);
  }
}

// Rotary embedding in place, rotate-half style, on the first rotary_dim of each head:
// x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin (halves of rotary_dim), cos and sin [tokens,
// rotary_dim] per token (scaling already applied). x [tokens, heads, head_dim], tokens `x_stride`
// apart (q, k and v may be column blocks of one projection), each token's heads contiguous.
void rotary(float* x, int64_t x_stride, const float* cos, const float* sin, int64_t tokens, int64_t heads,
            int64_t head_dim, int64_t rotary_dim, int threads) {
  const int64_t half = rotary_dim / 2;
#pragma omp parallel for num_threads(threads) schedule(static) if (tokens * heads * head_dim >= 32768)
  for (int64_t i = 0; i < tokens * heads; ++i) {
    const int64_t t = i / heads;
    float* v = x + t * x_stride + (i - t * heads) * head_dim;
    const float* ct = cos + t * rotary_dim;
    const float* st = sin + t * rotary_dim;
#pragma omp simd
    for (int64_t j = 0; j < half; ++j) {
      const float a = v[j], b = v[j + half];
      v[j] = a * ct[j] - b * st[j];
      v[j + half] = b * ct[j + half] + a * st[j + half];
    }
  }
}

// Mamba's output gate with the skip: out[t, c] = (y[t, c] + x[t, c] D[c]) * silu(z[t, c]); x and z
// rows `x_stride` and `z_stride` apart (z read in place from the input projection), y and out
// contiguous (out may be y).
void gated_skip(const float* y, const float* x, int64_t x_stride, const float* D, const float* z,
                int64_t z_stride, float* out, int64_t rows, int64_t cols, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * cols >= 32768)
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * x_stride;
    const float* zr = z + r * z_stride;
#pragma omp simd
    for (int64_t c = 0; c < cols; ++c)
      out[r * cols + c] = (y[r * cols + c] + xr[c] * D[c]) * (zr[c] / (1.f + fast_exp(-zr[c])));
  }
}

// dt = softplus(dt + bias) in place (bias null: softplus(dt); torch's threshold: above 20,
// softplus(v) = v); dt [rows, cols].
void bias_softplus(float* dt, const float* bias, int64_t rows, int64_t cols, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * cols >= 32768)
  for (int64_t r = 0; r < rows; ++r) {
#pragma omp simd
    for (int64_t c = 0; c < cols; ++c) {
      const float v = bias != nullptr ? dt[r * cols + c] + bias[c] : dt[r * cols + c];
      dt[r * cols + c] = v > 20.f ? v : std::log1p(std::exp(v));
    }
  }
}

// Mamba2's dt (engine.kernels.mamba2_update.process_dt): out = min(max(softplus(dt + bias), lo),
// hi), softplus where `softplus` is set, bias where given; dt rows `dt_stride` apart (read in
// place from the input projection), out [rows, heads].
void mamba2_dt(const float* dt, int64_t dt_stride, const float* bias, int64_t softplus, float lo, float hi,
               float* out, int64_t rows, int64_t heads, int) {
  for (int64_t r = 0; r < rows; ++r) {
#pragma omp simd
    for (int64_t h = 0; h < heads; ++h) {
      float v = bias != nullptr ? dt[r * dt_stride + h] + bias[h] : dt[r * dt_stride + h];
      if (softplus) v = v > 20.f ? v : std::log1p(std::exp(v));
      out[r * heads + h] = std::min(std::max(v, lo), hi);
    }
  }
}

// Causal depthwise conv over one sequence's prefill, continuing from its state (the last `width`
// inputs before it, oldest first; zeros when `fresh`): out[t, c] = act(bias[c] + sum_j
// weight[c, j] in[t - width + 1 + j, c]), `in` being the state then x. The state becomes the last
// `width` inputs. x rows `x_stride` apart; out [length, channels]; state [channels, width].
void causal_conv_prefill(const float* x, int64_t x_stride, float* state, const float* weight, const float* bias,
                         float* out, int64_t length, int64_t channels, int64_t width, int64_t fresh,
                         int64_t silu, int threads) {
  // Taps and history transposed to [width][channels], so each output row is a few passes over
  // contiguous rows (inputs, taps) that vectorise across channels; threads split the tokens.
  std::vector<float> taps(width * channels), history(width * channels, 0.f);
  for (int64_t c = 0; c < channels; ++c)
    for (int64_t j = 0; j < width; ++j) {
      taps[j * channels + c] = weight[c * width + j];
      if (!fresh) history[j * channels + c] = state[c * width + j];
    }
  auto row = [&](int64_t pos) {  // the inputs at position pos (from -width: the history)
    return pos < 0 ? history.data() + (pos + width) * channels : x + pos * x_stride;
  };
#pragma omp parallel for num_threads(threads) schedule(static) if (length * channels * width >= 65536)
  for (int64_t t = 0; t < length; ++t) {
    float* o = out + t * channels;
    for (int64_t c = 0; c < channels; ++c) o[c] = bias != nullptr ? bias[c] : 0.f;
    for (int64_t j = 0; j < width; ++j) {
      const float* in = row(t - width + 1 + j);
      const float* tap = taps.data() + j * channels;
#pragma omp simd
      for (int64_t c = 0; c < channels; ++c) o[c] += tap[c] * in[c];
    }
    if (silu) {
#pragma omp simd
      for (int64_t c = 0; c < channels; ++c) o[c] = o[c] / (1.f + fast_exp(-o[c]));
    }
  }
  for (int64_t c = 0; c < channels; ++c)
    for (int64_t j = 0; j < width; ++j) state[c * width + j] = row(length - width + j)[c];
}

// Causal attention of one sequence's last n queries over its `context` keys (a whole prompt, or a
// chunk continuing one), the query at row i being position context - n + i; window 0 = none.
// q [n, H, Dh] (tokens q_stride apart), kt [KVH, Dh, padded] (keys transposed, each row padded with
// zeros to a multiple of 32 keys), v [context, KVH, Dh] (tokens v_stride apart), out [n, H, Dh].
// A task is R query rows of one head: scores kAttnKeys keys at a time with the R rows'
// accumulators in registers (each key vector loaded once for all R), the softmax per row, then
// kAttnKeys output channels at a time, each value vector loaded once for the R rows. R x kAttnKeys
// accumulators take 24 of AVX-512's 32 vector registers and 12 of AVX2's 16.
#ifdef __AVX512F__
constexpr int64_t kAttnRows = 12, kAttnKeys = 32;
#else
constexpr int64_t kAttnRows = 6, kAttnKeys = 16;
#endif

void prefill_attention(const float* q, int64_t q_stride, const float* kt, int64_t padded, const float* v,
                       int64_t v_stride, float* out, int64_t n, int64_t context, int64_t heads, int64_t kv_heads,
                       int64_t head_dim, float scale, int64_t window, int threads) {
  constexpr int64_t R = kAttnRows, W = kAttnKeys;
  const int64_t group = heads / kv_heads, row_groups = (n + R - 1) / R, offset = context - n;
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> scores(R * (padded + W)), qs(R * head_dim);
    float inv[R];
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < heads * row_groups; ++task) {
      const int64_t rg = row_groups - 1 - task / heads, h = task % heads;  // longest rows first
      const int64_t r0 = rg * R, rows = std::min(R, n - r0);
      const int64_t first_pos = offset + r0, hi = first_pos + rows;  // keys [lo, hi) cover all R
      const int64_t lo = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) / W * W : 0;
      const int64_t len = hi - lo, stride = (len + W - 1) / W * W;  // scores row r at r * stride
      const float* ktg = kt + (h / group) * head_dim * padded + lo;
      for (int64_t r = 0; r < R; ++r)
        for (int64_t d = 0; d < head_dim; ++d)
          qs[r * head_dim + d] = r < rows ? q[(r0 + r) * q_stride + h * head_dim + d] * scale : 0.f;
      for (int64_t j0 = 0; j0 < len; j0 += W) {
        float a[R][W] = {};
        for (int64_t d = 0; d < head_dim; ++d) {
          const float* kr = ktg + d * padded + j0;
          for (int64_t r = 0; r < R; ++r) {
            const float qd = qs[r * head_dim + d];
#pragma omp simd
            for (int64_t jj = 0; jj < W; ++jj) a[r][jj] += qd * kr[jj];
          }
        }
        for (int64_t r = 0; r < R; ++r) std::copy(a[r], a[r] + W, scores.data() + r * stride + j0);
      }
      for (int64_t r = 0; r < R; ++r) {  // unnormalised softmax over the keys row r sees, 0 elsewhere
        float* sr = scores.data() + r * stride;
        const int64_t pos = first_pos + r;
        const int64_t a = r < rows ? (window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0) - lo : 0;
        const int64_t b = r < rows ? pos + 1 - lo : 0;
        const float top = splitserve::max_of(sr + a, b - a, -INFINITY);
        float total = 0.f;
#pragma omp simd reduction(+ : total)
        for (int64_t j = a; j < b; ++j) {
          sr[j] = fast_exp(sr[j] - top);
          total += sr[j];
        }
        inv[r] = b > a ? 1.f / total : 0.f;
        std::fill(sr, sr + a, 0.f);
        std::fill(sr + b, sr + stride, 0.f);
      }
      const float* vg = v + (h / group) * head_dim;
      for (int64_t d0 = 0; d0 < head_dim; d0 += W) {
        const int64_t width = std::min(W, head_dim - d0);
        float o[R][W] = {};
        // Two loops, not one with the width test inside: with it, o lived on the stack and
        // every multiply-add loaded and stored its accumulator.
        if (width == W) {
          for (int64_t j = 0; j < len; ++j) {
            const float* value = vg + (lo + j) * v_stride + d0;
            for (int64_t r = 0; r < R; ++r) {
              const float p = scores[r * stride + j];
#pragma omp simd
              for (int64_t dd = 0; dd < W; ++dd) o[r][dd] += p * value[dd];
            }
          }
        } else {
          for (int64_t j = 0; j < len; ++j) {
            const float* value = vg + (lo + j) * v_stride + d0;
            for (int64_t r = 0; r < R; ++r)
              for (int64_t dd = 0; dd < width; ++dd) o[r][dd] += scores[r * stride + j] * value[dd];
          }
        }
        for (int64_t r = 0; r < rows; ++r) {
          float* dst = out + ((r0 + r) * heads + h) * head_dim + d0;
          for (int64_t dd = 0; dd < width; ++dd) dst[dd] = o[r][dd] * inv[r];
        }
      }
    }
  }
}

// Mixture-of-experts combine: out[t] = sum over k (in order) of weights[t, k] * picks[position[t * top_k + k]],
// picks [tokens * top_k, hidden] being the experts' outputs grouped by expert; out [tokens, hidden].
void moe_combine(const float* picks, const int64_t* position, const float* weights, float* out, int64_t tokens,
                 int64_t top_k, int64_t hidden, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (tokens * top_k * hidden >= 65536)
  for (int64_t t = 0; t < tokens; ++t) {
    float* o = out + t * hidden;
    for (int64_t k = 0; k < top_k; ++k) {
      const float* y = picks + position[t * top_k + k] * hidden;
      const float w = weights[t * top_k + k];
      if (k == 0) {
#pragma omp simd
        for (int64_t c = 0; c < hidden; ++c) o[c] = w * y[c];
      } else {
#pragma omp simd
        for (int64_t c = 0; c < hidden; ++c) o[c] += w * y[c];
      }
    }
  }
}

// Mixture-of-experts grouping, a stable counting sort of the (token, k) picks by expert:
// experts [picks] (pick i = token i / top_k), counts [num_experts] out, token_of_row [picks] out
// (the token each expert-grouped row reads), position [picks] out (pick i's grouped row).
// Expert ids outside [0, num_experts) are a caller's bug: they count nowhere and their rows are
// left out, which the caller's check (counts summing to picks) reports.
void moe_group(const int64_t* experts, int64_t* counts, int64_t* token_of_row, int64_t* position, int64_t picks,
               int64_t top_k, int64_t num_experts, int) {
  std::fill(counts, counts + num_experts, int64_t{0});
  for (int64_t i = 0; i < picks; ++i)
    if (experts[i] >= 0 && experts[i] < num_experts) ++counts[experts[i]];
  std::vector<int64_t> next(num_experts);
  for (int64_t e = 0, start = 0; e < num_experts; start += counts[e++]) next[e] = start;
  for (int64_t i = 0; i < picks; ++i) {
    const int64_t e = experts[i];
    if (e < 0 || e >= num_experts) continue;
    position[i] = next[e]++;
    token_of_row[position[i]] = i / top_k;
  }
}

// The greedy sampler's argmax of each row of x [rows, cols], with torch.argmax's answer: the first
// maximum (-0.0 equal to 0.0), or the first NaN in a row that has one (torch ranks NaN above
// everything). Floats are compared as integers that keep their order: fast math lets the
// compiler assume no float is NaN or infinite, and logits are -inf where a grammar masks them.
// torch's own CPU argmax runs far below memory bandwidth. One vector pass keeps each chunk's
// maximum; only the first chunk holding the row's maximum (or its first NaN) is scanned again
// for the index, not the whole row.
void row_argmax(const float* x, int64_t* out, int64_t rows, int64_t cols, int threads) {
  constexpr int64_t kChunk = 512;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const int32_t* bits = reinterpret_cast<const int32_t*>(x + r * cols);
    const auto is_nan = [](int32_t b) { return (b & 0x7fffffff) > 0x7f800000; };
    const auto key = [](int32_t b) { return b >= 0 ? b : (b ^ 0x7fffffff) + 1; };  // -0.0 -> 0
    int32_t best = INT32_MIN;
    int64_t best_chunk = 0;
    bool nan = false;
    for (int64_t start = 0; start < cols; start += kChunk) {
      const int64_t end = std::min(cols, start + kChunk);
      int32_t chunk_best = INT32_MIN, chunk_nan = 0;
#pragma omp simd reduction(max : chunk_best) reduction(| : chunk_nan)
      for (int64_t c = start; c < end; ++c) {
        chunk_nan |= is_nan(bits[c]);
        chunk_best = std::max(chunk_best, key(bits[c]));
      }
      if (chunk_nan) {  // the first NaN wins: it lies in this chunk
        nan = true, best_chunk = start;
        break;
      }
      if (chunk_best > best) best = chunk_best, best_chunk = start;  // strictly: the first such chunk
    }
    int64_t c = best_chunk;
    while (c < cols - 1 && (nan ? !is_nan(bits[c]) : key(bits[c]) != best)) ++c;
    out[r] = c;
  }
}

}  // extern "C"
