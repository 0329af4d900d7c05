// The CPU float32 GEMM of the linears (engine.models.packed_linear): out = x @ W^T + bias, with W
// packed once into panels of PANEL output columns, [ceil(out / PANEL)][in][PANEL], the columns
// past `out` zero. Built with cpu_kernels.cpp into one library (engine.kernels.native).
//
// A tile of up to ROWS rows of x by one panel keeps its ROWS x PANEL sums in vector registers
// (6 x 16 floats: 12 of AVX2's 16 registers) through the whole inner dimension: per k, two
// contiguous loads of the panel and one broadcast of x a row, for 2 x ROWS fused multiply-adds.
// The panel (16 KB at in = 256) stays in L1 while every tile of a chunk of rows runs over it,
// and a chunk's rows of x (at most CHUNK_BYTES) stay in L2 while the panels stream by, which is
// what a decode step needs: its weights come from memory once, each read as one contiguous run.
// Written with GCC vector extensions, so -march=native picks the instructions (AVX2, AVX-512,
// NEON) without a code path per CPU.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_kernels.h"

namespace {

constexpr int PANEL = splitserve::PANEL_COLUMNS;
constexpr int ROWS = 6;
constexpr int64_t CHUNK_BYTES = 256 * 1024;
constexpr int64_t MOST_CHUNK_ROWS = 1024;
// While its first tile runs over a panel, a thread asks for the panel PREFETCH_AHEAD further on to
// be brought into L2, one cache line (one k of the panel) per k. With the weights streaming from
// memory (cycled through 64 MB) that took 64-row GEMMs from about 180 to 195-215 GFLOP/s here
// (Zen 4, 2 threads) and 8 rows x 256 -> 8192 from 84 to 162; prefill shapes were unchanged. Under
// PREFETCH_MIN_ROWS rows it ran 5-15% slower: a panel's pass is then too short to hide the
// extra requests, and the hardware prefetcher keeps up with the stream on its own.
constexpr int64_t PREFETCH_AHEAD = 2;
constexpr int64_t PREFETCH_MIN_ROWS = 4;

typedef float vec8 __attribute__((vector_size(32)));
typedef float vec8_unaligned __attribute__((vector_size(32), aligned(4), may_alias));

inline vec8 load8(const float* p) { return *reinterpret_cast<const vec8_unaligned*>(p); }
inline void store8(float* p, vec8 v) { *reinterpret_cast<vec8_unaligned*>(p) = v; }

// Rows [0, R) of x (row stride ldx) times one panel, plus its bias (or zero), into out (row
// stride ldo); `columns` of the panel's PANEL are real (the last panel of W may be partial).
// `ahead`, if not null, is a panel to prefetch into L2 meanwhile.
template <int R>
void tile(const float* __restrict x, int64_t ldx, const float* __restrict panel, int64_t in,
          const float* bias, float* __restrict out, int64_t ldo, int columns, const float* ahead) {
  float start[PANEL] = {};
  if (bias != nullptr) std::memcpy(start, bias, columns * sizeof(float));
  vec8 lo[R], hi[R];
  for (int r = 0; r < R; ++r) {
    lo[r] = load8(start);
    hi[r] = load8(start + 8);
  }
#pragma GCC unroll 4
  for (int64_t k = 0; k < in; ++k) {
    const vec8 w_lo = load8(panel + k * PANEL), w_hi = load8(panel + k * PANEL + 8);
    if (ahead != nullptr) __builtin_prefetch(ahead + k * PANEL, 0, 2);
    for (int r = 0; r < R; ++r) {
      const float v = x[r * ldx + k];
      lo[r] += v * w_lo;
      hi[r] += v * w_hi;
    }
  }
  if (columns == PANEL) {
    for (int r = 0; r < R; ++r) {
      store8(out + r * ldo, lo[r]);
      store8(out + r * ldo + 8, hi[r]);
    }
    return;
  }
  float row[PANEL];
  for (int r = 0; r < R; ++r) {
    store8(row, lo[r]);
    store8(row + 8, hi[r]);
    std::memcpy(out + r * ldo, row, columns * sizeof(float));
  }
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, const float*, float*, int64_t, int,
                       const float*);
constexpr TileFn TILES[ROWS + 1] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>, tile<5>, tile<6>};

