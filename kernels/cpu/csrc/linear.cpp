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
// rows (from DRAM for the first tile, from L2 after). Threads split the blocks, each a contiguous range of the
// packed weight, and prefetch their next block while the current one's tiles run. Columns past N in the last
// block are zero; K must be even.
//
// linear_amx: the same packed weight on AMX tiles (Sapphire Rapids and later), for more rows than decode's few.
// The layout is already a tile's B operand: for 16 k-pairs and 16 columns of a block, 16 rows of 64 bytes at a
// stride of one k-pair (256 bytes). A tile of 16 rows of x (32 k each) is the A operand; one block's 64 columns
// are four fp32 C tiles. dpbf16 is bound by the weight stream at 1-8 rows and by its dot products from ~16;
// the tiles do 16x the dot products per instruction, so one pack serves decode (dpbf16) and prefill (AMX).
//
// AVX-512 build only (build.py): the AVX2 build has no such op and its hosts keep F.linear.
#if defined(__AVX512F__)
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <omp.h>

#include "amx_tiles.h"
#include "blocks.h"
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

// Rows [m, m + R) of y for the columns of block b from acc[R][BLOCK], rounded to bf16 (ties to even).
void store_rows(const Job& j, int64_t b, int64_t m, int64_t R, const float* acc) {
  const int64_t col = b * BLOCK, n = std::min<int64_t>(BLOCK, j.N - col);
  for (int64_t r = 0; r < R; ++r) {
    bf16* dst = j.y + (m + r) * j.N + col;
    if (n == BLOCK) {
      for (int v = 0; v < NV; ++v) vstore(dst + v * 16, vload(acc + r * BLOCK + v * 16));
    } else {
      for (int64_t c = 0; c < n; ++c) dst[c] = static_cast<bf16>(acc[r * BLOCK + c]);
    }
  }
}

template <int R>
void run_tile(const Job& j, int64_t b, int64_t m, float* acc, Spread* nx) {
  dpbf16_tile<R, FAR_PREFETCH_PAIRS>(j.x + m * j.xs, j.xs, j.K, j.packed + b * j.K * BLOCK, acc, nx);
  store_rows(j, b, m, R, acc);
}

// acc[16][BLOCK] = 16 rows of x (16 x K at stride xs) times block blk: tmm4 x (A), tmm6 / tmm7 the weight (B),
// tmm0-3 the four 16-column C tiles.
__attribute__((target("amx-tile,amx-bf16"))) void amx_tile(const bf16* x, int64_t xs, int64_t K, const bf16* blk,
                                                           float* acc) {
  constexpr int64_t PAIR = BLOCK * 2 * sizeof(bf16);  // bytes from one k-pair of a block to the next
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t k = 0; k < K; k += 32) {
    const bf16* w = blk + k * BLOCK;  // k-pair k / 2
    for (int64_t line = 0; line < 16 * PAIR; line += 64)  // the next step's 16 k-pairs, PREFETCH_PAIRS ahead
      _mm_prefetch(reinterpret_cast<const char*>(w) + PREFETCH_PAIRS * PAIR + line, _MM_HINT_T0);
    _tile_loadd(4, x + k, xs * sizeof(bf16));
    _tile_loadd(6, w, PAIR);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, w + 32, PAIR);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(6, w + 64, PAIR);
    _tile_dpbf16ps(2, 4, 6);
    _tile_loadd(7, w + 96, PAIR);
    _tile_dpbf16ps(3, 4, 7);
  }
  constexpr int64_t OUT = BLOCK * sizeof(float);
  _tile_stored(0, acc, OUT);
  _tile_stored(1, acc + 16, OUT);
  _tile_stored(2, acc + 32, OUT);
  _tile_stored(3, acc + 48, OUT);
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

