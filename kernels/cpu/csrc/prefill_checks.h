// The argument checks of the prefill attention kernels (csrc/prefill_amx.cpp, csrc/prefill_dpbf16.cpp,
// csrc/prefill_f32.cpp): each bad value gets its own message naming it. And the tiles kernels' work loop.
#pragma once
#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>

#include "vec.h"

namespace trnd {

// q [T, Hq, D] against a contiguous pool kv [pages, layers, 2, Hk, P, D] of the same dtype (bf16 unless the
// kernel says) and the sequence's page table (int64, one entry per page of its prior + T tokens, each inside the
// pool); D a multiple of d_multiple.
inline void check_prefill(const at::Tensor& q, const at::Tensor& kv, int64_t layer, const at::Tensor& pages,
                          int64_t prior, int64_t d_multiple, int64_t max_d, at::ScalarType dt = at::kBFloat16) {
  const char* name = dt == at::kBFloat16 ? "bf16" : "float32";
  TORCH_CHECK(kv.dim() == 6 && kv.is_contiguous() && kv.scalar_type() == dt, "kv: want a contiguous ", name,
              " pool [pages, layers, 2, kv_heads, page_size, head_dim]");
  TORCH_CHECK(0 <= layer && layer < kv.size(1), "layer ", layer, " outside the pool's ", kv.size(1), " layers");
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == dt && q.size(2) == kv.size(5),
              "q: want ", name, " [T, Hq, ", kv.size(5), "], got ", q.sizes());
  const int64_t T = q.size(0), hq = q.size(1), D = q.size(2), hk = kv.size(3), P = kv.size(4);
  TORCH_CHECK(D % d_multiple == 0 && D <= max_d, "head_dim ", D, ": want a multiple of ", d_multiple, ", <= ", max_d);
  TORCH_CHECK(hq % hk == 0, hq, " query heads are not a multiple of ", hk, " KV heads");
  TORCH_CHECK(prior >= 0 && T >= 1, "prior ", prior, ", T ", T);
  const int64_t L = prior + T;
  TORCH_CHECK(pages.scalar_type() == at::kLong && pages.dim() == 1 && pages.size(0) * P >= L,
              "pages: want int64 [>= ", (L + P - 1) / P, "] for ", L, " tokens, got ", pages.sizes());
  const int64_t* table = pages.data_ptr<int64_t>();
  const int64_t ts = pages.stride(0);
  for (int64_t i = 0; i * P < L; ++i)
    TORCH_CHECK(0 <= table[i * ts] && table[i * ts] < kv.size(0), "pages[", i, "] = ", table[i * ts],
                ": outside the pool's ", kv.size(0), " pages");
}

// f(rows, query head, first query) for every block of up to QR queries of a T-query chunk and every query head,
// over the threads, the longest blocks (the last queries: the most keys) first; rows is the block's count as
// std::integral_constant (with_rows), so each tail size runs a tile compiled for it.
template <int QR, typename F>
inline void for_query_blocks(int64_t T, int64_t hq, F&& f) {
  const int64_t nb = (T + QR - 1) / QR;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t it = 0; it < nb * hq; ++it) {
    const int64_t b = nb - 1 - it / hq, h = it % hq;
    with_rows<QR>(std::min<int64_t>(QR, T - b * QR), [&](auto r) { f(r, h, b * QR); });
  }
}

}  // namespace trnd
