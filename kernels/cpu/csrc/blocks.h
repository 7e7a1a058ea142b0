// How the linears' threads share a weight's column blocks (csrc/linear.cpp, csrc/linear_f32.cpp): the chunk of
// their `omp for schedule(dynamic, chunk)` over the blocks.
//
// Prefill-sized calls (DYNAMIC_TILES row tiles or more): every block is long work from L2, so the threads take
// blocks one at a time as they free up, and one preempted by other work on the cores (the HTTP server, a client)
// does not hold the others at the end of every linear: a 512-token prefill 0.5-3.7 ms faster offline (of ~215;
// docs/RESULTS.md, "Issue 15 on 2026-12-06"). Decode-sized: one contiguous range per thread, so each can prefetch
// the next block of its range under the current one (a block b + 1 with (b + 1) % chunk != 0).
#pragma once
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>

namespace trnd {

constexpr int64_t DYNAMIC_TILES = 8;

inline int64_t block_chunk(int64_t tiles, int64_t nb) {
  const int64_t threads = std::max(1, omp_get_max_threads());
  return tiles >= DYNAMIC_TILES ? 1 : (nb + threads - 1) / threads;
}

// Lines of another operand (the next block a thread multiplies) prefetched into L2 at an even rate over the
// k steps of the tiles before it: `lines` spread over `steps` calls of step(). With more than one row tile, the
// tiles after a block's first read it from L2 while DRAM would idle; this keeps DRAM streaming under all of them.
struct Spread {
  const char* p = nullptr;
  int64_t lines = 0, steps = 1, acc = 0, l = 0;
  inline void step() {
    acc += lines;
    while (acc >= steps) {
      _mm_prefetch(p + (l++) * 64, _MM_HINT_T1);
      acc -= steps;
    }
  }
};

}  // namespace trnd
