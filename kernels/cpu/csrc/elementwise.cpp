// The model's small elementwise ops, each one pass over its rows: RMSNorm, residual-add + RMSNorm, rotary,
// SiLU-and-mul, and Qwen3's q/k RMSNorm + rotary in one; and greedy sampling's argmax over the logits' rows.
// Torch references: kernels/norm.py, kernels/rotary.py, kernels/activation.py, kernels/sampling.py (the oracles).
//
// Why: at decode batch sizes these tensors are a few KB, so the torch references cost their dispatch, not
// their arithmetic: RMSNorm is eight ops (cast, pow, mean, add, rsqrt, mul, cast, mul), rotary eleven, and a
// step of the 12-layer model ran ~300 of them. Each kernel here is one op and one pass.
//
// Rounding: bf16 results are rounded where the torch reference rounds (after each op it runs in bf16: the
// products and the sum of rotary, the normalized value before the weight multiply, SiLU before the multiply),
// so the kernels give the reference's values up to the order of the RMSNorm sum and exp's last ulp. fp32
// math is done op by op as in the reference (no FMA contraction: the file is built with -ffp-contract=off).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

#include "vec.h"

namespace trnd {
namespace {

constexpr int64_t MAX_ROW = 16384;  // the widest row (hidden size) the kernels take; wider falls back
constexpr int64_t MAX_HEAD = 512;  // the widest head row qk_norm_rotary takes

template <typename T>
inline vf rnd(vf x) {  // the rounding a torch op on T applies to its fp32 result
  if constexpr (std::is_same_v<T, bf16>) return vround_bf16(x);
  else return x;
}

// Rows worth splitting across threads: below this many elements a parallel region costs more than it saves.
constexpr int64_t PARALLEL_MIN = 1 << 15;

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, name, ": float32 or bfloat16, got ",
              x.scalar_type());
  TORCH_CHECK(x.dim() >= 1 && x.stride(-1) == 1, name, ": want unit stride in the last dim");
  TORCH_CHECK(x.size(-1) % W == 0 && x.size(-1) <= MAX_ROW, name, ": last dim ", x.size(-1), " must be a multiple of ",
              W, " and <= ", MAX_ROW);
}

// out = w * round(x * rsqrt(mean(x^2) + eps)) over one row of D; x already in fp32 (rounded to T).
template <typename T>
inline void norm_row(const float* x, const T* w, T* out, int64_t D, float eps) {
  vf acc = vzero();
  for (int64_t c = 0; c < D; c += W) {
    vf v = vload(x + c);
    acc = vfma(v, v, acc);
  }
  const float inv = 1.0f / std::sqrt(vsum(acc) / static_cast<float>(D) + eps);
  const vf vi = vset(inv);
  for (int64_t c = 0; c < D; c += W) vstore(out + c, rnd<T>(vmul(vload(w + c), rnd<T>(vmul(vload(x + c), vi)))));
}

// Rows of x as [outer, inner, D] with strides (s0, s1, 1): a contiguous tensor, or Qwen3's q/k heads as
// views into the fused qkv projection ([T, heads, head_dim], rows 1280 apart), normalized without a copy.
template <typename T>
void rms_norm_impl(const at::Tensor& x, const at::Tensor& w, at::Tensor& out, double eps) {
  const int64_t D = x.size(-1), rows = x.numel() / D;
  const bool heads = x.dim() == 3;
  const int64_t inner = heads ? x.size(1) : 1, s0 = heads ? x.stride(0) : D, s1 = heads ? x.stride(1) : D;
  const T* xs = x.data_ptr<T>();
  const T* ws = w.data_ptr<T>();
  T* os = out.data_ptr<T>();
#pragma omp parallel for if (rows * D >= PARALLEL_MIN)
  for (int64_t r = 0; r < rows; ++r) {
    alignas(64) float h[MAX_ROW];
    const T* xr = xs + (r / inner) * s0 + (r % inner) * s1;
    for (int64_t c = 0; c < D; c += W) vstore(h + c, vload(xr + c));
    norm_row<T>(h, ws, os + r * D, D, static_cast<float>(eps));
  }
}

