// y[M, N] = x[M, K] . W[N, K]^T (+ b) for the few rows of a tree-verify step, on AVX2 + FMA.
//
// Why: a verify step multiplies 1-20 rows by every weight. BLAS / oneDNN GEMMs are built for many
// rows; at a few rows the step should cost what streaming the weight once costs. Here the weight
// is read in its own [out, in] layout (no copy). Up to 6 rows: 2 weight rows at a time against all
// of them in one pass (2 x 6 accumulators of 8 floats: 12 of the 16 ymm registers), the next 2
// weight rows prefetched meanwhile -- streaming the weight is the cost. 7+ rows (up to MAX_ROWS in
// rows_kernel.py): 3 weight rows against passes of up to 4 rows (3 x 4 accumulators, one load per
// 1.7 FMAs instead of 1.5), the next block prefetched evenly over all passes, so memory streams while
// every pass computes (the 2 x 6 layout prefetched in the first pass only and left the memory idle
// during the others: whole forwards 1.09-1.18x this one's time at 7-16 tokens,
// benchmarks/results/measurements/cpu-rows-kernel-s16.json).
//
// Every output y[m, n] is one dot product accumulated in the same order (8 lanes over k, then a
// fixed horizontal sum, then the k tail) whatever M is and whichever block computes it: a row's
// result does not depend on how many rows share the call (batch-invariant, bit for bit).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {

inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  __m128 sh = _mm_movehdup_ps(lo);
  __m128 s = _mm_add_ps(lo, sh);
  sh = _mm_movehl_ps(sh, s);
  s = _mm_add_ss(s, sh);
  return _mm_cvtss_f32(s);
}

// NB weight rows (w, stride K) x MB input rows (x, stride K) -> y (stride N); PF: prefetch the
// next NB weight rows (only on the first pass over a block, which streams the weight from memory).
template <int NB, int MB, bool PF>
inline void tile(const float* x, int64_t K, const float* w, float* y, int64_t N) {
  __m256 acc[NB][MB];
  for (int i = 0; i < NB; ++i)
    for (int j = 0; j < MB; ++j) acc[i][j] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    if (PF && (k & 15) == 0)
      for (int i = 0; i < NB; ++i) _mm_prefetch(reinterpret_cast<const char*>(w + (NB + i) * K + k), _MM_HINT_T0);
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
      for (int64_t t = k; t < K; ++t) s += w[i * K + t] * x[j * K + t];
      y[j * N + i] = s;
    }
}

// one tile of ``rows`` (1..6) input rows
template <int NB, bool PF>
inline void tile_rows(int64_t rows, const float* x, int64_t K, const float* w, float* y, int64_t N) {
  switch (rows) {
    case 1: tile<NB, 1, PF>(x, K, w, y, N); break;
    case 2: tile<NB, 2, PF>(x, K, w, y, N); break;
    case 3: tile<NB, 3, PF>(x, K, w, y, N); break;
    case 4: tile<NB, 4, PF>(x, K, w, y, N); break;
    case 5: tile<NB, 5, PF>(x, K, w, y, N); break;
    default: tile<NB, 6, PF>(x, K, w, y, N); break;
  }
}

// every input row against NB weight rows, in passes of at most 6 rows of equal size (8 rows: 4 + 4,
// not 6 + 2 -- a 2-row tile has too few accumulators to hide the FMA latency); the first pass
// streams the weight and prefetches the next block, the others find it in cache
template <int NB>
void block(const float* x, int64_t M, int64_t K, const float* w, float* y, int64_t N) {
  const int64_t passes = (M + 5) / 6, base = M / passes, extra = M % passes;
  int64_t m = 0;
  for (int64_t p = 0; p < passes; ++p) {
    const int64_t rows = base + (p < extra ? 1 : 0);
    if (p == 0) tile_rows<NB, true>(rows, x, K, w, y, N);
    else tile_rows<NB, false>(rows, x + m * K, K, w, y + m * N, N);
    m += rows;
  }
}

