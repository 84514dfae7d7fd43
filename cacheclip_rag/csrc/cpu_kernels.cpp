// Kernels for bf16 models on CPUs with AVX-512 BF16 (cacheclip_rag/cpu_kernels.py builds and checks them).
//
// packed_gemv: y[M, O] = x[M, I] W^T (a decode step's few rows) over oneDNN's prepacked bf16 weight, whose layout on AVX-512 is
//   [ceil(O/B)][ceil(I/2)][B][2] (B outputs a block, input pairs interleaved for vdpbf16ps; the block is one
//   contiguous stream): B = 64 for a weight packed for one row, 32 for many rows on AMX. cpu_kernels checks the
//   layout against oneDNN's own product for every weight.
// one_row_attention: one query row per head (GQA: each KV head's query heads together) over a bf16 cache,
//   flash-decoding style: (KV head, key range) work items with an online softmax, merged by log-sum-exp.
// positioned_attention: many query rows at given positions (a prefill's causal rows, or CacheClip's scattered
//   recompute rows), each over the keys up to its position. Keys are transposed by 16-key tiles and values
//   paired over two keys once a call, so scores and p V both run on vdpbf16ps; the online softmax runs over
//   64-key steps; the query heads of a KV head share every key load. p is rounded to bf16 for p V, as torch's
//   CPU flash attention does.
// silu_mul, rms_norm: a gated MLP's silu(gate) * up and an RMSNorm in one pass each over bf16 rows, rounding where
//   torch's ops round between them (transformers' Qwen2/Llama forwards), so only the order of a row's sum differs.
// All accumulate in float32 and round once to bf16, as oneDNN and sdpa do; only the order of sums differs.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <vector>

namespace {

inline __m512 bf16x16_to_f32(__m256i bits) {  // 16 bf16 values (their bit patterns) widened to float32
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 bf16x16_to_f32(const uint16_t* p) { return bf16x16_to_f32(_mm256_loadu_si256((const __m256i*)p)); }
inline __m512 bf16x16_to_f32(const uint16_t* p, __mmask16 m) {  // the first lanes of m; zeros past them
  return bf16x16_to_f32(_mm256_maskz_loadu_epi16(m, p));
}

inline float bf16_to_f32(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, as at::BFloat16
  return c10::BFloat16(f).x;
}

// exp(x) for x <= 0 (softmax arguments), to ~2 ulp: 2^n * p(r) with r in [-ln2/2, ln2/2]
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-103.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// r[i][j] <- r[j][i] for a 16 x 16 block of 32-bit elements
inline void transpose16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int h = 0; h < 16; h += 8)
    for (int i = 0; i < 4; ++i) {
      t[h + i] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0x88);
      t[h + i + 4] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0xdd);
    }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
  }
}

// rows r0..r0+R-1 of x against one block of C * 16 outputs: R x C accumulators, the block's weights loaded once a pair
template <int R, int C>
inline void block_product(const uint16_t* w, const uint32_t* xp, int64_t pairs, int64_t r0, float* out) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p, w += 32 * C) {
    __m512bh wc[C];
    for (int c = 0; c < C; ++c) wc[c] = (__m512bh)_mm512_loadu_si512(w + 32 * c);
    for (int r = 0; r < R; ++r) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)xp[(r0 + r) * pairs + p]);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], wc[c], xb);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm512_store_ps(out + r * 16 * C + 16 * c, acc[r][c]);
}

template <int C>
inline void rows_product(const uint16_t* w, const uint32_t* xp, int64_t pairs, int64_t r0, int64_t nr, float* out) {
  switch (nr) {
    case 1: block_product<1, C>(w, xp, pairs, r0, out); break;
    case 2: block_product<2, C>(w, xp, pairs, r0, out); break;
    case 3: block_product<3, C>(w, xp, pairs, r0, out); break;
    default: block_product<4, C>(w, xp, pairs, r0, out); break;
  }
}

