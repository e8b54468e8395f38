// y = x W^T (+ bias) (+ residual) in float32 for a few rows of x: the decode step's products,
// as the torch operators rltune::fewrows_pack and rltune::fewrows_linear; and a whole decoder
// layer for one new token a row on those products, rltune::fewrows_decode_layer (at the end).
//
// A decode step multiplies a handful of rows (the batch's sequences) by every weight of
// the model, reading each weight once for two flops per row: the product is bound by how
// fast the weights stream from memory. fewrows_pack stores a weight once per generation as
// panels of VW output columns, each panel K consecutive vectors ([N / VW][K][VW]), so a
// thread streams it front to back, and every loaded weight vector meets all MR rows at once
// (MR x NP vector accumulators held in registers for the whole K loop). x is transposed
// first into [K][MR] so the MR broadcasts of one k share a cache line.
//
// Compiled on the machine that runs it (-march=native picks the vector width); the work is
// split over torch's own threads (at::parallel_for). Every output is one dot product over k
// in increasing order, with fused multiply-adds: the terms of any float32 product, in
// another summation order.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

#if defined(__AVX512F__)
constexpr int VW = 16;  // floats per vector register
constexpr int NP = 2;   // panels a step: 2 x MR accumulators of the 32 registers
#else
constexpr int VW = 8;
constexpr int NP = 1;  // 16 registers: MR accumulators, the weight vector and a broadcast
#endif
constexpr int MR = 8;  // rows a step
// On AMD Zen the panels are read ahead of the loop by PREFETCH_BYTES, one prefetch a cache
// line: there the hardware prefetcher alone left the stream at about half of what a plain
// sum reads with 2 threads, and this made the product 1.2-1.3x faster (docs/performance.md).
// On an Intel AVX-512 machine software prefetching measured 15-25 % slower, so it is off
// elsewhere. Past the last panel it reads nothing that faults (a prefetch is a hint).
#if defined(__znver1__) || defined(__znver2__) || defined(__znver3__) || defined(__znver4__) || defined(__znver5__)
constexpr int64_t PREFETCH_BYTES = 3072;
#else
constexpr int64_t PREFETCH_BYTES = 0;
#endif
constexpr int64_t LINE_FLOATS = 64 / sizeof(float);

typedef float vec __attribute__((vector_size(VW * sizeof(float))));

// Panels a packed weight holds for n output columns: whole steps of NP panels, so a step
// never reads past the end; the columns past n are zero.
int64_t panels_for(int64_t n) { return ((n + VW * NP - 1) / (VW * NP)) * NP; }

// After the panels a packed weight's storage holds MARK_WORDS int32 words: a magic number,
// n, k and VW, which fewrows_linear checks, so that a tensor that is not fewrows_pack's
// output for this build (a plain weight, a copy, a slice) is refused, not misread.
constexpr int MARK_WORDS = 4;
constexpr int32_t MAGIC = 0x66726f77;  // "frow"

int64_t packed_floats(int64_t n, int64_t k) { return panels_for(n) * k * VW + MARK_WORDS; }

void write_mark(float* end, int64_t n, int64_t k) {
  int32_t mark[MARK_WORDS] = {MAGIC, int32_t(n), int32_t(k), VW};
  std::memcpy(end, mark, sizeof mark);
}

bool has_mark(const at::Tensor& packed, int64_t n, int64_t k) {
  if (packed.storage_offset() != 0 || packed.dim() != 2 || packed.stride(0) != k || packed.stride(1) != 1 ||
      packed.storage().nbytes() != size_t(packed_floats(n, k)) * sizeof(float))
    return false;
  int32_t mark[MARK_WORDS];
  std::memcpy(mark, static_cast<const float*>(packed.storage().data()) + panels_for(n) * k * VW, sizeof mark);
  return mark[0] == MAGIC && mark[1] == int32_t(n) && mark[2] == int32_t(k) && mark[3] == VW;
}

