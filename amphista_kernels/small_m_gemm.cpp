// float32 y = x W^T + b for decode-sized batches on AVX2 CPUs.
//
// A decode step multiplies a few rows by every weight of the model once, so it should cost what
// reading the weights costs, whatever the number of rows. W is stored in panels of 16 output
// columns, [N/16][K][16]: one k of a panel is one 64-byte cache line, each thread streams its
// panels front to back, and every weight loaded feeds all rows of x (up to 6 at a time, 12 ymm
// accumulators). Each output is one FMA chain over k in order, so a row's result does not
// depend on how many rows share the call.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>

namespace {

constexpr int64_t kPanel = 16;
constexpr int kRowBlock = 6;
// Cache lines ahead of the one in use: enough to hide DRAM latency at one line per k.
constexpr int64_t kPrefetchLines = 24;

template <int M>
void panel_rows(const float* x, const float* panel, float* y, int64_t K, int64_t N, int64_t n) {
  __m256 lo[M], hi[M];
  for (int m = 0; m < M; ++m) {
    lo[m] = _mm256_setzero_ps();
    hi[m] = _mm256_setzero_ps();
  }
  for (int64_t k = 0; k < K; ++k) {
    _mm_prefetch(reinterpret_cast<const char*>(panel + (k + kPrefetchLines) * kPanel), _MM_HINT_T0);
    const __m256 w_lo = _mm256_load_ps(panel + k * kPanel);
    const __m256 w_hi = _mm256_load_ps(panel + k * kPanel + 8);
    for (int m = 0; m < M; ++m) {
      const __m256 xv = _mm256_broadcast_ss(x + m * K + k);
      lo[m] = _mm256_fmadd_ps(xv, w_lo, lo[m]);
      hi[m] = _mm256_fmadd_ps(xv, w_hi, hi[m]);
    }
  }
  const int64_t width = std::min(kPanel, N - n);
  for (int m = 0; m < M; ++m) {
    if (width == kPanel) {
      _mm256_storeu_ps(y + m * N + n, lo[m]);
      _mm256_storeu_ps(y + m * N + n + 8, hi[m]);
    } else {
      alignas(32) float tail[kPanel];
      _mm256_store_ps(tail, lo[m]);
      _mm256_store_ps(tail + 8, hi[m]);
      std::memcpy(y + m * N + n, tail, width * sizeof(float));
    }
  }
}

void panel_all_rows(const float* x, const float* panel, float* y, int64_t M, int64_t K, int64_t N, int64_t n) {
  int64_t m = 0;
  for (; m + kRowBlock <= M; m += kRowBlock) panel_rows<6>(x + m * K, panel, y + m * N, K, N, n);
  const float* xr = x + m * K;
  float* yr = y + m * N;
  switch (M - m) {
    case 5: panel_rows<5>(xr, panel, yr, K, N, n); break;
    case 4: panel_rows<4>(xr, panel, yr, K, N, n); break;
    case 3: panel_rows<3>(xr, panel, yr, K, N, n); break;
    case 2: panel_rows<2>(xr, panel, yr, K, N, n); break;
    case 1: panel_rows<1>(xr, panel, yr, K, N, n); break;
    default: break;
  }
}

}  // namespace

// [N, K] -> [ceil(N/16), K, 16], the padding columns zero.
at::Tensor pack_panels(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat, "pack_panels: a 2-D float32 weight");
  const int64_t N = weight.size(0), K = weight.size(1), panels = (N + kPanel - 1) / kPanel;
  auto padded = at::zeros({panels * kPanel, K}, weight.options());
  padded.narrow(0, 0, N).copy_(weight);
  return padded.view({panels, kPanel, K}).transpose(1, 2).contiguous();
}

at::Tensor panel_linear_out(const at::Tensor& x2d, const at::Tensor& packed, int64_t N) {
  const int64_t M = x2d.size(0), K = x2d.size(1), panels = packed.size(0);
  auto y = at::empty({M, N}, x2d.options());
  const float* xp = x2d.data_ptr<float>();
  const float* pp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, panels, 4, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) panel_all_rows(xp, pp + p * K * kPanel, yp, M, K, N, p * kPanel);
  });
  return y;
}

// Batches of more than max_rows rows (prefill) go to `large_op`, an out-variant linear
// `(Tensor(a!) out, Tensor x, Tensor? bias, Tensor state) -> ()` registered by someone else
// (vLLM's oneDNN GEMM), so the choice is made per call, also inside a compiled graph.
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                        int64_t n, int64_t max_rows, c10::string_view large_op, const at::Tensor& large_state) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat, "panel_linear: float32 only");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.is_contiguous(),
              "panel_linear: weight not packed by pack_panels");
  const int64_t K = packed.size(1);
  TORCH_CHECK(x.size(-1) == K, "panel_linear: x has ", x.size(-1), " features, the weight ", K);
  TORCH_CHECK(packed.size(0) * kPanel >= n && packed.size(0) * kPanel < n + kPanel, "panel_linear: n does not match the packed weight");
  auto out_shape = x.sizes().vec();
  out_shape.back() = n;
  const auto x2d = x.reshape({-1, K}).contiguous();
  if (x2d.size(0) > max_rows) {
    auto out = at::empty({x2d.size(0), n}, x.options());
    const auto op = c10::Dispatcher::singleton().findSchemaOrThrow(std::string(large_op).c_str(), "");
    torch::jit::Stack stack{out, x2d, bias, large_state};
    op.callBoxed(&stack);
    return out.view(out_shape);
  }
  auto y = panel_linear_out(x2d, packed, n);
  if (bias.has_value()) y.add_(*bias);
  return y.view(out_shape);
}

TORCH_LIBRARY(amphista_kernels, m) {
  m.def("pack_panels(Tensor weight) -> Tensor");
  m.def("panel_linear(Tensor x, Tensor packed, Tensor? bias, int n, int max_rows, str large_op, Tensor large_state) -> Tensor");
}

TORCH_LIBRARY_IMPL(amphista_kernels, CPU, m) {
  m.impl("pack_panels", &pack_panels);
  m.impl("panel_linear", &panel_linear);
}
