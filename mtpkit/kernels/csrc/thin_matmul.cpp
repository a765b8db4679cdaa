// y[..., N] = x[..., K] @ w[N, K]^T for 1 to 16 fp32 rows of x (decode and verify steps) and fp32 or bf16 weights
// (fp32 arithmetic), AVX2 + FMA (and AVX-512F for the wide blocks), `block` weight rows per pass; the product itself
// is in thin_product.h.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <vector>

#include "thin_product.h"

namespace {

at::Tensor thin_linear(const at::Tensor& x, const at::Tensor& w, int64_t block) {
  TORCH_CHECK(x.dim() >= 1 && w.dim() == 2 && x.size(-1) == w.size(1), "thin_linear: x [..., K] and w [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16),
              "thin_linear: fp32 x and fp32 or bf16 weights only");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "thin_linear: CPU tensors only");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "thin_linear: contiguous tensors only");
  const int64_t K = w.size(1), M = K ? x.numel() / K : 0;
  TORCH_CHECK(M >= 1 && M <= mtpkit::kMaxRows, "thin_linear: 1 to ", mtpkit::kMaxRows, " rows, got ", M);
  TORCH_CHECK(mtpkit::valid_block(block), "thin_linear: block is one of thin_blocks() (1, 2, 4; with AVX-512F also ",
              mtpkit::kWide + 2, " and ", mtpkit::kWide + 4, "), got ", block);
  std::vector<int64_t> shape = x.sizes().vec();  // [..., K] -> [..., N]: the caller needs no reshape
  shape.back() = w.size(0);
  at::Tensor y = at::empty(shape, x.options());
  mtpkit::thin_product(x.const_data_ptr<float>(), w, y.mutable_data_ptr<float>(), M, block);
  return y;
}

std::vector<int64_t> thin_blocks() {
  std::vector<int64_t> blocks;
  for (int64_t b : {int64_t{1}, int64_t{2}, int64_t{4}, mtpkit::kWide + 2, mtpkit::kWide + 4})
    if (mtpkit::valid_block(b)) blocks.push_back(b);
  return blocks;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mtpkit_cpu, m) {
  m.def("thin_linear(Tensor x, Tensor w, int block) -> Tensor", &thin_linear);
  m.def("thin_blocks() -> int[]", &thin_blocks);
}