// One step: the MR rows of xt ([k][MR], one row block, rows r0..) times panels first..first+NP.
inline void step(const float* xt, int64_t k, const float* packed, int64_t first, int64_t n, int64_t rows,
                 int64_t r0, const float* bias, const float* residual, float* y) {
  vec acc[NP][MR];
  for (int q = 0; q < NP; q++)
    for (int r = 0; r < MR; r++) acc[q][r] = vec{};
  const float* w = packed + first * k * VW;
  for (int64_t i = 0; i < k; i++) {
    const float* xi = xt + i * MR;
    if (PREFETCH_BYTES > 0 && (i * VW) % LINE_FLOATS == 0)
      for (int q = 0; q < NP; q++)  // the address as an integer: it may lie past the buffer
        __builtin_prefetch(reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(w + (q * k + i) * VW) +
                                                         PREFETCH_BYTES), 0, 0);
    for (int q = 0; q < NP; q++) {
      vec wv;
      std::memcpy(&wv, w + (q * k + i) * VW, sizeof wv);
      for (int r = 0; r < MR; r++) acc[q][r] += xi[r] * wv;
    }
  }
  for (int q = 0; q < NP; q++) {
    int64_t c0 = (first + q) * VW;
    if (c0 >= n) break;
    int64_t width = n - c0 < VW ? n - c0 : VW;
    vec b = vec{};
    if (bias) std::memcpy(&b, bias + c0, width * sizeof(float));
    for (int r = 0; r < MR && r0 + r < rows; r++) {
      vec v = acc[q][r] + b;
      if (residual) {
        vec s = vec{};
        std::memcpy(&s, residual + (r0 + r) * n + c0, width * sizeof(float));
        v += s;
      }
      std::memcpy(y + (r0 + r) * n + c0, &v, width * sizeof(float));
    }
  }
}

void check_float_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.device().is_cpu(), "fewrows: ", name,
              " must be a float32 CPU tensor, got ", t.scalar_type(), " on ", t.device());
}

// The weights [n_i, k], stacked along n as one [n, k] (q, k and v; gate and up), into
// panels, returned as a tensor of the stacked logical shape [n, k] whose storage holds the
// panels (an input to fewrows_linear only). Each panel is filled VW columns by a cache
// line: one store per k of the VW values gathered from the VW source rows.
at::Tensor pack(at::TensorList weights) {
  TORCH_CHECK(!weights.empty(), "fewrows_pack: no weights");
  std::vector<at::Tensor> ws;
  int64_t n = 0, k = weights[0].dim() == 2 ? weights[0].size(1) : -1;
  for (const at::Tensor& w : weights) {
    check_float_cpu(w, "weight");
    TORCH_CHECK(w.dim() == 2 && w.size(1) == k, "fewrows_pack: the weights must be 2-D with the same columns, got ",
                w.sizes(), " after ", weights[0].sizes());
    ws.push_back(w.contiguous());
    n += w.size(0);
  }
  std::vector<float> zeros(k, 0.f);
  std::vector<const float*> source;  // the row of one output column, zeros past n
  for (const at::Tensor& w : ws)
    for (int64_t r = 0; r < w.size(0); r++) source.push_back(w.data_ptr<float>() + r * k);
  int64_t panels = panels_for(n);
  source.resize(panels * VW, zeros.data());
  at::Tensor out = at::empty({packed_floats(n, k)}, ws[0].options());
  float* dst = out.data_ptr<float>();
  write_mark(dst + panels * k * VW, n, k);
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; p++) {
      const float* const* src = source.data() + p * VW;
      float* d = dst + p * k * VW;
      for (int64_t i = 0; i < k; i++)
        for (int j = 0; j < VW; j++) d[i * VW + j] = src[j][i];
    }
  });
  return out.as_strided({n, k}, {k, 1});
}

