// Thin products y[M, N] = x[M, K] @ w[N, K]^T for M = 1 to 16 fp32 rows, AVX2 + FMA: shared by thin_linear
// (thin_matmul.cpp) and the fused decoder layer (decode_layer.cpp).
//
// A thin product reads each weight once and multiplies it by only M rows, so it is bound by how fast the weights
// stream from memory. Each weight row is read once while all M rows of x (a few kB, in L1) are multiplied
// against it, R weight rows at a time sharing each load of x (`block`). Threads split the N output columns.
//
// Which R streams fastest depends on M and on the CPU, so the caller passes it and the decode router measures
// each (decode/matmul_routing.py). On a 2-core AVX2 EPYC, over SmolLM2-135M's weights: R = 4 fastest for 1-5 rows
// (4 rows 1.07x the time of 1 row, against 1.19x with R = 1), R = 2 for 6-7 (1.16x against 1.30x); at 8 rows
// R = 1 and 2 tie (1.35x) and R = 4 spills its 32 accumulators (1.77x).
//
// More than 8 rows (a wide draft tree, a batch of verify steps) run as groups of at most 8 rows over tiles of
// kTile weight rows: more accumulators per weight row would spill AVX2's 16 registers, and a tile stays in L2
// between its groups, so the weights still stream from memory once. Each output is the same sum in the same
// order whatever the row count or group: a row's products do not depend on the other rows.
//
// The weights are fp32, or bf16 where every fp32 weight value is exactly a bf16 (a bf16 checkpoint run in fp32): a
// bf16 value is the top half of its fp32, so widening it gives the same fp32 weight, the same products in the
// same order, from half the bytes.
//
// On CPUs with AVX-512F the wide blocks (`kWide` + R) put two weight rows in each 512-bit register, row n in the
// low half and n + 1 in the high half, against x broadcast to both halves: every lane runs the AVX2 kernel's sum
// in its order, so the outputs are the same bits, from half the multiply instructions. Where 2-6 rows make the
// product partly bound by its arithmetic this pays (a 2-core Xeon with AMX, a step's products over SmolLM2-135M's
// weights: 0.97x / 0.96x / 0.93x the AVX2 blocks' time at 2 / 4 / 6 rows, level at 1); the decode router measures
// it beside the AVX2 blocks. The functions are compiled for AVX-512F alone (`target`), so the extension still loads
// on AVX2-only CPUs, which never call them.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace mtpkit {

inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(s);
}

// One output: an accumulator's 8 lanes summed, then the K % 8 tail of the row. Both kinds of block end each output
// here, so they give the same bits.
template <typename W>
inline float finish_output(__m256 acc, const float* x, const W* w_row, int64_t k, int64_t K) {
  float s = horizontal_sum(acc);
  // std::fma: the same rounding for either weight type (a compiler may fuse `s += w * x` for one only)
  for (int64_t t = k; t < K; ++t) s = std::fma(static_cast<float>(w_row[t]), x[t], s);
  return s;
}

// 8 weights as fp32
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// Output columns [n0, n1): R weight rows per pass (R * M accumulators), then one row at a time for the remainder.
// The next pass's weight rows are prefetched (measured on an AVX2 EPYC: ~1.4x the rate of 4-row products).
// Not inlined: inlined into parallel_for's OpenMP region, GCC kept the accumulators on the stack (a store and a
// load next to every FMA), and 3-8 row products streamed ~25% slower.
template <int M, int R, typename W>
[[gnu::noinline]] void columns(const float* x, const W* w, float* y, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    __m256 acc[R][M];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) acc[r][m] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
      __m256 wv[R];
      for (int r = 0; r < R; ++r) {
        wv[r] = load8(w + (n + r) * K + k);
        _mm_prefetch(reinterpret_cast<const char*>(w + (n + r + R) * K + k), _MM_HINT_T0);  // never faults
      }
      for (int m = 0; m < M; ++m) {
        const __m256 xv = _mm256_loadu_ps(x + m * K + k);
        for (int r = 0; r < R; ++r) acc[r][m] = _mm256_fmadd_ps(wv[r], xv, acc[r][m]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) y[m * N + n + r] = finish_output(acc[r][m], x + m * K, w + (n + r) * K, k, K);
  }
  if constexpr (R > 1) {
    if (n < n1) columns<M, 1>(x, w, y, N, K, n, n1);
  }
}

#define MTPKIT_AVX512 gnu::target("avx2,fma,avx512f")

// weights n[k..k+8) in the low half, the next row's in the high half
template <typename W>
[[MTPKIT_AVX512]] inline __m512 load8_pair(const W* low, const W* high) {
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(load8(low))),
                                             _mm256_castps_pd(load8(high)), 1));
}

