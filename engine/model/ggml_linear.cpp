// tandem_ggml::linear: a linear layer whose weight stays in GGUF's quantized blocks, computed by
// ggml's own CPU kernels. This file only drives them, two ways:
//  - a few rows (decode): ggml's dot products (ggml_get_type_traits_cpu: Q4_0 / Q4_1 / Q8_0 rows
//    against the activations quantized to the kernel's partner type, Q8_0 or Q8_1): quantize each
//    input row once, then one dot product per (output row, input row), output rows split across
//    ATen's threads;
//  - many rows (prefill): each dot product is one row against one row, so their cost grows with the
//    rows; from kGemmRows rows the weight is dequantized by ggml's to_float, a slice at a time,
//    into float32 and multiplied by ATen's matmul (a BLAS GEMM), several times faster at 128 rows.
// Built and loaded by engine/model/ggml_kernels.py.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <mutex>

#include "ggml-cpu.h"
#include "ggml.h"

namespace {

constexpr int64_t kRowsPerTask = 32;  // output rows per parallel task: a few KB of weights each
constexpr int64_t kGemmRows = 16;     // input rows from which dequantize + GEMM beats the dot products
constexpr int64_t kSliceRows = 1024;  // weight rows dequantized at a time (2.3 MB of float32 at 576 inputs)

void init_once() {
  static std::once_flag flag;
  std::call_once(flag, [] { ggml_cpu_init(); });
}

const ggml_type_traits_cpu* traits_of(int64_t type) {
  TORCH_CHECK(type == GGML_TYPE_Q4_0 || type == GGML_TYPE_Q4_1 || type == GGML_TYPE_Q8_0,
              "tandem_ggml::linear: unsupported ggml type ", type);
  return ggml_get_type_traits_cpu(static_cast<ggml_type>(type));
}

at::Tensor dequantized_matmul(const at::Tensor& x, const at::Tensor& weight, int64_t type, int64_t out_features) {
  const auto to_float = ggml_get_type_traits(static_cast<ggml_type>(type))->to_float;
  const int64_t in_features = x.size(1), w_row = weight.size(1);
  const uint8_t* w = weight.data_ptr<uint8_t>();
  at::Tensor out = at::empty({x.size(0), out_features}, x.options());
  at::Tensor slice = at::empty({std::min(kSliceRows, out_features), in_features}, x.options());
  for (int64_t start = 0; start < out_features; start += kSliceRows) {
    const int64_t count = std::min(kSliceRows, out_features - start);
    float* dst = slice.data_ptr<float>();
    at::parallel_for(0, count, kRowsPerTask, [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) {
        to_float(w + (start + n) * w_row, dst + n * in_features, in_features);
      }
    });
    at::Tensor columns = out.narrow(1, start, count);
    at::mm_out(columns, x, slice.narrow(0, 0, count).t());
  }
  return out;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, int64_t type, int64_t out_features,
                  const std::optional<at::Tensor>& residual) {
  init_once();
  TORCH_CHECK(x.dim() == 2, "tandem_ggml::linear: x must be [rows, in_features]");
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.dim() == 2 && weight.is_contiguous() &&
                  weight.size(0) == out_features,
              "tandem_ggml::linear: weight must be contiguous uint8 [out_features, row_bytes]");
  const auto* traits = traits_of(type);
  const int64_t rows = x.size(0), in_features = x.size(1);
  TORCH_CHECK(weight.size(1) == static_cast<int64_t>(ggml_row_size(static_cast<ggml_type>(type), in_features)),
              "tandem_ggml::linear: weight row bytes do not match in_features ", in_features);
  if (rows >= kGemmRows) {
    at::Tensor out = dequantized_matmul(x.to(at::kFloat), weight, type, out_features);
    return residual.has_value() ? out.add_(*residual) : out;
  }
  const auto act_type = traits->vec_dot_type;
  const int64_t act_row = ggml_row_size(act_type, in_features);
  const at::Tensor input = x.to(at::kFloat).contiguous();
  at::Tensor packed = at::empty({rows, act_row}, x.options().dtype(at::kByte));
  const auto from_float = ggml_get_type_traits_cpu(act_type)->from_float;
  for (int64_t m = 0; m < rows; ++m) {
    from_float(input.data_ptr<float>() + m * in_features, packed.data_ptr<uint8_t>() + m * act_row, in_features);
  }
  at::Tensor out = at::empty({rows, out_features}, x.options().dtype(at::kFloat));
  float* dst = out.data_ptr<float>();
  const uint8_t* w = weight.data_ptr<uint8_t>();
  const uint8_t* a = packed.data_ptr<uint8_t>();
  const int64_t w_row = weight.size(1);
  const auto vec_dot = traits->vec_dot;
  at::parallel_for(0, out_features, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t m = 0; m < rows; ++m) {
        vec_dot(in_features, dst + m * out_features + n, 0, w + n * w_row, 0, a + m * act_row, 0, 1);
      }
    }
  });
  if (residual.has_value()) {
    out.add_(*residual);
  }
  return out;
}

at::Tensor quantize(const at::Tensor& weight, int64_t type) {
  init_once();
  traits_of(type);
  TORCH_CHECK(weight.dim() == 2, "tandem_ggml::quantize: weight must be [out_features, in_features]");
  const at::Tensor w = weight.to(at::kFloat).contiguous();
  const int64_t rows = w.size(0), cols = w.size(1);
  at::Tensor out = at::empty({rows, static_cast<int64_t>(ggml_row_size(static_cast<ggml_type>(type), cols))},
                             w.options().dtype(at::kByte));
  ggml_quantize_chunk(static_cast<ggml_type>(type), w.data_ptr<float>(), out.data_ptr<uint8_t>(), 0, rows, cols,
                      nullptr);
  return out;
}

}  // namespace

TORCH_LIBRARY(tandem_ggml, m) {
  m.def("linear(Tensor x, Tensor weight, int type, int out_features, Tensor? residual=None) -> Tensor");
  m.def("quantize(Tensor weight, int type) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem_ggml, CPU, m) {
  m.impl("linear", &linear);
  m.impl("quantize", &quantize);
}