// x [M, in_features] bf16 times the weight oneDNN packed for [out_features, in_features] at weight_address in
// blocks of `block` (32 or 64) outputs; the weight's width is given, not read from x: a wrong-width x is refused
// rather than read past the weight.
at::Tensor packed_gemv(const at::Tensor& x, int64_t weight_address, int64_t in_features, int64_t out_features,
                       const std::optional<at::Tensor>& bias, int64_t block) {
  TORCH_CHECK(x.device().is_cpu() && (!bias.has_value() || bias->device().is_cpu()),
              "packed_gemv takes CPU tensors");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.is_contiguous(),
              "packed_gemv takes contiguous bf16 rows [M, in_features]");
  TORCH_CHECK(in_features > 0 && in_features % 2 == 0 && out_features > 0 && weight_address != 0,
              "packed_gemv: a packed weight of even width and at least one output");
  TORCH_CHECK(block == 32 || block == 64, "packed_gemv: a block of 32 or 64 outputs, got ", block);
  TORCH_CHECK(x.size(1) == in_features, "packed_gemv: rows of width ", x.size(1), " for a weight of width ",
              in_features);
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() &&
              bias->numel() == out_features), "packed_gemv: the bias must be bf16 [out_features]");
  if (x.size(0) == 0) return at::empty({0, out_features}, x.options());  // as F.linear: no rows, no output
  const int64_t rows = x.size(0), pairs = x.size(1) / 2, blocks = (out_features + block - 1) / block;
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(x.data_ptr());
  const uint16_t* bp = bias.has_value() ? reinterpret_cast<const uint16_t*>(bias->data_ptr()) : nullptr;
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(weight_address);
  auto y = at::empty({rows, out_features}, x.options());
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float out[4 * 64];
    for (int64_t b = begin; b < end; ++b) {
      const uint16_t* w = wp + b * pairs * 2 * block;
      const int64_t n = std::min<int64_t>(block, out_features - b * block);
      for (int64_t r0 = 0; r0 < rows; r0 += 4) {  // the block is re-read from cache for rows past 4
        const int64_t nr = std::min<int64_t>(4, rows - r0);
        if (block == 64) rows_product<4>(w, xp, pairs, r0, nr, out);
        else rows_product<2>(w, xp, pairs, r0, nr, out);
        for (int64_t r = 0; r < nr; ++r)
          for (int64_t c = 0; c < n; ++c) {
            float value = out[r * block + c];
            if (bp != nullptr) value += bf16_to_f32(bp[b * block + c]);
            yp[(r0 + r) * out_features + b * block + c] = f32_to_bf16(value);
          }
      }
    }
  });
  return y;
}

inline __m512 round_bf16(__m512 v) {  // to the nearest bf16 (even on ties) and back: torch's rounding of a bf16 op
  return bf16x16_to_f32((__m256i)_mm512_cvtneps_pbh(v));
}

void check_rows(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kBFloat16 && t.is_contiguous() && t.dim() >= 1,
              what, " takes contiguous bf16 CPU tensors");
}

// silu(gate) * up, each op rounded to bf16 as torch's `act_fn(gate) * up` rounds: silu in float32 of the bf16 gate,
// rounded; times up in float32, rounded. silu(x) = x * sigmoid(x), sigmoid from exp(-|x|) (never overflows).
at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up) {
  check_rows(gate, "silu_mul");
  check_rows(up, "silu_mul");
  TORCH_CHECK(gate.sizes() == up.sizes(), "silu_mul: gate and up of one shape, got ", gate.sizes(), " and ", up.sizes());
  auto out = at::empty_like(gate);
  const uint16_t* g = reinterpret_cast<const uint16_t*>(gate.data_ptr());
  const uint16_t* u = reinterpret_cast<const uint16_t*>(up.data_ptr());
  uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t n = gate.numel();
  const __m512 one = _mm512_set1_ps(1.0f);
  auto step = [&](__m512 x, __m512 y) {
    const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));  // exp(-|x|) <= 1
    const __m512 d = _mm512_add_ps(one, e);  // in [1, 2]: 1/d by rcp14 and one Newton step (~1 ulp of float32)
    __m512 inv = _mm512_rcp14_ps(d);
    inv = _mm512_mul_ps(inv, _mm512_fnmadd_ps(d, inv, _mm512_set1_ps(2.0f)));
    const __mmask16 negative = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
    const __m512 sigmoid = _mm512_mask_mul_ps(inv, negative, e, inv);  // x < 0: e / (1 + e)
    return _mm512_mul_ps(round_bf16(_mm512_mul_ps(x, sigmoid)), y);
  };
  at::parallel_for(0, (n + 15) / 16, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t i = b * 16;
      if (i + 16 <= n) {
        _mm256_storeu_si256((__m256i*)(o + i), (__m256i)_mm512_cvtneps_pbh(step(bf16x16_to_f32(g + i), bf16x16_to_f32(u + i))));
      } else {
        const __mmask16 m = (__mmask16)((1u << (n - i)) - 1);
        _mm256_mask_storeu_epi16(o + i, m, (__m256i)_mm512_cvtneps_pbh(step(bf16x16_to_f32(g + i, m),
                                                                             bf16x16_to_f32(u + i, m))));
      }
    }
  });
  return out;
}

