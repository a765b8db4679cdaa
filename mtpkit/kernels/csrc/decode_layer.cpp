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

// exp(x) for 8 lanes of x <= 0 (scores less their maximum): x = n ln2 + r, |r| <= ln2 / 2, exp(r) by the minimax
// polynomial of Cephes' expf (S. L. Moshier, Cephes Math Library: its coefficients and two-part ln2), 2^n from the
// exponent bits (the layer's outputs match the modules' std::exp to 1e-5: tests/kernels/test_decode_layer.py); x
// below -87, where exp leaves fp32's normal range, gives ~1e-38.
inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  for (float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(c));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i pow2n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(pow2n));
}

// q . k_j for the 8 keys k_j = k + j * stride (j = 0..7), the 8 dot products reduced together (one horizontal
// reduction per 8 keys, not one per key)
inline __m256 dot8(const float* q, const float* k, int64_t stride, int64_t D) {
  __m256 acc[8];
  for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) {
    const __m256 qv = _mm256_loadu_ps(q + d);
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(k + j * stride + d), qv, acc[j]);
  }
  const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
  const __m256 w = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
  __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(u, w, 0x20), _mm256_permute2f128_ps(u, w, 0x31));
  if (d < D) {  // a head size that is not a multiple of 8: the last channels one key at a time
    alignas(32) float tail[8];
    _mm256_store_ps(tail, sums);
    for (int j = 0; j < 8; ++j)
      for (int64_t t = d; t < D; ++t) tail[j] += q[t] * k[j * stride + t];
    sums = _mm256_load_ps(tail);
  }
  return sums;
}

