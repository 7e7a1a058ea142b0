// Prefill attention on AMX tiles (Sapphire Rapids and later): one chunk's queries against its sequence's pages,
// causal, read in place (the cached prefix and the chunk itself: the model writes the chunk's K/V first).
// Torch reference: kernels/attention.py prefill_attention (the test oracle).
//
// Flash-style: per (query head, block of 16 queries) the keys go 32 at a time. Scores are computed transposed,
// S^T = K Q^T, so K is read straight from its pages as the tiles' A operand and the online softmax runs with
// the 16 queries in the lanes (no horizontal sums); P is rounded to bf16 (as torch's CPU flash kernel does)
// and O^T += V^T P^T on tiles. V of each KV head is copied once per call into V^T tiles, shared by the G query
// heads of its group. O^T stays in tiles (head_dim <= 64) and is rescaled only when a query's max grows by
// RESCALE_AT; the scale rides in the exponent (2^x). A 512-token chunk of the `small` model: 0.59 ms a layer
// against torch's flash kernel's 1.04 ms (the prefill step ~78 -> 71 ms); the softmax on AVX-512 and the
// tiles' loads and stores, one step after another, are the cost now.//
// Built into the AVX-512 library only (elsewhere the op says so); the AMX instructions are enabled per function
// (target attribute), and used only where kernels/cpuinfo.py found amx_bf16 and the kernel was granted the
// tile state (amx_ready).
#include <ATen/ATen.h>
#include <torch/library.h>
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "amx_tiles.h"
#include "prefill_checks.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "vec.h"