// An RMSNorm over the last dimension as transformers' Qwen2/Llama RMSNorm computes it: x in float32 times
// 1/sqrt(mean(x^2) + eps), rounded to bf16, times the bf16 weight, rounded again.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm");
  check_rows(weight, "rms_norm");
  const int64_t width = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == width && width > 0,
              "rms_norm: a weight of the rows' width ", width, ", got ", weight.sizes());
  auto out = at::empty_like(x);
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t rows = x.numel() / width, full = width / 16 * 16;
  const __mmask16 tail = (__mmask16)((1u << (width - full)) - 1);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint16_t* row = xp + r * width;
      __m512 acc = _mm512_setzero_ps();
      for (int64_t i = 0; i < full; i += 16) {
        const __m512 v = bf16x16_to_f32(row + i);
        acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));  // x^2 rounded, then summed, as pow(2).mean()
      }
      if (tail) {
        const __m512 v = bf16x16_to_f32(row + full, tail);
        acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
      }
      const float variance = _mm512_reduce_add_ps(acc) / (float)width;
      const __m512 scale = _mm512_set1_ps(1.0f / std::sqrt(variance + (float)eps));
      uint16_t* dst = op + r * width;
      for (int64_t i = 0; i < full; i += 16) {
        const __m512 v = _mm512_mul_ps(bf16x16_to_f32(wp + i), round_bf16(_mm512_mul_ps(bf16x16_to_f32(row + i), scale)));
        _mm256_storeu_si256((__m256i*)(dst + i), (__m256i)_mm512_cvtneps_pbh(v));
      }
      if (tail) {
        const __m512 v = _mm512_mul_ps(bf16x16_to_f32(wp + full, tail),
                                       round_bf16(_mm512_mul_ps(bf16x16_to_f32(row + full, tail), scale)));
        _mm256_mask_storeu_epi16(dst + full, tail, (__m256i)_mm512_cvtneps_pbh(v));
      }
    }
  });
  return out;
}

constexpr int64_t kTile = 128;  // keys an online-softmax step (a multiple of 16)

