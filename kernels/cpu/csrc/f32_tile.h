// The fp32 register tile both csrc/linear_f32.cpp and csrc/prefill_f32.cpp multiply with: R <= 6 rows of x
// against one block of an operand laid out [K][BLOCK] (for each k, BLOCK = 2 vectors of columns side by side: 16 on
// AVX2, 32 on AVX-512), one broadcast of x[r][k] and two FMAs per row and k, no horizontal sum. 12 accumulators + 2
// operand vectors + a broadcast: AVX2's 16 registers. Out: fp32 [R][BLOCK] at row stride os.
// The operand is fp32, or bf16 (a linear's weight whose values are all bf16, as a bf16 checkpoint's are: half the
// bytes from DRAM), each k-row then W 32-bit pairs (column c in the low half, column W + c in the high) widened
// exactly: the same fp32 FMAs in the same order, the same bits out.
#pragma once
#include <immintrin.h>

#include <cstdint>

#include "blocks.h"
#include "vec.h"

namespace trnd {

constexpr int64_t F32_BLOCK = 2 * W;  // output columns per block
constexpr int F32_MAX_R = 6;
// pf: rows of the block itself to prefetch, one k-row (64 bytes on AVX2, 128 on AVX-512) per k, or nothing (null):
// the linear's (csrc/linear_f32.cpp) first tile over a block streams it from DRAM, this far ahead. nx (where SPREAD):
// the next block's lines, spread over the k steps of all the block's tiles (csrc/blocks.h), so the later tiles,
// compute-bound on the block from L2, keep DRAM busy. A template flag, not a null check: at one row the loop is two
// FMAs, and a branch per k cost a 12-layer pass ~7%.
inline void block_row(const float* w, vf& w0, vf& w1) {
  w0 = vload(w);
  w1 = vload(w + W);
}
inline void block_row(const bf16* w, vf& w0, vf& w1) { vload_pairs(w, w0, w1); }

template <int R, bool SPREAD = false, typename T>
inline void f32_tile(const float* x, int64_t xs, int64_t K, const T* blk, const T* pf, float* out,
                     int64_t os = F32_BLOCK, Spread* nx = nullptr) {
  vf acc[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = vzero();
  for (int64_t k = 0; k < K; ++k) {
    const T* w = blk + k * F32_BLOCK;
    if (pf != nullptr) {  // into L2 (the next block would push this one's rows out of L1)
      _mm_prefetch(reinterpret_cast<const char*>(pf + k * F32_BLOCK), _MM_HINT_T1);
      if constexpr (F32_BLOCK * sizeof(T) > 64)
        _mm_prefetch(reinterpret_cast<const char*>(pf + k * F32_BLOCK) + 64, _MM_HINT_T1);
    }
    if constexpr (SPREAD) nx->step();
    vf w0, w1;
    block_row(w, w0, w1);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const vf xb = vset(x[r * xs + k]);
      acc[r][0] = vfma(xb, w0, acc[r][0]);
      acc[r][1] = vfma(xb, w1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    vstore(out + r * os, acc[r][0]);
    vstore(out + r * os + W, acc[r][1]);
  }
}

}  // namespace trnd
