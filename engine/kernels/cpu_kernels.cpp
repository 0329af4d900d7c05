// CPU kernels (decode steps and the inner loops of two prefill scans; the fused passes are in
// cpu_fused.cpp), compiled on first use by engine/kernels/native.py and called through ctypes.
//
// Float32 everywhere except ids (int64); every array is contiguous (the Python side makes it so)
// or has the row stride it is passed with.
// Loops run on OpenMP with the thread count torch uses: the library links libgomp, which resolves
// to the copy torch has already loaded, so these loops run on torch's own worker threads instead
// of a second pool competing with them for the same cores.
//
// Every row's arithmetic is the same sequence of operations whatever else the call holds, so a
// request's result does not depend on its batch neighbours.

#include <algorithm>
#include <vector>

#include "cpu_kernels.h"

using splitserve::fast_exp;

namespace {

// Calls visit(block id, offset in the block, index from `first`, next block id or -1) for
// positions first..context-1 of a sequence's paged table, one table lookup per block.
template <typename Visit>
inline void for_each_position(const int64_t* table, int64_t first, int64_t context, int64_t block_size,
                              Visit&& visit) {
  for (int64_t blk = first / block_size; blk * block_size < context; ++blk) {
    const int64_t base = blk * block_size;
    const int64_t lo = std::max<int64_t>(first - base, 0), hi = std::min(context - base, block_size);
    const int64_t next = (blk + 1) * block_size < context ? table[blk + 1] : -1;
    for (int64_t t = lo; t < hi; ++t) visit(table[blk], t, base + t - first, next);
  }
}

// Asks for the cache lines of floats [p, p + count) ahead of their use: into L1 (locality 3) or
// into L2 (kIntoL2). Paged blocks lie anywhere in the pool, so the hardware prefetcher cannot run
// ahead across a block boundary.
constexpr int kIntoL2 = 2;
template <int Locality = 3>
inline void prefetch_floats(const float* p, int64_t count) {
  for (int64_t i = 0; i < count; i += 16) __builtin_prefetch(p + i, 0, Locality);
}

// 16 lanes of float (GCC vector extensions: -march=native picks the instructions).
constexpr int64_t kLanes16 = 16;
typedef float vec16 __attribute__((vector_size(64)));
typedef int32_t lanes16 __attribute__((vector_size(64)));

// The lane sums of 16 vectors, sums[j] = sum of v[j]'s lanes: each level adds the two halves of
// every pair (lane i and i + w, w = 8, 4, 2, 1), the halving order of a vectorised reduction, so
// each sum has the bits of its own reduction; transposed, 15 adds and 31 shuffles do what 16
// separate reductions do in 64 adds and 64 shuffles.
inline vec16 lane_sums(vec16* v) {
  const lanes16 lo8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const lanes16 hi8 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
  const lanes16 lo4 = {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27};
  const lanes16 hi4 = {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31};
  const lanes16 lo2 = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
  const lanes16 hi2 = {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31};
  const lanes16 lo1 = {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30};
  const lanes16 hi1 = {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31};
  // After each level, lane groups hold vectors in bit-reversed order; `order` undoes it.
  const lanes16 order = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
  for (int j = 0; j < 8; ++j)
    v[j] = __builtin_shuffle(v[2 * j], v[2 * j + 1], lo8) + __builtin_shuffle(v[2 * j], v[2 * j + 1], hi8);
  for (int j = 0; j < 4; ++j)
    v[j] = __builtin_shuffle(v[2 * j], v[2 * j + 1], lo4) + __builtin_shuffle(v[2 * j], v[2 * j + 1], hi4);
  for (int j = 0; j < 2; ++j)
    v[j] = __builtin_shuffle(v[2 * j], v[2 * j + 1], lo2) + __builtin_shuffle(v[2 * j], v[2 * j + 1], hi2);
  return __builtin_shuffle(__builtin_shuffle(v[0], v[1], lo1) + __builtin_shuffle(v[0], v[1], hi1), order);
}

// One token of the Mamba recurrence for one channel, s [N] in place:
// s = exp(dt a) s + u b (u = dt x) ; returns c . s.
inline float mamba_step(float* s, const float* a, const float* b, const float* c, float dt, float u,
                        int64_t d_state) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t n = 0; n < d_state; ++n) {
    s[n] = fast_exp(dt * a[n]) * s[n] + u * b[n];
    acc += s[n] * c[n];
  }
  return acc;
}

