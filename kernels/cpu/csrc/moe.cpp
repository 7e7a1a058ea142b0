// Mixture-of-experts on the CPU, in both builds (AVX2 + FMA and AVX-512): the router's top-k and gating in one pass
// over each token's logits, then each expert's two GEMMs on its own packed weights over the tokens routed to it, and
// the quantized linears (block-scaled FP8 and MXFP4 weights read as stored: csrc/quant_tile.h). Torch references:
// kernels/moe.py (route, experts) and kernels/quant.py; trnd/model/moe.py packs the weights at load.
//
// Why: the torch reference loops over the experts in Python (a gather, two F.linear, an index_add per expert);
// a decode step of a 32-expert layer with 4 active spent its time in dispatch. Here a step is one call per layer,
// and only the experts some token is routed to are read: at batch 1, top_k of them (sglang's fused_experts on CPU
// and vLLM's CPU MoE do the same grouping: tokens sorted by expert, a GEMM per expert, a weighted sum).
//
// Layout (both packed at load by trnd/model/moe.py through kernels/cpu's pack helpers, per expert as the fp32 linear
// lays out a weight, csrc/linear_f32.cpp): w13 [E, 2 * NB, H, BLOCK] with, for each block j of BLOCK intermediate
// columns, the gate block (2j) then the up block (2j + 1), so one work item computes both and applies the
// activation in registers' reach; w2 [E, NBH, IP, BLOCK], IP = NB * BLOCK (the intermediate size padded with zero
// columns, whose activations are zero). Elements: fp32, bf16 pairs (bf16-valued weights, widened exactly as in
// linear_f32), FP8 bytes or MXFP4 nibbles (scales beside them, quant_tile.h).
//
// Order: each token's weighted sum adds its experts' outputs in ascending expert id, as the reference's index_add
// over experts does, so fp32 results differ from it only by the two GEMMs' summation order.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <tuple>
#include <vector>

#include "f32_tile.h"
#include "quant_tile.h"
#include "vec.h"

namespace trnd {
namespace {

enum Act : int64_t { ACT_SILU = 0, ACT_SWIGLU_OAI = 1 };

// -- routing ---------------------------------------------------------------------------------------------------

template <typename T>
void route_rows(const T* lp, int64_t T_, int64_t E, int64_t k, bool softmax_first, bool renormalize, int32_t* ids,
                float* wts) {
#pragma omp parallel for if (T_ * E >= (1 << 14))
  for (int64_t t = 0; t < T_; ++t) {
    float l[1024];
    const T* row = lp + t * E;
    for (int64_t e = 0; e < E; ++e) l[e] = static_cast<float>(row[e]);
    int32_t* id = ids + t * k;
    float* w = wts + t * k;
    // top k by repeated selection: the larger first, the lower index among equals (torch.topk's order here)
    uint64_t taken[16] = {0};
    for (int64_t j = 0; j < k; ++j) {
      int64_t best = -1;
      for (int64_t e = 0; e < E; ++e) {
        if (taken[e >> 6] >> (e & 63) & 1) continue;
        if (best < 0 || l[e] > l[best]) best = e;
      }
      taken[best >> 6] |= uint64_t{1} << (best & 63);
      id[j] = static_cast<int32_t>(best);
      w[j] = l[best];
    }
    if (softmax_first) {  // softmax over all E, then the chosen ones (renormalized: divided by their sum)
      float m = l[0];
      for (int64_t e = 1; e < E; ++e) m = std::max(m, l[e]);
      float sum = 0.f;
      for (int64_t e = 0; e < E; ++e) sum += std::exp(l[e] - m);
      float chosen = 0.f;
      for (int64_t j = 0; j < k; ++j) chosen += (w[j] = std::exp(w[j] - m) / sum);
      if (renormalize)
        for (int64_t j = 0; j < k; ++j) w[j] /= chosen;
    } else {  // softmax over the k chosen logits (GPT-OSS)
      const float m = w[0];
      float sum = 0.f;
      for (int64_t j = 0; j < k; ++j) sum += (w[j] = std::exp(w[j] - m));
      for (int64_t j = 0; j < k; ++j) w[j] /= sum;
    }
  }
}

std::tuple<at::Tensor, at::Tensor> moe_route(const at::Tensor& logits, int64_t k, bool softmax_first,
                                             bool renormalize) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() &&
                  (logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16),
              "logits: want a contiguous float32 or bfloat16 [T, E], got ", logits.scalar_type(), " ", logits.sizes());
  const int64_t T_ = logits.size(0), E = logits.size(1);
  TORCH_CHECK(E >= 1 && E <= 1024 && k >= 1 && k <= E, "moe_route: E = ", E, " (at most 1024), k = ", k);
  at::Tensor ids = at::empty({T_, k}, logits.options().dtype(at::kInt));
  at::Tensor wts = at::empty({T_, k}, logits.options().dtype(at::kFloat));
  if (logits.scalar_type() == at::kFloat)
    route_rows(logits.data_ptr<float>(), T_, E, k, softmax_first, renormalize, ids.data_ptr<int32_t>(),
               wts.data_ptr<float>());
  else
    route_rows(logits.data_ptr<at::BFloat16>(), T_, E, k, softmax_first, renormalize, ids.data_ptr<int32_t>(),
               wts.data_ptr<float>());
  return {ids, wts};
}

