// One pre-norm decoder layer (Llama / Qwen2 / Qwen3 attention + SwiGLU MLP) over the 1 to 16 rows of a decode or
// verify step, in fp32 on CPU, as one op (product weights fp32, or bf16 where the decode router streams exact
// bf16 copies of them: thin_product.h).
//
// Such a step is memory-bound in its products, which the thin kernel streams near the read bandwidth; what is
// left is ~20 small torch ops per layer (norms, rotary, cache writes, attention, adds), each paying its dispatch
// and Python call on a few kB of data: measured on a 2-core AVX2 EPYC, ~25 ms of a ~60 ms SmolLM2-135M step.
// Here the same arithmetic runs in plain loops between the thin products. Reference: mtpkit/models/block.py
// (DecoderLayer with a KV cache), which tests/kernels/test_decode_layer.py compares this against.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <limits>
#include <utility>
#include <vector>

#include "thin_product.h"

namespace {

// y = x / rms(x) * w over each of M rows of length H (F.rms_norm's arithmetic: mean of squares in fp32)
void rms_norm(const float* x, const float* w, float* y, int64_t M, int64_t H, float eps) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * H;
    float ss = 0.f;
    for (int64_t i = 0; i < H; ++i) ss += xr[i] * xr[i];
    const float inv = 1.f / std::sqrt(ss / H + eps);
    for (int64_t i = 0; i < H; ++i) y[m * H + i] = xr[i] * inv * w[i];
  }
}

float dot(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float s = mtpkit::horizontal_sum(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// y += a * x
void axpy(float a, const float* x, float* y, int64_t n) {
  const __m256 av = _mm256_set1_ps(a);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += a * x[i];
}

// NeoX rotation of the first r channels of each of `heads` vectors of length D in v (row m's cos/sin: [r])
void rotate(float* v, const float* cos, const float* sin, int64_t heads, int64_t D, int64_t r) {
  const int64_t half = r / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* p = v + h * D;
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = p[i], x2 = p[i + half];
      p[i] = x1 * cos[i] - x2 * sin[i];
      p[i + half] = x2 * cos[i + half] + x1 * sin[i + half];
    }
  }
}

const float* data_or_null(const c10::optional<at::Tensor>& t) {
  return t.has_value() ? t->const_data_ptr<float>() : nullptr;
}

void add_bias(float* y, const float* b, int64_t M, int64_t N) {
  if (b == nullptr) return;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) y[m * N + n] += b[n];
}