namespace trnd {
namespace {

constexpr int64_t QB = 16;  // queries per block: the tiles' rows
constexpr int64_t KB = 32;  // keys per step: one bf16 tile of P is 16 x 32
constexpr int64_t MAX_D = 256;

#if defined(__AVX512F__)

// V of one KV head, keys [0, L) read from the pages (zeros after, up to Lp = L rounded up to KB), laid out as
// the A operand of O^T = V^T P^T: per block of 32 keys and chunk of 16 dims, a tile of 16 rows (dims) x 32 keys.
void lay_out_v(const bf16* kv, const int64_t* table, int64_t ts, int64_t page_stride, int64_t layer_off, int64_t hk,
               int64_t P, int64_t h, int64_t L, int64_t Lp, int64_t D, uint16_t* vt) {
  for (int64_t j = 0; j < Lp; ++j) {
    const uint16_t* v = j < L ? reinterpret_cast<const uint16_t*>(kv + table[(j / P) * ts] * page_stride + layer_off +
                                                                   (hk * P + h * P + j % P) * D)
                              : nullptr;
    uint16_t* dst = vt + (j / KB) * KB * D + j % KB;
    for (int64_t d = 0; d < D; ++d) dst[(d / 16) * 512 + (d % 16) * KB] = v ? v[d] : 0;
  }
}

// tmm0 K (A), tmm1 Q^T (B), tmm2 / tmm3 S^T for keys 0-15 / 16-31; then, head_dim <= 64, tmm2 P^T (B), tmm3
// V^T (A) and tmm4-7 O^T; else tmm4 V^T, tmm5 P^T, tmm6 one chunk of O^T (amx_tiles.h's configuration).
#define TRND_AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512bf16")))

// O^T held in tiles tmm4..tmm7 (head_dim <= 64: up to four 16-dim chunks); the tile number must be an immediate.
TRND_AMX inline void o_zero(int64_t c) {
  switch (c) { case 0: _tile_zero(4); break; case 1: _tile_zero(5); break; case 2: _tile_zero(6); break;
               default: _tile_zero(7); }
}
TRND_AMX inline void o_dp(int64_t c) {  // O^T chunk c += V^T (tmm3) P^T (tmm2)
  switch (c) { case 0: _tile_dpbf16ps(4, 3, 2); break; case 1: _tile_dpbf16ps(5, 3, 2); break;
               case 2: _tile_dpbf16ps(6, 3, 2); break; default: _tile_dpbf16ps(7, 3, 2); }
}
TRND_AMX inline void o_store(int64_t c, float* p) {
  switch (c) { case 0: _tile_stored(4, p, 64); break; case 1: _tile_stored(5, p, 64); break;
               case 2: _tile_stored(6, p, 64); break; default: _tile_stored(7, p, 64); }
}
TRND_AMX inline void o_load(int64_t c, const float* p) {
  switch (c) { case 0: _tile_loadd(4, p, 64); break; case 1: _tile_loadd(5, p, 64); break;
               case 2: _tile_loadd(6, p, 64); break; default: _tile_loadd(7, p, 64); }
}

// A query's running max may fall behind its true max by this much (e^8 in the probabilities, far inside fp32's
// and bf16's range) before O and l are rescaled: with O in tiles a rescale is a store, 64 multiplies and a
// load, so it is done only when a max grows that much, not every step (FlashAttention-4's lazy rescaling).
constexpr float RESCALE_AT = 8.0f;

// One block of up to 16 queries of one query head: rows [q0, q0 + nq) of the chunk, at positions prior + i.
// Scores go transposed, S^T = K Q^T (keys as tile rows, the 16 queries as lanes): K is read straight from its
// pages as the A operand, the softmax runs across 32 key vectors with no horizontal sums, and P^T feeds
// O^T += V^T P^T (dims x queries, fp32).
template <bool TILE_O>  // O^T in tiles with lazy rescaling (head_dim <= 64), else in L1 rescaled every step
TRND_AMX void run_block(
    const bf16* q, int64_t qs0, int64_t qs1, int64_t hq_idx, int64_t q0, int64_t nq, int64_t prior, int64_t L,
    const bf16* kv, const int64_t* table, int64_t ts, int64_t page_stride, int64_t layer_off, int64_t P, int64_t h,
    int64_t D, const uint16_t* vt, float scale, bf16* out, int64_t os0, int64_t os1) {
  alignas(64) uint32_t qt[MAX_D * 8];  // Q^T: per chunk of 32 dims, 16 rows (dim pairs) x 16 queries
  alignas(64) float st[KB * 16];       // S^T: 32 keys x 16 queries
  alignas(64) uint16_t pt[KB * 16];    // P^T as pairs: 16 rows (key pairs) x 16 queries x 2
  alignas(64) float pv[16 * 16];
  alignas(64) float ot[MAX_D * 16];    // O^T: dims x queries
  alignas(64) static const uint16_t zeros[16 * 32] = {};
  for (int64_t m = 0; m < QB; ++m) {
    const uint32_t* row = reinterpret_cast<const uint32_t*>(q + (q0 + std::min(m, nq - 1)) * qs0 + hq_idx * qs1);
    for (int64_t u = 0; u < D / 2; ++u) qt[(u / 16) * 256 + (u % 16) * 16 + m] = row[u];
  }
  if constexpr (TILE_O)
    for (int64_t c = 0; c < D / 16; ++c) o_zero(c);  // ot is only ever written from the tiles
  else
    std::memset(ot, 0, sizeof(float) * D * 16);
  const __m512 vtau = _mm512_set1_ps(RESCALE_AT / scale), vlog = _mm512_set1_ps(scale * 1.44269504088896341f);
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512i lanes = _mm512_min_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                         _mm512_set1_epi32(static_cast<int>(nq - 1)));  // a short block's extras
  const __m512i pair = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                        21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  __m512 mrun = ninf, lrun = _mm512_setzero_ps();
  const int64_t end = prior + q0 + nq;  // keys [0, end) are seen by some query of the block
  for (int64_t k0 = 0; k0 < end; k0 += KB) {
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t half = 0; half < 2; ++half) {
      const int64_t j = k0 + 16 * half;
      const bf16* K = j < L ? kv + table[(j / P) * ts] * page_stride + layer_off + (h * P + j % P) * D : nullptr;
      for (int64_t c = 0; c < D / 32; ++c) {
        if (K != nullptr) _tile_loadd(0, K + c * 32, D * 2);
        else _tile_loadd(0, zeros, 64);
        _tile_loadd(1, qt + c * 256, 64);
        if (half == 0) _tile_dpbf16ps(2, 0, 1);
        else _tile_dpbf16ps(3, 0, 1);
      }
    }
    _tile_stored(2, st, 64);
    _tile_stored(3, st + 256, 64);
    // query m (position prior + q0 + m) sees key k0 + j iff k0 + j - prior - q0 <= m, and k0 + j < L. Scores
    // stay raw (the max is the same), the scale goes into the exponent: p = 2^((s - m) scale log2 e).
    const bool masked = k0 + KB > prior + q0 + 1 || k0 + KB > L;
    __m512 mx = ninf;
    for (int64_t j = 0; j < KB; ++j) {
      __m512 sj = _mm512_load_ps(st + j * 16);
      if (masked) {
        const __mmask16 seen = k0 + j < L ? _mm512_cmpge_epi32_mask(lanes, _mm512_set1_epi32(
                                                static_cast<int>(k0 + j - prior - q0)))
                                          : static_cast<__mmask16>(0);
        sj = _mm512_mask_blend_ps(seen, ninf, sj);
        _mm512_store_ps(st + j * 16, sj);
      }
      mx = _mm512_max_ps(mx, sj);
    }
    __m512 corr = _mm512_set1_ps(1.0f);
    if (k0 == 0) {  // every query sees key 0: the first step's max is finite, and O and l are still zero
      mrun = mx;
    } else if (!TILE_O || _mm512_cmp_ps_mask(mx, _mm512_add_ps(mrun, vtau), _CMP_GT_OQ)) {
      const __m512 mnew = _mm512_max_ps(mrun, mx);
      corr = pow2_bf16(_mm512_mul_ps(_mm512_sub_ps(mrun, mnew), vlog));
      mrun = mnew;
      if constexpr (TILE_O) {
        for (int64_t c = 0; c < D / 16; ++c) {
          o_store(c, ot + c * 256);
          for (int64_t d = 0; d < 16; ++d) {
            float* o = ot + (c * 16 + d) * 16;
            _mm512_store_ps(o, _mm512_mul_ps(_mm512_load_ps(o), corr));
          }
          o_load(c, ot + c * 256);
        }
      }
    }
    const __m512 mlog = _mm512_mul_ps(mrun, vlog);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < KB; j += 2) {
      const __m512 a = _mm512_load_ps(st + j * 16), b = _mm512_load_ps(st + (j + 1) * 16);
      __m512 pa = pow2_bf16(_mm512_fmsub_ps(a, vlog, mlog)), pb = pow2_bf16(_mm512_fmsub_ps(b, vlog, mlog));
      if (masked) {  // a masked key's probability must be exactly 0 (its V row may be anything)
        pa = _mm512_maskz_mov_ps(_mm512_cmpneq_ps_mask(a, ninf), pa);
        pb = _mm512_maskz_mov_ps(_mm512_cmpneq_ps_mask(b, ninf), pb);
      }
      sum = _mm512_add_ps(sum, _mm512_add_ps(pa, pb));
      const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(pb, pa);  // [pa as bf16, pb as bf16]
      _mm512_store_si512(pt + j * 16, _mm512_permutexvar_epi16(pair, both));  // (pa[m], pb[m]) pairs
    }
    lrun = _mm512_fmadd_ps(lrun, corr, sum);
    if constexpr (TILE_O) {
      _tile_loadd(2, pt, 64);
      for (int64_t c = 0; c < D / 16; ++c) {
        _tile_loadd(3, vt + ((k0 / KB) * (D / 16) + c) * 512, 64);
        o_dp(c);
      }
    } else {
      _tile_loadd(5, pt, 64);
      for (int64_t c = 0; c < D / 16; ++c) {
        _tile_zero(6);
        _tile_loadd(4, vt + ((k0 / KB) * (D / 16) + c) * 512, 64);
        _tile_dpbf16ps(6, 4, 5);
        _tile_stored(6, pv, 64);
        for (int64_t d = 0; d < 16; ++d) {
          float* o = ot + (c * 16 + d) * 16;
          _mm512_store_ps(o, _mm512_fmadd_ps(_mm512_load_ps(o), corr, _mm512_load_ps(pv + d * 16)));
        }
      }
    }
  }
  if constexpr (TILE_O)
    for (int64_t c = 0; c < D / 16; ++c) o_store(c, ot + c * 256);
  alignas(64) float inv[16];
  _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), lrun));
  for (int64_t m = 0; m < nq; ++m) {
    bf16* dst = out + (q0 + m) * os0 + hq_idx * os1;
    for (int64_t d = 0; d < D; ++d) dst[d] = bf16(ot[d * 16 + m] * inv[m]);
  }
}

