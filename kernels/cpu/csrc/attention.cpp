// Paged attention over trnd's KV pool, read in place: kv[page, layer, k|v, kv_head, slot, head_dim]
// (kernels/attention.py says why page-major). Torch references: kernels/attention.py (the test oracle).
//
// decode_attention: per work item (sequence b, KV head h, a range of its context) the G query heads of that
// KV head go through the range's pages together, so each K/V row is loaded once for all of them; scores
// and the online softmax are fp32 (K/V widened from bf16 on load, or dotted natively with dpbf16). Scores
// go a row and a block of W slots at a time, the block's W dot products reduced together (vsum_lanes):
// a horizontal sum per token was most of the kernel's time. The softmax steps once per block of pages
// (BLOCK tokens), not per page; with dpbf16, P V runs on it too (the probabilities rounded to bf16, two
// tokens per instruction). The next K/V blocks are prefetched into L2 as the current one computes. Long
// contexts are split into several items when there are fewer items than threads can balance; their
// partial (unnormalized output, max, sum) are merged by log-sum-exp afterwards. With enough sequences, one
// thread runs all the KV heads of a sequence together, page by page (their rows are adjacent in each page). No page is
// copied and no mask is built: each item reads only the slots below its sequence's context length.
//
// write_kv: one pass copying each token's K and V rows into its (page, slot).
//
// Compiled twice (build.py): AVX2 + FMA and AVX-512; TRND_LIB names the op namespace of each build.
#include <ATen/ATen.h>
#include <torch/library.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "vec.h"