// The conv update (below) for one batch row's channels. `Width` > 0 fixes the window width at
// compile time, so the loop over channels vectorises (the common widths); 0 takes it at run time.
template <int64_t Width>
inline void conv_update_row(float* w, const float* weight, const float* x, const float* bias, float* y,
                            int64_t channels, int64_t runtime_width, int64_t silu) {
  const int64_t width = Width > 0 ? Width : runtime_width;
#pragma omp simd
  for (int64_t c = 0; c < channels; ++c) {
    float* wc = w + c * width;
    const float* k = weight + c * width;
    float acc = 0.f;
    for (int64_t j = 0; j + 1 < width; ++j) {
      wc[j] = wc[j + 1];
      acc += wc[j] * k[j];
    }
    wc[width - 1] = x[c];
    acc += x[c] * k[width - 1];
    if (bias != nullptr) acc += bias[c];
    y[c] = silu ? acc / (1.f + fast_exp(-acc)) : acc;
  }
}

// One token of the gated delta rule on one head's S [dk, dv] in place: S *= exp(g) ;
// S += k (x) ((v - S^T k) * beta) ; o = S^T q. Row r of S decays by exp(g[r * g_stride]):
// g_stride 0 for one decay per head, 1 for one per key channel (Kimi Delta Attention). Two
// passes over S: decay and predict, then update and read. `delta` is scratch of v_dim floats.
inline void delta_rule_step(float* S, const float* q, const float* k, const float* v, float* o, const float* g,
                            int64_t g_stride, float rate, float* delta, int64_t k_dim, int64_t v_dim) {
  std::fill(delta, delta + v_dim, 0.f);  // S^T k first
  for (int64_t r = 0; r < k_dim; ++r) {
    float* row = S + r * v_dim;
    const float kr = k[r], decay = std::exp(g[r * g_stride]);
#pragma omp simd
    for (int64_t j = 0; j < v_dim; ++j) {
      row[j] *= decay;
      delta[j] += row[j] * kr;
    }
  }
#pragma omp simd
  for (int64_t j = 0; j < v_dim; ++j) delta[j] = (v[j] - delta[j]) * rate;
  std::fill(o, o + v_dim, 0.f);
  for (int64_t r = 0; r < k_dim; ++r) {
    float* row = S + r * v_dim;
    const float kr = k[r], qr = q[r];
#pragma omp simd
    for (int64_t j = 0; j < v_dim; ++j) {
      row[j] += kr * delta[j];
      o[j] += row[j] * qr;
    }
  }
}

// Whether neighbouring rows share a slot: a verify step's tokens of one sequence (engine.phase
// VERIFY, engine.kernels.slot_runs), where each row must read the state the row before it left.
inline bool shares_slots(const int64_t* slots, int64_t batch) {
  for (int64_t b = 1; b < batch; ++b)
    if (slots[b] == slots[b - 1]) return true;
  return false;
}

// body(b, u) for every row b and unit u (a block of channels, a head) of a decode state update.
// Each row on its own slot: the (row, unit) pairs split among the threads, row-major. Rows that
// share a slot: each thread takes whole units and runs every row of them in row order, so a
// slot's rows see each other's state, and the threads still split the work.
template <class Body>
inline void for_rows_and_units(const int64_t* slots, int64_t batch, int64_t units, int threads, Body body) {
  if (!shares_slots(slots, batch)) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < batch * units; ++i) body(i / units, i % units);
    return;
  }
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t u = 0; u < units; ++u)
    for (int64_t b = 0; b < batch; ++b) body(b, u);
}

}  // namespace