// o[0, D) += sum over j < n of w[j] * v_j (v_j = v + j * stride), slot by slot, the slots of weight 0 (hidden)
// skipped; 64 channels at a time held in registers (accumulated in memory, each slot waited on the last one's
// store: twice the time at 4k slots)
void weighted_sum(const float* w, const float* v, int64_t stride, int64_t n, int64_t D, float* o) {
  int64_t d0 = 0;
  for (; d0 + 64 <= D; d0 += 64) {
    __m256 acc[8];
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_loadu_ps(o + d0 + 8 * i);
    for (int64_t j = 0; j < n; ++j) {
      if (w[j] == 0.f) continue;
      const __m256 wj = _mm256_set1_ps(w[j]);
      const float* vj = v + j * stride + d0;
      for (int i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(wj, _mm256_loadu_ps(vj + 8 * i), acc[i]);
    }
    for (int i = 0; i < 8; ++i) _mm256_storeu_ps(o + d0 + 8 * i, acc[i]);
  }
  for (; d0 < D; ++d0)  // a head size that is not a multiple of 64: the rest channel by channel
    for (int64_t j = 0; j < n; ++j)
      if (w[j] != 0.f) o[d0] = std::fma(w[j], v[j * stride + d0], o[d0]);
}

constexpr int64_t kChunk = 128;  // cache slots per piece of the attention's work (a multiple of 8)

// Softmax attention of the step's queries over the first S slots of their batch row's cache (the additive mask
// [B, 1, T, S] hides the rest; GQA: head h reads kv head h / group), flash-decoding style: the work is split into
// (batch row, kv head, chunk of kChunk slots) pieces, so that each K/V row is read once for every query of the
// pieces' group (the T rows of a verify step and the heads that share the kv head), and both threads have work at
// batch 1; each piece keeps its queries' maximum, sum of exps and weighted sum of V, merged afterwards in chunk
// order. A query's result depends only on its own scores, never on the other rows of the step: a row verified
// among k + 1 computes what it computes alone.
void attend(const float* q, const float* kc, const float* vc, const float* mask, float* out, int64_t B, int64_t T,
            int64_t L, int64_t S, int64_t n_heads, int64_t n_kv, int64_t D) {
  const int64_t group = n_heads / n_kv, nq = T * group, chunks = (S + kChunk - 1) / kChunk;
  const int64_t QD = n_heads * D, KD = n_kv * D, pieces = B * n_kv * chunks;
  constexpr float kNeg = -std::numeric_limits<float>::infinity();
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  // per piece and query: the chunk's max score, sum of exp(score - max), and sum of exp(score - max) * v
  std::vector<float> top(pieces * nq), total(pieces * nq), acc(pieces * nq * D, 0.f);
  at::parallel_for(0, pieces, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> score(nq * kChunk), pad_k(8 * D);
    std::vector<__m256> best(nq);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t b = p / (n_kv * chunks), kvh = p / chunks % n_kv, c = p % chunks;
      const int64_t s0 = c * kChunk, n = std::min(kChunk, S - s0);
      const float* kb = kc + (b * L + s0) * KD + kvh * D;
      const float* vb = vc + (b * L + s0) * KD + kvh * D;
      // scores, 8 slots at a time for every query of the piece (the 8 keys stay in L1 between the queries): the
      // last 8 of the first S slots may be fewer, their keys then copied to a zero-padded block and the lanes past
      // S hidden, so that every slot's score is the same sum whatever S (a verify step's S is a decode step's plus
      // its rows)
      for (int64_t j = 0; j < n; j += 8) {
        const bool whole = j + 8 <= n;
        if (!whole) {
          std::fill(pad_k.begin(), pad_k.end(), 0.f);
          for (int64_t r = 0; r < n - j; ++r) std::copy_n(kb + (j + r) * KD, D, pad_k.data() + r * D);
        }
        for (int64_t i = 0; i < nq; ++i) {  // query i: row i / group of the step, head kvh * group + i % group
          const int64_t m = b * T + i / group;
          const float* row_mask = mask + m * S + s0 + j;
          alignas(32) float partial_mask[8];
          if (!whole) {
            std::fill(partial_mask, partial_mask + 8, kNeg);
            std::copy_n(row_mask, n - j, partial_mask);
          }
          const __m256 mk = _mm256_loadu_ps(whole ? row_mask : partial_mask);
          const float* qv = q + m * QD + (kvh * group + i % group) * D;
          const __m256 dots = whole ? dot8(qv, kb + j * KD, KD, D) : dot8(qv, pad_k.data(), D, D);
          // a hidden slot is -inf whatever its (possibly never written) K holds
          const __m256 v = _mm256_blendv_ps(_mm256_fmadd_ps(dots, _mm256_set1_ps(scale), mk), _mm256_set1_ps(kNeg),
                                            _mm256_cmp_ps(mk, _mm256_set1_ps(kNeg), _CMP_EQ_OQ));
          _mm256_storeu_ps(score.data() + i * kChunk + j, v);
          best[i] = j ? _mm256_max_ps(best[i], v) : v;
        }
      }
      for (int64_t i = 0; i < nq; ++i) {
        float* sc = score.data() + i * kChunk;
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, best[i]);
        const float hi = *std::max_element(lanes, lanes + 8);
        top[p * nq + i] = hi;
        if (hi == kNeg) continue;  // every slot of the chunk hidden: it adds nothing
        const __m256 his = _mm256_set1_ps(hi);
        __m256 sum = _mm256_setzero_ps();
        for (int64_t j = 0; j < n; j += 8) {
          const __m256 x = _mm256_loadu_ps(sc + j);
          // exactly 0 for a hidden slot (so that its V is never read)
          const __m256 w = _mm256_and_ps(exp_nonpositive(_mm256_sub_ps(x, his)),
                                         _mm256_cmp_ps(x, _mm256_set1_ps(kNeg), _CMP_NEQ_OQ));
          _mm256_storeu_ps(sc + j, w);
          sum = _mm256_add_ps(sum, w);
        }
        total[p * nq + i] = mtpkit::horizontal_sum(sum);
        weighted_sum(sc, vb, KD, n, D, acc.data() + (p * nq + i) * D);
      }
    }
  });
  // each query's pieces merged in chunk order: rescaled to the overall maximum
  at::parallel_for(0, B * n_kv * nq, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t x = i0; x < i1; ++x) {
      const int64_t b = x / (n_kv * nq), kvh = x / nq % n_kv, i = x % nq;
      const int64_t first = (b * n_kv + kvh) * chunks;
      float hi = kNeg;
      for (int64_t c = 0; c < chunks; ++c) hi = std::max(hi, top[(first + c) * nq + i]);
      const int64_t t = i / group, hd = kvh * group + i % group;
      float* o = out + (b * T + t) * QD + hd * D;
      std::fill(o, o + D, 0.f);
      float sum = 0.f;
      for (int64_t c = 0; c < chunks; ++c) {
        const float m = top[(first + c) * nq + i];
        if (m == kNeg) continue;
        const float f = std::exp(m - hi);
        sum += f * total[(first + c) * nq + i];
        axpy(f, acc.data() + ((first + c) * nq + i) * D, o, D);
      }
      const float inv = 1.f / sum;
      for (int64_t d = 0; d < D; ++d) o[d] *= inv;
    }
  });
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
              "decode_layer: blocks: one of thin_blocks() for each of q, k, v, o, gate, up, down");
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

  attend(q.data(), kc, vc, mask.const_data_ptr<float>(), attn.data(), B, T, L, S, n_heads, n_kv, D);

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