// x [..., k] W^T + bias [n] + residual [..., n] with W packed by fewrows_pack; a new
// contiguous [..., n] tensor.
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                  const std::optional<at::Tensor>& residual) {
  check_float_cpu(x, "x");
  check_float_cpu(packed, "packed");
  TORCH_CHECK(packed.dim() == 2, "fewrows_linear: packed must be 2-D, got ", packed.sizes());
  int64_t n = packed.size(0), k = packed.size(1);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == k, "fewrows_linear: x ", x.sizes(), " does not fit a [", n, ", ", k,
              "] weight");
  TORCH_CHECK(has_mark(packed, n, k), "fewrows_linear: packed ", packed.sizes(),
              " is not fewrows_pack's output as it returned it (a plain weight, a copy or a slice of one)");
  at::Tensor xc = x.contiguous();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  at::Tensor y = at::empty(shape, x.options());
  int64_t rows = 1;
  for (size_t d = 0; d + 1 < shape.size(); d++) rows *= shape[d];
  at::Tensor bc, rc;
  if (bias) {
    check_float_cpu(*bias, "bias");
    TORCH_CHECK(bias->numel() == n, "fewrows_linear: bias has ", bias->numel(), " elements, the weight ", n, " rows");
    bc = bias->contiguous();
  }
  if (residual) {
    check_float_cpu(*residual, "residual");
    TORCH_CHECK(residual->sizes() == y.sizes(), "fewrows_linear: residual ", residual->sizes(),
                " is not the output's shape ", y.sizes());
    rc = residual->contiguous();
  }
  int64_t blocks = (rows + MR - 1) / MR;
  std::vector<float> xt(blocks * k * MR);
  const float* xs = xc.data_ptr<float>();
  for (int64_t b = 0; b < blocks; b++)
    for (int r = 0; r < MR; r++) {
      int64_t row = b * MR + r;
      float* d = xt.data() + b * k * MR + r;
      if (row < rows)
        for (int64_t i = 0; i < k; i++) d[i * MR] = xs[row * k + i];
      else
        for (int64_t i = 0; i < k; i++) d[i * MR] = 0.f;
    }
  const float* w = packed.data_ptr<float>();
  const float* bp = bias ? bc.data_ptr<float>() : nullptr;
  const float* rp = residual ? rc.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, panels_for(n) / NP, 1, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; s++)
      for (int64_t b = 0; b < blocks; b++) step(xt.data() + b * k * MR, k, w, s * NP, n, rows, b * MR, bp, rp, yp);
  });
  return y;
}


// ---- One decoder layer for one new token of every row (fewrows_decode_layer) ----
//
// LeanDecoder._one_query's arithmetic for one layer (rltune/rollout/fastpath.py): RMSNorm,
// the q/k/v product, rotary on q and k, k and v written into the cache at slot t, attention
// of each query head over slots 0..t (padded slots, -inf in key_bias, skipped), the o
// product plus the residual, RMSNorm, the gate/up product, silu(gate) * up, the down product
// plus the residual. The products are fewrows_linear's; the rest is loops over the rows,
// ~70 us a layer at 25 M, where the same steps as ATen ops cost a dispatch each (2.5-3 ms a
// token at 25 M with the step's own calls). The same float32 arithmetic in another order:
// sums of squares and dot products accumulate in another order, exp is the polynomial
// below (within 1 ulp of the exact exp over a dense sample of floats in [-87, 88]), so
// outputs agree with the ATen steps to float32 rounding, not bit for bit.