#endif  // __AVX512F__

bool amx_ready() {
#if defined(__AVX512F__)
  return amx_permitted();
#else
  return false;
#endif
}

at::Tensor prefill_attention_amx(const at::Tensor& q_, const at::Tensor& kv, int64_t layer, const at::Tensor& pages,
                                 int64_t prior, double scale) {
#if !defined(__AVX512F__)
  TORCH_CHECK(false, "prefill_attention_amx needs the AVX-512 build");
#else
  TORCH_CHECK(amx_permitted(), "prefill_attention_amx: the kernel was refused the AMX tile state");
  check_prefill(q_, kv, layer, pages, prior, 32, MAX_D);
  const at::Tensor q = q_.contiguous();
  const int64_t T = q.size(0), hq = q.size(1), D = q.size(2), hk = kv.size(3), P = kv.size(4), L = prior + T;
  const int64_t* table = pages.data_ptr<int64_t>();
  const int64_t ts = pages.stride(0);
  TORCH_CHECK(P % 16 == 0, "page_size ", P, ": want a multiple of 16 (the tiles take 16 keys of a page)");
  const int64_t Lp = (L + KB - 1) / KB * KB;
  std::vector<uint16_t> vt(hk * Lp * D);
  const bf16* pool = static_cast<const bf16*>(kv.data_ptr());
  const int64_t page_stride = kv.stride(0), layer_off = layer * kv.stride(1);
#pragma omp parallel for schedule(static)
  for (int64_t h = 0; h < hk; ++h)
    lay_out_v(pool, table, ts, page_stride, layer_off, hk, P, h, L, Lp, D, vt.data() + h * Lp * D);
  auto out = at::empty({T, hq, D}, q.options());
  const int64_t nb = (T + QB - 1) / QB, G = hq / hk;
  const bf16* qp = static_cast<const bf16*>(q.data_ptr());
  bf16* op = static_cast<bf16*>(out.data_ptr());
#pragma omp parallel
  {
    load_tiles();
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < nb * hq; ++it) {
      const int64_t b = nb - 1 - it / hq, h = it % hq;  // the longest blocks (last queries) first
      (D <= 64 ? run_block<true> : run_block<false>)(
          qp, q.stride(0), q.stride(1), h, b * QB, std::min(QB, T - b * QB), prior, L, pool, table, ts, page_stride,
          layer_off, P, h / G, D, vt.data() + (h / G) * Lp * D, static_cast<float>(scale), op, out.stride(0),
          out.stride(1));
    }
    release_tiles();
  }
  return out;
#endif
}

}  // namespace
}  // namespace trnd

#define TRND_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
#define TRND_FRAGMENT_IMPL(ns, k, m) TORCH_LIBRARY_IMPL(ns, k, m)

TRND_FRAGMENT(TRND_LIB, m) {
  m.def("amx_ready() -> bool", &trnd::amx_ready);
  m.def("prefill_attention_amx(Tensor q, Tensor kv, int layer, Tensor pages, int prior, float scale) -> Tensor");
}

TRND_FRAGMENT_IMPL(TRND_LIB, CPU, m) {
  m.impl("prefill_attention_amx", &trnd::prefill_attention_amx);
}