at::Tensor rms_norm(const at::Tensor& x_, const at::Tensor& w, double eps) {
  const bool strided_heads = x_.dim() == 3 && x_.stride(2) == 1 && x_.stride(1) >= x_.size(2);
  const at::Tensor x = strided_heads ? x_ : x_.contiguous();
  check_rows(x, "x");
  TORCH_CHECK(w.scalar_type() == x.scalar_type() && w.dim() == 1 && w.size(0) == x.size(-1) && w.is_contiguous(),
              "weight: want contiguous [", x.size(-1), "] of ", x.scalar_type());
  at::Tensor out = at::empty(x.sizes(), x.options());
  if (x.scalar_type() == at::kFloat) rms_norm_impl<float>(x, w, out, eps);
  else rms_norm_impl<bf16>(x, w, out, eps);
  return out;
}

template <typename T>
void add_rms_norm_impl(const at::Tensor& x, const at::Tensor& res, const at::Tensor& w, at::Tensor& out,
                       at::Tensor& new_res, double eps) {
  const int64_t D = x.size(-1), rows = x.numel() / D;
  const T* xs = x.data_ptr<T>();
  const T* rs = res.data_ptr<T>();
  const T* ws = w.data_ptr<T>();
  T* os = out.data_ptr<T>();
  T* ns = new_res.data_ptr<T>();
#pragma omp parallel for if (rows * D >= PARALLEL_MIN)
  for (int64_t r = 0; r < rows; ++r) {
    alignas(64) float h[MAX_ROW];
    for (int64_t c = 0; c < D; c += W) {
      vf s = rnd<T>(vadd(vload(xs + r * D + c), vload(rs + r * D + c)));
      vstore(h + c, s);
      vstore(ns + r * D + c, s);
    }
    norm_row<T>(h, ws, os + r * D, D, static_cast<float>(eps));
  }
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x_, const at::Tensor& res_, const at::Tensor& w,
                                                double eps) {
  const at::Tensor x = x_.contiguous(), res = res_.contiguous();
  check_rows(x, "x");
  TORCH_CHECK(res.sizes() == x.sizes() && res.scalar_type() == x.scalar_type(), "residual: want ", x.sizes(), " of ",
              x.scalar_type(), ", got ", res.sizes(), " of ", res.scalar_type());
  TORCH_CHECK(w.scalar_type() == x.scalar_type() && w.dim() == 1 && w.size(0) == x.size(-1) && w.is_contiguous(),
              "weight: want contiguous [", x.size(-1), "] of ", x.scalar_type());
  at::Tensor out = at::empty_like(x), new_res = at::empty_like(x);
  if (x.scalar_type() == at::kFloat) add_rms_norm_impl<float>(x, res, w, out, new_res, eps);
  else add_rms_norm_impl<bf16>(x, res, w, out, new_res, eps);
  return {out, new_res};
}

// One head row, "rotate half" layout: out[i] = x[i] c[i] - x[i+h] s[i], out[i+h] = x[i+h] c[i+h] + x[i] s[i+h].
template <typename T>
inline void rotate_row(const T* x, const T* c, const T* s, T* out, int64_t half) {
  for (int64_t i = 0; i < half; i += W) {
    vf x1 = vload(x + i), x2 = vload(x + half + i);
    vf c1 = vload(c + i), c2 = vload(c + half + i), s1 = vload(s + i), s2 = vload(s + half + i);
    vstore(out + i, rnd<T>(vsub(rnd<T>(vmul(x1, c1)), rnd<T>(vmul(x2, s1)))));
    vstore(out + half + i, rnd<T>(vadd(rnd<T>(vmul(x2, c2)), rnd<T>(vmul(x1, s2)))));
  }
}

template <typename T>
void rotary_impl(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& out) {
  const int64_t Tn = x.size(0), H = x.size(1), D = x.size(2), x0 = x.stride(0), x1 = x.stride(1);
  const T* xs = x.data_ptr<T>();
  const T* cs = cos.data_ptr<T>();
  const T* ss = sin.data_ptr<T>();
  T* os = out.data_ptr<T>();
#pragma omp parallel for if (Tn * H * D >= PARALLEL_MIN)
  for (int64_t t = 0; t < Tn; ++t)
    for (int64_t h = 0; h < H; ++h) rotate_row<T>(xs + t * x0 + h * x1, cs + t * D, ss + t * D, os + (t * H + h) * D, D / 2);
}