// exp(x) for every lane: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by Cephes' expf polynomial,
// 2^n through the exponent bits. x is clamped to [-87.3, 88.3], where 2^n is normal; a NaN
// stays NaN.
vec exp_vec(vec x) {
  typedef int32_t ivec __attribute__((vector_size(VW * sizeof(int32_t))));
  x = x > 88.3762626647949f ? vec{} + 88.3762626647949f : x;
  x = x < -87.3365478515625f ? vec{} - 87.3365478515625f : x;
  vec fx = x * 1.44269504088896341f + 0.5f;
  vec fl = __builtin_convertvector(__builtin_convertvector(fx, ivec), vec);  // toward zero
  fl += __builtin_convertvector(fl > fx, vec);                               // -1 where above: floor
  x = x - fl * 0.693359375f + fl * 2.12194440e-4f;
  vec y = ((((1.9875691500e-4f * x + 1.3981999507e-3f) * x + 8.3334519073e-3f) * x + 4.1665795894e-2f) * x +
           1.6666665459e-1f) * x + 5.0000001201e-1f;
  y = y * (x * x) + x + 1.0f;
  ivec bits = (__builtin_convertvector(fl, ivec) + 127) << 23;
  vec scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return y * scale;
}

// x[i] = exp(x[i]) for n floats, the tail through a zero-padded vector.
void exp_inplace(float* x, int64_t n) {
  int64_t i = 0;
  for (; i + VW <= n; i += VW) {
    vec v;
    std::memcpy(&v, x + i, sizeof v);
    v = exp_vec(v);
    std::memcpy(x + i, &v, sizeof v);
  }
  if (i < n) {
    vec v = vec{};
    std::memcpy(&v, x + i, (n - i) * sizeof(float));
    v = exp_vec(v);
    std::memcpy(x + i, &v, (n - i) * sizeof(float));
  }
}

// sum of a[i] b[i] over n floats: VW lanes, two vector accumulators, then the lanes and the tail.
float dot(const float* a, const float* b, int64_t n) {
  vec s0 = vec{}, s1 = vec{};
  int64_t i = 0;
  for (; i + 2 * VW <= n; i += 2 * VW) {
    vec a0, a1, b0, b1;
    std::memcpy(&a0, a + i, sizeof a0);
    std::memcpy(&a1, a + i + VW, sizeof a1);
    std::memcpy(&b0, b + i, sizeof b0);
    std::memcpy(&b1, b + i + VW, sizeof b1);
    s0 += a0 * b0;
    s1 += a1 * b1;
  }
  s0 += s1;
  float total = 0.f;
  for (int j = 0; j < VW; j++) total += s0[j];
  for (; i < n; i++) total += a[i] * b[i];
  return total;
}

// HF's RMSNorm in float32: x / sqrt(mean(x^2) + eps) * weight, a row of width h at a time.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  int64_t rows = x.size(0), h = x.size(1);
  at::Tensor out = at::empty({rows, h}, x.options());
  const float* xs = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* o = out.data_ptr<float>();
  for (int64_t r = 0; r < rows; r++) {
    float sum = dot(xs + r * h, xs + r * h, h);
    float inv = 1.f / std::sqrt(sum / float(h) + float(eps));
    for (int64_t i = 0; i < h; i++) o[r * h + i] = w[i] * (xs[r * h + i] * inv);
  }
  return out;
}

// Rotate-half rotary of one head's d values in place: x cos + [-x2, x1] sin.
void rotate(float* x, const float* cos, const float* sin, int64_t d) {
  int64_t half = d / 2;
  float rotated[512];
  for (int64_t i = 0; i < half; i++) {
    rotated[i] = x[i] * cos[i] - x[i + half] * sin[i];
    rotated[i + half] = x[i + half] * cos[i + half] + x[i] * sin[i + half];
  }
  std::memcpy(x, rotated, d * sizeof(float));
}

