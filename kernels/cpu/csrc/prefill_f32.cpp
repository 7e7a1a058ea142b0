// Prefill attention in fp32, in both builds (AVX2 + FMA and AVX-512): one chunk's queries against its sequence's
// pages, causal (the cached prefix and the chunk itself: the model writes the chunk's K/V first). What an fp32 pool
// runs, i.e. every CPU without bf16 in hardware (AMD Zen 3). Torch reference: kernels/attention.py
// prefill_attention (the test oracle).
//
// Why: torch's CPU flash kernel ran a 512-token chunk of the `small` model at ~66 GFLOP/s on AMD Zen 4 capped to
// AVX2, 15% of the prefill (the linears, at ~196 GFLOP/s, are the rest); and it wants the context gathered out of
// the pages first. Here both products are register tiles of the fp32 linear's shape (csrc/linear_f32.cpp):
//   S = Q K^T: R = 6 queries of one head by a block of KB = 2 vectors of keys (16 on AVX2, 32 on AVX-512), over
//     head_dim: one broadcast of q[r][d] and two FMAs per row, K laid out once per call as [L/KB][D][KB];
//   O = O * alpha + P V: the same 6 rows by 2 vectors of head_dim, over the block's keys, V read in place from
//     its pages (a row pointer per key).
// 12 accumulators + 2 operand vectors + a broadcast: AVX2's 16 registers. Flash-style: per (query head, block
// of 6 queries) the keys go 64 at a time (the S tiles of a step side by side) up to the block's last query, with
// an online softmax (max and sum per row, O rescaled as each step's keys are added): per-row costs (the max, the
// sum, the rescale of O) once per 64 keys, not per tile. The G query heads of a KV head share its laid-out K (in cache).
// head_dim a multiple of 32.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>

#include "f32_tile.h"
#include "prefill_checks.h"
#include "vec.h"

namespace trnd {
namespace {

constexpr int64_t FKB = F32_BLOCK;  // keys per S tile (f32_tile.h)
constexpr int64_t FSTEP = 64;   // keys per softmax step: 4 tiles on AVX2, 2 on AVX-512
constexpr int FQR = 6;          // queries per block
constexpr int64_t F_MAX_D = 256;
constexpr float F_NEG_INF = -std::numeric_limits<float>::infinity();
alignas(64) const float kZeroRow[F_MAX_D] = {};  // V of the keys past the context (their P is 0)

struct F32Ctx {  // one call's shared state
  const float* q;
  int64_t qs0, qs1, G, D, prior, L, Lp;
  const float* kt;  // [hk][Lp/KB][D][KB]
  const float* pool;
  const int64_t* table;
  int64_t ts, page_stride, layer_off, hk, P;
  float scale;
  float* out;
  int64_t os0, os1;