void check_head_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, name, ": want [T, heads, head_dim] with unit stride in head_dim, got ",
              x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, name, ": float32 or bfloat16");
  TORCH_CHECK(x.size(2) % (2 * W) == 0, name, ": head_dim ", x.size(2), " must be a multiple of ", 2 * W);
}

// q, k [T, heads, head_dim] and cos, sin [T, head_dim], all of one dtype (what rotary takes).
void check_rotary_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin) {
  check_head_rows(q, "q");
  check_head_rows(k, "k");
  TORCH_CHECK(k.size(0) == q.size(0) && k.size(2) == q.size(2) && k.scalar_type() == q.scalar_type(),
              "k: want [", q.size(0), ", heads, ", q.size(2), "] of ", q.scalar_type());
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->dim() == 2 && t->size(0) == q.size(0) && t->size(1) == q.size(2) &&
                    t->scalar_type() == q.scalar_type(),
                "cos, sin: want [", q.size(0), ", ", q.size(2), "] of ", q.scalar_type(), ", got ", t->sizes());
}

std::tuple<at::Tensor, at::Tensor> apply_rotary(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos_,
                                                const at::Tensor& sin_) {
  const at::Tensor cos = cos_.contiguous(), sin = sin_.contiguous();
  check_rotary_args(q, k, cos, sin);
  at::Tensor qo = at::empty(q.sizes(), q.options()), ko = at::empty(k.sizes(), k.options());
  if (q.scalar_type() == at::kFloat) {
    rotary_impl<float>(q, cos, sin, qo);
    rotary_impl<float>(k, cos, sin, ko);
  } else {
    rotary_impl<bf16>(q, cos, sin, qo);
    rotary_impl<bf16>(k, cos, sin, ko);
  }
  return {qo, ko};
}

// Qwen3's q/k path in one pass per head row: RMSNorm with the head's weight, then rotary, the row kept in L1
// between them. The same arithmetic and rounding as rms_norm then apply_rotary (norm_row, rotate_row), so
// the result is theirs bit for bit; at decode it is one op instead of three, and in a prefill chunk q and k
// are read once from the qkv projection and written once.
template <typename T>
void norm_rotary_impl(const at::Tensor& x, const at::Tensor& w, double eps, const at::Tensor& cos,
                      const at::Tensor& sin, at::Tensor& out) {
  const int64_t Tn = x.size(0), H = x.size(1), D = x.size(2), x0 = x.stride(0), x1 = x.stride(1);
  const T* xs = x.data_ptr<T>();
  const T* ws = w.data_ptr<T>();
  const T* cs = cos.data_ptr<T>();
  const T* ss = sin.data_ptr<T>();
  T* os = out.data_ptr<T>();
  const float e = static_cast<float>(eps);
#pragma omp parallel for if (Tn * H * D >= PARALLEL_MIN)
  for (int64_t t = 0; t < Tn; ++t) {
    alignas(64) float h[MAX_HEAD];
    alignas(64) T n[MAX_HEAD];
    for (int64_t hd = 0; hd < H; ++hd) {
      const T* xr = xs + t * x0 + hd * x1;
      for (int64_t c = 0; c < D; c += W) vstore(h + c, vload(xr + c));
      norm_row<T>(h, ws, n, D, e);
      rotate_row<T>(n, cs + t * D, ss + t * D, os + (t * H + hd) * D, D / 2);
    }
  }
}