// x [B, T, H] -> the layer's output [B, T, H]; writes this step's K/V at `slots` [B, T] of the caches
// [B, L, n_kv, D] and attends over their first S slots with the additive mask [B, 1, T, S].
at::Tensor decode_layer(const at::Tensor& x_in, const at::Tensor& input_norm, const at::Tensor& post_norm, double eps,
                        const at::Tensor& wq, const at::Tensor& wk, const at::Tensor& wv,
                        const c10::optional<at::Tensor>& bq, const c10::optional<at::Tensor>& bk,
                        const c10::optional<at::Tensor>& bv, const c10::optional<at::Tensor>& q_norm,
                        const c10::optional<at::Tensor>& k_norm, const at::Tensor& wo, const at::Tensor& w_gate,
                        const at::Tensor& w_up, const at::Tensor& w_down, const at::Tensor& cos_in,
                        const at::Tensor& sin_in, at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots_in,
                        const at::Tensor& mask_in, at::IntArrayRef blocks) {
  // the step's small inputs may come as views (a prefill's expanded slot grid): contiguous copies of those
  const at::Tensor x = x_in.contiguous(), cos = cos_in.contiguous(), sin = sin_in.contiguous(),
                   slots = slots_in.contiguous(), mask = mask_in.contiguous();
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "decode_layer: x must be an fp32 CPU tensor [B, T, H]");
  const int64_t B = x.size(0), T = x.size(1), H = x.size(2), M = B * T;
  TORCH_CHECK(M >= 1 && M <= mtpkit::kMaxRows, "decode_layer: 1 to ", mtpkit::kMaxRows, " rows (B * T), got ", M);
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.size(0) == B,
              "decode_layer: K/V caches must be contiguous [B, L, n_kv, D]");
  const int64_t L = k_cache.size(1), n_kv = k_cache.size(2), D = k_cache.size(3);
  const int64_t n_heads = wq.size(0) / D, I = w_gate.size(0), r = cos.size(-1), S = mask.size(-1);
  TORCH_CHECK(n_heads % n_kv == 0 && wk.size(0) == n_kv * D && wo.size(1) == n_heads * D && r % 2 == 0 && r <= D,
              "decode_layer: attention shapes do not match the caches");
  TORCH_CHECK(wq.size(1) == H && wk.size(1) == H && wv.size(0) == n_kv * D && wv.size(1) == H && wo.size(0) == H &&
                  w_gate.size(1) == H && w_up.sizes() == w_gate.sizes() && w_down.size(0) == H &&
                  w_down.size(1) == I && input_norm.numel() == H && post_norm.numel() == H &&
                  cos.numel() == M * r && sin.numel() == M * r,
              "decode_layer: weight shapes do not match x [B, T, H]");
  TORCH_CHECK(mask.numel() == M * S && S <= L && slots.numel() == M && slots.scalar_type() == at::kLong,
              "decode_layer: mask [B, 1, T, S] and slots [B, T] (int64) expected");
  using Tensors = std::initializer_list<const at::Tensor*>;
  for (const at::Tensor* t : Tensors{&input_norm, &post_norm, &cos, &sin, &k_cache, &v_cache, &mask})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(), "decode_layer: contiguous fp32 tensors only");
  for (const at::Tensor* t : Tensors{&wq, &wk, &wv, &wo, &w_gate, &w_up, &w_down})
    TORCH_CHECK((t->scalar_type() == at::kFloat || t->scalar_type() == at::kBFloat16) && t->is_contiguous(),
                "decode_layer: product weights must be contiguous fp32 or bf16");
  const int64_t QD = n_heads * D, KD = n_kv * D;
  using Optional = std::pair<const c10::optional<at::Tensor>*, int64_t>;  // an optional tensor, its size
  for (const Optional& t : std::initializer_list<Optional>{{&bq, QD}, {&bk, KD}, {&bv, KD}, {&q_norm, D}, {&k_norm, D}})
    TORCH_CHECK(!t.first->has_value() || ((*t.first)->scalar_type() == at::kFloat && (*t.first)->is_contiguous() &&
                                          (*t.first)->numel() == t.second),
                "decode_layer: biases and QK-norm weights must be contiguous fp32 of the projections' sizes");
  TORCH_CHECK(blocks.size() == 7 && std::all_of(blocks.begin(), blocks.end(), mtpkit::valid_block),
              "decode_layer: blocks: 1, 2 or 4 weight rows per pass for each of q, k, v, o, gate, up, down");
  const float e = static_cast<float>(eps);

  at::Tensor out = at::empty_like(x);
  std::vector<float> h(M * std::max(H, QD)), q(M * QD), k(M * KD), v(M * KD), attn(M * QD), gate(M * I),
      up(M * I);
  const float* xp = x.const_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();

  // attention block: norm, projections, QK-norm, rotary, cache write
  rms_norm(xp, input_norm.const_data_ptr<float>(), h.data(), M, H, e);
  mtpkit::thin_product(h.data(), wq, q.data(), M, blocks[0]);
  mtpkit::thin_product(h.data(), wk, k.data(), M, blocks[1]);
  mtpkit::thin_product(h.data(), wv, v.data(), M, blocks[2]);
  add_bias(q.data(), data_or_null(bq), M, QD);
  add_bias(k.data(), data_or_null(bk), M, KD);
  add_bias(v.data(), data_or_null(bv), M, KD);
  if (q_norm.has_value()) rms_norm(q.data(), q_norm->const_data_ptr<float>(), q.data(), M * n_heads, D, e);
  if (k_norm.has_value()) rms_norm(k.data(), k_norm->const_data_ptr<float>(), k.data(), M * n_kv, D, e);
  const float* cp = cos.const_data_ptr<float>();
  const float* sp = sin.const_data_ptr<float>();
  const int64_t* slot = slots.const_data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m)  // before any write: a refused call leaves the caches as they were
    TORCH_CHECK(slot[m] >= 0 && slot[m] < L, "decode_layer: cache slot ", slot[m], " outside [0, ", L, ")");
  float* kc = k_cache.mutable_data_ptr<float>();
  float* vc = v_cache.mutable_data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    rotate(q.data() + m * QD, cp + m * r, sp + m * r, n_heads, D, r);
    rotate(k.data() + m * KD, cp + m * r, sp + m * r, n_kv, D, r);
    const int64_t b = m / T, s = slot[m];
    std::copy_n(k.data() + m * KD, KD, kc + (b * L + s) * KD);
    std::copy_n(v.data() + m * KD, KD, vc + (b * L + s) * KD);
  }

  // softmax attention of each (row, head) over the first S slots of its row's cache (GQA: head / group)
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  const float* mp = mask.const_data_ptr<float>();
  const int64_t group = n_heads / n_kv;
  std::fill(attn.begin(), attn.end(), 0.f);
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, S * D));  // small work: one thread
  at::parallel_for(0, M * n_heads, grain, [&](int64_t i0, int64_t i1) {
    std::vector<float> p(S);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t m = i / n_heads, hd = i % n_heads, b = m / T, kvh = hd / group;
      const float* qv = q.data() + m * QD + hd * D;
      const float* kb = kc + b * L * KD + kvh * D;
      const float* vb = vc + b * L * KD + kvh * D;
      const float* row_mask = mp + m * S;
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t s = 0; s < S; ++s) {
        p[s] = row_mask[s] == -std::numeric_limits<float>::infinity() ? row_mask[s]
                                                                       : dot(qv, kb + s * KD, D) * scale + row_mask[s];
        top = std::max(top, p[s]);
      }
      float total = 0.f;
      float* o = attn.data() + m * QD + hd * D;
      for (int64_t s = 0; s < S; ++s) {
        if (p[s] == -std::numeric_limits<float>::infinity()) continue;
        const float w = std::exp(p[s] - top);
        total += w;
        axpy(w, vb + s * KD, o, D);
      }
      const float inv = 1.f / total;
      for (int64_t d = 0; d < D; ++d) o[d] *= inv;
    }
  });

  // output projection and residual, then the MLP block and its residual
  mtpkit::thin_product(attn.data(), wo, h.data(), M, blocks[3]);
  for (int64_t i = 0; i < M * H; ++i) op[i] = xp[i] + h[i];
  rms_norm(op, post_norm.const_data_ptr<float>(), h.data(), M, H, e);
  mtpkit::thin_product(h.data(), w_gate, gate.data(), M, blocks[4]);
  mtpkit::thin_product(h.data(), w_up, up.data(), M, blocks[5]);
  for (int64_t i = 0; i < M * I; ++i) gate[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
  mtpkit::thin_product(gate.data(), w_down, h.data(), M, blocks[6]);
  for (int64_t i = 0; i < M * H; ++i) op[i] += h[i];
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mtpkit_cpu, m) {
  m.def(
      "decode_layer(Tensor x, Tensor input_norm, Tensor post_norm, float eps, Tensor wq, Tensor wk, Tensor wv, "
      "Tensor? bq, Tensor? bk, Tensor? bv, Tensor? q_norm, Tensor? k_norm, Tensor wo, Tensor w_gate, Tensor w_up, "
      "Tensor w_down, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, Tensor mask, "
      "int[] blocks) -> Tensor");
  m.impl("decode_layer", c10::DispatchKey::CPU, TORCH_FN(decode_layer));
}