// -- one block of columns over R rows, whatever the weights' format ---------------------------------------------

struct Weights {
  const void* data;  // the packed blocks
  const void* scales;  // quantized: each block's [G][BLOCK] scales
  int64_t fmt, group, K;
  bool bf16;  // fmt Q_NONE: bf16 pairs instead of fp32

  int64_t block_bytes() const {
    const int64_t row = fmt == Q_FP8 ? F32_BLOCK : fmt == Q_MXFP4 ? F32_BLOCK / 2 : F32_BLOCK * (bf16 ? 2 : 4);
    return K * row;
  }
  int64_t scale_bytes() const { return fmt == Q_NONE ? 0 : (K + group - 1) / group * F32_BLOCK * (fmt == Q_FP8 ? 4 : 1); }
};

// out[R][BLOCK] = x[R rows at stride xs] . block b of w; pf: prefetch the block's stream ahead (first tile)
template <int R>
inline void block_tile(const Weights& w, int64_t b, const float* x, int64_t xs, bool pf, float* out) {
  const char* blk = static_cast<const char*>(w.data) + b * w.block_bytes();
  if (w.fmt == Q_NONE) {
    const int64_t ahead = 64 * F32_BLOCK;  // elements of the block's stream ahead, as linear_f32
    if (w.bf16) {
      const bf16* p = reinterpret_cast<const bf16*>(blk);
      f32_tile<R>(x, xs, w.K, p, pf ? p + ahead : nullptr, out);
    } else {
      const float* p = reinterpret_cast<const float*>(blk);
      f32_tile<R>(x, xs, w.K, p, pf ? p + ahead : nullptr, out);
    }
    return;
  }
  const char* sc = static_cast<const char*>(w.scales) + b * w.scale_bytes();
  const uint8_t* p = reinterpret_cast<const uint8_t*>(blk);
  if (w.fmt == Q_FP8) q_tile<R, Q_FP8>(x, xs, w.K, w.group, p, sc, pf, out);
  else q_tile<R, Q_MXFP4>(x, xs, w.K, w.group, p, sc, pf, out);
}

// rows [0, M) of x (stride xs) against block b -> f(m, R, acc) for each tile of R <= F32_MAX_R rows
template <typename F>
inline void over_tiles(const Weights& w, int64_t b, const float* x, int64_t xs, int64_t M, F&& f) {
  alignas(64) float acc[F32_MAX_R * F32_BLOCK];
  const int64_t tiles = (M + F32_MAX_R - 1) / F32_MAX_R;
  for (int64_t t = 0, m = 0; t < tiles; ++t) {
    const int64_t R = M / tiles + (t < M % tiles);
    with_rows<F32_MAX_R>(R, [&](auto r) { block_tile<decltype(r)::value>(w, b, x + m * xs, xs, t == 0, acc); });
    f(m, R, acc);
    m += R;
  }
}

Weights weights_of(const at::Tensor& packed, const at::Tensor& scales, int64_t fmt, int64_t group) {
  Weights w{packed.data_ptr(), scales.numel() ? scales.data_ptr() : nullptr, fmt, group, packed.size(-2),
            packed.scalar_type() == at::kBFloat16};
  return w;
}