extern "C" {

// Mamba decode step, per row (b, c) of h = state[slots[b], c] in place:
// h = h * exp(dt[b, c] A[c]) + dt[b, c] x[b, c] B[b] ; y[b, c] = h . C[b].
// state [S, D, N]; x, dt (final: bias and softplus done), y [batch, D]; A [D, N]; B, C [batch, N].
// Where N and D are multiples of 16 (Mamba's usual d_state is 16), a thread takes 16 channels
// at a time and sums their 16 dot products in one transposed tree (lane_sums), the same halving
// order as mamba_step's reduction (the same bits where the compiler vectorises that at 16 lanes;
// the same state bits, and y to rounding, where it picks 8), with a third of the shuffles: one
// reduction per channel would dominate the kernel's time.
void ssm_state_update(float* state, const int64_t* slots, const float* x, const float* dt,
                      const float* A, const float* B, const float* C, float* y, int64_t batch,
                      int64_t d_inner, int64_t d_state, int threads) {
  if (d_state % kLanes16 != 0 || d_inner % kLanes16 != 0) {
    for_rows_and_units(slots, batch, d_inner, threads, [&](int64_t b, int64_t c) {
      const int64_t i = b * d_inner + c;
      y[i] = mamba_step(state + (slots[b] * d_inner + c) * d_state, A + c * d_state, B + b * d_state,
                        C + b * d_state, dt[i], dt[i] * x[i], d_state);
    });
    return;
  }
  for_rows_and_units(slots, batch, d_inner / kLanes16, threads, [&](int64_t b, int64_t block) {
    const int64_t c0 = block * kLanes16;
    const float *bb = B + b * d_state, *cb = C + b * d_state;
    vec16 dots[kLanes16];
    for (int64_t j = 0; j < kLanes16; ++j) {
      float* s = state + (slots[b] * d_inner + c0 + j) * d_state;
      const float* a = A + (c0 + j) * d_state;
      const float d = dt[b * d_inner + c0 + j], u = d * x[b * d_inner + c0 + j];
      dots[j] = vec16{};
      for (int64_t n0 = 0; n0 < d_state; n0 += kLanes16) {
        alignas(64) float part[kLanes16];
#pragma omp simd
        for (int64_t n = n0; n < n0 + kLanes16; ++n) {
          s[n] = fast_exp(d * a[n]) * s[n] + u * bb[n];
          part[n - n0] = s[n] * cb[n];
        }
        dots[j] += *reinterpret_cast<const vec16*>(part);
      }
    }
    const vec16 sums = lane_sums(dots);
    std::memcpy(y + b * d_inner + c0, &sums, sizeof sums);
  });
}

// Causal depthwise conv, one decode token: per row (b, c) of w = state[slots[b], c] ([K], oldest
// first) in place: w = (w[1:], x[b, c]) ; y[b, c] = act(w . weight[c] + bias[c]) (silu: 1).
// state [S, D, K]; x, y [batch, D]; weight [D, K]; bias [D] or null.
void conv_update(float* state, const int64_t* slots, const float* x, int64_t x_stride, const float* weight,
                 const float* bias, float* y, int64_t batch, int64_t channels, int64_t width,
                 int64_t silu, int threads) {
  constexpr int64_t kBlock = 256;  // channels a unit: the row loop vectorises within it
  const int64_t units = (channels + kBlock - 1) / kBlock;
  for_rows_and_units(slots, batch, units, threads, [&](int64_t b, int64_t u) {
    const int64_t c0 = u * kBlock, count = std::min(kBlock, channels - c0);
    float* w = state + (slots[b] * channels + c0) * width;
    const float* xb = x + b * x_stride + c0;
    float* yb = y + b * channels + c0;
    const float* bu = bias != nullptr ? bias + c0 : nullptr;
    if (width == 4) {
      conv_update_row<4>(w, weight + c0 * width, xb, bu, yb, count, width, silu);
    } else {
      conv_update_row<0>(w, weight + c0 * width, xb, bu, yb, count, width, silu);
    }
  });
}

// Mamba prefill of one sequence: per channel c, from h = h0[c] (updated in place to h_L),
// h_t = exp(dt[t, c] A[c]) h_{t-1} + dt[t, c] x[t, c] B[t] ; y[t, c] = C[t] . h_t.
// x, dt, y [L, D]; A, h [D, N]; B, C [L, N]. Threads take blocks of 16 channels; a block's state
// is held transposed, [N][16], so each token is N steps over one vector of 16 channels, with
// B[t, n] and C[t, n] broadcast and no reduction across lanes; tokens go in order.
void selective_scan(const float* x, const float* dt, const float* A, const float* B, const float* C,
                    float* h, float* y, int64_t length, int64_t d_inner, int64_t d_state, int threads) {
  constexpr int64_t kLanes = 16, kAhead = 8;
  const int64_t blocks = (d_inner + kLanes - 1) / kLanes;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t block = 0; block < blocks; ++block) {
    const int64_t c0 = block * kLanes, n = std::min(kLanes, d_inner - c0);
    std::vector<float> s(d_state * kLanes, 0.f), a(d_state * kLanes, 0.f);  // unused lanes stay 0
    for (int64_t cc = 0; cc < n; ++cc)
      for (int64_t k = 0; k < d_state; ++k) {
        s[k * kLanes + cc] = h[(c0 + cc) * d_state + k];
        a[k * kLanes + cc] = A[(c0 + cc) * d_state + k];
      }
    for (int64_t t = 0; t < length; ++t) {
      // The block touches one line per token of x, dt and y, rows d_inner apart: fetched ahead,
      // the loads and stores do not each wait on memory (prefill's rows are rarely in cache).
      if (t + kAhead < length) {
        __builtin_prefetch(x + (t + kAhead) * d_inner + c0);
        __builtin_prefetch(dt + (t + kAhead) * d_inner + c0);
        __builtin_prefetch(y + (t + kAhead) * d_inner + c0, 1);
      }
      float d[kLanes] = {}, u[kLanes] = {}, acc[kLanes] = {};
      for (int64_t cc = 0; cc < n; ++cc) {
        d[cc] = dt[t * d_inner + c0 + cc];
        u[cc] = d[cc] * x[t * d_inner + c0 + cc];
      }
      for (int64_t k = 0; k < d_state; ++k) {
        const float bk = B[t * d_state + k], ck = C[t * d_state + k];
        float* sk = s.data() + k * kLanes;
        const float* ak = a.data() + k * kLanes;
#pragma omp simd
        for (int64_t cc = 0; cc < kLanes; ++cc) {
          sk[cc] = fast_exp(d[cc] * ak[cc]) * sk[cc] + u[cc] * bk;
          acc[cc] += sk[cc] * ck;
        }
      }
      for (int64_t cc = 0; cc < n; ++cc) y[t * d_inner + c0 + cc] = acc[cc];
    }
    for (int64_t cc = 0; cc < n; ++cc)
      for (int64_t k = 0; k < d_state; ++k) h[(c0 + cc) * d_state + k] = s[k * kLanes + cc];
  }
}

