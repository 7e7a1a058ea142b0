// Prefill attention with AVX-512 BF16 dot products, for CPUs without AMX (AMD Zen 4): one chunk's queries
// against its sequence's pages, causal (the cached prefix and the chunk itself: the model writes the chunk's
// K/V first). Torch reference: kernels/attention.py prefill_attention (the test oracle).
//
// Why: one row per query (the decode kernel, what short contexts took) reads the whole context per query, and
// torch's flash kernel runs bf16 at ~64 GFLOP/s on Zen 4. Here both products are matmuls on dpbf16_tile.h:
//   S = Q K^T: the tile's x is R = 6 queries of one head, its operand the context's K laid out once per call
//     in k-pair order over head_dim ([L/64][D/2][64 keys][2]): 64 keys' scores a tile;
//   O += P V: x is the 6 rows of probabilities rounded to bf16 (as torch's CPU flash kernel rounds them), the
//     operand V laid out in k-pair order over keys ([L/64][D/64][32 key pairs][64 d][2]).
// Flash-style: per (query head, block of 6 queries) the keys go 64 at a time up to the block's last query, with
// an online softmax in fp32 (O, max and sum per row, O rescaled per key block), P V adding straight into O. The
// G query heads of a KV head share its laid-out K and V (in cache). head_dim a multiple of 64. The softmax was a
// quarter of the time: its exponentials are vec.h's pow2_bf16 (P is rounded to bf16 anyway) and P is rounded
// by the bf16 convert instruction; the diagonal block's P V stops at the last visible key. 1.11-1.14x over the
// kernel before (docs/RESULTS.md, "Prefill attention: a shorter softmax").
//
// AVX-512 build only; used where kernels/cpuinfo.py found avx512_bf16 and no AMX (kernels/cpu/__init__.py).
#if defined(__AVX512F__)
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>

#include "dpbf16_tile.h"
#include "prefill_checks.h"
#include "vec.h"

namespace trnd {
namespace {

constexpr int64_t KB = TILE_COLS;  // keys per block
constexpr int QR = TILE_MAX_R;     // queries per block
constexpr int64_t MAX_D = 256;
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

struct Ctx {  // one call's shared state
  const bf16* q;
  int64_t qs0, qs1, G, D, prior, Lp;
  const bf16* kt;  // [hk][Lp/64][D/2][64][2]
  const bf16* vp;  // [hk][Lp/64][D/64][32][64][2]
  float scale;
  bf16* out;
  int64_t os0, os1;
};

// K and V of KV head h, from its pages into the two operand layouts; the keys past L, up to the block's end,
// are zero (the buffers are not initialized: everything else is written here). K goes a key at a time as
// 32-bit (d, d + 1) pairs, each to its pair's row of the block; V a pair of keys at a time, the two rows
// interleaved by one permute per 16 d (a key's row is contiguous in its page, and in the operand each d
// holds the pair's two values side by side).
void lay_out(const bf16* pool, const int64_t* table, int64_t ts, int64_t page_stride, int64_t layer_off, int64_t hk,
             int64_t P, int64_t h, int64_t L, int64_t Lp, int64_t D, bf16* kt, bf16* vp) {
  auto row = [&](int64_t j) -> const bf16* {  // key j's K row (its V row is hk * P * D further), or none past L
    return j < L ? pool + table[(j / P) * ts] * page_stride + layer_off + (h * P + j % P) * D : nullptr;
  };
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37,
                                      5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int64_t j = 0; j < Lp; j += 2) {
    const bf16* k0 = row(j);
    const bf16* k1 = row(j + 1);
    const int64_t b = j / KB, c = j % KB;
    uint32_t* kb = reinterpret_cast<uint32_t*>(kt + b * KB * D);  // [D/2][64] pairs of d
    for (int i = 0; i < 2; ++i) {
      const uint32_t* kw = reinterpret_cast<const uint32_t*>(i ? k1 : k0);
      for (int64_t pd = 0; pd < D / 2; ++pd) kb[pd * KB + c + i] = kw ? kw[pd] : 0u;
    }
    bf16* vb = vp + b * KB * D + (c / 2) * 128;  // [D/64][32][64][2]: this key pair's 64 d of each block of 64
    for (int64_t d = 0; d < D; d += 32) {
      const __m512i v0 = k0 ? _mm512_loadu_si512(k0 + hk * P * D + d) : _mm512_setzero_si512();
      const __m512i v1 = k1 ? _mm512_loadu_si512(k1 + hk * P * D + d) : _mm512_setzero_si512();
      bf16* dst = vb + (d / 64) * KB * 64 + (d % 64) * 2;
      _mm512_storeu_si512(dst, _mm512_permutex2var_epi16(v0, lo, v1));
      _mm512_storeu_si512(dst + 32, _mm512_permutex2var_epi16(v0, hi, v1));
    }
  }
}

// e rounded to bf16 (nearest even) into dst; returns the rounded values as fp32 (what the sum must add).
__attribute__((target("avx512bf16"))) inline vf store_bf16(bf16* dst, vf e) {
  const __m256i b = (__m256i)_mm512_cvtneps_pbh(e);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), b);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