// One (KV head, key range) work item: running max m[g], sum l[g] and unnormalised output acc[g][D] of its group.
template <int CH>  // CH = D / 16
void attend_range(const uint16_t* q, const uint16_t* keys, const uint16_t* values, int64_t lo, int64_t hi,
                  int64_t group, float scale, float* m, float* l, float* acc, float* scores) {
  constexpr int64_t dim = CH * 16, pairs = dim / 2;
  const uint32_t* qpairs = reinterpret_cast<const uint32_t*>(q);
  std::fill(m, m + group, -std::numeric_limits<float>::infinity());
  std::fill(l, l + group, 0.0f);
  std::fill(acc, acc + group * dim, 0.0f);
  for (int64_t t0 = lo; t0 < hi; t0 += kTile) {
    const int64_t len = std::min(kTile, hi - t0);
    // scores: 16 keys a lane-vector. The tile's keys are transposed once into input pairs x 16 keys, then each
    // query head's pair is broadcast against them: no horizontal sums.
    for (int64_t j = 0; j < len; j += 16) {
      const int64_t n = std::min<int64_t>(16, len - j);
      alignas(64) uint32_t kt[pairs][16];
      for (int64_t part = 0; part < pairs; part += 16) {
        __m512i r[16];
        for (int64_t i = 0; i < 16; ++i)
          r[i] = i < n ? _mm512_loadu_si512(keys + (t0 + j + i) * dim + 2 * part) : _mm512_setzero_si512();
        transpose16(r);
        for (int64_t i = 0; i < 16; ++i) _mm512_store_si512(kt[part + i], r[i]);
      }
      for (int64_t g0 = 0; g0 < group; g0 += 8) {  // 8 query heads at once: independent dot-product chains
        const int64_t gn = std::min<int64_t>(8, group - g0);
        __m512 a[8];
        for (int64_t g = 0; g < 8; ++g) a[g] = _mm512_setzero_ps();
        for (int64_t d = 0; d < pairs; ++d) {
          const __m512bh k = (__m512bh)_mm512_load_si512(kt[d]);
          for (int64_t g = 0; g < gn; ++g)
            a[g] = _mm512_dpbf16_ps(a[g], k, (__m512bh)_mm512_set1_epi32((int)qpairs[(g0 + g) * pairs + d]));
        }
        for (int64_t g = 0; g < gn; ++g)
          _mm512_storeu_ps(scores + (g0 + g) * kTile + j, _mm512_mul_ps(a[g], _mm512_set1_ps(scale)));
      }
    }
    for (int64_t g = 0; g < group; ++g) {  // online softmax over the tile
      float* sg = scores + g * kTile;
      const float new_max = std::max(m[g], *std::max_element(sg, sg + len));
      const float rescale = std::exp(m[g] - new_max);  // 0 on the first tile (m = -inf)
      __m512 total = _mm512_setzero_ps();
      for (int64_t t = 0; t < len; t += 16) {
        const __mmask16 live = (__mmask16)(len - t >= 16 ? 0xFFFF : (1u << (len - t)) - 1);
        const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, sg + t), _mm512_set1_ps(new_max)));
        _mm512_mask_storeu_ps(sg + t, live, e);
        total = _mm512_add_ps(total, _mm512_maskz_mov_ps(live, e));
      }
      l[g] = l[g] * rescale + _mm512_reduce_add_ps(total);
      m[g] = new_max;
      for (int64_t c = 0; c < dim; ++c) acc[g * dim + c] *= rescale;
    }
    // acc += p V: up to 16 accumulator registers, so query heads in passes of 16 / CH
    constexpr int64_t per_pass = CH >= 16 ? 1 : 16 / CH;
    for (int64_t g0 = 0; g0 < group; g0 += per_pass) {
      const int64_t gn = std::min(per_pass, group - g0);
      __m512 a[per_pass][CH];
      for (int64_t g = 0; g < gn; ++g)
        for (int c = 0; c < CH; ++c) a[g][c] = _mm512_loadu_ps(acc + (g0 + g) * dim + 16 * c);
      for (int64_t t = 0; t < len; ++t) {
        const uint16_t* v = values + (t0 + t) * dim;
        __m512 vc[CH];
        for (int c = 0; c < CH; ++c) vc[c] = bf16x16_to_f32(v + 16 * c);
        for (int64_t g = 0; g < gn; ++g) {
          const __m512 p = _mm512_set1_ps(scores[(g0 + g) * kTile + t]);
          for (int c = 0; c < CH; ++c) a[g][c] = _mm512_fmadd_ps(p, vc[c], a[g][c]);
        }
      }
      for (int64_t g = 0; g < gn; ++g)
        for (int c = 0; c < CH; ++c) _mm512_storeu_ps(acc + (g0 + g) * dim + 16 * c, a[g][c]);
    }
  }
}

