// The few vector operations the kernels use, for the ISA this translation unit is compiled for:
// AVX-512F (16 fp32 lanes) when __AVX512F__ is defined, else AVX2 + FMA (8 lanes). One source, two builds
// (kernels/cpu/build.py), picked at run time from kernels/cpuinfo.py: nothing here probes the CPU.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <type_traits>

#include <c10/util/BFloat16.h>

namespace trnd {

using bf16 = c10::BFloat16;

#if defined(__AVX512F__)
constexpr int W = 16;
using vf = __m512;
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vset(float x) { return _mm512_set1_ps(x); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline vf vload(const bf16* p) {  // bf16 is the top half of an fp32: widen by a 16-bit shift
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
// 2W bf16 laid out as W 32-bit pairs: lo = the pairs' low halves, hi = their high halves, widened exactly to fp32
// (a shift and a mask: the bf16 is the top half of an fp32).
inline void vload_pairs(const bf16* p, vf& lo, vf& hi) {
  __m512i v = _mm512_loadu_si512(p);
  lo = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  hi = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}
inline void vstore(float* p, vf x) { _mm512_storeu_ps(p, x); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf vmin(vf a, vf b) { return _mm512_min_ps(a, b); }
inline float vsum(vf x) { return _mm512_reduce_add_ps(x); }
inline float vhmax(vf x) { return _mm512_reduce_max_ps(x); }
inline uint32_t veq_mask(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }  // bit i: lane i equal
inline vf vround(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf vpow2i(vf n) {  // 2^n for integral n in [-126, 127]: n + 127 into the exponent field
  __m512i e = _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127));
  return _mm512_castsi512_ps(_mm512_slli_epi32(e, 23));
}
inline __m128 vquarter(vf x) {  // 4 partial sums of x
  __m256 h = _mm256_add_ps(_mm512_castps512_ps256(x), _mm512_extractf32x8_ps(x, 1));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}
inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
// fp32 -> the nearest bf16 (ties to even), kept as an fp32 with the low 16 bits zero: what torch's bf16
// ops round every result to, so a fused kernel can round where the torch reference's ops do.
inline vf vround_bf16(vf x) {
  __m512i b = _mm512_castps_si512(x);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  b = _mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  return _mm512_castsi512_ps(_mm512_and_si512(b, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}
inline void vstore(bf16* p, vf x) {  // rounds to nearest even
  __m512i b = _mm512_srli_epi32(_mm512_castps_si512(vround_bf16(x)), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(b));
}
// 2^t on 16 lanes, enough for probabilities rounded to bf16 next (8-bit mantissa; both prefill kernels):
// 2^n 2^f, f in [-0.5, 0.5], 2^f by a degree-4 polynomial (relative error < 5e-5); t = -inf (a masked key) gives
// NaN, which the caller masks to 0, and a t far below -126 gives 0. 7 vector ops where vexp takes 20.
inline vf pow2_bf16(vf t) {
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(9.6181291e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}
#else
constexpr int W = 8;
using vf = __m256;
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vset(float x) { return _mm256_set1_ps(x); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline vf vload(const bf16* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline void vload_pairs(const bf16* p, vf& lo, vf& hi) {
  __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  hi = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}
inline void vstore(float* p, vf x) { _mm256_storeu_ps(p, x); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
inline vf vmin(vf a, vf b) { return _mm256_min_ps(a, b); }
inline float vsum(vf x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float vhmax(vf x) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline uint32_t veq_mask(vf a, vf b) { return _mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_EQ_OQ)); }
inline vf vround(vf x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf vpow2i(vf n) {
  __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
}
inline __m128 vquarter(vf x) { return _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1)); }
inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
inline vf vround_bf16(vf x) {
  __m256i b = _mm256_castps_si256(x);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  b = _mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  return _mm256_castsi256_ps(_mm256_and_si256(b, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}
inline void vstore(bf16* p, vf x) {
  __m256i b = _mm256_srli_epi32(_mm256_castps_si256(vround_bf16(x)), 16);
  __m128i h = _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
}
#endif

// The sums of W vectors at once, lane t of the result = sum of a[t]'s lanes: a transpose-and-add tree
// (unpack, shuffle, then across 128-bit lanes), ~3 instructions a vector instead of a horizontal sum each.
// Lanes of different a[t] never mix, so a garbage a[t] (a slot past the context) spoils only lane t.
#if defined(__AVX512F__)
inline vf vsum_lanes(const vf* a) {
  vf c[4];
  for (int k = 0; k < 4; ++k) {
    const vf* x = a + 4 * k;
    vf b01 = _mm512_add_ps(_mm512_unpacklo_ps(x[0], x[1]), _mm512_unpackhi_ps(x[0], x[1]));
    vf b23 = _mm512_add_ps(_mm512_unpacklo_ps(x[2], x[3]), _mm512_unpackhi_ps(x[2], x[3]));
    // each 128-bit lane L: [sum_L x0, sum_L x1, sum_L x2, sum_L x3]
    c[k] = _mm512_add_ps(_mm512_shuffle_ps(b01, b23, 0x44), _mm512_shuffle_ps(b01, b23, 0xEE));
  }
  vf d01 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
  vf d23 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d01, d23, 0x88), _mm512_shuffle_f32x4(d01, d23, 0xDD));
}
#else
inline vf vsum_lanes(const vf* a) {
  vf c[2];
  for (int k = 0; k < 2; ++k) {
    const vf* x = a + 4 * k;
    vf b01 = _mm256_add_ps(_mm256_unpacklo_ps(x[0], x[1]), _mm256_unpackhi_ps(x[0], x[1]));
    vf b23 = _mm256_add_ps(_mm256_unpacklo_ps(x[2], x[3]), _mm256_unpackhi_ps(x[2], x[3]));
    c[k] = _mm256_add_ps(_mm256_shuffle_ps(b01, b23, 0x44), _mm256_shuffle_ps(b01, b23, 0xEE));
  }
  return _mm256_add_ps(_mm256_permute2f128_ps(c[0], c[1], 0x20), _mm256_permute2f128_ps(c[0], c[1], 0x31));
}
#endif

// The sums of four vectors at once, [sum a, sum b, sum c, sum d]: cheaper than four horizontal sums.
inline __m128 vsum4(vf a, vf b, vf c, vf d) {
  return _mm_hadd_ps(_mm_hadd_ps(vquarter(a), vquarter(b)), _mm_hadd_ps(vquarter(c), vquarter(d)));
}

// exp(x), a few ulp over the range softmax uses (x <= 0 after the max is subtracted): Cephes' expf
// polynomial on x - n ln2, times 2^n. Inputs below -87 give ~1e-38, not 0; callers zero what they mask.
inline vf vexp(vf x) {
  x = vmin(vmax(x, vset(-87.0f)), vset(88.0f));
  vf n = vround(vmul(x, vset(1.44269504088896341f)));
  vf r = vsub(vsub(x, vmul(n, vset(0.693359375f))), vmul(n, vset(-2.12194440e-4f)));
  vf p = vset(1.9875691500e-4f);
  p = vfma(p, r, vset(1.3981999507e-3f));
  p = vfma(p, r, vset(8.3334519073e-3f));
  p = vfma(p, r, vset(4.1665795894e-2f));
  p = vfma(p, r, vset(1.6666665459e-1f));
  p = vfma(p, r, vset(5.0000001201e-1f));
  vf y = vadd(vfma(vmul(p, r), r, r), vset(1.0f));
  return vmul(y, vpow2i(n));
}

// f(std::integral_constant<int, R>{}) for R = rows (1 <= rows <= MAX_R): the tail of a row range runs the tile
// compiled for its own row count (the dpbf16 tiles, the fp32 linear's tiles).
template <int MAX_R, typename F>
inline void with_rows(int64_t rows, F&& f) {
  if constexpr (MAX_R > 1) {
    if (rows < MAX_R) return with_rows<MAX_R - 1>(rows, f);
  }
  f(std::integral_constant<int, MAX_R>{});
}

}  // namespace trnd