namespace trnd {
namespace {

constexpr int64_t MAX_D = 256;  // head_dim
constexpr int64_t MAX_P = 256;  // page size
// Tokens per softmax step: as many whole pages as fit. One max, one rescale of the output and one exp per
// row per block rather than per 16-slot page. With P V on dpbf16 and the prefetch below, the kernel alone
// (b=16, ctx 577, GQA 3, AMD Zen 4) ran 1.25-1.30x faster than page by page in fp32 on a cache-resident pool,
// 2.0-2.2x on a pool read from DRAM.
constexpr int64_t BLOCK = MAX_P;
// K/V blocks (one page of one KV head) ahead in the order the kernel reads them whose lines are prefetched
// into L2, a few lines per step of the current block's loop. In a model step (the pool in DRAM, not cache)
// on AMD Zen 4, the b=16 step against the per-page kernel this replaced: spread, not in one burst (bursts at
// each page's start made the step 5-9% slower: they fill the line-fill buffers and stall the arithmetic), and
// to L2, not L1 (1.15x faster with T1, 1.02x with T0: L1's fill buffers bound the lines in flight). 2 to 8
// ahead measured alike.
constexpr int64_t PREFETCH_AHEAD = 2;
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

struct Pool {  // the strides of a contiguous kv[page, layer, 2, Hk, P, D]
  int64_t hk, P, D, layer_stride, page_stride;
  Pool(const at::Tensor& kv)
      : hk(kv.size(3)), P(kv.size(4)), D(kv.size(5)), layer_stride(2 * hk * P * D),
        page_stride(kv.size(1) * layer_stride) {}
};

// The running state of GB query rows of one KV head: unnormalized output o, running max m, running sum l.
template <int GB>
struct Rows {
  alignas(64) float q[GB * MAX_D];  // the query rows in fp32, pre-scaled (zeros past the real rows)
  alignas(64) bf16 qb[GB * MAX_D];  // the same rows unscaled in bf16, for the dpbf16 path
  alignas(64) float s[GB * BLOCK];  // one block's scores, then its probabilities
  alignas(64) bf16 pb[GB * BLOCK];  // the probabilities rounded to bf16, for the dpbf16 P V
  alignas(64) float o[GB * MAX_D];
  float m[GB], l[GB];
};

// The lines of one K or V block being prefetched while another is computed on: `steps` calls of step()
// spread them over the computation, finish() issues what is left.
struct Ahead {
  const char* p = nullptr;
  int64_t lines = 0, l = 0, per = 0;
  void start(const void* block, int64_t nlines, int64_t steps) {
    p = static_cast<const char*>(block);
    lines = block != nullptr ? nlines : 0;
    l = 0;
    per = (lines + steps - 1) / std::max<int64_t>(steps, 1);
  }
  inline void step() {
    for (const int64_t e = std::min(l + per, lines); l < e; ++l) _mm_prefetch(p + l * 64, _MM_HINT_T1);
  }
  void finish() {
    for (; l < lines; ++l) _mm_prefetch(p + l * 64, _MM_HINT_T1);
  }
};

// s[g][j] = scale * sum(a[g]) for the GB rows; four rows at a time while there are four.
template <int GB, typename V>
inline void store_sums(Rows<GB>& r, const V* a, int64_t j, float scale) {  // j: the slot in the block
  int g = 0;
  for (; g + 4 <= GB; g += 4) {
    alignas(16) float t[4];
    _mm_store_ps(t, _mm_mul_ps(vsum4(a[g], a[g + 1], a[g + 2], a[g + 3]), _mm_set1_ps(scale)));
    for (int i = 0; i < 4; ++i) r.s[(g + i) * BLOCK + j] = t[i];
  }
  for (; g < GB; ++g) r.s[g * BLOCK + j] = vsum(a[g]) * scale;
}

// Scores of rows x tokens [0, j1) of one page of P slots: s[g][off + j] = q[g] . K[j] (q pre-scaled).
// Whole blocks of W slots go row by row: W tokens' products accumulated in W registers, then reduced
// together (vsum_lanes), and the block's K (widened once to fp32 when bf16) stays in L1 across the rows.
// A block may run past j1 inside the page: those lanes are masked by softmax_step. Slots a block would
// read past the page's end (P not a multiple of W) go token by token.
template <typename T, int GB>
inline void scores(Rows<GB>& r, const T* K, int64_t D, int64_t P, int64_t j1, int64_t off, float* kf, Ahead& pf) {
  const int64_t nc = D / W;
  int64_t j = 0;
  for (; j < j1 && j + W <= P; j += W) {
    pf.step();
    const float* kb;
    if constexpr (std::is_same_v<T, float>) {
      kb = K + j * D;
    } else {
      for (int64_t i = 0; i < W * D; i += W) vstore(kf + i, vload(K + j * D + i));
      kb = kf;
    }
    for (int g = 0; g < GB; ++g) {
      vf a[W];
#pragma GCC unroll 16
      for (int t = 0; t < W; ++t) a[t] = vzero();
      for (int64_t c = 0; c < nc; ++c) {
        const vf qv = vload(r.q + g * D + c * W);
#pragma GCC unroll 16
        for (int t = 0; t < W; ++t) a[t] = vfma(qv, vload(kb + t * D + c * W), a[t]);
      }
      vstore(r.s + g * BLOCK + off + j, vsum_lanes(a));
    }
  }
  for (; j < j1; ++j) {
    const T* kr = K + j * D;
    vf a[GB];
#pragma GCC unroll 8
    for (int g = 0; g < GB; ++g) a[g] = vzero();
    for (int64_t c = 0; c < nc; ++c) {
      vf k = vload(kr + c * W);
#pragma GCC unroll 8
      for (int g = 0; g < GB; ++g) a[g] = vfma(vload(r.q + g * D + c * W), k, a[g]);
    }
    store_sums<GB>(r, a, off + j, 1.0f);
  }
  pf.finish();
}

#if defined(__AVX512F__)
// The same with AVX-512 BF16's dot product of bf16 pairs (32 products per instruction, fp32 accumulate,
// K read straight from the page as the instruction's memory operand): called only where
// kernels/cpuinfo.py found avx512_bf16, and only for bf16 K.
template <int GB>
__attribute__((target("avx512bf16"))) void scores_dpbf16(Rows<GB>& r, const bf16* K, int64_t D, int64_t P,
                                                        int64_t j1, int64_t off, float scale, Ahead& pf) {
  const int64_t nc = D / 32;
  const __m512 vs = _mm512_set1_ps(scale);
  int64_t j = 0;
  for (; j < j1 && j + 16 <= P; j += 16) {
    for (int g = 0; g < GB; ++g) {
      pf.step();
      __m512 a[16];
#pragma GCC unroll 16
      for (int t = 0; t < 16; ++t) a[t] = _mm512_setzero_ps();
      for (int64_t c = 0; c < nc; ++c) {
        const __m512bh qv = (__m512bh)_mm512_loadu_si512(r.qb + g * D + c * 32);
#pragma GCC unroll 16
        for (int t = 0; t < 16; ++t)
          a[t] = _mm512_dpbf16_ps(a[t], qv, (__m512bh)_mm512_loadu_si512(K + (j + t) * D + c * 32));
      }
      _mm512_storeu_ps(r.s + g * BLOCK + off + j, _mm512_mul_ps(vsum_lanes(a), vs));
    }
  }
  for (; j < j1; ++j) {
    const bf16* kr = K + j * D;
    __m512 a[GB];
#pragma GCC unroll 8
    for (int g = 0; g < GB; ++g) a[g] = _mm512_setzero_ps();
    for (int64_t c = 0; c < nc; ++c) {
      __m512bh k = (__m512bh)_mm512_loadu_si512(kr + c * 32);
#pragma GCC unroll 8
      for (int g = 0; g < GB; ++g)
        a[g] = _mm512_dpbf16_ps(a[g], (__m512bh)_mm512_loadu_si512(r.qb + g * D + c * 32), k);
    }
    store_sums<GB>(r, a, off + j, scale);
  }
  pf.finish();
}
#endif

// Fold one block's scores (n of them per row) into the running softmax; leaves probabilities in r.s.
template <int GB>
inline void softmax_step(Rows<GB>& r, int64_t D, int64_t n) {
  const int64_t np = (n + W - 1) / W * W;
  for (int g = 0; g < GB; ++g) {
    float* s = r.s + g * BLOCK;
    for (int64_t j = n; j < np; ++j) s[j] = NEG_INF;
    vf mx = vset(NEG_INF);
    for (int64_t j = 0; j < np; j += W) mx = vmax(mx, vload(s + j));
    const float m_new = std::max(r.m[g], vhmax(mx));
    const float corr = r.m[g] == NEG_INF ? 0.0f : std::exp(r.m[g] - m_new);
    const vf vm = vset(m_new);
    vf sum = vzero();
    for (int64_t j = 0; j < np; j += W) {
      vf p = vexp(vsub(vload(s + j), vm));
      vstore(s + j, p);
    }
    for (int64_t j = n; j < np; ++j) s[j] = 0.0f;
    for (int64_t j = 0; j < np; j += W) sum = vadd(sum, vload(s + j));
    r.l[g] = r.l[g] * corr + vsum(sum);
    r.m[g] = m_new;
    if (corr != 1.0f) {
      const vf vc = vset(corr);
      float* o = r.o + g * D;
      for (int64_t c = 0; c < D; c += W) vstore(o + c, vmul(vload(o + c), vc));
    }
  }
}

// o[g][c, c + CW W) += sum_j p[g][off + j] V[j][c, c + CW W) over one page's n rows, the CW x GB accumulators
// held in registers across them.
template <typename T, int GB, int CW>
inline void pv_pass(Rows<GB>& r, const T* V, int64_t D, int64_t n, int64_t off, int64_t c) {
  vf a[CW][GB];
#pragma GCC unroll 8
  for (int g = 0; g < GB; ++g)
#pragma GCC unroll 2
    for (int w = 0; w < CW; ++w) a[w][g] = vload(r.o + g * D + c + w * W);
  for (int64_t j = 0; j < n; ++j) {
    vf v[CW];
#pragma GCC unroll 2
    for (int w = 0; w < CW; ++w) v[w] = vload(V + j * D + c + w * W);
#pragma GCC unroll 8
    for (int g = 0; g < GB; ++g) {
      const vf p = vset(r.s[g * BLOCK + off + j]);
#pragma GCC unroll 2
      for (int w = 0; w < CW; ++w) a[w][g] = vfma(p, v[w], a[w][g]);
    }
  }
#pragma GCC unroll 8
  for (int g = 0; g < GB; ++g)
#pragma GCC unroll 2
    for (int w = 0; w < CW; ++w) vstore(r.o + g * D + c + w * W, a[w][g]);
}

// o[g] += sum_j p[g][off + j] V[j] over one page's n rows. Two vectors of head_dim a pass where 2 GB accumulators,
// two V vectors and a broadcast fit the registers: per row, 2 V loads and GB broadcasts for 2 GB FMAs instead of 1
// and GB for GB (bound by the loads, not the FMAs). The 12 layers' calls at ctx 576, AMD Zen 4: fp32 1.085x at
// b=1, 1.00-1.02x at b=4-16 (there DRAM binds), bf16 on the AVX2 build 1.07-1.10x, fp32 on the AVX-512 build
// 1.03-1.04x.
template <typename T, int GB>
inline void accumulate(Rows<GB>& r, const T* V, int64_t D, int64_t n, int64_t off, Ahead& pf) {
  constexpr bool PAIRS = 2 * GB + 3 <= (W == 16 ? 32 : 16);  // the vector registers: 32 with AVX-512, else 16
  int64_t c = 0;
  if constexpr (PAIRS)
    for (; c + 2 * W <= D; c += 2 * W) {
      pf.step();
      pf.step();
      pv_pass<T, GB, 2>(r, V, D, n, off, c);
    }
  for (; c < D; c += W) {
    pf.step();
    pv_pass<T, GB, 1>(r, V, D, n, off, c);
  }
  pf.finish();
}

#if defined(__AVX512F__)
// The same with dpbf16 over pairs of tokens: the probabilities rounded to bf16 (as the prefill kernels and
// flash attention round them), rows j and j + 1 of V interleaved by unpacklo/hi so that one dpbf16 against
// the broadcast pair (p[j], p[j + 1]) adds both tokens' products to 16 lanes of o. The unpacks run within
// 128-bit lanes, so o is kept in their order (see natural_order) until the end. A page's odd last row is
// paired with zeros (what the slot after it holds need not be a number).
template <int GB>
__attribute__((target("avx512bf16"))) void accumulate_dpbf16(Rows<GB>& r, const bf16* V, int64_t D, int64_t n,
                                                            int64_t off, Ahead& pf) {
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t c = 0; c < D; c += 32) {
    __m512 lo[GB], hi[GB];
#pragma GCC unroll 8
    for (int g = 0; g < GB; ++g) {
      lo[g] = _mm512_loadu_ps(r.o + g * D + c);
      hi[g] = _mm512_loadu_ps(r.o + g * D + c + 16);
    }
    for (int64_t j = 0; j < n; j += 2) {
      pf.step();
      const __m512i v0 = _mm512_loadu_si512(V + j * D + c);
      const __m512i v1 = j + 1 < n ? _mm512_loadu_si512(V + (j + 1) * D + c) : zero;
      const __m512bh vl = (__m512bh)_mm512_unpacklo_epi16(v0, v1), vh = (__m512bh)_mm512_unpackhi_epi16(v0, v1);
#pragma GCC unroll 8
      for (int g = 0; g < GB; ++g) {
        int32_t pair;
        std::memcpy(&pair, r.pb + g * BLOCK + off + j, sizeof(pair));
        const __m512bh pp = (__m512bh)_mm512_set1_epi32(pair);
        lo[g] = _mm512_dpbf16_ps(lo[g], pp, vl);
        hi[g] = _mm512_dpbf16_ps(hi[g], pp, vh);
      }
    }
#pragma GCC unroll 8
    for (int g = 0; g < GB; ++g) {
      _mm512_storeu_ps(r.o + g * D + c, lo[g]);
      _mm512_storeu_ps(r.o + g * D + c + 16, hi[g]);
    }
  }
  pf.finish();
}

// accumulate_dpbf16's o back to head_dim order: in each 32-wide chunk, lanes 4L + i of its low half hold
// d = 8L + i and of its high half d = 8L + 4 + i (L the 128-bit lane, i < 4).
inline void natural_order(float* o, int64_t D) {
  float t[32];
  for (int64_t c = 0; c < D; c += 32) {
    for (int L = 0; L < 4; ++L)
      for (int i = 0; i < 4; ++i) {
        t[8 * L + i] = o[c + 4 * L + i];
        t[8 * L + 4 + i] = o[c + 16 + 4 * L + i];
      }
    std::memcpy(o + c, t, sizeof(t));
  }
}
#endif

struct Item {
  int64_t b, h, t0, t1, part;  // sequence, KV head, context tokens [t0, t1), partial slot (-1: final)
};

struct Args {
  const void* q;
  int64_t q_s0, q_s1;  // strides of q [B, Hq, D] (the last is 1)
  const void* kv;
  Pool pool;
  int64_t layer;
  const int64_t* pages;
  int64_t pages_s0, pages_s1;
  int64_t G;
  float scale;
  bool dpbf16;
};

// Query heads [h G + g0, h G + g0 + gn) of item `it` into r (gn <= GB; rows past gn are zeros), state reset.
template <typename T, int GB>
void start_rows(const Args& a, const Item& it, int64_t g0, int64_t gn, Rows<GB>& r) {
  const int64_t D = a.pool.D;
  const T* q = static_cast<const T*>(a.q) + it.b * a.q_s0 + (it.h * a.G + g0) * a.q_s1;
  for (int g = 0; g < GB; ++g) {
    for (int64_t d = 0; d < D; ++d) {
      const float x = g < gn ? static_cast<float>(q[g * a.q_s1 + d]) : 0.0f;
      r.q[g * D + d] = x * a.scale;
      r.qb[g * D + d] = bf16(x);
      r.o[g * D + d] = 0.0f;
    }
    r.m[g] = NEG_INF;
    r.l[g] = 0.0f;
  }
}

// Row g of item `it` done: into out (normalized), or its partial (unnormalized o, max, sum) for the merge.
template <typename T>
void emit_row(const Args& a, const Item& it, int64_t g, const float* o, float m, float l, T* out, int64_t out_s0,
              float* part_o, float* part_ml) {
  const int64_t D = a.pool.D;
  if (it.part < 0) {
    T* dst = out + it.b * out_s0 + (it.h * a.G + g) * D;
    const float inv = 1.0f / l;
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(o[d] * inv);
  } else {
    std::memcpy(part_o + (it.part * a.G + g) * D, o, D * sizeof(float));
    part_ml[(it.part * a.G + g) * 2] = m;
    part_ml[(it.part * a.G + g) * 2 + 1] = l;
  }
}

// Query rows [g0, g0 + gn) (gn <= GB) of the nh items its[0..nh): the same sequence and context range, KV heads
// its[0].h .. its[0].h + nh - 1 (one item, or every KV head of a (sequence, split) in the grouped order). Page by
// page: the page's K rows of all nh heads (adjacent in the pool) one head after the other, then, after the
// block's softmax, its V rows likewise. A thread that ran head after head read each page in runs of one head's
// P x D and jumped (4 KB in fp32 at P = 16, D = 64); here the runs are nh times longer, which DRAM streams faster
// (b=4-16 at ctx 576, AMD Zen 4, the 12 layers' calls: 1.15-1.17x in fp32, 1.17-1.27x in bf16 with dpbf16; a plain
// read of the pool in this order against the head-by-head one: 1.4-1.6x; docs/RESULTS.md, "Issue 15, 2026-12-06
// (second session)").
template <typename T, int GB>
void run_heads(const Args& a, const Item* its, int64_t nh, int64_t g0, int64_t gn, T* out, int64_t out_s0,
               float* part_o, float* part_ml) {
  const Pool& p = a.pool;
  const int64_t D = p.D, P = p.P, head = P * D, lines = head * static_cast<int64_t>(sizeof(T)) / 64;
  thread_local std::vector<Rows<GB>> rs;  // ~4 KB of state a query row: a buffer kept per thread, not the stack
  if (rs.size() < static_cast<size_t>(nh)) rs.resize(nh);
  alignas(64) float kf[W * MAX_D];  // one block of K widened to fp32 (bf16 pools)
  for (int64_t h = 0; h < nh; ++h) start_rows<T, GB>(a, its[h], g0, gn, rs[h]);
  const Item& it = its[0];
  const T* kv = static_cast<const T*>(a.kv);
  const int64_t* table = a.pages + it.b * a.pages_s0;
  // the K rows of heads it.h .. of page pi; its V rows are hk heads further
  auto k_page = [&](int64_t pi) {
    return kv + table[pi * a.pages_s1] * p.page_stride + a.layer * p.layer_stride + it.h * head;
  };
#if defined(__AVX512F__)
  const bool dp = std::is_same_v<T, bf16> && a.dpbf16 && D % 32 == 0;
#else
  const bool dp = false;
#endif
  // Blocks of whole pages (items start on a page): every page's scores, one softmax step, then P V page by
  // page. The reads go K of the block's pages, then their V, then the next block's K: `ahead(b0, i)` is the
  // page's K or V rows i places on from the start of the block at page b0 (nullptr past the item's end). Each
  // head's call prefetches its share of those PREFETCH_AHEAD places ahead.
  const int64_t first = it.t0 / P, end = (it.t1 + P - 1) / P, per_block = std::max<int64_t>(1, BLOCK / P);
  auto ahead = [&](int64_t b0, int64_t i) -> const T* {
    while (b0 < end) {
      const int64_t nb = std::min(end, b0 + per_block) - b0;
      if (i < 2 * nb) return k_page(b0 + i % nb) + (i < nb ? 0 : p.hk * head);
      i -= 2 * nb;
      b0 += nb;
    }
    return nullptr;
  };
  for (int64_t i = 0; i < PREFETCH_AHEAD; ++i) {
    Ahead burst;
    burst.start(ahead(first, i), nh * lines, 1);
    burst.finish();
  }
  const int64_t vsteps = dp ? D / 32 * ((P + 1) / 2) : D / W, ksteps = dp ? GB * ((P + 15) / 16) : (P + W - 1) / W;
  Ahead pf;
  for (int64_t b0 = first; b0 < end; b0 += per_block) {
    const int64_t b1 = std::min(end, b0 + per_block), nb = b1 - b0;
    for (int64_t pi = b0; pi < b1; ++pi) {
      const T* nx = ahead(b0, pi - b0 + PREFETCH_AHEAD);
      const T* K = k_page(pi);
      const int64_t j1 = std::min<int64_t>(it.t1 - pi * P, P), off = (pi - b0) * P;
      for (int64_t h = 0; h < nh; ++h) {
        pf.start(nx != nullptr ? nx + h * head : nullptr, lines, ksteps);
#if defined(__AVX512F__)
        if constexpr (std::is_same_v<T, bf16>) {
          if (dp) {
            scores_dpbf16<GB>(rs[h], K + h * head, D, P, j1, off, a.scale, pf);
            continue;
          }
        }
#endif
        scores<T, GB>(rs[h], K + h * head, D, P, j1, off, kf, pf);
      }
    }
    const int64_t n = std::min<int64_t>(it.t1, b1 * P) - b0 * P;
    for (int64_t h = 0; h < nh; ++h) {
      softmax_step<GB>(rs[h], D, n);
#if defined(__AVX512F__)
      if (dp) {
        const int64_t np = (n + W - 1) / W * W;  // softmax_step zeroed the slots past n up to np
        for (int g = 0; g < GB; ++g)
          for (int64_t j = 0; j < np; j += W) vstore(rs[h].pb + g * BLOCK + j, vload(rs[h].s + g * BLOCK + j));
      }
#endif
    }
    for (int64_t pi = b0; pi < b1; ++pi) {
      const T* nx = ahead(b0, nb + pi - b0 + PREFETCH_AHEAD);
      const T* V = k_page(pi) + p.hk * head;
      const int64_t n_p = std::min<int64_t>(it.t1 - pi * P, P), off = (pi - b0) * P;
      for (int64_t h = 0; h < nh; ++h) {
        pf.start(nx != nullptr ? nx + h * head : nullptr, lines, vsteps);
#if defined(__AVX512F__)
        if constexpr (std::is_same_v<T, bf16>) {
          if (dp) {
            accumulate_dpbf16<GB>(rs[h], V + h * head, D, n_p, off, pf);
            continue;
          }
        }
#endif
        accumulate<T, GB>(rs[h], V + h * head, D, n_p, off, pf);
      }
    }
  }
  for (int64_t h = 0; h < nh; ++h) {
#if defined(__AVX512F__)
    if (dp)
      for (int64_t g = 0; g < gn; ++g) natural_order(rs[h].o + g * D, D);
#endif
    for (int64_t g = 0; g < gn; ++g)
      emit_row<T>(a, its[h], g0 + g, rs[h].o + g * D, rs[h].m[g], rs[h].l[g], out, out_s0, part_o, part_ml);
  }
}

template <typename T, int GB>
void run_passes(const Args& a, const Item* its, int64_t nh, T* out, int64_t out_s0, float* part_o, float* part_ml) {
  for (int64_t g0 = 0; g0 < a.G; g0 += GB)
    run_heads<T, GB>(a, its, nh, g0, std::min<int64_t>(GB, a.G - g0), out, out_s0, part_o, part_ml);
}

template <typename T>
void run_any(const Args& a, const Item* its, int64_t nh, T* out, int64_t out_s0, float* part_o, float* part_ml) {
  // GB: query rows per pass, the whole group up to 8 (no padded rows: a group of 3 does 3 rows' work);
  // larger groups take passes of 8
  switch (a.G) {
    case 1: return run_passes<T, 1>(a, its, nh, out, out_s0, part_o, part_ml);
    case 2: return run_passes<T, 2>(a, its, nh, out, out_s0, part_o, part_ml);
    case 3: return run_passes<T, 3>(a, its, nh, out, out_s0, part_o, part_ml);
    case 4: return run_passes<T, 4>(a, its, nh, out, out_s0, part_o, part_ml);
    case 5: return run_passes<T, 5>(a, its, nh, out, out_s0, part_o, part_ml);
    case 6: return run_passes<T, 6>(a, its, nh, out, out_s0, part_o, part_ml);
    case 7: return run_passes<T, 7>(a, its, nh, out, out_s0, part_o, part_ml);
    default: return run_passes<T, 8>(a, its, nh, out, out_s0, part_o, part_ml);
  }
}

template <typename T>
void decode(const Args& a, const std::vector<Item>& items, int64_t group, const std::vector<int64_t>& first_part,
            const std::vector<int64_t>& nsplit, int64_t B, at::Tensor& out, int64_t nparts) {
  const int64_t D = a.pool.D, hk = a.pool.hk, G = a.G;
  std::vector<float> part_o(nparts * G * D), part_ml(nparts * G * 2);
  T* o = out.data_ptr<T>();
  const int64_t out_s0 = out.stride(0);
  const int64_t n = static_cast<int64_t>(items.size()) / group;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t i = 0; i < n; ++i) run_any<T>(a, &items[i * group], group, o, out_s0, part_o.data(), part_ml.data());
  if (nparts == 0) return;
  // merge the splits of each (sequence, KV head) by log-sum-exp
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t bh = 0; bh < B * hk; ++bh) {
    const int64_t b = bh / hk, h = bh % hk, S = nsplit[b];
    if (S <= 1) continue;
    for (int64_t g = 0; g < G; ++g) {
      float mx = NEG_INF;
      for (int64_t s = 0; s < S; ++s) mx = std::max(mx, part_ml[((first_part[bh] + s) * G + g) * 2]);
      float acc[MAX_D] = {0.0f}, l = 0.0f;
      for (int64_t s = 0; s < S; ++s) {
        const int64_t row = (first_part[bh] + s) * G + g;
        const float w = std::exp(part_ml[row * 2] - mx);
        l += w * part_ml[row * 2 + 1];
        for (int64_t d = 0; d < D; ++d) acc[d] += w * part_o[row * D + d];
      }
      T* dst = o + b * out_s0 + (h * G + g) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(acc[d] / l);
    }
  }
}