void check_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1,
              "x: want a bfloat16 [M, K] with unit stride in K, got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  packed.size(2) == BLOCK && packed.size(3) == 2,
              "packed: want pack_linear's [N/64, K/2, 64, 2] bfloat16, got ", packed.sizes());
  const int64_t K = x.size(1), nb = packed.size(0);
  TORCH_CHECK(packed.size(1) * 2 == K, "x has K = ", K, ", the packed weight ", packed.size(1) * 2);
  TORCH_CHECK((nb - 1) * BLOCK < N && N <= nb * BLOCK, "N = ", N, " does not fit ", nb, " blocks of ", BLOCK);
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t N) {
  check_linear(x, packed, N);
  const int64_t M = x.size(0), K = x.size(1), nb = packed.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const Job j{reinterpret_cast<const bf16*>(x.data_ptr()), x.stride(0), K, N,
              reinterpret_cast<const bf16*>(packed.data_ptr()), reinterpret_cast<bf16*>(y.data_ptr())};
  const int64_t tiles = (M + MAX_R - 1) / MAX_R, chunk = block_chunk(tiles, nb);  // csrc/blocks.h
#pragma omp parallel if (M * N * K >= (1 << 18))
  {
    alignas(64) float acc[MAX_R * BLOCK];
#pragma omp for schedule(dynamic, chunk) nowait
    for (int64_t b = 0; b < nb; ++b) {
      // The rows in near-equal tiles (16 rows: 6 + 5 + 5, not 6 + 6 + 4). With more than one tile, the tiles after
      // a block's first read it from L2 while DRAM would idle, so the next block of this thread's range is
      // prefetched into L2 over all the block's tiles (Spread): its first tile need not wait on DRAM. At 8-16 rows
      // (c=16's decode) the model's linears ran 1.09-1.24x faster (docs/RESULTS.md, "Linears: the next block into
      // L2 under the current one's tiles").
      Spread next;
      if (tiles > 1 && b + 1 < nb && (b + 1) % chunk != 0) {
        next.p = reinterpret_cast<const char*>(j.packed + (b + 1) * K * BLOCK);
        next.lines = K * BLOCK * static_cast<int64_t>(sizeof(bf16)) / 64;
        next.steps = tiles * (K / 2);
      }
      for (int64_t t = 0, m = 0; t < tiles; ++t) {
        const int64_t R = M / tiles + (t < M % tiles);
        with_rows<MAX_R>(R, [&](auto r) { run_tile<decltype(r)::value>(j, b, m, acc, next.p ? &next : nullptr); });
        m += R;
      }
    }
  }
  return y;
}

at::Tensor linear_amx(const at::Tensor& x_, const at::Tensor& packed, int64_t N) {
  TORCH_CHECK(amx_permitted(), "linear_amx: the kernel was refused the AMX tile state");
  check_linear(x_, packed, N);
  const int64_t M = x_.size(0), K = x_.size(1), nb = packed.size(0);
  TORCH_CHECK(K % 32 == 0, "linear_amx: K = ", K, " must be a multiple of 32 (a tile row is 32 of x)");
  at::Tensor y = at::empty({M, N}, x_.options());
  if (M == 0) return y;
  at::Tensor x = x_;  // whole tiles of 16 rows: a partial last one is read from zero-padded rows
  if (M % 16 != 0) {
    x = at::zeros({(M + 15) / 16 * 16, K}, x_.options());
    x.narrow(0, 0, M).copy_(x_);
  }
  const Job j{reinterpret_cast<const bf16*>(x.data_ptr()), x.stride(0), K, N,
              reinterpret_cast<const bf16*>(packed.data_ptr()), reinterpret_cast<bf16*>(y.data_ptr())};
#pragma omp parallel
  {
    alignas(64) float acc[16 * BLOCK];
    load_tiles();
#pragma omp for schedule(static)
    for (int64_t b = 0; b < nb; ++b)
      for (int64_t m = 0; m < M; m += 16) {
        amx_tile(j.x + m * j.xs, j.xs, K, j.packed + b * K * BLOCK, acc);
        store_rows(j, b, m, std::min<int64_t>(16, M - m), acc);
      }
    release_tiles();
  }
  return y;
}

}  // namespace
}  // namespace trnd

TORCH_LIBRARY_FRAGMENT(TRND_LIB, m) {
  m.def("pack_linear(Tensor weight) -> Tensor");
  m.def("linear(Tensor x, Tensor packed, int n) -> Tensor");
  m.def("linear_amx(Tensor x, Tensor packed, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(TRND_LIB, CPU, m) {
  m.impl("pack_linear", &trnd::pack_linear);
  m.impl("linear", &trnd::linear);
  m.impl("linear_amx", &trnd::linear_amx);
}
#endif
