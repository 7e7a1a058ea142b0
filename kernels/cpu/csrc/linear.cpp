// y = x W^T for bf16 weights in a layout made for AVX-512 BF16: the CPU engine's linears where the CPU has
// avx512_bf16 and no AMX (with AMX, oneDNN's prepacked matmul runs them on tiles). Torch reference: F.linear.
//
// Why: oneDNN's prepacked bf16 matmul streams a decode step's weights at 17-22 GB/s at batch 1 on AMD Zen 4,
// against the 36.8 GB/s the cores can read, and a batch-1 step is little but that stream (docs/RESULTS.md,
// "Linears without AMX").
//
// Layout (pack_linear, once at load): W[N, K] as blocks of 64 output columns, each block [K/2][64][2]: for a
// pair of k, the block's 64 columns with each column's two weights side by side. A block is one contiguous
// stream; a 64-byte load is 16 columns x 2 k, and one dpbf16 against the broadcast pair (x[k], x[k+1]) adds
// both products into the 16 columns' fp32 sums: no horizontal sum anywhere, the output goes out 16 columns
// at a time. A tile (dpbf16_tile.h) is R <= 6 rows of x by one block, the block's stream read once per R
// rows. Threads split the blocks, each a contiguous range of the packed weight. Columns past N in the last
// block are zero; K must be even.
//
// AVX-512 build only (build.py): the AVX2 build has no such op and its hosts keep F.linear.
#if defined(__AVX512F__)
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "dpbf16_tile.h"
#include "vec.h"

namespace trnd {
namespace {

constexpr int64_t BLOCK = TILE_COLS;  // output columns per block (dpbf16_tile.h)
constexpr int NV = BLOCK / 16;
constexpr int MAX_R = TILE_MAX_R;
constexpr int64_t MAX_K = 1 << 16;

struct Job {
  const bf16* x;
  int64_t xs, K, N;
  const bf16* packed;
  bf16* y;
};

// Rows [m, m + R) of y for the columns of block b, rounded to bf16 (ties to even) as they are stored.
template <int R>
void run_tile(const Job& j, int64_t b, int64_t m, float* acc) {
  dpbf16_tile<R>(j.x + m * j.xs, j.xs, j.K, j.packed + b * j.K * BLOCK, acc);
  const int64_t col = b * BLOCK, n = std::min<int64_t>(BLOCK, j.N - col);
  for (int r = 0; r < R; ++r) {
    bf16* dst = j.y + (m + r) * j.N + col;
    if (n == BLOCK) {
      for (int v = 0; v < NV; ++v) vstore(dst + v * 16, vload(acc + r * BLOCK + v * 16));
    } else {
      for (int64_t c = 0; c < n; ++c) dst[c] = static_cast<bf16>(acc[r * BLOCK + c]);
    }
  }
}

at::Tensor pack_linear(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "weight: want a bfloat16 [N, K], got ",
              w.scalar_type(), " ", w.sizes());
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(N > 0 && K % 2 == 0 && 0 < K && K <= MAX_K, "weight: K = ", K, " must be even, at most ", MAX_K);
  const int64_t nb = (N + BLOCK - 1) / BLOCK;
  // [nb, K/2, 64, 2] <- W[n, k]: zero columns up to whole blocks, then each k-pair's columns side by side
  at::Tensor padded = at::zeros({nb * BLOCK, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  return padded.view({nb, BLOCK, K / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1,
              "x: want a bfloat16 [M, K] with unit stride in K, got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  packed.size(2) == BLOCK && packed.size(3) == 2,
              "packed: want pack_linear's [N/64, K/2, 64, 2] bfloat16, got ", packed.sizes());
  const int64_t M = x.size(0), K = x.size(1), nb = packed.size(0);
  TORCH_CHECK(packed.size(1) * 2 == K, "x has K = ", K, ", the packed weight ", packed.size(1) * 2);
  TORCH_CHECK((nb - 1) * BLOCK < N && N <= nb * BLOCK, "N = ", N, " does not fit ", nb, " blocks of ", BLOCK);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const Job j{reinterpret_cast<const bf16*>(x.data_ptr()), x.stride(0), K, N,
              reinterpret_cast<const bf16*>(packed.data_ptr()), reinterpret_cast<bf16*>(y.data_ptr())};
#pragma omp parallel if (M * N * K >= (1 << 18))
  {
    alignas(64) float acc[MAX_R * BLOCK];
#pragma omp for schedule(static)
    for (int64_t b = 0; b < nb; ++b)
      for (int64_t m = 0; m < M; m += MAX_R)
        with_rows(std::min<int64_t>(MAX_R, M - m), [&](auto r) { run_tile<decltype(r)::value>(j, b, m, acc); });
  }
  return y;
}

}  // namespace
}  // namespace trnd

TORCH_LIBRARY_FRAGMENT(TRND_LIB, m) {
  m.def("pack_linear(Tensor weight) -> Tensor");
  m.def("linear(Tensor x, Tensor packed, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(TRND_LIB, CPU, m) {
  m.impl("pack_linear", &trnd::pack_linear);
  m.impl("linear", &trnd::linear);
}
#endif