// Mamba2 decode step, per row (b, h, p) of the state in place (head h reads group h / (H / G)):
// s = s * exp(dt[b, h] A[h]) + dt[b, h] x[b, h, p] B[b, g] ; y[b, h, p] = s . C[b, g].
// state [S, H, P, N]; x, y [batch, H, P]; dt [batch, H] (final: bias, softplus, clamp done);
// A [H]; B, C [batch, G, N]. Where P and N are multiples of 16, a thread takes 16 rows of a head
// at a time: one exp for them, their dot products summed together by lane_sums (as in
// ssm_state_update); the same state bits (y to rounding, as there).
void mamba2_state_update(float* state, const int64_t* slots, const float* x, const float* dt,
                         const float* A, const float* B, const float* C, float* y, int64_t batch,
                         int64_t heads, int64_t head_dim, int64_t groups, int64_t d_state, int threads) {
  const int64_t per_group = heads / groups;
  if (head_dim % kLanes16 == 0 && d_state % kLanes16 == 0) {
    const int64_t blocks = head_dim / kLanes16;
    for_rows_and_units(slots, batch, heads * blocks, threads, [&](int64_t b, int64_t unit) {
      const int64_t h = unit / blocks, p0 = (unit - h * blocks) * kLanes16, g = h / per_group;
      const float* bb = B + (b * groups + g) * d_state;
      const float* cc = C + (b * groups + g) * d_state;
      const float dt_v = dt[b * heads + h];
      const float decay = std::exp(dt_v * A[h]);
      const float* xh = x + (b * heads + h) * head_dim;
      vec16 dots[kLanes16];
      for (int64_t j = 0; j < kLanes16; ++j) {
        float* row = state + ((slots[b] * heads + h) * head_dim + p0 + j) * d_state;
        const float dt_x = dt_v * xh[p0 + j];
        alignas(64) float lane[kLanes16] = {};
        for (int64_t n0 = 0; n0 < d_state; n0 += kLanes16) {
#pragma omp simd
          for (int64_t l = 0; l < kLanes16; ++l) {
            const float s = row[n0 + l] * decay + dt_x * bb[n0 + l];
            row[n0 + l] = s;
            lane[l] += s * cc[n0 + l];
          }
        }
        std::memcpy(&dots[j], lane, sizeof lane);
      }
      const vec16 sums = lane_sums(dots);
      std::memcpy(y + (b * heads + h) * head_dim + p0, &sums, sizeof sums);
    });
    return;
  }
  for_rows_and_units(slots, batch, heads * head_dim, threads, [&](int64_t b, int64_t unit) {
    const int64_t h = unit / head_dim, p = unit - h * head_dim, g = h / per_group;
    float* row = state + ((slots[b] * heads + h) * head_dim + p) * d_state;
    const float* bb = B + (b * groups + g) * d_state;
    const float* cc = C + (b * groups + g) * d_state;
    const float dt_v = dt[b * heads + h];
    const float decay = std::exp(dt_v * A[h]);
    const float dt_x = dt_v * x[b * heads * head_dim + unit];
    float acc = 0.f;
    for (int64_t n = 0; n < d_state; ++n) {
      const float s = row[n] * decay + dt_x * bb[n];
      row[n] = s;
      acc += s * cc[n];
    }
    y[b * heads * head_dim + unit] = acc;
  });
}

