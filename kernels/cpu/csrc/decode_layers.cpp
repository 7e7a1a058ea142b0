// decode_layers: a decode-only step's decoder layers (trnd/model/llama.py) in one call from Python.
//
// Why: eager, a decode step is ~110 kernel calls from Python, and each pays the interpreter and the dispatcher
// with their working set just evicted from L2 by the linear before it (the weights stream through). At batch 4
// on 2 cores (AMD Zen 4) that was ~2 ms of an ~8.6 ms step outside any kernel. Here the same kernels run in the
// same order on the same tensors, called through the dispatcher from C++: logits bit-identical to the eager
// loop (tests/test_decode_layers.py), only the calls between them are cheaper. Prefill and mixed steps stay on
// the eager loop: their kernels are long, the calls between them a small part.
//
// weights: per layer, 8 tensors in order: input norm, qkv (packed), q norm, k norm (empty: no q/k norm), o
// (packed), post-attention norm, gate_up (packed), down (packed). widths: the four linears' output widths.
// linear: the packed linears' op in this build ("linear", "linear_amx" or "linear_f32").
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>

#define TRND_STR2(x) #x
#define TRND_STR(x) TRND_STR2(x)

namespace trnd {
namespace {

using T = at::Tensor;
using Pair = std::tuple<T, T>;

std::string qualified(const char* name) { return std::string(TRND_STR(TRND_LIB)) + "::" + name; }

template <typename Sig>
c10::TypedOperatorHandle<Sig> find(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(qualified(name).c_str(), "").typed<Sig>();
}

using NormSig = T(const T&, const T&, double);
using AddNormSig = Pair(const T&, const T&, const T&, double);
using QkNormRotarySig = Pair(const T&, const T&, const T&, const T&, double, const T&, const T&);
using RotarySig = Pair(const T&, const T&, const T&, const T&);
using WriteKvSig = void(T&, int64_t, const T&, const T&, const T&, const T&);
using AttentionSig = T(const T&, const T&, int64_t, const T&, const T&, double, int64_t, bool);
using SiluSig = T(const T&);
using LinearSig = T(const T&, const T&, int64_t);

struct Kernels {  // this build's ops, looked up once (at the first call: every op registers when the library loads)
  c10::TypedOperatorHandle<NormSig> rms_norm = find<NormSig>("rms_norm");
  c10::TypedOperatorHandle<AddNormSig> add_rms_norm = find<AddNormSig>("add_rms_norm");
  c10::TypedOperatorHandle<QkNormRotarySig> qk_norm_rotary = find<QkNormRotarySig>("qk_norm_rotary");
  c10::TypedOperatorHandle<RotarySig> apply_rotary = find<RotarySig>("apply_rotary");
  c10::TypedOperatorHandle<WriteKvSig> write_kv = find<WriteKvSig>("write_kv");
  c10::TypedOperatorHandle<AttentionSig> attention = find<AttentionSig>("decode_attention");
  c10::TypedOperatorHandle<SiluSig> silu_and_mul = find<SiluSig>("silu_and_mul");
  // the packed linears; the AVX2 build has no `linear` nor `linear_amx`
  std::optional<c10::TypedOperatorHandle<LinearSig>> linear = maybe("linear"), linear_amx = maybe("linear_amx"),
                                                      linear_f32 = maybe("linear_f32");

  static std::optional<c10::TypedOperatorHandle<LinearSig>> maybe(const char* name) {
    auto op = c10::Dispatcher::singleton().findSchema({qualified(name), ""});
    if (!op) return std::nullopt;
    return op->typed<LinearSig>();
  }

  c10::TypedOperatorHandle<LinearSig> linear_op(c10::string_view name) const {
    const auto& op = name == "linear" ? linear : name == "linear_amx" ? linear_amx : linear_f32;
    TORCH_CHECK(name == "linear" || name == "linear_amx" || name == "linear_f32",
                "decode_layers: linear = '", name, "': want linear, linear_amx or linear_f32");
    TORCH_CHECK(op.has_value(), "decode_layers: this build (", TRND_STR(TRND_LIB), ") has no ", name);
    return *op;
  }
};

const Kernels& kernels() {
  static const Kernels k;
  return k;
}

Pair decode_layers(const T& x0, at::TensorList w, c10::IntArrayRef widths, c10::string_view linear, const T& cos,
                   const T& sin, T& kv, const T& page_ids, const T& offsets, const T& pages, const T& ctx,
                   int64_t num_heads, int64_t num_kv_heads, double scale, double eps, bool dpbf16) {
  TORCH_CHECK(w.size() % 8 == 0 && !w.empty(), "decode_layers: want 8 weights a layer, got ", w.size());
  TORCH_CHECK(widths.size() == 4, "decode_layers: want the 4 linears' widths, got ", widths.size());
  TORCH_CHECK(x0.dim() == 2 && kv.dim() == 6, "decode_layers: x [B, hidden], kv [pages, layers, 2, kv_heads, page, "
              "head_dim]");
  const Kernels& k = kernels();
  const auto lin = k.linear_op(linear);
  const int64_t layers = static_cast<int64_t>(w.size()) / 8, B = x0.size(0), hd = kv.size(5);
  const int64_t nq = num_heads * hd, nk = num_kv_heads * hd;
  T x = x0, res;
  for (int64_t l = 0; l < layers; ++l) {
    const T* lw = w.data() + 8 * l;
    if (l == 0) {
      res = x;
      x = k.rms_norm.call(x, lw[0], eps);
    } else {
      std::tie(x, res) = k.add_rms_norm.call(x, res, lw[0], eps);
    }
    const T qkv = lin.call(x, lw[1], widths[0]);
    T q = qkv.narrow(1, 0, nq).view({B, num_heads, hd});
    T kn = qkv.narrow(1, nq, nk).view({B, num_kv_heads, hd});
    const T v = qkv.narrow(1, nq + nk, nk).view({B, num_kv_heads, hd});
    if (lw[2].numel() > 0) std::tie(q, kn) = k.qk_norm_rotary.call(q, kn, lw[2], lw[3], eps, cos, sin);
    else std::tie(q, kn) = k.apply_rotary.call(q, kn, cos, sin);
    k.write_kv.call(kv, l, kn, v, page_ids, offsets);
    const T a = k.attention.call(q, kv, l, pages, ctx, scale, 0, dpbf16);
    x = lin.call(a.reshape({B, nq}), lw[4], widths[1]);
    std::tie(x, res) = k.add_rms_norm.call(x, res, lw[5], eps);
    x = lin.call(k.silu_and_mul.call(lin.call(x, lw[6], widths[2])), lw[7], widths[3]);
  }
  return {x, res};
}

}  // namespace
}  // namespace trnd

TORCH_LIBRARY_FRAGMENT(TRND_LIB, m) {
  m.def("decode_layers(Tensor x, Tensor[] weights, int[] widths, str linear, Tensor cos, Tensor sin, Tensor(a!) kv, "
        "Tensor page_ids, Tensor offsets, Tensor pages, Tensor ctx, int num_heads, int num_kv_heads, float scale, "
        "float eps, bool dpbf16) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(TRND_LIB, CPU, m) { m.impl("decode_layers", &trnd::decode_layers); }
