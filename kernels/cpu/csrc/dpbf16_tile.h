// The AVX-512 BF16 tile both csrc/linear.cpp and csrc/prefill_dpbf16.cpp multiply with: R <= 6 rows of a bf16
// x against one block of a "k-pair" packed operand, [K/2][64][2] (for a pair of k, 64 columns with each
// column's two values side by side). One 64-byte load is 16 columns x 2 k; one dpbf16 against the broadcast
// pair (x[k], x[k+1]) adds both products into 16 column sums, so no horizontal sum is needed. 6 rows x 4
// vectors = 24 accumulators, + 4 operand vectors + a broadcast of the 32 registers. Out: fp32 [R][64].
#pragma once
#if defined(__AVX512F__)
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "blocks.h"
#include "vec.h"

namespace trnd {

constexpr int64_t TILE_COLS = 64;
constexpr int TILE_MAX_R = 6;
// How far ahead (in k-pairs) the weight stream is prefetched: 16 pairs = 4 KB of a block. The hardware
// prefetcher alone left a one-row decode linear at ~13 GB/s; this distance lifted it to 17-19 GB/s (Intel
// Sapphire Rapids, docs/RESULTS.md "Linears on AMX"). csrc/linear.cpp's AMX tile uses the same distance.
constexpr int64_t PREFETCH_PAIRS = 16;
// A weight streamed from DRAM (the linears) is also prefetched this far ahead into L2: L1's fill buffers bound
// the lines one core has in flight, L2's queue holds more. 64 pairs = 16 KB ahead: a 12-layer pass of the `small`
// linears 1.02-1.10x faster at 1, 4 and 16 rows on AMD Zen 4 (docs/RESULTS.md, "Linears: a second, far
// prefetch into L2"). FAR = 0 (prefill attention: its operand is L2-resident, re-read per row tile): none.
constexpr int64_t FAR_PREFETCH_PAIRS = 64;

// ACC: the sums start from out (row stride os) and go back there, as P V adds into its output rows.
template <int R, int64_t FAR = 0, bool ACC = false>
__attribute__((target("avx512bf16"))) inline void dpbf16_tile(const bf16* x, int64_t xs, int64_t K, const bf16* blk,
                                                              float* out, Spread* nx = nullptr,
                                                              int64_t os = TILE_COLS) {
  constexpr int NV = TILE_COLS / 16;
  __m512 acc[R][NV];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v] = ACC ? _mm512_loadu_ps(out + r * os + v * 16) : _mm512_setzero_ps();
  for (int64_t kp = 0; kp < K / 2; ++kp) {
    const bf16* w = blk + kp * 2 * TILE_COLS;
    if (nx != nullptr) nx->step();
    __m512bh wv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      _mm_prefetch(reinterpret_cast<const char*>(w + PREFETCH_PAIRS * 2 * TILE_COLS + 32 * v), _MM_HINT_T0);
      if constexpr (FAR > 0)
        _mm_prefetch(reinterpret_cast<const char*>(w + FAR * 2 * TILE_COLS + 32 * v), _MM_HINT_T1);
    }
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) wv[v] = (__m512bh)_mm512_loadu_si512(w + 32 * v);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * xs + 2 * kp, 4);
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], xb, wv[v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(out + r * os + v * 16, acc[r][v]);
}

}  // namespace trnd
#endif