// Mamba2 prefill of one sequence, the recurrence one token at a time, per head h of group
// g = h / (H / G), from h = state[h] (updated in place to h_L):
// s_t = exp(dt[t, h] A[h]) s_{t-1} + dt[t, h] x[t, h] (outer) B[t, g] ; y[t, h] = s_t . C[t, g].
// x [L, H, P] (tokens x_stride apart), dt [L, H] (final: bias, softplus, clamp done), A [H],
// B, C [L, G, N] (tokens bc_stride apart), state [H, P, N], y [L, H, P]. The decay is one scalar
// per head and token, so a token costs 2 P N multiply-adds per head; the chunked (SSD) form
// trades more arithmetic for matrix products, which pays on tensor cores, not here. A head's
// state is held transposed, [N][P], so each of the N steps is vectors across P, no reduction.
void ssd_scan(const float* x, int64_t x_stride, const float* dt, const float* A, const float* B,
              const float* C, int64_t bc_stride, float* state, float* y, int64_t length, int64_t heads,
              int64_t head_dim, int64_t groups, int64_t d_state, int threads) {
  // W channels at a time: their accumulators and inputs stay in registers across the N steps,
  // and four vectors give four independent chains of multiply-adds, not one waiting on the last.
  // Written on vectors: as a float array under omp simd, GCC kept the sums on the stack, a store
  // and a reload in every chain's step (0.86-0.89 of the time since, same bits).
  constexpr int64_t W = 64, kAhead = 8;
  const int64_t per_group = heads / groups, lanes = (head_dim + W - 1) / W * W;
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> s(d_state * lanes), u(lanes);
#pragma omp for schedule(static)
    for (int64_t hd = 0; hd < heads; ++hd) {
      const int64_t g = hd / per_group;
      float* sh = state + hd * head_dim * d_state;
      std::fill(s.begin(), s.end(), 0.f);
      std::fill(u.begin(), u.end(), 0.f);
      for (int64_t p = 0; p < head_dim; ++p)
        for (int64_t n = 0; n < d_state; ++n) s[n * lanes + p] = sh[p * d_state + n];
      for (int64_t t = 0; t < length; ++t) {
        const float d = dt[t * heads + hd], decay = std::exp(d * A[hd]);
        const float* xt = x + t * x_stride + hd * head_dim;
        const float* bt = B + t * bc_stride + g * d_state;
        const float* ct = C + t * bc_stride + g * d_state;
        float* yt = y + (t * heads + hd) * head_dim;
        if (t + kAhead < length) {  // rows x_stride apart, rarely still in cache
          prefetch_floats(xt + kAhead * x_stride, head_dim);
          for (int64_t p = 0; p < head_dim; p += 16) __builtin_prefetch(yt + kAhead * heads * head_dim + p, 1);
        }
        for (int64_t p = 0; p < head_dim; ++p) u[p] = d * xt[p];
        for (int64_t p0 = 0; p0 < lanes; p0 += W) {
          constexpr int64_t V = W / kLanes16;
          vec16 acc[V] = {}, uw[V];
          std::memcpy(uw, u.data() + p0, sizeof uw);
          for (int64_t n = 0; n < d_state; ++n) {
            const float bn = bt[n], cn = ct[n];
            float* sn = s.data() + n * lanes + p0;
            for (int64_t v = 0; v < V; ++v) {
              vec16 sv;
              std::memcpy(&sv, sn + v * kLanes16, sizeof sv);
              sv = sv * decay + uw[v] * bn;
              std::memcpy(sn + v * kLanes16, &sv, sizeof sv);
              acc[v] += sv * cn;
            }
          }
          alignas(64) float out[W];
          std::memcpy(out, acc, sizeof out);
          std::copy(out, out + std::min(W, head_dim - p0), yt + p0);
        }
      }
      for (int64_t p = 0; p < head_dim; ++p)
        for (int64_t n = 0; n < d_state; ++n) sh[p * d_state + n] = s[n * lanes + p];
    }
  }
}