void check_pool(const at::Tensor& kv, int64_t layer) {
  TORCH_CHECK(kv.dim() == 6, "kv: want [pages, layers, 2, kv_heads, page_size, head_dim], got ", kv.sizes());
  TORCH_CHECK(kv.is_contiguous(), "kv: the pool must be contiguous");
  TORCH_CHECK(kv.scalar_type() == at::kFloat || kv.scalar_type() == at::kBFloat16,
              "kv: float32 or bfloat16, got ", kv.scalar_type());
  TORCH_CHECK(0 <= layer && layer < kv.size(1), "layer ", layer, " outside the pool's ", kv.size(1), " layers");
  TORCH_CHECK(kv.size(5) % 16 == 0 && kv.size(5) <= MAX_D, "head_dim ", kv.size(5), ": want a multiple of 16, <= ",
              MAX_D);
  TORCH_CHECK(kv.size(4) <= MAX_P, "page_size ", kv.size(4), " > ", MAX_P);
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& kv, int64_t layer, const at::Tensor& pages,
                            const at::Tensor& ctx, double scale, int64_t split_pages, bool dpbf16) {
  check_pool(kv, layer);
  TORCH_CHECK(q.dim() == 3 && q.size(2) == kv.size(5) && q.stride(2) == 1, "q: want [B, Hq, head_dim] with unit "
              "stride in head_dim, got ", q.sizes());
  TORCH_CHECK(q.scalar_type() == kv.scalar_type(), "q is ", q.scalar_type(), ", the pool ", kv.scalar_type());
  const int64_t B = q.size(0), hq = q.size(1), hk = kv.size(3), P = kv.size(4);
  TORCH_CHECK(hq % hk == 0, hq, " query heads are not a multiple of ", hk, " KV heads");
  TORCH_CHECK(pages.scalar_type() == at::kLong && pages.dim() == 2 && pages.size(0) == B,
              "pages: want int64 [B, width], got ", pages.scalar_type(), " ", pages.sizes());
  TORCH_CHECK(ctx.scalar_type() == at::kLong && ctx.dim() == 1 && ctx.size(0) == B && ctx.is_contiguous(),
              "ctx: want contiguous int64 [B]");
  auto out = at::empty({B, hq, kv.size(5)}, q.options());
  if (B == 0) return out;
  const int64_t* c = ctx.data_ptr<int64_t>();
  const int64_t* tab = pages.data_ptr<int64_t>();
  const int64_t width = pages.size(1), num_pages = kv.size(0);
  int64_t total = 0;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(c[b] >= 1 && c[b] <= width * P, "ctx[", b, "] = ", c[b], ": outside 1 .. ", width * P,
                " (the page table's width x page_size)");
    for (int64_t pi = 0; pi * P < c[b]; ++pi) {
      const int64_t pg = tab[b * pages.stride(0) + pi * pages.stride(1)];
      TORCH_CHECK(0 <= pg && pg < num_pages, "pages[", b, ", ", pi, "] = ", pg, ": outside the pool's ",
                  num_pages, " pages");
    }
    total += c[b];
  }
  // Split length: whole pages; by default long enough that splitting only happens when there are too few
  // (sequence, KV head) items to keep every thread busy, and never below 512 tokens.
  int64_t split_len;
  if (split_pages > 0) {
    split_len = split_pages * P;
  } else {
    const int64_t threads = std::max(1, omp_get_max_threads());
    const int64_t target = std::max<int64_t>(512, (total * hk + 2 * threads - 1) / (2 * threads));
    split_len = (target + P - 1) / P * P;
  }
  std::vector<Item> items;
  std::vector<int64_t> first_part(B * hk, -1), nsplit(B);
  int64_t nparts = 0, ngroups = 0;
  for (int64_t b = 0; b < B; ++b) {
    nsplit[b] = (c[b] + split_len - 1) / split_len;
    ngroups += nsplit[b];
    if (nsplit[b] > 1)
      for (int64_t h = 0; h < hk; ++h) {
        first_part[b * hk + h] = nparts;
        nparts += nsplit[b];
      }
  }
  // Items in the order (sequence, split, KV head). With enough (sequence, split) groups to keep every thread
  // busy, one thread takes all the KV heads of a group together (run_heads): a page's K (and V) rows of all
  // heads are adjacent, read in one run by one core instead of in pieces by several. Head after head on one
  // thread against a head per item (before run_heads), b=16 at ctx ~576 on AMD Zen 4, the 12 layers' calls:
  // 1.01-1.18x (the more the DRAM is shared, the more), b=32 1.2-1.4x.
  const int64_t group = ngroups >= 2 * std::max(1, omp_get_max_threads()) ? hk : 1;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t S = nsplit[b];
    for (int64_t s = 0; s < S; ++s)
      for (int64_t h = 0; h < hk; ++h)
        items.push_back({b, h, s * split_len, std::min(c[b], (s + 1) * split_len),
                         S > 1 ? first_part[b * hk + h] + s : -1});
  }
  Args a{q.data_ptr(), q.stride(0), q.stride(1), kv.data_ptr(), Pool(kv), layer, tab, pages.stride(0),
         pages.stride(1), hq / hk, static_cast<float>(scale), dpbf16};