template <int R>
void run_block(const Ctx& c, int64_t hq, int64_t t0) {
  const int64_t h = hq / c.G, D = c.D;
  const bf16* x = c.q + t0 * c.qs0 + hq * c.qs1;
  const bf16* kt = c.kt + h * c.Lp * D;
  const bf16* vp = c.vp + h * c.Lp * D;
  alignas(64) float s[R * KB];
  alignas(64) bf16 p[R * KB];
  alignas(64) float o[R * MAX_D];
  float m[R], l[R];
  for (int r = 0; r < R; ++r) m[r] = NEG_INF, l[r] = 0.0f;
  std::fill(o, o + R * D, 0.0f);
  const int64_t last = c.prior + t0 + R - 1;  // the block's last query's position: its keys are [0, last]
  constexpr float LOG2E = 1.44269504088896341f;
  const vf scale2 = vset(c.scale * LOG2E);
  for (int64_t b = 0; b * KB <= last; ++b) {
    dpbf16_tile<R>(x, c.qs0, D, kt + b * KB * D, s);
    for (int r = 0; r < R; ++r) {
      const int64_t limit = c.prior + t0 + r - b * KB;  // keys [0, limit] of this block are visible to row r
      float* sr = s + r * KB;
      // the max of the raw scores (scale > 0): the masked keys of the diagonal block set to -inf in place
      vf mx = vset(NEG_INF);
      for (int64_t j = 0; j < KB; j += 16) {
        vf v = vload(sr + j);
        if (j + 15 > limit) {
          const int64_t n = limit < j ? 0 : std::min<int64_t>(16, limit - j + 1);
          const __mmask16 keep = static_cast<__mmask16>((1u << n) - 1);
          v = _mm512_mask_blend_ps(keep, vset(NEG_INF), v);
          vstore(sr + j, v);
        }
        mx = vmax(mx, v);
      }
      const float mnew = std::max(m[r], vhmax(mx) * c.scale);
      const float alpha = m[r] == NEG_INF ? 0.0f : std::exp(m[r] - mnew);
      const vf mv = vset(mnew * LOG2E);
      vf sum = vzero();
      for (int64_t j = 0; j < KB; j += 16) {
        const vf v = vload(sr + j);
        vf e = pow2_bf16(_mm512_fmsub_ps(v, scale2, mv));
        if (j + 15 > limit) e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, vset(NEG_INF), _CMP_NEQ_OQ), e);
        sum = vadd(sum, store_bf16(p + r * KB + j, e));  // P as the PV product sees it: the sum matches it
      }
      l[r] = l[r] * alpha + vsum(sum);
      m[r] = mnew;
      if (alpha != 1.0f)
        for (int64_t d = 0; d < D; d += 16) vstore(o + r * D + d, vmul(vload(o + r * D + d), vset(alpha)));
    }
    // keys past the block's last query are zero in P: the product stops at the last visible pair
    const int64_t keys = std::min<int64_t>(KB, (last - b * KB + 2) / 2 * 2);
    for (int64_t db = 0; db < D / 64; ++db)
      dpbf16_tile<R, 0, true>(p, KB, keys, vp + b * KB * D + db * KB * 64, o + db * 64, nullptr, D);
  }
  for (int r = 0; r < R; ++r) {
    bf16* dst = c.out + (t0 + r) * c.os0 + hq * c.os1;
    const vf inv = vset(1.0f / l[r]);
    for (int64_t d = 0; d < D; d += 16) vstore(dst + d, vmul(vload(o + r * D + d), inv));
  }
}

at::Tensor prefill_attention_dpbf16(const at::Tensor& q_, const at::Tensor& kv, int64_t layer, const at::Tensor& pages,
                                    int64_t prior, double scale) {
  check_prefill(q_, kv, layer, pages, prior, 64, MAX_D);
  const at::Tensor q = q_.stride(2) == 1 ? q_ : q_.contiguous();
  const int64_t T = q.size(0), hq = q.size(1), D = q.size(2), hk = kv.size(3), P = kv.size(4), L = prior + T;
  const int64_t* table = pages.data_ptr<int64_t>();
  const int64_t ts = pages.stride(0);
  const int64_t Lp = (L + KB - 1) / KB * KB;
  std::unique_ptr<bf16[]> kt(new bf16[hk * Lp * D]), vp(new bf16[hk * Lp * D]);  // lay_out writes all of it
  const bf16* pool = static_cast<const bf16*>(kv.data_ptr());
  const int64_t page_stride = kv.stride(0), layer_off = layer * kv.stride(1);
#pragma omp parallel for schedule(static)
  for (int64_t h = 0; h < hk; ++h)
    lay_out(pool, table, ts, page_stride, layer_off, hk, P, h, L, Lp, D, kt.get() + h * Lp * D,
            vp.get() + h * Lp * D);
  auto out = at::empty({T, hq, D}, q.options());
  const Ctx c{static_cast<const bf16*>(q.data_ptr()), q.stride(0), q.stride(1), hq / hk, D, prior, Lp, kt.get(),
              vp.get(), static_cast<float>(scale), static_cast<bf16*>(out.data_ptr()), out.stride(0), out.stride(1)};
  for_query_blocks<QR>(T, hq, [&](auto r, int64_t h, int64_t t0) { run_block<decltype(r)::value>(c, h, t0); });
  return out;
}

}  // namespace
}  // namespace trnd

TORCH_LIBRARY_FRAGMENT(TRND_LIB, m) {
  m.def("prefill_attention_dpbf16(Tensor q, Tensor kv, int layer, Tensor pages, int prior, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(TRND_LIB, CPU, m) {
  m.impl("prefill_attention_dpbf16", &trnd::prefill_attention_dpbf16);
}
#endif