// Gated DeltaNet decode step, per row (b, h) of S = state[slots[b], h] ([dk, dv]) in place.
// q, k [batch, H, dk] come in prepared (L2-normalised, q scaled, key heads repeated to the
// value heads); v, o [batch, H, dv]; beta [batch, H]; g [batch, H], or [batch, H, dk] where
// g_per_channel.
void gated_delta_step(float* state, const int64_t* slots, const float* q, const float* k,
                      const float* v, const float* g, const float* beta, float* o, int64_t batch,
                      int64_t heads, int64_t k_dim, int64_t v_dim, int64_t g_per_channel, int threads) {
  for_rows_and_units(slots, batch, heads, threads, [&](int64_t b, int64_t h) {
    thread_local std::vector<float> delta;  // scratch of v_dim floats, one a thread
    delta.resize(v_dim);
    const int64_t i = b * heads + h;
    delta_rule_step(state + (slots[b] * heads + h) * k_dim * v_dim, q + i * k_dim, k + i * k_dim,
                    v + i * v_dim, o + i * v_dim, g + (g_per_channel ? i * k_dim : i), g_per_channel, beta[i],
                    delta.data(), k_dim, v_dim);
  });
}

// Gated DeltaNet prefill of one sequence, the rule one token at a time, per head of
// state [H, dk, dv] in place (to S_L); q, k [L, H, dk] prepared as above, v, o [L, H, dv],
// beta [L, H], g [L, H] or [L, H, dk] where g_per_channel. A token costs about 4 dk dv
// multiply-adds per head on a state that stays in L1; the chunked form's triangular solves and
// dozens of torch ops cost far more on a CPU.
void gated_delta_scan(float* state, const float* q, const float* k, const float* v, const float* g,
                      const float* beta, float* o, int64_t length, int64_t heads, int64_t k_dim,
                      int64_t v_dim, int64_t g_per_channel, int threads) {
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> delta(v_dim);
#pragma omp for schedule(static)
    for (int64_t h = 0; h < heads; ++h) {
      float* S = state + h * k_dim * v_dim;
      for (int64_t t = 0; t < length; ++t) {
        const int64_t i = t * heads + h;
        delta_rule_step(S, q + i * k_dim, k + i * k_dim, v + i * v_dim, o + i * v_dim,
                        g + (g_per_channel ? i * k_dim : i), g_per_channel, beta[i], delta.data(), k_dim, v_dim);
      }
    }
  }
}