// columns<M, 2P> in 512-bit registers: P pairs of weight rows per pass, the same sums in the same order
template <int M, int P, typename W>
[[MTPKIT_AVX512, gnu::noinline]] void wide_columns(const float* x, const W* w, float* y, int64_t N, int64_t K,
                                                   int64_t n0, int64_t n1) {
  constexpr int R = 2 * P;
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    __m512 acc[P][M];
    for (int p = 0; p < P; ++p)
      for (int m = 0; m < M; ++m) acc[p][m] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
      __m512 wv[P];
      for (int p = 0; p < P; ++p) {
        wv[p] = load8_pair(w + (n + 2 * p) * K + k, w + (n + 2 * p + 1) * K + k);
        _mm_prefetch(reinterpret_cast<const char*>(w + (n + 2 * p + R) * K + k), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(w + (n + 2 * p + 1 + R) * K + k), _MM_HINT_T0);
      }
      for (int m = 0; m < M; ++m) {
        const __m512 xv = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_loadu_pd(reinterpret_cast<const double*>(
            x + m * K + k))));
        for (int p = 0; p < P; ++p) acc[p][m] = _mm512_fmadd_ps(wv[p], xv, acc[p][m]);
      }
    }
    for (int p = 0; p < P; ++p)
      for (int m = 0; m < M; ++m) {
        const __m512d both = _mm512_castps_pd(acc[p][m]);
        for (int half = 0; half < 2; ++half) {
          const int64_t row = n + 2 * p + half;
          const __m256 lanes = _mm256_castpd_ps(half ? _mm512_extractf64x4_pd(both, 1) : _mm512_castpd512_pd256(both));
          y[m * N + row] = finish_output(lanes, x + m * K, w + row * K, k, K);
        }
      }
  }
  if (n < n1) columns<M, 1>(x, w, y, N, K, n, n1);
}
#undef MTPKIT_AVX512

constexpr int64_t kMaxRows = 16;
constexpr int64_t kTile = 16;  // weight rows per tile of a product over more than 8 rows: a multiple of every R
constexpr int64_t kWide = 16;  // block kWide + R: R = 2 or 4 weight rows per pass as pairs in 512-bit registers

template <typename W>
using Columns = void (*)(const float*, const W*, float*, int64_t, int64_t, int64_t, int64_t);

inline bool has_avx512f() {
  static const bool yes = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") != 0;  // the OS's support of the 512-bit state included
  }();
  return yes;
}

// the blocks this CPU runs: 1, 2 and 4 weight rows per pass, and the wide ones where it has AVX-512F
inline bool valid_block(int64_t block) {
  return block == 1 || block == 2 || block == 4 || ((block == kWide + 2 || block == kWide + 4) && has_avx512f());
}

template <int M, typename W>
Columns<W> columns_of_block(int64_t block) {
  switch (block) {
    case 1: return &columns<M, 1, W>;
    case 2: return &columns<M, 2, W>;
    case kWide + 2: return &wide_columns<M, 1, W>;
    case kWide + 4: return &wide_columns<M, 2, W>;
    default: return &columns<M, 4, W>;
  }
}

// columns<M, R> for M = 1..8 rows, R = `block`
template <typename W>
Columns<W> columns_for(int64_t M, int64_t block) {
  switch (M) {
    case 1: return columns_of_block<1, W>(block);
    case 2: return columns_of_block<2, W>(block);
    case 3: return columns_of_block<3, W>(block);
    case 4: return columns_of_block<4, W>(block);
    case 5: return columns_of_block<5, W>(block);
    case 6: return columns_of_block<6, W>(block);
    case 7: return columns_of_block<7, W>(block);
    default: return columns_of_block<8, W>(block);
  }
}

// the product for M = 1..kMaxRows rows, `block` = R weight rows per pass or kWide + R (the caller checks M and
// valid_block)
template <typename W>
inline void thin_product(const float* x, const W* w, float* y, int64_t M, int64_t N, int64_t K, int64_t block) {
  const int64_t groups = (M + 7) / 8;
  const Columns<W> full = columns_for<W>(std::min<int64_t>(M, 8), block);
  const Columns<W> last = columns_for<W>(M - 8 * (groups - 1), block);
  // grain: at least 64 weight rows per thread, so a small weight is not split into slivers
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    if (groups == 1) return full(x, w, y, N, K, n0, n1);
    for (int64_t t0 = n0; t0 < n1; t0 += kTile) {
      const int64_t t1 = std::min(t0 + kTile, n1);
      for (int64_t g = 0; g < groups; ++g)
        (g + 1 < groups ? full : last)(x + 8 * g * K, w, y + 8 * g * N, N, K, t0, t1);
    }
  });
}

// the product for a weight tensor [N, K] that is fp32 or bf16 (the caller checks which)
inline void thin_product(const float* x, const at::Tensor& w, float* y, int64_t M, int64_t block) {
  const int64_t N = w.size(0), K = w.size(1);
  if (w.scalar_type() == at::kBFloat16)
    thin_product(x, w.const_data_ptr<c10::BFloat16>(), y, M, N, K, block);
  else
    thin_product(x, w.const_data_ptr<float>(), y, M, N, K, block);
}

}  // namespace mtpkit
