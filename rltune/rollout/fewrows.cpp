// y = x W^T (+ bias) (+ residual) in float32 for a few rows of x: the decode step's products,
// as the torch operators rltune::fewrows_pack and rltune::fewrows_linear.
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
      for (int q = 0; q < NP; q++) __builtin_prefetch(w + (q * k + i) * VW + PREFETCH_BYTES / sizeof(float), 0, 0);
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

}  // namespace

TORCH_LIBRARY_FRAGMENT(rltune, m) {
  m.def("fewrows_pack(Tensor[] weights) -> Tensor");
  m.def("fewrows_linear(Tensor x, Tensor packed, Tensor? bias=None, Tensor? residual=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(rltune, CPU, m) {
  m.impl("fewrows_pack", &pack);
  m.impl("fewrows_linear", &linear);
}