// query [H, D] bf16 contiguous; key/value [KV, N, D] bf16 with dense rows (the heads may be strided: a cache
// slice); D one of 32, 64, 128. Returns [H, D] bf16.
at::Tensor one_row_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, double scaling) {
  TORCH_CHECK(query.device().is_cpu() && key.device().is_cpu() && value.device().is_cpu(),
              "one_row_attention takes CPU tensors");
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 && key.scalar_type() == at::kBFloat16 &&
              value.scalar_type() == at::kBFloat16, "one_row_attention takes bf16 tensors");
  TORCH_CHECK(query.dim() == 2 && key.dim() == 3 && value.dim() == 3 && query.is_contiguous(), "bad shapes");
  const int64_t heads = query.size(0), dim = query.size(1), kv_heads = key.size(0), rows = key.size(1);
  // kv_heads first: a zero would divide by zero below (SIGFPE, no exception)
  TORCH_CHECK(kv_heads > 0 && heads > 0 && (dim == 32 || dim == 64 || dim == 128) && heads % kv_heads == 0 && rows > 0,
              "unsupported shape: heads ", heads, ", kv heads ", kv_heads, ", width ", dim, ", keys ", rows);
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1 && key.stride(1) == dim && value.stride(1) == dim &&
              value.size(0) == kv_heads && value.size(1) == rows && value.size(2) == dim && key.size(2) == dim,
              "keys and values need dense rows of the query's width");
  const int64_t group = heads / kv_heads;
  const int64_t threads = at::get_num_threads();
  const int64_t splits = std::max<int64_t>(1, std::min<int64_t>((threads + kv_heads - 1) / kv_heads,
                                                                (rows + 4 * kTile - 1) / (4 * kTile)));
  std::vector<float> maxes(kv_heads * splits * group), sums(kv_heads * splits * group),
      accs(kv_heads * splits * group * dim);
  const uint16_t* qp = reinterpret_cast<const uint16_t*>(query.data_ptr());
  const uint16_t* kp = reinterpret_cast<const uint16_t*>(key.data_ptr());
  const uint16_t* vp = reinterpret_cast<const uint16_t*>(value.data_ptr());
  const float scale = static_cast<float>(scaling);
  at::parallel_for(0, kv_heads * splits, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(group * kTile);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / splits, s = item % splits;
      const int64_t lo = rows * s / splits, hi = rows * (s + 1) / splits;
      auto run = dim == 32 ? attend_range<2> : dim == 64 ? attend_range<4> : attend_range<8>;
      run(qp + h * group * dim, kp + h * key.stride(0), vp + h * value.stride(0), lo, hi, group, scale,
          maxes.data() + item * group, sums.data() + item * group, accs.data() + item * group * dim, scores.data());
    }
  });
  auto out = at::empty({heads, dim}, query.options());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  std::vector<float> merged(dim);
  for (int64_t h = 0; h < kv_heads; ++h) {  // merge the key ranges by log-sum-exp
    for (int64_t g = 0; g < group; ++g) {
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t s = 0; s < splits; ++s) top = std::max(top, maxes[(h * splits + s) * group + g]);
      std::fill(merged.begin(), merged.end(), 0.0f);
      float total = 0.0f;
      for (int64_t s = 0; s < splits; ++s) {
        const int64_t item = h * splits + s;
        const float w = std::exp(maxes[item * group + g] - top);
        total += sums[item * group + g] * w;
        for (int64_t c = 0; c < dim; ++c) merged[c] += accs[(item * group + g) * dim + c] * w;
      }
      for (int64_t c = 0; c < dim; ++c) op[(h * group + g) * dim + c] = f32_to_bf16(merged[c] / total);
    }
  }
  return out;
}

constexpr int KT = 64;  // keys an online-softmax step of the many-row attention (4 x 16)
constexpr int QB = 4;   // query rows a work item takes (times the group's heads: at most 32 rows of scores)

// scores of R query rows (combos) against one 16-key tile of transposed keys, masked by position
template <int P, int R>
inline void score_rows(const uint32_t* k, const uint32_t* const* q32, const int64_t* qpos, __m512i keyidx, float scale,
                       float (*s)[KT], int tile) {
  __m512 a[R];
  for (int j = 0; j < R; ++j) a[j] = _mm512_setzero_ps();
  for (int d = 0; d < P; ++d) {
    const __m512bh kv = (__m512bh)_mm512_loadu_si512(k + d * 16);
    for (int j = 0; j < R; ++j) a[j] = _mm512_dpbf16_ps(a[j], kv, (__m512bh)_mm512_set1_epi32((int)q32[j][d]));
  }
  for (int j = 0; j < R; ++j) {
    const __mmask16 visible = _mm512_cmple_epi32_mask(keyidx, _mm512_set1_epi32((int)qpos[j]));
    _mm512_store_ps(s[j] + tile * 16, _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), visible,
                                                          _mm512_mul_ps(a[j], _mm512_set1_ps(scale))));
  }
}