// The rows of the next tile when `left` remain. A tile of R rows keeps 2R sums in flight; under
// 4 rows that is fewer than the multiply-add units' latency times their number, so a tile of 1-3
// rows takes as long as one of 4. Tiles of 4-6 rows (7 = 4 + 3 excepted) cover any count: 32 rows
// as 6, 6, 6, 6, 4, 4 rather than 6 x 5 + 2 (an MoE expert's share of a decode batch).
inline int64_t rows_in_tile(int64_t left) {
  if (left <= ROWS) return left;
  return left - ROWS >= 4 ? ROWS : std::max<int64_t>(4, left - 4);
}

// One panel over rows [begin, end) of x into out (its columns of those rows), tile by tile;
// `ahead`, if not null, is prefetched during the first tile.
inline void panel_pass(const float* x, int64_t ldx, const float* panel, const float* panel_bias, float* out,
                       int64_t ldo, int64_t begin, int64_t end, int64_t in_features, int columns, const float* ahead) {
  for (int64_t r = begin, tile_rows; r < end; r += tile_rows, ahead = nullptr) {
    tile_rows = rows_in_tile(end - r);
    TILES[tile_rows](x + r * ldx, ldx, panel, in_features, panel_bias, out + r * ldo, ldo, columns, ahead);
  }
}

// The rows of a chunk: equal chunks of at most CHUNK_BYTES of x (and MOST_CHUNK_ROWS), whole tiles.
inline int64_t most_chunk_rows(int64_t in_features) {
  const int64_t fit = CHUNK_BYTES / (static_cast<int64_t>(sizeof(float)) * std::max<int64_t>(in_features, 1));
  return std::max<int64_t>(1, std::min(fit, MOST_CHUNK_ROWS) / ROWS) * ROWS;
}

}  // namespace

// out[rows, out_features] (row stride ldo) = x[rows, in_features] (row stride ldx) @ W^T + bias.
// Rows are split into equal chunks that fit CHUNK_BYTES; the threads share the (chunk, panel)
// pairs in order (splitserve::steal_for), so in decode (one chunk) each thread streams its own
// half of the weight, and the first done takes panels from the end of the other's half.
extern "C" void packed_linear(const float* x, int64_t ldx, const float* panels, const float* bias, float* out,
                              int64_t ldo, int64_t rows, int64_t out_features, int64_t in_features, int threads) {
  if (rows <= 0 || out_features <= 0) return;
  const int64_t num_panels = (out_features + PANEL - 1) / PANEL;
  const int64_t most = most_chunk_rows(in_features);
  const int64_t chunks = (rows + most - 1) / most;
  const int64_t chunk_rows = ((rows + chunks - 1) / chunks + ROWS - 1) / ROWS * ROWS;
  splitserve::steal_for(chunks * num_panels, threads, [&](int64_t item) {
    const int64_t c = item / num_panels, p = item - c * num_panels;
    const float* panel = panels + p * PANEL * in_features;
    const float* ahead = rows >= PREFETCH_MIN_ROWS && p + PREFETCH_AHEAD < num_panels
                             ? panel + PREFETCH_AHEAD * PANEL * in_features : nullptr;
    panel_pass(x, ldx, panel, bias == nullptr ? nullptr : bias + p * PANEL, out + p * PANEL, ldo, c * chunk_rows,
               std::min(rows, (c + 1) * chunk_rows), in_features,
               static_cast<int>(std::min<int64_t>(PANEL, out_features - p * PANEL)), ahead);
  });
}