void check_packed(const at::Tensor& p, const at::Tensor& s, int64_t fmt, int64_t group, const char* name) {
  TORCH_CHECK(p.is_contiguous() && s.is_contiguous(), name, ": want contiguous packed weights and scales");
  const int64_t row = p.size(-1);
  if (fmt == Q_NONE) {
    TORCH_CHECK((p.scalar_type() == at::kFloat || p.scalar_type() == at::kBFloat16) && row == F32_BLOCK, name,
                ": want this build's fp32 packing (blocks of ", F32_BLOCK, " columns), got ", p.scalar_type(), " ",
                p.sizes());
    return;
  }
  TORCH_CHECK(fmt == Q_FP8 || fmt == Q_MXFP4, name, ": format ", fmt, " is not 0 (none), 1 (fp8) or 2 (mxfp4)");
  TORCH_CHECK(p.scalar_type() == at::kByte && row == (fmt == Q_FP8 ? F32_BLOCK : F32_BLOCK / 2), name,
              ": want uint8 codes in this build's blocks (", F32_BLOCK, " columns), got ", p.scalar_type(), " ",
              p.sizes());
  const int64_t K = p.size(-2), G = (K + group - 1) / group;
  TORCH_CHECK(group > 0 && (fmt == Q_FP8 || group % 2 == 0), name, ": group = ", group);
  TORCH_CHECK(s.dim() == p.dim() && s.size(-1) == F32_BLOCK && s.size(-2) == G &&
                  s.scalar_type() == (fmt == Q_FP8 ? at::kFloat : at::kByte),
              name, ": scales want [..., ", G, ", ", F32_BLOCK, "] ", fmt == Q_FP8 ? "float32" : "uint8", ", got ",
              s.scalar_type(), " ", s.sizes());
  for (int64_t d = 0; d + 2 < p.dim(); ++d) TORCH_CHECK(s.size(d) == p.size(d), name, ": scales' blocks differ");
}

// -- a quantized linear ------------------------------------------------------------------------------------------

at::Tensor qlinear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t N, int64_t fmt,
                   int64_t group) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "x: want a float32 [M, K] with unit stride in K, got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(packed.dim() == 3 && fmt != Q_NONE, "packed: want quantized blocks [N/BLOCK, K, row]");
  check_packed(packed, scales, fmt, group, "qlinear");
  const int64_t M = x.size(0), nb = packed.size(0);
  TORCH_CHECK(packed.size(1) == x.size(1), "x has K = ", x.size(1), ", the packed weight ", packed.size(1));
  TORCH_CHECK((nb - 1) * F32_BLOCK < N && N <= nb * F32_BLOCK, "N = ", N, " does not fit ", nb, " blocks");
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const Weights w = weights_of(packed, scales, fmt, group);
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t xs = x.stride(0);
#pragma omp parallel for schedule(static) if (M * N * x.size(1) >= (1 << 18))
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t col = b * F32_BLOCK, n = std::min<int64_t>(F32_BLOCK, N - col);
    over_tiles(w, b, xp, xs, M, [&](int64_t m, int64_t R, const float* acc) {
      for (int64_t r = 0; r < R; ++r) std::copy(acc + r * F32_BLOCK, acc + r * F32_BLOCK + n, yp + (m + r) * N + col);
    });
  }
  return y;
}

// -- the experts -------------------------------------------------------------------------------------------------

inline vf vsigmoid(vf v) { return vdiv(vset(1.f), vadd(vset(1.f), vexp(vsub(vzero(), v)))); }

// One row of a gate block and an up block -> BLOCK activations (n of them real, the padding's zero). silu: gate x
// sigmoid(gate) x up; swiglu_oai (GPT-OSS): gate clamped above at lim, up to [-lim, lim], (up + 1) x gate x
// sigmoid(alpha gate). bg, bu: the block's biases (null: none).
inline void activate(const float* g, const float* u, const float* bg, const float* bu, int64_t n, int64_t act,
                     float alpha, float lim, float* dst) {
  alignas(64) float gb[F32_BLOCK], ub[F32_BLOCK];
  if (bg != nullptr || n < F32_BLOCK) {
    for (int64_t c = 0; c < F32_BLOCK; ++c) {
      gb[c] = c < n ? g[c] + (bg ? bg[c] : 0.f) : 0.f;
      ub[c] = c < n ? u[c] + (bu ? bu[c] : 0.f) : 0.f;
    }
    g = gb;
    u = ub;
  }
  for (int64_t c = 0; c < F32_BLOCK; c += W) {
    vf gv = vload(g + c), uv = vload(u + c);
    if (act == ACT_SILU) {
      vstore(dst + c, vmul(vmul(gv, vsigmoid(gv)), uv));
    } else {
      gv = vmin(gv, vset(lim));
      uv = vmax(vmin(uv, vset(lim)), vset(-lim));
      vstore(dst + c, vmul(vadd(uv, vset(1.f)), vmul(gv, vsigmoid(vmul(gv, vset(alpha))))));
    }
  }
}