// One query per sequence over its paged KV (write-then-read: lens count the current token).
// q, out [batch, H, Dh]; caches [blocks, block_size, KVH, Dh]; tables [batch, table_width];
// window 0 = none. One sequence per iteration, reading each token's K row (all KV heads, one
// contiguous run) once and then each V row once: the cache does not fit in the CPU's caches, and
// this streams it at memory bandwidth where one (sequence, KV head) per iteration, reading a
// quarter of each row at a time, runs at about half of it. Each row of the next block is
// prefetched with the same row of this one, into L2 rather than L1: the KV streams from memory,
// and prefetches into L1 would evict the rows being read.
void paged_attention_decode(const float* q, const float* k_cache, const float* v_cache,
                            const int64_t* tables, int64_t table_width, const int64_t* lens,
                            float* out, int64_t batch, int64_t heads, int64_t kv_heads,
                            int64_t head_dim, int64_t block_size, float scale, int64_t window,
                            int threads) {
  const int64_t group = heads / kv_heads, row = kv_heads * head_dim, block_elems = block_size * row;
  int64_t longest = 1;
  for (int64_t b = 0; b < batch; ++b) longest = std::max(longest, lens[b]);
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> probs(heads * longest);  // [H, n]: scores, then probabilities
#pragma omp for schedule(dynamic, 1)
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t context = lens[b];
      const int64_t first = (window > 0 && context > window) ? context - window : 0;
      const int64_t n = context - first;
      const int64_t* table = tables + b * table_width;
      const float* qb = q + b * heads * head_dim;
      float* ob = out + b * heads * head_dim;
      for_each_position(table, first, context, block_size, [&](int64_t block, int64_t t, int64_t m, int64_t next) {
        const float* keys = k_cache + block * block_elems + t * row;
        if (next >= 0) prefetch_floats<kIntoL2>(k_cache + next * block_elems + t * row, row);
        for (int64_t h = 0; h < heads; ++h) {
          const float* key = keys + (h / group) * head_dim;
          const float* qh = qb + h * head_dim;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < head_dim; ++d) s += qh[d] * key[d];
          probs[h * n + m] = s * scale;
        }
      });
      // The first blocks of the V pass and of the likely next sequence load during the softmax.
      prefetch_floats<kIntoL2>(v_cache + table[first / block_size] * block_elems, block_elems);
      if (b + 1 < batch && tables[(b + 1) * table_width] >= 0)
        prefetch_floats<kIntoL2>(k_cache + tables[(b + 1) * table_width] * block_elems, block_elems);
      for (int64_t h = 0; h < heads; ++h) {
        float* p = probs.data() + h * n;
        const float top = splitserve::max_of(p + 1, n - 1, p[0]);
        float total = 0.f;
#pragma omp simd reduction(+ : total)
        for (int64_t m = 0; m < n; ++m) {
          p[m] = fast_exp(p[m] - top);
          total += p[m];
        }
        const float inv = 1.f / total;
#pragma omp simd
        for (int64_t m = 0; m < n; ++m) p[m] *= inv;
        std::fill(ob + h * head_dim, ob + (h + 1) * head_dim, 0.f);
      }
      for_each_position(table, first, context, block_size, [&](int64_t block, int64_t t, int64_t m, int64_t next) {
        const float* values = v_cache + block * block_elems + t * row;
        if (next >= 0) prefetch_floats<kIntoL2>(v_cache + next * block_elems + t * row, row);
        for (int64_t h = 0; h < heads; ++h) {
          const float* value = values + (h / group) * head_dim;
          const float p = probs[h * n + m];
          float* o = ob + h * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) o[d] += p * value[d];
        }
      });
    }
  }
}

}  // extern "C"