// Attention of every query head of every row over cache slots 0..t; heads [R, (Hq + 2 KV) d]
// holds the rotated queries first. out [R, Hq d].
void attend(const float* heads, int64_t width, const at::Tensor& keys, const at::Tensor& values,
            const float* key_bias, int64_t t, double scale, int64_t q_heads, float* out) {
  int64_t rows = keys.size(0), kv = keys.size(1), slots = keys.size(2), d = keys.size(3);
  int64_t groups = q_heads / kv;
  const float* ks = keys.data_ptr<float>();
  const float* vs = values.data_ptr<float>();
  std::vector<float> p(t + 1);
  for (int64_t r = 0; r < rows; r++)
    for (int64_t g = 0; g < kv; g++) {
      const float* bias = key_bias + (r * kv + g) * slots;
      const float* kg = ks + ((r * kv + g) * slots) * d;
      const float* vg = vs + ((r * kv + g) * slots) * d;
      for (int64_t i = 0; i < groups; i++) {
        int64_t head = g * groups + i;
        const float* q = heads + r * width + head * d;
        float top = -INFINITY;
        for (int64_t j = 0; j <= t; j++) {
          p[j] = std::isinf(bias[j]) ? -INFINITY : bias[j] + float(scale) * dot(q, kg + j * d, d);
          top = p[j] > top ? p[j] : top;
        }
        // a masked slot's exp is set to 0 below; a NaN or +inf score gives NaN, as ATen's softmax
        for (int64_t j = 0; j <= t; j++) p[j] = std::isinf(bias[j]) ? -200.f : p[j] - top;
        exp_inplace(p.data(), t + 1);
        float total = 0.f;
        for (int64_t j = 0; j <= t; j++) {
          if (std::isinf(bias[j])) p[j] = 0.f;
          total += p[j];
        }
        float* o = out + r * q_heads * d + head * d;
        for (int64_t e = 0; e < d; e++) o[e] = 0.f;
        for (int64_t j = 0; j <= t; j++) {
          float weight = p[j] / total;
          for (int64_t e = 0; e < d; e++) o[e] += weight * vg[j * d + e];
        }
      }
    }
}