// Several weights over consecutive groups of rows (an MoE layer's experts): rows [start_g,
// start_g + counts[g]) of x times weight g, whose panels are at weights[g * stride], into the
// same rows of out, without bias; each row's bits are packed_linear's. Where every group fits one
// chunk (decode), the threads share all the (group, panel) pairs in one pass: group by group,
// each call's start and its wait for the slower thread came back per weight (4 experts of 32 rows
// x 256 -> 768: one pass 0.90-0.92 the time of 4 calls here). Larger groups take packed_linear.
extern "C" void grouped_linear(const float* x, int64_t ldx, const int64_t* counts, const int64_t* weights,
                               int64_t stride, float* out, int64_t ldo, int64_t groups, int64_t out_features,
                               int64_t in_features, int threads) {
  const int64_t most = most_chunk_rows(in_features);
  std::vector<int64_t> starts(groups + 1, 0);
  bool one_chunk_each = true;
  for (int64_t g = 0; g < groups; ++g) {
    starts[g + 1] = starts[g] + counts[g];
    one_chunk_each = one_chunk_each && counts[g] <= most;
  }
  const auto panels_of = [&](int64_t g) { return reinterpret_cast<const float*>(weights[g * stride]); };
  if (!one_chunk_each) {
    for (int64_t g = 0; g < groups; ++g)
      packed_linear(x + starts[g] * ldx, ldx, panels_of(g), nullptr, out + starts[g] * ldo, ldo, counts[g],
                    out_features, in_features, threads);
    return;
  }
  const int64_t num_panels = (out_features + PANEL - 1) / PANEL;
  splitserve::steal_for(groups * num_panels, threads, [&](int64_t item) {
    const int64_t g = item / num_panels, p = item - g * num_panels;
    if (counts[g] == 0) return;
    const float* panel = panels_of(g) + p * PANEL * in_features;
    const float* ahead = counts[g] >= PREFETCH_MIN_ROWS && p + PREFETCH_AHEAD < num_panels
                             ? panel + PREFETCH_AHEAD * PANEL * in_features : nullptr;
    panel_pass(x, ldx, panel, nullptr, out + p * PANEL, ldo, starts[g], starts[g + 1], in_features,
               static_cast<int>(std::min<int64_t>(PANEL, out_features - p * PANEL)), ahead);
  });
}

// [gate | up] = grouped_linear's projection of each group's rows (no bias), then act = silu(gate) *
// up (silu_mul's formula) [rows, inter], without writing [gate | up] out: per (group, chunk of
// its rows, panel j of gate) the tiles run over gate's panel j and then up's (panel j + inter /
// PANEL) into the thread's scratch, and act's columns of panel j are written from it. Each value
// has the bits of grouped_linear then silu_mul (both take silu_times). inter must be a multiple of
// PANEL.
extern "C" void grouped_silu_gate_up(const float* x, int64_t ldx, const int64_t* counts, const int64_t* weights,
                                     int64_t stride, float* act, int64_t groups, int64_t inter, int64_t in_features,
                                     int threads) {
  const int64_t most = most_chunk_rows(in_features), num_panels = inter / PANEL;
  std::vector<int64_t> starts(groups + 1, 0), first_item(groups + 1, 0);  // each group's rows and items
  for (int64_t g = 0; g < groups; ++g) {
    starts[g + 1] = starts[g] + counts[g];
    first_item[g + 1] = first_item[g] + (counts[g] + most - 1) / most * num_panels;
  }
  splitserve::steal_for(first_item[groups], threads, [&](int64_t item) {
    const int64_t g = std::upper_bound(first_item.begin(), first_item.end(), item) - first_item.begin() - 1;
    const int64_t c = (item - first_item[g]) / num_panels, j = (item - first_item[g]) % num_panels;
    const int64_t begin = starts[g] + c * most, rows = std::min(most, starts[g + 1] - begin);
    const float* gate_panel = reinterpret_cast<const float*>(weights[g * stride]) + j * PANEL * in_features;
    const float* up_panel = gate_panel + num_panels * PANEL * in_features;
    thread_local std::vector<float> scratch;
    scratch.resize(2 * rows * PANEL);
    float *gate = scratch.data(), *up = gate + rows * PANEL;
    // While the gate's tiles run, the up panel comes in; while the up's, the next gate panel.
    const float* x_rows = x + begin * ldx;
    panel_pass(x_rows, ldx, gate_panel, nullptr, gate, PANEL, 0, rows, in_features, PANEL,
               rows >= PREFETCH_MIN_ROWS ? up_panel : nullptr);
    panel_pass(x_rows, ldx, up_panel, nullptr, up, PANEL, 0, rows, in_features, PANEL,
               rows >= PREFETCH_MIN_ROWS && j + 1 < num_panels ? gate_panel + PANEL * in_features : nullptr);
    for (int64_t r = 0; r < rows; ++r) {
      float* out = act + (begin + r) * inter + j * PANEL;
      const float *gr = gate + r * PANEL, *ur = up + r * PANEL;
#pragma omp simd
      for (int64_t k = 0; k < PANEL; ++k) out[k] = splitserve::silu_times(gr[k], ur[k]);
    }
  });
}