std::tuple<at::Tensor, at::Tensor> qk_norm_rotary(const at::Tensor& q, const at::Tensor& k, const at::Tensor& qw,
                                                  const at::Tensor& kw, double eps, const at::Tensor& cos_,
                                                  const at::Tensor& sin_) {
  const at::Tensor cos = cos_.contiguous(), sin = sin_.contiguous();
  check_rotary_args(q, k, cos, sin);
  TORCH_CHECK(q.size(2) <= MAX_HEAD, "q: head_dim ", q.size(2), " > ", MAX_HEAD);
  for (const at::Tensor* t : {&qw, &kw})
    TORCH_CHECK(t->dim() == 1 && t->size(0) == q.size(2) && t->is_contiguous() && t->scalar_type() == q.scalar_type(),
                "q/k norm weight: want contiguous [", q.size(2), "] of ", q.scalar_type());
  at::Tensor qo = at::empty(q.sizes(), q.options()), ko = at::empty(k.sizes(), k.options());
  if (q.scalar_type() == at::kFloat) {
    norm_rotary_impl<float>(q, qw, eps, cos, sin, qo);
    norm_rotary_impl<float>(k, kw, eps, cos, sin, ko);
  } else {
    norm_rotary_impl<bf16>(q, qw, eps, cos, sin, qo);
    norm_rotary_impl<bf16>(k, kw, eps, cos, sin, ko);
  }
  return {qo, ko};
}

// out = round(silu(gate)) * up, gate|up the two halves of each row; silu(g) = g / (1 + exp(-g)).
inline vf silu(vf g) { return vdiv(g, vadd(vset(1.0f), vexp(vsub(vzero(), g)))); }

// round(silu(g)) for every bf16 g (by its 16 bits), computed once by silu() above. A bf16 gate then takes its SiLU
// from the table, 16 lanes to one gather, instead of an exp and a divide per element: the same values, bit for
// bit. 128 KiB, in L2 across a prefill chunk's rows. One call on a 512-token chunk's [512, 4096] (AMD Zen 4, 2 threads):
// 372 -> 289 us in the AVX-512 build, 594 -> 475 us in the AVX2 one.
const uint16_t* silu_table() {
  static const std::vector<uint16_t> table = [] {
    std::vector<uint16_t> t(65536 + 2);  // + 2: the 4-byte gather of the last entry reads past it
    alignas(64) float g[W];
    alignas(64) bf16 out[W];
    for (int64_t i = 0; i < 65536; i += W) {
      for (int k = 0; k < W; ++k) {
        const uint32_t bits = static_cast<uint32_t>(i + k) << 16;
        std::memcpy(g + k, &bits, sizeof(bits));
      }
      vstore(out, rnd<bf16>(silu(vload(g))));
      std::memcpy(t.data() + i, out, sizeof(out));
    }
    return t;
  }();
  return table.data();
}

// The table's entries for W bf16 gates, widened to fp32.
inline vf silu_lookup(const uint16_t* table, const bf16* g) {
#if defined(__AVX512F__)
  const __m512i idx = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(g)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_i32gather_epi32(idx, table, 2), 16));
#else
  const __m256i idx = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_i32gather_epi32(reinterpret_cast<const int*>(table), idx, 2),
                                               16));
#endif
}

template <typename T>
void silu_and_mul_impl(const at::Tensor& x, at::Tensor& out) {
  const int64_t rows = x.size(0), I = out.size(1), xs0 = x.stride(0);
  const T* xs = x.data_ptr<T>();
  T* os = out.data_ptr<T>();
  const uint16_t* table = std::is_same_v<T, bf16> ? silu_table() : nullptr;
#pragma omp parallel for if (rows * I >= PARALLEL_MIN)
  for (int64_t r = 0; r < rows; ++r) {
    const T* g = xs + r * xs0;
    for (int64_t i = 0; i < I; i += W) {
      vf s;
      if constexpr (std::is_same_v<T, bf16>) s = silu_lookup(table, g + i);
      else s = silu(vload(g + i));
      vstore(os + r * I + i, rnd<T>(vmul(s, vload(g + I + i))));
    }
  }
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  check_rows(x, "gate_up");
  TORCH_CHECK(x.dim() == 2 && x.size(1) % (2 * W) == 0, "gate_up: want [T, 2 * I] with I a multiple of ", W,
              ", got ", x.sizes());
  at::Tensor out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  if (x.scalar_type() == at::kFloat) silu_and_mul_impl<float>(x, out);
  else silu_and_mul_impl<bf16>(x, out);
  return out;
}

