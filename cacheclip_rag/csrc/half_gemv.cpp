// A decode step's few float32 rows times a linear's weight kept in float16, widened on the fly (AVX2, FMA, F16C):
// the step reads every weight once, so it runs at the memory's speed, and 16-bit weights are half float32's bytes
// (cacheclip_rag/models/half_gemv.py builds and checks it; tests/test_half_gemv.py holds it to a reference).
//
// half_gemv: y[M, O] = x[M, I] W^T + b, x and y float32, W [O, I] float16 row-major, b float32. Groups of four
//   outputs over the threads; in a group each weight vector is widened once for up to four rows of x (a request's
//   step is one row; the server batches a few). Sums in float32.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <optional>

namespace {

inline __m256 half8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

// the sums of four 8-lane vectors, as one 4-lane vector (a[0]'s sum first)
inline __m128 sum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);
  const __m256 abcd = _mm256_hadd_ps(ab, cd);
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

// outputs o..o+C-1 (C = 2 or 4 whole rows of w) for rows r..r+R-1 of x: R x C accumulators, each weight vector
// widened once for all R rows
template <int R, int C>
inline void outputs_block(const uint16_t* w, int64_t width, const float* x, float* y, int64_t out_features,
                          const float* bias) {
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  const int64_t whole = width / 8 * 8;
  for (int64_t i = 0; i < whole; i += 8) {
    __m256 wc[C];
    for (int c = 0; c < C; ++c) wc[c] = half8(w + c * width + i);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * width + i);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(wc[c], xv, acc[r][c]);
    }
  }
  static_assert(C == 2 || C == 4, "two or four outputs a block");
  for (int r = 0; r < R; ++r) {
    alignas(16) float s[4];
    if constexpr (C == 4) _mm_store_ps(s, sum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
    else _mm_store_ps(s, sum4(acc[r][0], acc[r][1], _mm256_setzero_ps(), _mm256_setzero_ps()));
    for (int c = 0; c < C; ++c) {
      for (int64_t i = whole; i < width; ++i) s[c] += half_to_float(w[c * width + i]) * x[r * width + i];
      y[r * out_features + c] = s[c] + (bias != nullptr ? bias[c] : 0.0f);
    }
  }
}

// four outputs (o..o+3) for every row of x: four rows at a time on two outputs a pass (16 registers hold no
// more), the last one or two rows on all four
inline void four_outputs(const uint16_t* w, int64_t width, const float* x, int64_t rows, float* y,
                         int64_t out_features, const float* bias) {
  const float* b2 = bias != nullptr ? bias + 2 : nullptr;
  int64_t r = 0;
  for (; rows - r >= 3; r += std::min<int64_t>(4, rows - r)) {
    const float* xr = x + r * width;
    float* yr = y + r * out_features;
    if (rows - r >= 4) {
      outputs_block<4, 2>(w, width, xr, yr, out_features, bias);
      outputs_block<4, 2>(w + 2 * width, width, xr, yr + 2, out_features, b2);
    } else {
      outputs_block<3, 2>(w, width, xr, yr, out_features, bias);
      outputs_block<3, 2>(w + 2 * width, width, xr, yr + 2, out_features, b2);
    }
  }
  if (rows - r == 2) outputs_block<2, 4>(w, width, x + r * width, y + r * out_features, out_features, bias);
  if (rows - r == 1) outputs_block<1, 4>(w, width, x + r * width, y + r * out_features, out_features, bias);
}

// one output (a weight row) for one row of x: the last outputs when O is not a multiple of 4
inline float one_output(const uint16_t* w, int64_t width, const float* x) {
  __m256 acc = _mm256_setzero_ps();
  const int64_t whole = width / 8 * 8;
  for (int64_t i = 0; i < whole; i += 8) acc = _mm256_fmadd_ps(half8(w + i), _mm256_loadu_ps(x + i), acc);
  alignas(16) float s[4];
  _mm_store_ps(s, sum4(acc, _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()));
  float total = s[0];
  for (int64_t i = whole; i < width; ++i) total += half_to_float(w[i]) * x[i];
  return total;
}

at::Tensor half_gemv(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu() && (!bias.has_value() || bias->device().is_cpu()),
              "half_gemv takes CPU tensors");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "half_gemv takes contiguous float32 rows [M, in_features], got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(weight.scalar_type() == at::kHalf && weight.dim() == 2 && weight.is_contiguous(),
              "half_gemv takes a contiguous float16 weight [out_features, in_features], got ", weight.scalar_type(),
              " ", weight.sizes());
  const int64_t out_features = weight.size(0), width = weight.size(1), rows = x.size(0);
  TORCH_CHECK(x.size(1) == width, "half_gemv: rows of width ", x.size(1), " for a weight of width ", width);
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
              bias->dim() == 1 && bias->numel() == out_features), "half_gemv: the bias must be float32 [out_features]");
  auto y = at::empty({rows, out_features}, x.options());
  if (rows == 0 || out_features == 0) return y;  // as F.linear: no rows, no output
  if (width == 0) return bias.has_value() ? y.copy_(bias->expand({rows, out_features})) : y.zero_();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  const float* xp = x.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t groups = out_features / 4;
  at::parallel_for(0, groups, 16, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t o = g * 4;
      four_outputs(wp + o * width, width, xp, rows, yp + o, out_features, bp != nullptr ? bp + o : nullptr);
    }
  });
  for (int64_t o = groups * 4; o < out_features; ++o)
    for (int64_t r = 0; r < rows; ++r)
      yp[r * out_features + o] = one_output(wp + o * width, width, xp + r * width) + (bp != nullptr ? bp[o] : 0.0f);
  return y;
}

}  // namespace

TORCH_LIBRARY(cacheclip_half, m) {
  m.def("half_gemv(Tensor x, Tensor weight, Tensor? bias) -> Tensor", &half_gemv);
}
