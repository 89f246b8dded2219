// Shared by the CPU kernels of this folder (rows_linear.cpp, rows_attention.cpp).
#pragma once
#include <immintrin.h>

// the 8 lanes of v summed in one fixed order: a kernel that sums a dot product's lanes with it gives
// the same bits whatever tile or call computed the lanes
inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  __m128 sh = _mm_movehdup_ps(lo);
  __m128 s = _mm_add_ps(lo, sh);
  sh = _mm_movehl_ps(sh, s);
  s = _mm_add_ss(s, sh);
  return _mm_cvtss_f32(s);
}