// torch.argmax(x, -1) of one row: the first index of the largest value, a NaN counting as the largest (the first
// NaN's index). Two passes over a row that stays in L2: its max, then the first lane equal to it. A NaN or an
// infinity anywhere (x - x is then NaN, and the sum of those differences with it) sends the row to a scalar scan.
template <typename T>
int64_t argmax_row(const T* x, int64_t V) {
  const int64_t vn = V / W * W;
  vf m0 = vset(-std::numeric_limits<float>::infinity()), m1 = m0, z = vzero();
  int64_t i = 0;
  for (; i + 2 * W <= vn; i += 2 * W) {
    const vf a = vload(x + i), b = vload(x + i + W);
    m0 = vmax(m0, a);
    m1 = vmax(m1, b);
    z = vadd(z, vadd(vsub(a, a), vsub(b, b)));
  }
  for (; i < vn; i += W) {
    const vf a = vload(x + i);
    m0 = vmax(m0, a);
    z = vadd(z, vsub(a, a));
  }
  float m = vhmax(vmax(m0, m1));
  bool special = std::isnan(vsum(z));
  for (int64_t j = vn; j < V; ++j) {
    const float v = static_cast<float>(x[j]);
    special = special || !std::isfinite(v);
    m = std::max(m, v);
  }
  if (special) {  // torch's order: the first NaN, else the first of the largest (infinities compare as numbers)
    int64_t best = 0;
    for (int64_t j = 0; j < V; ++j) {
      const float v = static_cast<float>(x[j]);
      if (std::isnan(v)) return j;
      if (v > static_cast<float>(x[best])) best = j;
    }
    return best;
  }
  const vf vm = vset(m);
  for (i = 0; i < vn; i += W)
    if (const uint32_t k = veq_mask(vload(x + i), vm)) return i + __builtin_ctz(k);
  for (int64_t j = vn; j < V; ++j)
    if (static_cast<float>(x[j]) == m) return j;
  return 0;  // not reached: m is one of the row's values
}

// Why: greedy decoding's one op between the LM head and the next step. torch's argmax took 0.22 ms for 16 rows of
// the `small` model's 32000 fp32 logits on AMD Zen 4 (0.92 ms in bf16), this 0.025 (0.029): a b=16 bf16 decode
// step ~1% shorter (docs/RESULTS.md, "Issue 15, 2026-12-06 (second session)"). Rows split over the threads from 8.
at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "logits: float32 or bfloat16, got ",
              x.scalar_type());
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0 && x.stride(1) == 1, "logits: want [B, V] with V > 0 and unit stride in "
              "V, got ", x.sizes());
  const int64_t B = x.size(0), V = x.size(1), s0 = x.stride(0);
  at::Tensor out = at::empty({B}, x.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  const bool f32 = x.scalar_type() == at::kFloat;
#pragma omp parallel for if (B * V >= 8 * PARALLEL_MIN)
  for (int64_t b = 0; b < B; ++b)
    o[b] = f32 ? argmax_row(x.data_ptr<float>() + b * s0, V)
               : argmax_row(reinterpret_cast<const bf16*>(x.data_ptr()) + b * s0, V);
  return out;
}

}  // namespace
}  // namespace trnd

#define TRND_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
#define TRND_FRAGMENT_IMPL(ns, k, m) TORCH_LIBRARY_IMPL(ns, k, m)

TRND_FRAGMENT(TRND_LIB, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("apply_rotary(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def("qk_norm_rotary(Tensor q, Tensor k, Tensor q_weight, Tensor k_weight, float eps, Tensor cos, Tensor sin) -> "
        "(Tensor, Tensor)");
}

TRND_FRAGMENT_IMPL(TRND_LIB, CPU, m) {
  m.impl("rms_norm", &trnd::rms_norm);
  m.impl("add_rms_norm", &trnd::add_rms_norm);
  m.impl("apply_rotary", &trnd::apply_rotary);
  m.impl("silu_and_mul", &trnd::silu_and_mul);
  m.impl("argmax_rows", &trnd::argmax_rows);
  m.impl("qk_norm_rotary", &trnd::qk_norm_rotary);
}