at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights, const at::Tensor& w13,
                       const at::Tensor& s13, const at::Tensor& w2, const at::Tensor& s2,
                       const c10::optional<at::Tensor>& b13, const c10::optional<at::Tensor>& b2, int64_t first,
                       int64_t inter, int64_t fmt, int64_t group, int64_t act, double alpha, double limit) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: want a contiguous float32 [T, H]");
  TORCH_CHECK(ids.dim() == 2 && ids.scalar_type() == at::kInt && ids.is_contiguous() && ids.size(0) == x.size(0),
              "ids: want int32 [T, k]");
  TORCH_CHECK(weights.sizes() == ids.sizes() && weights.scalar_type() == at::kFloat && weights.is_contiguous(),
              "weights: want float32 [T, k]");
  TORCH_CHECK(w13.dim() == 4 && w2.dim() == 4 && w13.size(0) == w2.size(0), "w13, w2: want [E, blocks, K, row]");
  check_packed(w13, s13, fmt, group, "w13");
  check_packed(w2, s2, fmt, group, "w2");
  const int64_t T_ = x.size(0), H = x.size(1), k = ids.size(1), E = w13.size(0), NB = w13.size(1) / 2;
  const int64_t IP = NB * F32_BLOCK, NBH = w2.size(1);
  TORCH_CHECK(w13.size(2) == H && w2.size(2) == IP && (NBH - 1) * F32_BLOCK < H && H <= NBH * F32_BLOCK &&
                  inter <= IP && inter > IP - F32_BLOCK,
              "w13 ", w13.sizes(), " and w2 ", w2.sizes(), " do not fit H = ", H, ", intermediate ", inter);
  const float* bp13 = nullptr;
  const float* bp2 = nullptr;
  if (b13.has_value()) {
    TORCH_CHECK(b13->scalar_type() == at::kFloat && b13->is_contiguous() && b13->numel() == E * 2 * inter,
                "b13: want float32 [E, 2 * intermediate]");
    bp13 = b13->data_ptr<float>();
  }
  if (b2.has_value()) {
    TORCH_CHECK(b2->scalar_type() == at::kFloat && b2->is_contiguous() && b2->numel() == E * H, "b2: want float32 [E, H]");
    bp2 = b2->data_ptr<float>();
  }
  at::Tensor out = at::zeros({T_, H}, x.options());
  if (T_ == 0) return out;

  // Each of this rank's experts' slots (token, choice) in token order, the experts one after another.
  const int32_t* idp = ids.data_ptr<int32_t>();
  std::vector<int64_t> count(E + 1, 0);
  for (int64_t i = 0; i < T_ * k; ++i) {
    const int64_t e = idp[i] - first;
    if (e >= 0 && e < E) ++count[e + 1];
  }
  std::vector<int64_t> start(E + 1, 0);
  std::partial_sum(count.begin(), count.end(), start.begin());
  const int64_t M = start[E];
  if (M == 0) return out;
  std::vector<int64_t> slot(M), row_of(T_ * k, -1);  // sorted row -> slot; slot -> sorted row
  {
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t i = 0; i < T_ * k; ++i) {
      const int64_t e = idp[i] - first;
      if (e >= 0 && e < E) {
        slot[fill[e]] = i;
        row_of[i] = fill[e]++;
      }
    }
  }
  std::vector<int64_t> active;
  for (int64_t e = 0; e < E; ++e)
    if (start[e + 1] > start[e]) active.push_back(e);
  const int64_t na = static_cast<int64_t>(active.size());

  at::Tensor xg = at::empty({M, H}, x.options()), h = at::empty({M, IP}, x.options()), y = at::empty({M, H}, x.options());
  const float* xp = x.data_ptr<float>();
  float* xgp = xg.data_ptr<float>();
  float* hp = h.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const Weights W13 = weights_of(w13, s13, fmt, group), W2 = weights_of(w2, s2, fmt, group);
  const bool parallel = M * H * IP >= (1 << 16);
  const float a = static_cast<float>(alpha), lim = static_cast<float>(limit);

