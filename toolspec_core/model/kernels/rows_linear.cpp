// y[M, N] = x[M, K] . W[N, K]^T (+ b) for the few rows of a tree-verify step, on AVX2 + FMA.
//
// Why: a verify step multiplies 1-64 rows by every weight. BLAS / oneDNN GEMMs are built for many
// rows; at a few rows the step should cost what streaming the weight once costs. The weight is read
// in its own [out, in] layout (no copy), NB weight rows at a time (a block) against passes of at
// most MB input rows (NB x MB accumulators of 8 floats). Every pass of a block prefetches its share
// of the weight rows DIST rows ahead into L2, spread evenly over its k loop, so DRAM streams at
// every row count while the passes compute (one-row products read the weights at 23-29 GB/s where
// torch.sum reads 25-38: benchmarks/results/measurements/linear-bandwidth-cpu-avx512-093f8a8.json).
// Where the compiler may use AVX-512VL, the 32 ymm registers hold bigger tiles (up to 4 x 6
// accumulators instead of 3 x 4).
//
// Every output y[m, n] is one dot product accumulated in the same order (8 lanes over k, then a
// fixed horizontal sum, then the k tail) whatever M is and whichever tile computes it: a row's
// result does not depend on how many rows share the call (batch-invariant, bit for bit). The k tail is
// unfused multiply + add in every build (compiled with -ffp-contract=off, so that gcc cannot fuse it
// under -mavx512f and not under AVX2 alone), so the AVX2 and AVX-512VL builds agree bit for bit.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "simd.h"

namespace {

constexpr int64_t DIST = 16;  // prefetch distance in weight rows (56 KB ahead at K = 896)

// NB weight rows (w, stride K) x MB input rows (x, stride K) -> y (stride N), prefetching ``lines``
// cache lines from ``pf`` into L2 spread evenly over the k loop. Not inlined: gcc 12 compiles some
// shapes 1.5x slower when this is inlined into the dispatch switch.
template <int NB, int MB>
__attribute__((noinline)) void tile(const float* x, int64_t K, const float* w, float* y, int64_t N, const char* pf, int64_t lines) {
  __m256 acc[NB][MB];
  for (int i = 0; i < NB; ++i)
    for (int j = 0; j < MB; ++j) acc[i][j] = _mm256_setzero_ps();
  const int64_t steps = K / 8 > 0 ? K / 8 : 1;
  int64_t due = 0;
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    for (due += lines; due >= steps; due -= steps, pf += 64) _mm_prefetch(pf, _MM_HINT_T1);
    __m256 wv[NB];
    for (int i = 0; i < NB; ++i) wv[i] = _mm256_loadu_ps(w + i * K + k);
    for (int j = 0; j < MB; ++j) {
      const __m256 xv = _mm256_loadu_ps(x + j * K + k);
      for (int i = 0; i < NB; ++i) acc[i][j] = _mm256_fmadd_ps(wv[i], xv, acc[i][j]);
    }
  }
  for (int i = 0; i < NB; ++i)
    for (int j = 0; j < MB; ++j) {
      float s = hsum(acc[i][j]);
      for (int64_t t = k; t < K; ++t) s += w[i * K + t] * x[j * K + t];  // unfused (-ffp-contract=off): the same bits in every build
      y[j * N + i] = s;
    }
}

template <int NB, int MB>
inline void tile_rows(int64_t rows, const float* x, int64_t K, const float* w, float* y, int64_t N, const char* pf, int64_t lines) {
  if constexpr (MB > 1) {
    if (rows < MB) return tile_rows<NB, MB - 1>(rows, x, K, w, y, N, pf, lines);
  }
  tile<NB, MB>(x, K, w, y, N, pf, lines);
}

// every input row against NB weight rows in balanced passes of at most MB rows (8 = 4 + 4, not
// 6 + 2: a small tile has too few accumulators to hide the FMA latency); the passes share the
// prefetch of the weight rows DIST rows ahead
template <int NB, int MB>
void block(const float* x, int64_t M, int64_t K, const float* w, float* y, int64_t N, bool prefetch) {
  const int64_t passes = (M + MB - 1) / MB, base = M / passes, extra = M % passes;
  const int64_t lines = prefetch ? NB * K * 4 / 64 : 0;
  const char* ahead = reinterpret_cast<const char*>(w + DIST * K);
  int64_t m = 0;
  for (int64_t p = 0; p < passes; ++p) {
    const int64_t rows = base + (p < extra ? 1 : 0);
    const int64_t l0 = lines * p / passes, l1 = lines * (p + 1) / passes;
    tile_rows<NB, MB>(rows, x + m * K, K, w, y + m * N, N, ahead + 64 * l0, l1 - l0);
    m += rows;
  }
}

template <int NB, int MB>
void run(const float* x, int64_t M, int64_t K, const float* w, float* y, int64_t N) {
  const int64_t blocks = N / NB;
  at::parallel_for(0, blocks, 8, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) block<NB, MB>(x, M, K, w + b * NB * K, y + b * NB, N, true);
  });
  for (int64_t n = blocks * NB; n < N; ++n) block<1, MB>(x, M, K, w + n * K, y + n, N, false);
}

}  // namespace

torch::Tensor rows_linear(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "rows_linear: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "rows_linear: float32 only");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "rows_linear: weight must be a contiguous [out, in] matrix");
  TORCH_CHECK(x.size(-1) == w.size(1), "rows_linear: input has ", x.size(-1), " features, weight ", w.size(1));
  TORCH_CHECK(w.size(1) > 0, "rows_linear: weight has no input features");
  const auto xc = x.contiguous();
  const int64_t K = w.size(1), N = w.size(0), M = xc.numel() / K;
  auto shape = x.sizes().vec();
  shape.back() = N;
  auto y = torch::empty(shape, x.options());
  const float* xp = xc.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (M == 0 || N == 0) return y;  // nothing to compute (and no pass of zero rows)
  // tile shapes: NB x MB accumulators + NB weight vectors + 1 input vector within the registers (one
  // input row: each weight vector is used once, so its load folds into the FMA and 8 x 1 fits AVX2's 16)
#if defined(__AVX512VL__)  // 32 ymm registers
  if (M == 1) run<8, 1>(xp, M, K, wp, yp, N);
  else if (M == 2) run<8, 2>(xp, M, K, wp, yp, N);
  else if (M == 3) run<6, 3>(xp, M, K, wp, yp, N);
  else run<4, 6>(xp, M, K, wp, yp, N);  // 4-6 rows in one pass, more in balanced passes
#else  // 16 ymm registers
  if (M == 1) run<8, 1>(xp, M, K, wp, yp, N);
  else if (M == 2) run<4, 2>(xp, M, K, wp, yp, N);
  else if (M <= 6) run<2, 6>(xp, M, K, wp, yp, N);
  else run<3, 4>(xp, M, K, wp, yp, N);  // 3 x 4: one load per 1.7 FMAs
#endif
  if (bias.has_value() && bias->defined()) y.add_(*bias);
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rows_linear", &rows_linear, "x @ W.T (+ b) for a few rows (tree verification)");
}