#if !defined(__AVX512F__)
  TORCH_CHECK(!dpbf16, "dpbf16 needs the AVX-512 build");
#endif
  if (kv.scalar_type() == at::kFloat) decode<float>(a, items, group, first_part, nsplit, B, out, nparts);
  else decode<bf16>(a, items, group, first_part, nsplit, B, out, nparts);
  return out;
}

void write_kv(at::Tensor& kv, int64_t layer, const at::Tensor& k, const at::Tensor& v, const at::Tensor& page_ids,
              const at::Tensor& offsets) {
  check_pool(kv, layer);
  const int64_t T = k.size(0), hk = kv.size(3), P = kv.size(4), D = kv.size(5);
  for (const at::Tensor* x : {&k, &v}) {
    TORCH_CHECK(x->dim() == 3 && x->size(0) == T && x->size(1) == hk && x->size(2) == D && x->stride(2) == 1,
                "k, v: want [T, ", hk, ", ", D, "] with unit stride in head_dim, got ", x->sizes());
    TORCH_CHECK(x->scalar_type() == kv.scalar_type(), "k/v are ", x->scalar_type(), ", the pool ", kv.scalar_type());
  }
  TORCH_CHECK(page_ids.scalar_type() == at::kLong && offsets.scalar_type() == at::kLong && page_ids.numel() == T &&
              offsets.numel() == T && page_ids.is_contiguous() && offsets.is_contiguous(),
              "page_ids, offsets: want contiguous int64 [T]");
  const int64_t* pg = page_ids.data_ptr<int64_t>();
  const int64_t* off = offsets.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(0 <= pg[t] && pg[t] < kv.size(0) && 0 <= off[t] && off[t] < P, "token ", t, ": page ", pg[t],
                " slot ", off[t], " outside the pool");
  const Pool p(kv);
  const int64_t elt = kv.element_size();
  char* base = static_cast<char*>(kv.data_ptr());
  const char* ks = static_cast<const char*>(k.data_ptr());
  const char* vs = static_cast<const char*>(v.data_ptr());
  const int64_t k0 = k.stride(0), k1 = k.stride(1), v0 = v.stride(0), v1 = v.stride(1);
#pragma omp parallel for if (T * hk >= 512)
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < hk; ++h) {
      char* dst = base + (pg[t] * p.page_stride + layer * p.layer_stride + (h * P + off[t]) * D) * elt;
      std::memcpy(dst, ks + (t * k0 + h * k1) * elt, D * elt);
      std::memcpy(dst + hk * P * D * elt, vs + (t * v0 + h * v1) * elt, D * elt);
    }
  }
}

}  // namespace
}  // namespace trnd

#define TRND_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define TRND_LIBRARY_IMPL(ns, k, m) TORCH_LIBRARY_IMPL(ns, k, m)

TRND_LIBRARY(TRND_LIB, m) {
  m.def("decode_attention(Tensor q, Tensor kv, int layer, Tensor pages, Tensor ctx, float scale, int split_pages, "
        "bool dpbf16) -> Tensor");
  m.def("write_kv(Tensor(a!) kv, int layer, Tensor k, Tensor v, Tensor page_ids, Tensor offsets) -> ()");
}

TRND_LIBRARY_IMPL(TRND_LIB, CPU, m) {
  m.impl("decode_attention", &trnd::decode_attention);
  m.impl("write_kv", &trnd::write_kv);
}
