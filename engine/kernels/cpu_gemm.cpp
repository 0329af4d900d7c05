// The CPU float32 GEMM of the linears (engine.models.packed_linear): out = x @ W^T + bias, with W
// packed once into panels of PANEL output columns, [ceil(out / PANEL)][in][PANEL], the columns
// past `out` zero. Built with cpu_kernels.cpp into one library (engine.kernels.native).
//
// A tile of up to ROWS rows of x by one panel (two with AVX-512) keeps its sums in vector
// registers through the whole inner dimension: per k, one contiguous load of each panel's row and
// one broadcast of x a row, for 2 x ROWS fused multiply-adds of full vectors. The panels (16 KB
// each at in = 256) stay in L1 while every tile of a chunk of rows runs over them, and a chunk's
// rows of x (at most CHUNK_BYTES) stay in L2 while the panels stream by, which is what a decode
// step needs: its weights come from memory once, each read as one contiguous run. Written with
// GCC vector extensions, so -march=native picks the instructions (AVX2, AVX-512, NEON) without a
// code path per CPU; only the vector width and the panels per tile follow AVX-512.

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
// While its first tile of rows runs over its panels, a thread asks for the panels PREFETCH_AHEAD
// tiles further on to be brought into L2, one cache line (one k of a panel) per k and panel. With the weights streaming from
// memory (cycled through 64 MB) that took 64-row GEMMs from about 180 to 195-215 GFLOP/s here
// (Zen 4, 2 threads) and 8 rows x 256 -> 8192 from 84 to 162; prefill shapes were unchanged. Under
// PREFETCH_MIN_ROWS rows it ran 5-15% slower: a panel's pass is then too short to hide the
// extra requests, and the hardware prefetcher keeps up with the stream on its own.
constexpr int64_t PREFETCH_AHEAD = 2;
constexpr int64_t PREFETCH_MIN_ROWS = 4;

// A tile keeps ROWS x PANEL x PANELS_PER_TILE sums in vector registers: 12 registers either way.
// With AVX-512 a panel's row is one 16-float register and a tile covers two panels (AVX-512 has
// 32 registers); otherwise two 8-float halves of one panel. On a core with full-width AVX-512
// units (Zen 5) the 8-float form reached half of oneDNN's rate; each sum's multiply-adds run in
// the same order in both forms, so the bits are the same.
#if defined(__AVX512F__)
constexpr int LANES = 16;
constexpr int PANELS_PER_TILE = 2;
#else
constexpr int LANES = 8;
constexpr int PANELS_PER_TILE = 1;
#endif
constexpr int VECTORS = PANEL / LANES;  // vectors in one k of a panel

typedef float vec __attribute__((vector_size(LANES * sizeof(float))));
typedef float vec_unaligned __attribute__((vector_size(LANES * sizeof(float)), aligned(4), may_alias));

inline vec load(const float* p) { return *reinterpret_cast<const vec_unaligned*>(p); }
inline void store(float* p, vec v) { *reinterpret_cast<vec_unaligned*>(p) = v; }

// One panel's part of a tile: its weights, its bias (or null: zero), where its columns of the
// tile's first row go, how many of its PANEL columns are real (the last panel of W may be
// partial), and a panel to prefetch into L2 meanwhile (or null).
struct PanelWork {
  const float* panel;
  const float* bias;
  float* out;
  int columns;
  const float* ahead;
};

// Rows [0, R) of x (row stride ldx) times P panels, each into its own out (row stride ldo).
template <int R, int P>
void tile(const float* __restrict x, int64_t ldx, int64_t in, int64_t ldo, const PanelWork* work) {
  vec sums[R][P][VECTORS];
  for (int p = 0; p < P; ++p) {
    float start[PANEL] = {};
    if (work[p].bias != nullptr) std::memcpy(start, work[p].bias, work[p].columns * sizeof(float));
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < VECTORS; ++v) sums[r][p][v] = load(start + v * LANES);
  }
  const float* __restrict panels[P];
  const float* ahead[P];
  for (int p = 0; p < P; ++p) panels[p] = work[p].panel, ahead[p] = work[p].ahead;
#pragma GCC unroll 4
  for (int64_t k = 0; k < in; ++k) {
    vec w[P][VECTORS];
    for (int p = 0; p < P; ++p) {
      for (int v = 0; v < VECTORS; ++v) w[p][v] = load(panels[p] + k * PANEL + v * LANES);
      if (ahead[p] != nullptr) __builtin_prefetch(ahead[p] + k * PANEL, 0, 2);
    }
    for (int r = 0; r < R; ++r) {
      const float value = x[r * ldx + k];
      for (int p = 0; p < P; ++p)
        for (int v = 0; v < VECTORS; ++v) sums[r][p][v] += value * w[p][v];
    }
  }
  for (int p = 0; p < P; ++p) {
    float* out = work[p].out;
    if (work[p].columns == PANEL) {
      for (int r = 0; r < R; ++r)
        for (int v = 0; v < VECTORS; ++v) store(out + r * ldo + v * LANES, sums[r][p][v]);
      continue;
    }
    float row[PANEL];
    for (int r = 0; r < R; ++r) {
      for (int v = 0; v < VECTORS; ++v) store(row + v * LANES, sums[r][p][v]);
      std::memcpy(out + r * ldo, row, work[p].columns * sizeof(float));
    }
  }
}

using TileFn = void (*)(const float*, int64_t, int64_t, int64_t, const PanelWork*);
template <int P>
constexpr TileFn TILES[ROWS + 1] = {nullptr, tile<1, P>, tile<2, P>, tile<3, P>, tile<4, P>, tile<5, P>, tile<6, P>};

