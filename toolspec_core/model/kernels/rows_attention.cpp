// Attention of decode, tree-verify and prompt rows with one fixed order of arithmetic per row, on AVX2 + FMA.
//
// Why: greedy ToolSpec writes plain greedy's tokens only if a token's row is computed alike in a
// verify step (among the tree's rows, in one call) and in plain decoding (alone). torch's CPU
// attention and even its float32 matmul give a row other bits depending on the rows beside it
// (benchmarks/studies/attention_rows.py); a float32 model absorbs the ~1e-7 difference, a
// bfloat16 model rounds it into whole ulps and tips near-ties. Here a row's output is a function of
// its query and the keys / values it sees, in their logical order, and nothing else:
//
//   * the keys a row sees are the cached prefix (logical positions 0 .. prefix - 1) and then its
//     ancestors in the call down to itself (positions prefix, prefix + 1, ...): a decode row alone
//     and the same token's row in a verify step see the same sequence;
//   * they are taken in blocks of BK logical positions (block b: positions b * BK ..), so block
//     edges do not move with the call's shape; per block: each score a dot product in one order
//     (8 lanes over the head dimension, a fixed horizontal sum), the running maximum raised once,
//     the weights by one exp routine, the sum and the weighted values accumulated key by key;
//   * rows and heads are independent tasks; threads split tasks, never a row's sums.
//
// Inputs: q [n, H, D] float32 (contiguous), k and v [H_kv, S, D] float32 or bfloat16 (the cache as
// it is: widening bf16 to float32 is exact, so reading it in place gives the bits a float32 copy
// would, without copying the cache every layer; any strides but the last), parents [n] (a row's
// parent row in the call, -1 for none: it hangs off the prefix). A chain (each row the child of
// the one before: a prompt chunk, a single decode row) needs no per-row paths: row i's keys are
// logical positions 0 .. prefix + i, where they are stored.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "simd.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

constexpr int64_t BK = 16;  // keys a block, by logical position

// e^x for 8 floats (range reduction by ln 2 and a degree-6 polynomial, Cephes' expf): the same
// bits for the same input, in every build; x of -inf (or below -88) gives 0
inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-88.3762626647949f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(88.3762626647949f));
  __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  const __m256 z = _mm256_mul_ps(x, x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_add_ps(_mm256_fmadd_ps(y, z, x), _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(0x7f)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

inline float exp1(float x) { return _mm256_cvtss_f32(exp8(_mm256_set1_ps(x))); }

// 8 consecutive keys' / values' elements as float32 (bfloat16 widened exactly: its bits are the
// top half of a float32's)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// one row's G query heads (qh: G x D, scaled) over the keys key(0 .. last), D a multiple of 8
template <typename T, typename KeyAt>
void row_heads(const float* qh, int64_t G, int64_t D, int64_t last, KeyAt key_at, float* out) {
  const int64_t V = D / 8;
  std::vector<float> acc(G * D, 0.0f), m(G, -INFINITY), l(G, 0.0f);
  const T* ks[BK];
  const T* vs[BK];
  alignas(32) float s[BK];
  alignas(32) float p[BK];
  for (int64_t x0 = 0; x0 <= last; x0 += BK) {
    const int64_t cnt = std::min<int64_t>(BK, last - x0 + 1);
    for (int64_t t = 0; t < cnt; ++t) key_at(x0 + t, ks[t], vs[t]);
    for (int64_t h = 0; h < G; ++h) {
      const float* q = qh + h * D;
      float mb = -INFINITY;
      for (int64_t t = 0; t < cnt; ++t) {
        __m256 d = _mm256_setzero_ps();
        for (int64_t j = 0; j < V; ++j) d = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * j), load8(ks[t] + 8 * j), d);
        s[t] = hsum(d);
        mb = s[t] > mb ? s[t] : mb;
      }
      for (int64_t t = cnt; t < BK; ++t) s[t] = -INFINITY;
      float* a = acc.data() + h * D;
      if (mb > m[h]) {  // the running maximum rises: rescale what is summed so far
        const __m256 corr = _mm256_set1_ps(exp1(m[h] - mb));
        l[h] = l[h] * _mm256_cvtss_f32(corr);
        for (int64_t j = 0; j < V; ++j) _mm256_storeu_ps(a + 8 * j, _mm256_mul_ps(_mm256_loadu_ps(a + 8 * j), corr));
        m[h] = mb;
      }
      const __m256 mv = _mm256_set1_ps(m[h]);
      for (int64_t t = 0; t < BK; t += 8) _mm256_store_ps(p + t, exp8(_mm256_sub_ps(_mm256_load_ps(s + t), mv)));
      float lh = l[h];
      for (int64_t t = 0; t < cnt; ++t) {
        lh += p[t];
        const __m256 w = _mm256_set1_ps(p[t]);
        for (int64_t j = 0; j < V; ++j)
          _mm256_storeu_ps(a + 8 * j, _mm256_fmadd_ps(w, load8(vs[t] + 8 * j), _mm256_loadu_ps(a + 8 * j)));
      }
      l[h] = lh;
    }
  }
  for (int64_t h = 0; h < G; ++h) {
    const __m256 inv = _mm256_set1_ps(1.0f / l[h]);
    for (int64_t j = 0; j < V; ++j)
      _mm256_storeu_ps(out + h * D + 8 * j, _mm256_mul_ps(_mm256_loadu_ps(acc.data() + h * D + 8 * j), inv));
  }
}