#pragma omp parallel if (parallel)
  {
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; ++m) std::memcpy(xgp + m * H, xp + slot[m] / k * H, H * sizeof(float));
    // gate and up of block j of an active expert, then the activation, into h's rows of that expert
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < na * NB; ++item) {
      const int64_t e = active[item / NB], j = item % NB, r0 = start[e], rows = start[e + 1] - r0;
      const int64_t bg = e * 2 * NB + 2 * j;
      // per tile of rows, the gate block then the up block, so the tile's gate and up meet in two small buffers
      alignas(64) float g[F32_MAX_R * F32_BLOCK];
      const int64_t tiles = (rows + F32_MAX_R - 1) / F32_MAX_R;
      for (int64_t t = 0, m = 0; t < tiles; ++t) {
        const int64_t R = rows / tiles + (t < rows % tiles);
        alignas(64) float u[F32_MAX_R * F32_BLOCK];
        with_rows<F32_MAX_R>(R, [&](auto r) {
          block_tile<decltype(r)::value>(W13, bg, xgp + (r0 + m) * H, H, t == 0, g);
          block_tile<decltype(r)::value>(W13, bg + 1, xgp + (r0 + m) * H, H, t == 0, u);
        });
        const int64_t n = std::min<int64_t>(F32_BLOCK, inter - j * F32_BLOCK);  // columns past inter: padding
        const float* bg_ = bp13 ? bp13 + e * 2 * inter + j * F32_BLOCK : nullptr;
        const float* bu_ = bp13 ? bp13 + (e * 2 + 1) * inter + j * F32_BLOCK : nullptr;
        for (int64_t r = 0; r < R; ++r)
          activate(g + r * F32_BLOCK, u + r * F32_BLOCK, bg_, bu_, n, act, a, lim,
                   hp + (r0 + m + r) * IP + j * F32_BLOCK);
        m += R;
      }
    }
    // down: block jh of an active expert over its rows of h
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < na * NBH; ++item) {
      const int64_t e = active[item / NBH], jh = item % NBH, r0 = start[e], rows = start[e + 1] - r0;
      const int64_t col = jh * F32_BLOCK, n = std::min<int64_t>(F32_BLOCK, H - col);
      over_tiles(W2, e * NBH + jh, hp + r0 * IP, IP, rows, [&](int64_t m, int64_t R, const float* acc) {
        for (int64_t r = 0; r < R; ++r) {
          float* dst = yp + (r0 + m + r) * H + col;
          for (int64_t c = 0; c < n; ++c) dst[c] = acc[r * F32_BLOCK + c] + (bp2 ? bp2[e * H + col + c] : 0.f);
        }
      });
    }
    // each token: its choices held here, weighted, added in ascending expert id
    const float* wp = weights.data_ptr<float>();
    float* op = out.data_ptr<float>();
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T_; ++t) {
      int64_t order[64];
      int64_t n = 0;
      for (int64_t j = 0; j < k && n < 64; ++j)
        if (row_of[t * k + j] >= 0) order[n++] = j;
      std::sort(order, order + n, [&](int64_t p, int64_t q) { return idp[t * k + p] < idp[t * k + q]; });
      float* dst = op + t * H;
      for (int64_t i = 0; i < n; ++i) {
        const float wt = wp[t * k + order[i]];
        const float* src = yp + row_of[t * k + order[i]] * H;
        for (int64_t c = 0; c < H; ++c) dst[c] += src[c] * wt;
      }
    }
  }
  return out;
}

int64_t quant_block() { return F32_BLOCK; }

}  // namespace
}  // namespace trnd

TORCH_LIBRARY_FRAGMENT(TRND_LIB, m) {
  m.def("moe_route(Tensor logits, int k, bool softmax_first, bool renormalize) -> (Tensor, Tensor)");
  m.def("moe_experts(Tensor x, Tensor ids, Tensor weights, Tensor w13, Tensor s13, Tensor w2, Tensor s2, Tensor? b13, "
        "Tensor? b2, int first, int inter, int fmt, int group, int act, float alpha, float limit) -> Tensor");
  m.def("qlinear(Tensor x, Tensor packed, Tensor scales, int n, int fmt, int group) -> Tensor");
  m.def("quant_block() -> int");
}

TORCH_LIBRARY_IMPL(TRND_LIB, CPU, m) {
  m.impl("moe_route", &trnd::moe_route);
  m.impl("moe_experts", &trnd::moe_experts);
  m.impl("qlinear", &trnd::qlinear);
}

TORCH_LIBRARY_IMPL(TRND_LIB, CompositeExplicitAutograd, m) { m.impl("quant_block", &trnd::quant_block); }