// The rows of the next tile when `left` remain. A tile of R rows keeps 2R sums in flight; under
// 4 rows that is fewer than the multiply-add units' latency times their number, so a tile of 1-3
// rows takes as long as one of 4. Tiles of 4-6 rows (7 = 4 + 3 excepted) cover any count: 32 rows
// as 6, 6, 6, 6, 4, 4 rather than 6 x 5 + 2 (an MoE expert's share of a decode batch).
inline int64_t rows_in_tile(int64_t left) {
  if (left <= ROWS) return left;
  return left - ROWS >= 4 ? ROWS : std::max<int64_t>(4, left - 4);
}

// Panels work[0, count) over rows [begin, end) of x, PANELS_PER_TILE at a time, tile by tile;
// each panel's `out` points at row 0 of its columns. Only the first tile of rows prefetches.
inline void panel_pass(const float* x, int64_t ldx, int64_t ldo, int64_t begin, int64_t end, int64_t in_features,
                       PanelWork* work, int count) {
  for (int first = 0; first < count; first += PANELS_PER_TILE) {
    const int panels = std::min(PANELS_PER_TILE, count - first);
    PanelWork at[PANELS_PER_TILE];
    for (int p = 0; p < panels; ++p) at[p] = work[first + p], at[p].out += begin * ldo;
    for (int64_t r = begin, tile_rows; r < end; r += tile_rows) {
      tile_rows = rows_in_tile(end - r);
      (panels == PANELS_PER_TILE ? TILES<PANELS_PER_TILE> : TILES<1>)[tile_rows](x + r * ldx, ldx, in_features, ldo,
                                                                                  at);
      for (int p = 0; p < panels; ++p) at[p].out += tile_rows * ldo, at[p].ahead = nullptr;
    }
  }
}

// The panels covered by tiles across a weight of `out_features` columns.
inline int64_t tiles_across(int64_t out_features) {
  const int64_t num_panels = (out_features + PANEL - 1) / PANEL;
  return (num_panels + PANELS_PER_TILE - 1) / PANELS_PER_TILE;
}

// Tile column t (panels t * PANELS_PER_TILE on, of a packed weight with its bias or null) over
// rows [begin, end) of x into out; prefetching the panels PREFETCH_AHEAD tiles on if asked.
inline void tile_column(const float* x, int64_t ldx, const float* panels, const float* bias, float* out,
                        int64_t ldo, int64_t begin, int64_t end, int64_t t, int64_t out_features,
                        int64_t in_features, bool prefetch) {
  const int64_t num_panels = (out_features + PANEL - 1) / PANEL, first = t * PANELS_PER_TILE;
  const int count = static_cast<int>(std::min<int64_t>(PANELS_PER_TILE, num_panels - first));
  PanelWork work[PANELS_PER_TILE];
  for (int i = 0; i < count; ++i) {
    const int64_t p = first + i, ahead = p + PREFETCH_AHEAD * PANELS_PER_TILE;
    work[i] = {panels + p * PANEL * in_features, bias == nullptr ? nullptr : bias + p * PANEL, out + p * PANEL,
               static_cast<int>(std::min<int64_t>(PANEL, out_features - p * PANEL)),
               prefetch && ahead < num_panels ? panels + ahead * PANEL * in_features : nullptr};
  }
  panel_pass(x, ldx, ldo, begin, end, in_features, work, count);
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
  const int64_t most = most_chunk_rows(in_features);
  const int64_t chunks = (rows + most - 1) / most;
  const int64_t chunk_rows = ((rows + chunks - 1) / chunks + ROWS - 1) / ROWS * ROWS;
  const int64_t across = tiles_across(out_features);
  splitserve::steal_for(chunks * across, threads, [&](int64_t item) {
    const int64_t c = item / across;
    tile_column(x, ldx, panels, bias, out, ldo, c * chunk_rows, std::min(rows, (c + 1) * chunk_rows),
                item - c * across, out_features, in_features, rows >= PREFETCH_MIN_ROWS);
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
  const int64_t across = tiles_across(out_features);
  splitserve::steal_for(groups * across, threads, [&](int64_t item) {
    const int64_t g = item / across;
    if (counts[g] == 0) return;
    tile_column(x, ldx, panels_of(g), nullptr, out, ldo, starts[g], starts[g + 1], item - g * across, out_features,
                in_features, counts[g] >= PREFETCH_MIN_ROWS);
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
    // Gate's panel j and up's run as one tile where a tile takes two panels, prefetching both
    // panels j + 1; one after the other otherwise: while the gate's tiles run, the up panel
    // comes in, while the up's, the next gate panel.
    const bool prefetch = rows >= PREFETCH_MIN_ROWS, more = j + 1 < num_panels;
    const float* next_gate = prefetch && more ? gate_panel + PANEL * in_features : nullptr;
    const float* next_up = prefetch && more ? up_panel + PANEL * in_features : nullptr;
    const bool together = PANELS_PER_TILE == 2;
    PanelWork work[2] = {{gate_panel, nullptr, gate, PANEL, together ? next_gate : prefetch ? up_panel : nullptr},
                         {up_panel, nullptr, up, PANEL, together ? next_up : next_gate}};
    panel_pass(x + begin * ldx, ldx, PANEL, 0, rows, in_features, work, 2);
    for (int64_t r = 0; r < rows; ++r) {
      float* out = act + (begin + r) * inter + j * PANEL;
      const float *gr = gate + r * PANEL, *ur = up + r * PANEL;
#pragma omp simd
      for (int64_t k = 0; k < PANEL; ++k) out[k] = splitserve::silu_times(gr[k], ur[k]);
    }
  });
}