template <int NB>
void run(const float* x, int64_t M, int64_t K, const float* w, float* y, int64_t N) {
  const int64_t blocks = N / NB;
  at::parallel_for(0, blocks, 8, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) block<NB>(x, M, K, w + b * NB * K, y + b * NB, N);
  });
  for (int64_t n = blocks * NB; n < N; ++n) block<1>(x, M, K, w + n * K, y + n, N);
}

// 7+ rows: NB weight rows x MB input rows, prefetching ``lines`` cache lines from ``pf`` spread
// evenly over the k loop (each pass of a block fetches its share of the next block). Not inlined:
// inlined into block_many's switch, gcc 12 compiled the 3 x 3 tile 1.5x slower (9 rows: 3 + 3 + 3).
// Its loop repeats ``tile``'s on purpose: one template with a prefetch-policy argument for both made
// gcc 12 compile the 1-6-row path 6-49% slower on lm_head, so the two stay apart (both:
// benchmarks/results/measurements/cpu-rows-kernel-s16-codegen.json).
template <int NB, int MB>
__attribute__((noinline)) void tile_spread(const float* x, int64_t K, const float* w, float* y, int64_t N, const char* pf, int64_t lines) {
  __m256 acc[NB][MB];
  for (int i = 0; i < NB; ++i)
    for (int j = 0; j < MB; ++j) acc[i][j] = _mm256_setzero_ps();
  const int64_t steps = K / 8;
  int64_t due = 0;
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    for (due += lines; due >= steps; due -= steps, pf += 64) _mm_prefetch(pf, _MM_HINT_T0);
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
      for (int64_t t = k; t < K; ++t) s += w[i * K + t] * x[j * K + t];
      y[j * N + i] = s;
    }
}

template <int NB>
inline void tile_spread_rows(int64_t rows, const float* x, int64_t K, const float* w, float* y, int64_t N,
                             const char* pf, int64_t lines) {
  switch (rows) {
    case 1: tile_spread<NB, 1>(x, K, w, y, N, pf, lines); break;
    case 2: tile_spread<NB, 2>(x, K, w, y, N, pf, lines); break;
    case 3: tile_spread<NB, 3>(x, K, w, y, N, pf, lines); break;
    default: tile_spread<NB, 4>(x, K, w, y, N, pf, lines); break;
  }
}

// every input row against NB weight rows in balanced passes of at most 4 rows (8 = 4 + 4, 7 = 4 + 3)
template <int NB>
void block_many(const float* x, int64_t M, int64_t K, const float* w, float* y, int64_t N) {
  const int64_t passes = (M + 3) / 4, base = M / passes, extra = M % passes;
  const int64_t lines = NB * K * 4 / 64;  // the next block: NB rows right after these
  const char* next = reinterpret_cast<const char*>(w + NB * K);
  int64_t m = 0;
  for (int64_t p = 0; p < passes; ++p) {
    const int64_t rows = base + (p < extra ? 1 : 0);
    const int64_t l0 = lines * p / passes, l1 = lines * (p + 1) / passes;
    tile_spread_rows<NB>(rows, x + m * K, K, w, y + m * N, N, next + 64 * l0, l1 - l0);
    m += rows;
  }
}

template <int NB>
void run_many(const float* x, int64_t M, int64_t K, const float* w, float* y, int64_t N) {
  const int64_t blocks = N / NB;
  at::parallel_for(0, blocks, 8, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) block_many<NB>(x, M, K, w + b * NB * K, y + b * NB, N);
  });
  for (int64_t n = blocks * NB; n < N; ++n) block<1>(x, M, K, w + n * K, y + n, N);
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
  if (M <= 6) run<2>(xp, M, K, wp, yp, N);
  else run_many<3>(xp, M, K, wp, yp, N);
  if (bias.has_value() && bias->defined()) y.add_(*bias);
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rows_linear", &rows_linear, "x @ W.T (+ b) for a few rows (tree verification)");
}
