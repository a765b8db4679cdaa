// Thin fp32 products y[M, N] = x[M, K] @ w[N, K]^T for M = 1 to 8 rows, AVX2 + FMA: shared by thin_linear
// (thin_matmul.cpp) and the fused decoder layer (decode_layer.cpp).
//
// A thin product reads each weight once and multiplies it by only M rows, so it is bound by how fast the weights
// stream from memory. Each weight row is read once while all M rows of x (a few kB, in L1) are multiplied
// against it; with 1-2 rows, 4 weight rows at a time share each load of x. Threads split the N output columns.
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstdint>

namespace mtpkit {

inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(s);
}

// Output columns [n0, n1): R weight rows per pass (R * M accumulators stay in the 16 ymm registers), then one
// row at a time for the remainder. The next pass's weight rows are prefetched: measured on an AVX2 EPYC, one
// thread streamed 4-row products at ~1.4x the rate with the prefetch and R = 1 than without it and R = 2.
// Not inlined: inlined into parallel_for's OpenMP region, GCC kept the accumulators on the stack (a store and a
// load next to every FMA), and 3-8 row products streamed ~25% slower.
template <int M, int R>
[[gnu::noinline]] void columns(const float* x, const float* w, float* y, int64_t N, int64_t K, int64_t n0,
                               int64_t n1) {
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    __m256 acc[R][M];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) acc[r][m] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
      __m256 wv[R];
      for (int r = 0; r < R; ++r) {
        wv[r] = _mm256_loadu_ps(w + (n + r) * K + k);
        _mm_prefetch(reinterpret_cast<const char*>(w + (n + r + R) * K + k), _MM_HINT_T0);  // never faults
      }
      for (int m = 0; m < M; ++m) {
        const __m256 xv = _mm256_loadu_ps(x + m * K + k);
        for (int r = 0; r < R; ++r) acc[r][m] = _mm256_fmadd_ps(wv[r], xv, acc[r][m]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) {
        float s = horizontal_sum(acc[r][m]);
        for (int64_t t = k; t < K; ++t) s += w[(n + r) * K + t] * x[m * K + t];
        y[m * N + n + r] = s;
      }
  }
  if constexpr (R > 1) {
    if (n < n1) columns<M, 1>(x, w, y, N, K, n, n1);
  }
}

template <int M, int R>
inline void product(const float* x, const float* w, float* y, int64_t N, int64_t K) {
  // grain: at least 64 weight rows per thread, so a small weight is not split into slivers
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) { columns<M, R>(x, w, y, N, K, n0, n1); });
}

// the product for M = 1..8 rows (the caller checks M)
inline void thin_product(const float* x, const float* w, float* y, int64_t M, int64_t N, int64_t K) {
  switch (M) {
    case 1: product<1, 4>(x, w, y, N, K); break;
    case 2: product<2, 4>(x, w, y, N, K); break;
    case 3: product<3, 1>(x, w, y, N, K); break;
    case 4: product<4, 1>(x, w, y, N, K); break;
    case 5: product<5, 1>(x, w, y, N, K); break;
    case 6: product<6, 1>(x, w, y, N, K); break;
    case 7: product<7, 1>(x, w, y, N, K); break;
    default: product<8, 1>(x, w, y, N, K); break;
  }
}

}  // namespace mtpkit
