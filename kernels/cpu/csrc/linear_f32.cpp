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
//
// bf16-valued weights (pack_linear_f32(w, bf16=True), refused unless every value of w is a bf16: a bf16 checkpoint
// run in fp32, as on AVX2-only hosts by default) are packed as bf16, each k-row of a block W 32-bit pairs
// (f32_tile.h), and widened exactly in the tile: the same products and sums as the fp32 packing, bit for bit, from
// half the bytes. A decode step's linears stream their weight from DRAM, so that halves the step's largest read.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "blocks.h"
#include "f32_tile.h"
#include "vec.h"

namespace trnd {
namespace {

// How far ahead the block's stream is prefetched: 4 KB on AVX2 (64 fp32 k-rows of 64 bytes), 8 KB on AVX-512.
constexpr int64_t F32_PREFETCH_BYTES = 64 * F32_BLOCK * sizeof(float);

at::Tensor pack_linear_f32(const at::Tensor& w, bool as_bf16) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat, "weight: want a float32 [N, K], got ", w.scalar_type(),
              " ", w.sizes());
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(N > 0 && K > 0, "weight: empty ", w.sizes());
  const int64_t nb = (N + F32_BLOCK - 1) / F32_BLOCK;
  if (as_bf16) {
    at::Tensor b = w.to(at::kBFloat16);
    TORCH_CHECK(at::equal(b.to(at::kFloat), w), "weight: bf16=True wants every value a bfloat16 (this one rounds)");
    at::Tensor padded = at::zeros({nb * F32_BLOCK, K}, b.options());
    padded.narrow(0, 0, N).copy_(b);
    // [nb, K, W, 2] <- W[b * BLOCK + h * W + c, k]: for each k, W pairs (column c, column W + c)
    return padded.view({nb, 2, W, K}).permute({0, 3, 2, 1}).contiguous().view({nb, K, F32_BLOCK});
  }
  at::Tensor padded = at::zeros({nb * F32_BLOCK, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  // [nb, K, BLOCK] <- W[n, k]
  return padded.view({nb, F32_BLOCK, K}).permute({0, 2, 1}).contiguous();
}

template <typename T>
void run_f32(const float* xp, int64_t xs, const T* wp, float* yp, int64_t M, int64_t N, int64_t K, int64_t nb) {
  const int64_t prefetch_k = F32_PREFETCH_BYTES / (F32_BLOCK * static_cast<int64_t>(sizeof(T)));
  const int64_t tiles = (M + F32_MAX_R - 1) / F32_MAX_R, chunk = block_chunk(tiles, nb);  // csrc/blocks.h
#pragma omp parallel if (M * N * K >= (1 << 18))
  {
    alignas(64) float acc[F32_MAX_R * F32_BLOCK];
#pragma omp for schedule(dynamic, chunk) nowait
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t col = b * F32_BLOCK, n = std::min<int64_t>(F32_BLOCK, N - col);
      // rows in tiles of near-equal size (8 rows: 4 + 4, not 6 + 2: a short tile pays a whole weight load for few FMAs)
      const T* blk = wp + b * K * F32_BLOCK;
      // With more than one tile, the next block of this thread's range goes into L2 over all of this block's tiles
      // (Spread, as csrc/linear.cpp): the model's linears at 8-16 rows (c=4-16's decode) 1.01-1.30x faster than
      // prefetching it all under the second tile in 8 of 9 alternated runs, 0.83x in one (docs/RESULTS.md,
      // "Issue 15, 2026-12-06 (second session)").
      Spread next;
      if (tiles > 1 && b + 1 < nb && (b + 1) % chunk != 0) {
        next.p = reinterpret_cast<const char*>(blk + K * F32_BLOCK);
        next.lines = K * F32_BLOCK * static_cast<int64_t>(sizeof(T)) / 64;
        next.steps = tiles * K;
      }
      for (int64_t t = 0, m = 0; t < tiles; ++t) {
        const int64_t R = M / tiles + (t < M % tiles);
        // the first tile streams this block, F32_PREFETCH_BYTES ahead
        const T* pf = t == 0 ? blk + prefetch_k * F32_BLOCK : nullptr;
        with_rows<F32_MAX_R>(R, [&](auto r) {
          if (next.p != nullptr)
            f32_tile<decltype(r)::value, true>(xp + m * xs, xs, K, blk, pf, acc, F32_BLOCK, &next);
          else
            f32_tile<decltype(r)::value>(xp + m * xs, xs, K, blk, pf, acc);
        });
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
}

at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& packed, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "x: want a float32 [M, K] with unit stride in K, got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(packed.dim() == 3 && (packed.scalar_type() == at::kFloat || packed.scalar_type() == at::kBFloat16) &&
                  packed.is_contiguous() && packed.size(2) == F32_BLOCK,
              "packed: want this build's pack_linear_f32 [N/", F32_BLOCK, ", K, ", F32_BLOCK, "] float32 or bfloat16, got ",
              packed.scalar_type(), " ", packed.sizes());
  const int64_t M = x.size(0), K = x.size(1), nb = packed.size(0);
  TORCH_CHECK(packed.size(1) == K, "x has K = ", K, ", the packed weight ", packed.size(1));
  TORCH_CHECK((nb - 1) * F32_BLOCK < N && N <= nb * F32_BLOCK, "N = ", N, " does not fit ", nb, " blocks of ",
              F32_BLOCK);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  if (packed.scalar_type() == at::kBFloat16)
    run_f32(x.data_ptr<float>(), x.stride(0), packed.data_ptr<bf16>(), y.data_ptr<float>(), M, N, K, nb);
  else
    run_f32(x.data_ptr<float>(), x.stride(0), packed.data_ptr<float>(), y.data_ptr<float>(), M, N, K, nb);
  return y;
}

}  // namespace
}  // namespace trnd

#define TRND_F32_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
#define TRND_F32_IMPL(ns, k, m) TORCH_LIBRARY_IMPL(ns, k, m)

TRND_F32_FRAGMENT(TRND_LIB, m) {
  m.def("pack_linear_f32(Tensor weight, bool bf16=False) -> Tensor");
  m.def("linear_f32(Tensor x, Tensor packed, int n) -> Tensor");
}

TRND_F32_IMPL(TRND_LIB, CPU, m) {
  m.impl("pack_linear_f32", &trnd::pack_linear_f32);
  m.impl("linear_f32", &trnd::linear_f32);
}