// One layer (see above). h [R, H]; keys, values [R, KV, T, d] (slot t written here);
// key_bias [R KV, 1, T] (0, or -inf at a padded slot); cos, sin [R, d] of this position;
// qkv, o, gate_up, down packed by fewrows_pack. Returns {h after the layer, q/k/v as the
// product gave them (before rotary), h after the attention's residual, gate/up}.
std::vector<at::Tensor> decode_layer(const at::Tensor& h, const at::Tensor& norm1, double eps1, const at::Tensor& qkv,
                                     const std::optional<at::Tensor>& qkv_bias, const at::Tensor& keys,
                                     const at::Tensor& values, const at::Tensor& key_bias, const at::Tensor& cos,
                                     const at::Tensor& sin, int64_t t, double scale, const at::Tensor& o,
                                     const std::optional<at::Tensor>& o_bias, const at::Tensor& norm2, double eps2,
                                     const at::Tensor& gate_up, const at::Tensor& down) {
  for (const at::Tensor* x : {&h, &norm1, &keys, &values, &key_bias, &cos, &sin, &norm2}) check_float_cpu(*x, "input");
  TORCH_CHECK(h.dim() == 2 && keys.dim() == 4 && values.sizes() == keys.sizes() && h.size(0) == keys.size(0),
              "fewrows_decode_layer: h ", h.sizes(), " and the caches ", keys.sizes(), " do not fit");
  int64_t rows = h.size(0), kv = keys.size(1), slots = keys.size(2), d = keys.size(3);
  TORCH_CHECK(kv > 0 && d > 0 && d % 2 == 0 && d <= 512 && qkv.dim() == 2 && qkv.size(0) % d == 0,
              "fewrows_decode_layer: caches ", keys.sizes(), " do not fit a q/k/v weight of ", qkv.sizes());
  int64_t width = qkv.size(0), q_heads = width / d - 2 * kv;
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous() && q_heads > 0 && q_heads % kv == 0 && t >= 0 &&
                  t < slots,
              "fewrows_decode_layer: caches ", keys.sizes(), ", q/k/v width ", width, ", slot ", t, " do not fit");
  TORCH_CHECK(norm1.numel() == h.size(1) && norm2.numel() == h.size(1),
              "fewrows_decode_layer: norm weights of ", norm1.numel(), " and ", norm2.numel(), " for h ", h.sizes());
  TORCH_CHECK(gate_up.dim() == 2 && down.dim() == 2 && gate_up.size(0) == 2 * down.size(1),
              "fewrows_decode_layer: gate/up ", gate_up.sizes(), " is not twice the down weight's inputs ",
              down.sizes());
  TORCH_CHECK(key_bias.numel() == rows * kv * slots && cos.numel() == rows * d && sin.numel() == rows * d,
              "fewrows_decode_layer: key_bias ", key_bias.sizes(), " or cos/sin ", cos.sizes(), " do not fit");
  at::Tensor hc = h.contiguous(), bias = key_bias.contiguous(), cs = cos.contiguous(), sn = sin.contiguous();
  at::Tensor heads = linear(rms_norm(hc, norm1.contiguous(), eps1), qkv, qkv_bias, std::nullopt);
  at::Tensor rotated = heads.clone();
  float* hr = rotated.data_ptr<float>();
  float* ks = keys.data_ptr<float>();
  float* vs = values.data_ptr<float>();
  for (int64_t r = 0; r < rows; r++) {
    const float* c = cs.data_ptr<float>() + r * d;
    const float* s = sn.data_ptr<float>() + r * d;
    for (int64_t head = 0; head < q_heads + kv; head++) rotate(hr + r * width + head * d, c, s, d);
    for (int64_t g = 0; g < kv; g++) {
      std::memcpy(ks + (((r * kv + g) * slots) + t) * d, hr + r * width + (q_heads + g) * d, d * sizeof(float));
      std::memcpy(vs + (((r * kv + g) * slots) + t) * d, hr + r * width + (q_heads + kv + g) * d, d * sizeof(float));
    }
  }
  at::Tensor attention = at::empty({rows, q_heads * d}, h.options());
  attend(hr, width, keys, values, bias.data_ptr<float>(), t, scale, q_heads, attention.data_ptr<float>());
  at::Tensor after_attention = linear(attention, o, o_bias, hc);
  at::Tensor projected = linear(rms_norm(after_attention, norm2.contiguous(), eps2), gate_up, std::nullopt, std::nullopt);
  int64_t inner = projected.size(1) / 2;
  at::Tensor act = at::empty({rows, inner}, h.options());
  const float* gu = projected.data_ptr<float>();
  float* a = act.data_ptr<float>();
  for (int64_t r = 0; r < rows; r++) {  // silu(gate) * up = gate * up / (1 + exp(-gate))
    for (int64_t i = 0; i < inner; i++) a[r * inner + i] = -gu[r * 2 * inner + i];
    exp_inplace(a + r * inner, inner);
    for (int64_t i = 0; i < inner; i++)
      a[r * inner + i] = gu[r * 2 * inner + i] / (1.f + a[r * inner + i]) * gu[r * 2 * inner + inner + i];
  }
  return {linear(act, down, std::nullopt, after_attention), heads, after_attention, projected};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(rltune, m) {
  m.def("fewrows_pack(Tensor[] weights) -> Tensor");
  m.def("fewrows_linear(Tensor x, Tensor packed, Tensor? bias=None, Tensor? residual=None) -> Tensor");
  m.def("fewrows_decode_layer(Tensor h, Tensor norm1, float eps1, Tensor qkv, Tensor? qkv_bias, Tensor(a!) keys, "
        "Tensor(b!) values, Tensor key_bias, Tensor cos, Tensor sin, int t, float scale, Tensor o, Tensor? o_bias, "
        "Tensor norm2, float eps2, Tensor gate_up, Tensor down) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(rltune, CPU, m) {
  m.impl("fewrows_pack", &pack);
  m.impl("fewrows_linear", &linear);
  m.impl("fewrows_decode_layer", &decode_layer);
}