  const float* v_row(int64_t h, int64_t j) const {
    if (j >= L) return kZeroRow;
    return pool + table[(j / P) * ts] * page_stride + layer_off + hk * P * D + (h * P + j % P) * D;
  }
};

// K of KV head h from its pages into [Lp/KB][D][KB] (for each d the block's keys side by side); keys past L are 0.
void lay_out_k(const F32Ctx& c, int64_t h, float* kt) {
  const int64_t D = c.D;
  for (int64_t j = 0; j < c.Lp; ++j) {
    float* kb = kt + (j / FKB) * FKB * D + j % FKB;
    if (j >= c.L) {
      for (int64_t d = 0; d < D; ++d) kb[d * FKB] = 0.0f;
      continue;
    }
    const float* k = c.pool + c.table[(j / c.P) * c.ts] * c.page_stride + c.layer_off + (h * c.P + j % c.P) * D;
    for (int64_t d = 0; d < D; ++d) kb[d * FKB] = k[d];
  }
}

template <int R>
void run_f32_block(const F32Ctx& c, int64_t hq, int64_t t0) {
  const int64_t h = hq / c.G, D = c.D;
  const float* x = c.q + t0 * c.qs0 + hq * c.qs1;
  const float* kt = c.kt + h * c.Lp * D;
  alignas(64) float s[R * FSTEP];
  alignas(64) float o[R * F_MAX_D];
  const float* vrow[FSTEP];
  float m[R], l[R], alpha[R];
  for (int r = 0; r < R; ++r) m[r] = F_NEG_INF, l[r] = 0.0f;
  std::fill(o, o + R * D, 0.0f);
  const int64_t last = c.prior + t0 + R - 1;  // the block's last query's position: its keys are [0, last]
  for (int64_t k0 = 0; k0 <= last; k0 += FSTEP) {
    for (int64_t kb0 = 0; kb0 < FSTEP; kb0 += FKB)  // S = x K^T (unscaled), one tile of KB keys at a time
      f32_tile<R>(x, c.qs0, D, kt + (k0 + kb0) * D, static_cast<const float*>(nullptr), s + kb0, FSTEP);
    for (int r = 0; r < R; ++r) {  // the online softmax over the step's keys, row by row
      float* sr = s + r * FSTEP;
      const int64_t first_masked = std::max<int64_t>(0, c.prior + t0 + r - k0 + 1);  // keys past row r's position
      for (int64_t j = first_masked; j < FSTEP; ++j) sr[j] = F_NEG_INF;
      vf mx = vload(sr);
      for (int64_t j = W; j < FSTEP; j += W) mx = vmax(mx, vload(sr + j));
      // scale > 0: the max of the scaled scores is the scaled max, rounding included
      const float mnew = std::max(m[r], c.scale * vhmax(mx));  // finite: the first step has key 0
      alpha[r] = m[r] == F_NEG_INF ? 0.0f : std::exp(m[r] - mnew);
      const vf mv = vset(mnew), sc = vset(c.scale);
      for (int64_t j = 0; j < FSTEP; j += W) vstore(sr + j, vexp(vsub(vmul(vload(sr + j), sc), mv)));
      for (int64_t j = first_masked; j < FSTEP; ++j) sr[j] = 0.0f;  // vexp gives ~1e-38 for -inf, not 0
      vf sum = vload(sr);
      for (int64_t j = W; j < FSTEP; j += W) sum = vadd(sum, vload(sr + j));
      l[r] = l[r] * alpha[r] + vsum(sum);
      m[r] = mnew;
    }
    const int64_t keys = std::min<int64_t>(FSTEP, last + 1 - k0);  // past these, every row's P is 0
    for (int64_t j = 0; j < keys; ++j) vrow[j] = c.v_row(h, k0 + j);
    for (int64_t dc = 0; dc < D; dc += 2 * W) {  // O = O * alpha + P V, two vectors of head_dim at a time
      vf acc[R][2];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        acc[r][0] = vmul(vload(o + r * D + dc), vset(alpha[r]));
        acc[r][1] = vmul(vload(o + r * D + dc + W), vset(alpha[r]));
      }
      for (int64_t j = 0; j < keys; ++j) {
        const vf v0 = vload(vrow[j] + dc), v1 = vload(vrow[j] + dc + W);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const vf pb = vset(s[r * FSTEP + j]);
          acc[r][0] = vfma(pb, v0, acc[r][0]);
          acc[r][1] = vfma(pb, v1, acc[r][1]);
        }
      }
      for (int r = 0; r < R; ++r) {
        vstore(o + r * D + dc, acc[r][0]);
        vstore(o + r * D + dc + W, acc[r][1]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    float* dst = c.out + (t0 + r) * c.os0 + hq * c.os1;
    const vf inv = vset(1.0f / l[r]);
    for (int64_t d = 0; d < D; d += W) vstore(dst + d, vmul(vload(o + r * D + d), inv));
  }
}

at::Tensor prefill_attention_f32(const at::Tensor& q_, const at::Tensor& kv, int64_t layer, const at::Tensor& pages,
                                 int64_t prior, double scale) {
  check_prefill(q_, kv, layer, pages, prior, 32, F_MAX_D, at::kFloat);
  const at::Tensor q = q_.stride(2) == 1 ? q_ : q_.contiguous();
  const int64_t T = q.size(0), hq = q.size(1), D = q.size(2), hk = kv.size(3), P = kv.size(4), L = prior + T;
  const int64_t Lp = (L + FSTEP - 1) / FSTEP * FSTEP;
  std::unique_ptr<float[]> kt(new float[hk * Lp * D]);  // lay_out_k writes all of it
  auto out = at::empty({T, hq, D}, q.options());
  const F32Ctx c{q.data_ptr<float>(), q.stride(0), q.stride(1), hq / hk, D, prior, L, Lp, kt.get(),
                 kv.data_ptr<float>(), pages.data_ptr<int64_t>(), pages.stride(0), kv.stride(0),
                 layer * kv.stride(1), hk, P, static_cast<float>(scale), out.data_ptr<float>(), out.stride(0),
                 out.stride(1)};
#pragma omp parallel for schedule(static)
  for (int64_t h = 0; h < hk; ++h) lay_out_k(c, h, kt.get() + h * Lp * D);
  for_query_blocks<FQR>(T, hq, [&](auto r, int64_t h, int64_t t0) { run_f32_block<decltype(r)::value>(c, h, t0); });
  return out;
}

}  // namespace
}  // namespace trnd

TORCH_LIBRARY_FRAGMENT(TRND_LIB, m) {
  m.def("prefill_attention_f32(Tensor q, Tensor kv, int layer, Tensor pages, int prior, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(TRND_LIB, CPU, m) {
  m.impl("prefill_attention_f32", &trnd::prefill_attention_f32);
}