// every (row, KV head) task of the call; ``paths`` empty for a chain
template <typename T>
void run_rows(const float* qp, const T* kp, const T* vp, float* op, int64_t n, int64_t H, int64_t G, int64_t D,
              int64_t Hkv, int64_t prefix, const std::vector<std::vector<int64_t>>& paths, int64_t ks0, int64_t ks1,
              int64_t vs0, int64_t vs1) {
  const bool chain = paths.empty();
  at::parallel_for(0, n * Hkv, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t i = t / Hkv, hk = t % Hkv;
      const T* kh = kp + hk * ks0;
      const T* vh = vp + hk * vs0;
      const int64_t* path = chain ? nullptr : paths[i].data();
      auto key_at = [&](int64_t x, const T*& kx, const T*& vx) {
        const int64_t at = (chain || x < prefix) ? x : prefix + path[x - prefix];
        kx = kh + at * ks1;
        vx = vh + at * vs1;
      };
      const int64_t last = prefix + (chain ? i : static_cast<int64_t>(paths[i].size()) - 1);
      row_heads<T>(qp + (i * H + hk * G) * D, G, D, last, key_at, op + (i * H + hk * G) * D);
    }
  });
}

}  // namespace

torch::Tensor rows_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                             const torch::Tensor& parents, int64_t prefix, double scale) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "rows_attention: CPU tensors only");
  TORCH_CHECK(q.scalar_type() == at::kFloat, "rows_attention: q float32 only");
  TORCH_CHECK(k.scalar_type() == v.scalar_type() && (k.scalar_type() == at::kFloat || k.scalar_type() == at::kBFloat16),
              "rows_attention: k / v float32 or bfloat16, both the same");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "rows_attention: q [n, H, D], k / v [H_kv, S, D]");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "rows_attention: k / v need a contiguous last dimension");
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2), Hkv = k.size(0), S = k.size(1);
  TORCH_CHECK(D % 8 == 0 && k.size(2) == D && v.size(2) == D && v.size(0) == Hkv && v.size(1) == S,
              "rows_attention: shapes do not match");
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "rows_attention: query heads must be a multiple of KV heads");
  TORCH_CHECK(parents.scalar_type() == at::kLong && parents.numel() == n, "rows_attention: parents [n] int64");
  TORCH_CHECK(prefix >= 0 && prefix + n <= S, "rows_attention: prefix + rows exceed the keys");
  const int64_t G = H / Hkv;
  const auto qs = (q * static_cast<float>(scale)).contiguous();  // [n, H, D]
  const auto par = parents.contiguous();
  const int64_t* pp = par.data_ptr<int64_t>();
  bool chain = true;
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(pp[i] < i && pp[i] >= -1, "rows_attention: a parent must come before its row");
    chain = chain && pp[i] == i - 1;
  }
  // a tree's rows: each one's path in the call, its ancestors from the root down, then itself
  std::vector<std::vector<int64_t>> paths(chain ? 0 : n);
  for (int64_t i = 0; i < static_cast<int64_t>(paths.size()); ++i) {
    for (int64_t r = i; r >= 0; r = pp[r]) paths[i].push_back(r);
    std::reverse(paths[i].begin(), paths[i].end());
  }
  auto out = torch::empty({n, H, D}, q.options());
  const float* qp = qs.data_ptr<float>();
  float* op = out.data_ptr<float>();
  if (k.scalar_type() == at::kFloat)
    run_rows<float>(qp, k.data_ptr<float>(), v.data_ptr<float>(), op, n, H, G, D, Hkv, prefix, paths, k.stride(0),
                    k.stride(1), v.stride(0), v.stride(1));
  else
    run_rows<at::BFloat16>(qp, k.data_ptr<at::BFloat16>(), v.data_ptr<at::BFloat16>(), op, n, H, G, D, Hkv, prefix,
                           paths, k.stride(0), k.stride(1), v.stride(0), v.stride(1));
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rows_attention", &rows_attention, "decode / tree-verify attention, a fixed order of arithmetic per row");
}
