// y = x W^T for fp32 weights, in both builds (AVX2 + FMA and AVX-512): the CPU engine's fp32 linears, which is
// the compute dtype wherever the CPU has no bf16 in hardware (AVX2-only hosts such as AMD Zen 3). Torch
// reference: F.linear.
//
// Why: a decode step is little but its weight stream, and the BLASes torch calls run decode's 4-16 rows at
// gemv cost per row on AMD: MKL's F.linear and oneDNN's prepacked matmul both read the weights more than once
// (AMD EPYC Zen 3: the model's linears at 4 rows took 2.4x their 1-row time; docs/RESULTS.md, "Serving on an
// AVX2-only AMD EPYC (Zen 3)"). Here the weight is streamed from DRAM once per call, whatever the rows.
//
// Layout (pack_linear_f32, once at load): W[N, K] as blocks of BLOCK = 2 vectors of output columns (16 on AVX2,
// 32 on AVX-512), each block [K][BLOCK]: for each k the block's columns side by side, so one k is one
// broadcast of x[k] and two FMAs per row into BLOCK column sums, no horizontal sum. A tile is R <= 6 rows of
// x by one block: 12 accumulators + 2 weight vectors + a broadcast fit AVX2's 16 registers. A block (48 KB at
// K = 768 on AVX2) stays in L2 while the next row tiles of the call read it again, so DRAM sees it once.
// Threads split the blocks. Columns past N in the last block are zero. The packed layout belongs to the build
// that made it (BLOCK differs): the engine packs and multiplies with the same library.
// Each output is the sum over k in order, one fused multiply-add at a time: fp32 rounding as any sequential
// dot product, not F.linear's blocked order (the tests bound the difference against a float64 product).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "vec.h"

namespace trnd {
namespace {

constexpr int64_t F32_BLOCK = 2 * W;  // output columns per block
constexpr int F32_MAX_R = 6;
// How far ahead (in k) the block's stream is prefetched: 4 KB on AVX2 (one 64-byte line per k), 8 KB on AVX-512.
constexpr int64_t F32_PREFETCH_K = 64;

// pf: what to prefetch, one k-row of a block (64 bytes on AVX2, 128 on AVX-512) per k. The first tile over a
// block streams it from DRAM and prefetches its own rows ahead; the later tiles read it from L2 and, compute-bound
// there, prefetch the next block instead, so its DRAM stream runs under their FMAs (at 16 rows, the batch of a
// c=16 decode step, the weight stream and the 2 cached passes no longer take turns).
template <int R>
inline void f32_tile(const float* x, int64_t xs, int64_t K, const float* blk, const float* pf, float* out) {
  vf acc[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = vzero();
  for (int64_t k = 0; k < K; ++k) {
    const float* w = blk + k * F32_BLOCK;
    if (pf != nullptr) {  // into L2 (the next block would push this one's rows out of L1)
      _mm_prefetch(reinterpret_cast<const char*>(pf + k * F32_BLOCK), _MM_HINT_T1);
      if constexpr (F32_BLOCK * sizeof(float) > 64)
        _mm_prefetch(reinterpret_cast<const char*>(pf + k * F32_BLOCK) + 64, _MM_HINT_T1);
    }
    const vf w0 = vload(w), w1 = vload(w + W);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const vf xb = vset(x[r * xs + k]);
      acc[r][0] = vfma(xb, w0, acc[r][0]);
      acc[r][1] = vfma(xb, w1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    vstore(out + r * F32_BLOCK, acc[r][0]);
    vstore(out + r * F32_BLOCK + W, acc[r][1]);
  }
}

at::Tensor pack_linear_f32(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat, "weight: want a float32 [N, K], got ", w.scalar_type(),
              " ", w.sizes());
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(N > 0 && K > 0, "weight: empty ", w.sizes());
  const int64_t nb = (N + F32_BLOCK - 1) / F32_BLOCK;
  at::Tensor padded = at::zeros({nb * F32_BLOCK, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  // [nb, K, BLOCK] <- W[n, k]
  return padded.view({nb, F32_BLOCK, K}).permute({0, 2, 1}).contiguous();
}

at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& packed, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "x: want a float32 [M, K] with unit stride in K, got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kFloat && packed.is_contiguous() &&
                  packed.size(2) == F32_BLOCK,
              "packed: want this build's pack_linear_f32 [N/", F32_BLOCK, ", K, ", F32_BLOCK, "] float32, got ",
              packed.sizes());
  const int64_t M = x.size(0), K = x.size(1), nb = packed.size(0);
  TORCH_CHECK(packed.size(1) == K, "x has K = ", K, ", the packed weight ", packed.size(1));
  TORCH_CHECK((nb - 1) * F32_BLOCK < N && N <= nb * F32_BLOCK, "N = ", N, " does not fit ", nb, " blocks of ",
              F32_BLOCK);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t xs = x.stride(0);
#pragma omp parallel if (M * N * K >= (1 << 18))
  {
    alignas(64) float acc[F32_MAX_R * F32_BLOCK];
#pragma omp for schedule(static)
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t col = b * F32_BLOCK, n = std::min<int64_t>(F32_BLOCK, N - col);
      // rows in tiles of near-equal size (8 rows: 4 + 4, not 6 + 2: a short tile pays a whole weight load for few FMAs)
      const int64_t tiles = (M + F32_MAX_R - 1) / F32_MAX_R;
      const float* blk = wp + b * K * F32_BLOCK;
      const float* next = b + 1 < nb ? blk + K * F32_BLOCK : nullptr;
      for (int64_t t = 0, m = 0; t < tiles; ++t) {
        const int64_t R = M / tiles + (t < M % tiles);
        // the first tile: this block, F32_PREFETCH_K rows ahead; the second: the next block, all of it
        const float* pf = t == 0 ? blk + F32_PREFETCH_K * F32_BLOCK : t == 1 ? next : nullptr;
        with_rows<F32_MAX_R>(R, [&](auto r) { f32_tile<decltype(r)::value>(xp + m * xs, xs, K, blk, pf, acc); });
        for (int64_t r = 0; r < R; ++r) {
          float* dst = yp + (m + r) * N + col;
          if (n == F32_BLOCK) {
            vstore(dst, vload(acc + r * F32_BLOCK));
            vstore(dst + W, vload(acc + r * F32_BLOCK + W));
          } else {
            std::copy(acc + r * F32_BLOCK, acc + r * F32_BLOCK + n, dst);
          }
        }
        m += R;
      }
    }
  }
  return y;
}

}  // namespace
}  // namespace trnd

#define TRND_F32_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
#define TRND_F32_IMPL(ns, k, m) TORCH_LIBRARY_IMPL(ns, k, m)

TRND_F32_FRAGMENT(TRND_LIB, m) {
  m.def("pack_linear_f32(Tensor weight) -> Tensor");
  m.def("linear_f32(Tensor x, Tensor packed, int n) -> Tensor");
}

TRND_F32_IMPL(TRND_LIB, CPU, m) {
  m.impl("pack_linear_f32", &trnd::pack_linear_f32);
  m.impl("linear_f32", &trnd::linear_f32);
}