// acc[j] += sum over key pairs of p[j] (bf16 pairs) x V (pairs interleaved over two keys), for R rows
template <int CH, int R>
inline void value_rows(const uint32_t* v, int pairs, const uint16_t (*pb)[KT], float (*acc)[CH * 16]) {
  __m512 a[R][CH];
  for (int j = 0; j < R; ++j)
    for (int c = 0; c < CH; ++c) a[j][c] = _mm512_load_ps(acc[j] + 16 * c);
  for (int u = 0; u < pairs; ++u, v += CH * 16) {
    __m512bh vv[CH];
    for (int c = 0; c < CH; ++c) vv[c] = (__m512bh)_mm512_loadu_si512(v + c * 16);
    for (int j = 0; j < R; ++j) {
      const __m512bh pp = (__m512bh)_mm512_set1_epi32((int)reinterpret_cast<const uint32_t*>(pb[j])[u]);
      for (int c = 0; c < CH; ++c) a[j][c] = _mm512_dpbf16_ps(a[j][c], vv[c], pp);
    }
  }
  for (int j = 0; j < R; ++j)
    for (int c = 0; c < CH; ++c) _mm512_store_ps(acc[j] + 16 * c, a[j][c]);
}

// kt: [N/16][D/2][16] uint32 (key pairs transposed by 16-key tile); vp: [N/2][D/16][16 x 2] (value pairs
// interleaved over two keys). Rows of query q[i] (head-major [H][M][D]) at positions pos[i].
template <int CH>
void attend_block(const uint16_t* qrows /* [n_rows][D], each a (head,row) combo */, const int64_t* qpos, int n_rows,
                  const uint32_t* kt, const uint32_t* vp, int64_t nkeys, float scale, uint16_t* const* outs) {
  constexpr int D = CH * 16, P = D / 2;
  // per combo state
  float m[32], l[32];
  alignas(64) float acc[32][D];
  int64_t last = 0;
  for (int r = 0; r < n_rows; ++r) { m[r] = -INFINITY; l[r] = 0; std::fill(acc[r], acc[r] + D, 0.0f); last = std::max(last, qpos[r]); }
  const int64_t end = std::min<int64_t>(nkeys, last + 1);
  const uint32_t* q32[32];
  for (int r = 0; r < n_rows; ++r) q32[r] = reinterpret_cast<const uint32_t*>(qrows + (int64_t)r * D);
  alignas(64) float s[32][KT];
  alignas(64) uint16_t pb[32][KT];
  for (int64_t t0 = 0; t0 < end; t0 += KT) {
    const int64_t len = std::min<int64_t>(KT, end - t0);
    const int tiles = (int)((len + 15) / 16);
    // scores, 4 combos at a time x 16 keys
    for (int tile = 0; tile < tiles; ++tile) {
      const uint32_t* k = kt + ((t0 / 16) + tile) * (int64_t)P * 16;
      const __m512i keyidx = _mm512_add_epi32(_mm512_set1_epi32((int)(t0 + tile * 16)),
                                              _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
      for (int r0 = 0; r0 < n_rows; r0 += 4) {
        switch (std::min(4, n_rows - r0)) {
          case 1: score_rows<P, 1>(k, q32 + r0, qpos + r0, keyidx, scale, &s[r0], tile); break;
          case 2: score_rows<P, 2>(k, q32 + r0, qpos + r0, keyidx, scale, &s[r0], tile); break;
          case 3: score_rows<P, 3>(k, q32 + r0, qpos + r0, keyidx, scale, &s[r0], tile); break;
          default: score_rows<P, 4>(k, q32 + r0, qpos + r0, keyidx, scale, &s[r0], tile); break;
        }
      }
    }
    // online softmax over the step
    for (int r = 0; r < n_rows; ++r) {
      __m512 mx = _mm512_set1_ps(-INFINITY);
      for (int tile = 0; tile < tiles; ++tile) mx = _mm512_max_ps(mx, _mm512_load_ps(s[r] + tile * 16));
      const float tmax = _mm512_reduce_max_ps(mx);
      if (tmax == -INFINITY) { for (int tile = 0; tile < tiles; ++tile) _mm256_store_si256((__m256i*)(pb[r] + tile * 16), _mm256_setzero_si256()); continue; }
      const float nm = std::max(m[r], tmax);
      const float rescale = std::exp(m[r] - nm);
      __m512 tot = _mm512_setzero_ps();
      for (int tile = 0; tile < tiles; ++tile) {
        __m512 e = exp512(_mm512_sub_ps(_mm512_load_ps(s[r] + tile * 16), _mm512_set1_ps(nm)));
        const __m256bh eb = _mm512_cvtneps_pbh(e);
        _mm256_store_si256((__m256i*)(pb[r] + tile * 16), (__m256i)eb);
        tot = _mm512_add_ps(tot, e);
      }
      l[r] = l[r] * rescale + _mm512_reduce_add_ps(tot);
      m[r] = nm;
      if (rescale != 1.0f) { const __m512 rs = _mm512_set1_ps(rescale); for (int c = 0; c < CH; ++c) _mm512_store_ps(acc[r] + 16 * c, _mm512_mul_ps(_mm512_load_ps(acc[r] + 16 * c), rs)); }
    }
    // acc += p V over key pairs, RB combos at a time (RB x CH <= 16 accumulators, kept in registers)
    constexpr int RB = CH <= 4 ? 4 : 2;
    const int pairs = (int)((tiles * 16) / 2);
    const uint32_t* v = vp + (t0 / 2) * (int64_t)CH * 16;
    for (int r0 = 0; r0 < n_rows; r0 += RB) {
      switch (std::min(RB, n_rows - r0)) {
        case 1: value_rows<CH, 1>(v, pairs, &pb[r0], &acc[r0]); break;
        case 2: value_rows<CH, 2>(v, pairs, &pb[r0], &acc[r0]); break;
        case 3: value_rows<CH, 3>(v, pairs, &pb[r0], &acc[r0]); break;
        default: value_rows<CH, RB>(v, pairs, &pb[r0], &acc[r0]); break;
      }
    }
  }
  for (int r = 0; r < n_rows; ++r) {
    const float inv = l[r] > 0 ? 1.0f / l[r] : 0.0f;
    for (int c = 0; c < D; ++c) outs[r][c] = f32_to_bf16(acc[r][c] * inv);
  }
}

// query [H, M, D]; positions [M] (key j visible to row i iff j <= positions[i]); key/value [KV, N, D] dense rows.
at::Tensor positioned_attention(const at::Tensor& query, const at::Tensor& positions, const at::Tensor& key,
                                const at::Tensor& value, double scaling) {
  TORCH_CHECK(query.device().is_cpu() && key.device().is_cpu() && value.device().is_cpu() && positions.device().is_cpu(),
              "positioned_attention takes CPU tensors");
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 && key.scalar_type() == at::kBFloat16 &&
              value.scalar_type() == at::kBFloat16 && positions.scalar_type() == at::kLong, "bf16 tensors, int64 positions");
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && value.dim() == 3 && query.is_contiguous() &&
              positions.is_contiguous() && positions.dim() == 1 && positions.numel() == query.size(1), "bad shapes");
  const int64_t H = query.size(0), M = query.size(1), D = query.size(2), KV = key.size(0), N = key.size(1);
  // KV first: a zero would divide by zero below (SIGFPE, no exception)
  TORCH_CHECK(KV > 0 && H > 0 && (D == 32 || D == 64 || D == 128) && H % KV == 0 && H / KV <= 32 && N > 0,
              "unsupported shape: heads ", H, ", kv heads ", KV, ", width ", D, ", keys ", N);
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1 && key.stride(1) == D && value.stride(1) == D &&
              value.size(0) == KV && value.size(1) == N && key.size(2) == D && value.size(2) == D,
              "keys and values need dense rows of the query's width");
  const int64_t G = H / KV, P = D / 2, NT = (N + 15) / 16, NP = NT * 8;
  const int64_t QR = std::max<int64_t>(1, std::min<int64_t>(QB, 32 / G));  // query rows a work item: <= 32 combos
  // transposed keys and paired values, per KV head (padded to whole 16-key tiles with zeros). Every element is
  // written below (the padding as zeros), so the buffers are not zero-filled first; the values are paired by
  // 16-lane widening, not element by element (before, the pack took 0.85 of the 3.7 ms of 32 query rows over
  // 4K keys)
  std::unique_ptr<uint32_t[]> kt(new uint32_t[KV * NT * P * 16]), vp(new uint32_t[KV * NP * (D / 16) * 16]);
  const uint16_t* kp = (const uint16_t*)key.data_ptr();
  const uint16_t* vsrc = (const uint16_t*)value.data_ptr();
  at::parallel_for(0, KV * NT, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t h = b / NT, tile = b % NT;
      for (int64_t part = 0; part < P; part += 16) {
        __m512i r[16];
        for (int i = 0; i < 16; ++i) {
          const int64_t row = tile * 16 + i;
          r[i] = row < N ? _mm512_loadu_si512(kp + h * key.stride(0) + row * D + 2 * part) : _mm512_setzero_si512();
        }
        transpose16(r);
        for (int i = 0; i < 16; ++i) _mm512_storeu_si512(&kt[((h * NT + tile) * P + part + i) * 16], r[i]);
      }
      // values: keys tile*16 .. +16 -> 8 pairs; pair u holds for chunk c: [v[2u][c*16+x], v[2u+1][c*16+x]] x
      for (int64_t u = tile * 8; u < tile * 8 + 8; ++u) {
        const int64_t ra = 2 * u, rb = 2 * u + 1;
        const uint16_t* a = vsrc + h * value.stride(0) + ra * D;
        const uint16_t* bb = vsrc + h * value.stride(0) + rb * D;
        for (int64_t c = 0; c < D / 16; ++c) {
          const __m512i lo = ra < N ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(a + c * 16)))
                                    : _mm512_setzero_si512();
          const __m512i hi = rb < N ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(bb + c * 16)))
                                    : _mm512_setzero_si512();
          _mm512_storeu_si512(&vp[((h * NP + u) * (D / 16) + c) * 16], _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
      }
    }
  });
  auto out = at::empty({M, H, D}, query.options());
  const uint16_t* qp = (const uint16_t*)query.data_ptr();
  const int64_t* pos = positions.data_ptr<int64_t>();
  uint16_t* op = (uint16_t*)out.data_ptr();
  const int64_t blocks = (M + QR - 1) / QR;
  // work: (kv head, row block), later row blocks first (they have more keys)
  const int64_t lanes = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), KV * blocks));
  at::parallel_for(0, lanes, 1, [&](int64_t l0, int64_t l1) {
   for (int64_t lane = l0; lane < l1; ++lane)
    for (int64_t w = lane; w < KV * blocks; w += lanes) {  // round robin: causal rows' costs differ
      const int64_t h = w % KV, blk = blocks - 1 - w / KV;
      const int64_t i0 = blk * QR, rn = std::min<int64_t>(QR, M - i0);
      // combos: g-major over the block's rows
      std::vector<uint16_t> qrows(G * rn * D);
      int64_t qpos[32];
      uint16_t* outs[32];
      for (int64_t g = 0; g < G; ++g)
        for (int64_t i = 0; i < rn; ++i) {
          const int64_t combo = g * rn + i;
          std::memcpy(&qrows[combo * D], qp + ((h * G + g) * M + i0 + i) * D, D * 2);
          // keys past N do not exist: the last tile's zero padding must stay masked for a row at or past N
          qpos[combo] = std::min<int64_t>(pos[i0 + i], N - 1);
          outs[combo] = op + ((i0 + i) * H + h * G + g) * D;
        }
      const uint32_t* keys_t = kt.get() + h * NT * P * 16;
      const uint32_t* values_p = vp.get() + h * NP * (D / 16) * 16;
      if (D == 64) attend_block<4>(qrows.data(), qpos, (int)(G * rn), keys_t, values_p, N, (float)scaling, outs);
      else if (D == 128) attend_block<8>(qrows.data(), qpos, (int)(G * rn), keys_t, values_p, N, (float)scaling, outs);
      else attend_block<2>(qrows.data(), qpos, (int)(G * rn), keys_t, values_p, N, (float)scaling, outs);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(cacheclip_cpu, m) {
  m.def("packed_gemv(Tensor x, int weight_address, int in_features, int out_features, Tensor? bias, int block=64) -> Tensor",
        &packed_gemv);
  m.def("one_row_attention(Tensor query, Tensor key, Tensor value, float scaling) -> Tensor", &one_row_attention);
  m.def("silu_mul(Tensor gate, Tensor up) -> Tensor", &silu_mul);
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &rms_norm);
  m.def("positioned_attention(Tensor query, Tensor positions, Tensor key, Tensor value, float scaling) -> Tensor",
        &positioned_attention);
}
