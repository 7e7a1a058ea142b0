// The register tile of the quantized weights (csrc/moe.cpp's experts and quantized linears): R <= 6 rows of fp32 x
// against one block of BLOCK = 2W output columns laid out [K][BLOCK] as in f32_tile.h, the weights stored as the
// checkpoint stores them and widened to fp32 in registers, one k-row at a time, times their group's scales. No
// dequantized copy of a weight exists anywhere. Torch reference: kernels/quant.py (dequantize, then F.linear).
//
//   FP8  (block-scaled float8_e4m3fn): a k-row is BLOCK bytes, one code per column. e4m3 is turned into an fp16 by
//        moving its bits (sign to bit 15, exponent and mantissa to bits 13-7; bit 14 cleared), which F16C widens
//        exactly, subnormals included: the fp16 is the e4m3 value / 256, and the pack stores each scale x 256, so the
//        one multiply by the scale rounds as the reference's value x scale does. Scales: fp32 [G][BLOCK] per block.
//   MXFP4 (OCP e2m1, GPT-OSS): a k-row is BLOCK / 2 bytes, column c in the low nibble of byte c and column
//        c + W in the high one; a byte shuffle looks each code up as 2x its value (an int8), widened to fp32 and
//        multiplied by 2^(s - 128) (s the group's e8m0 byte): exact. Scales: bytes [G][BLOCK] per block.
// G = ceil(K / group) groups of `group` consecutive k share a scale vector (one scale per column).
#pragma once
#include <immintrin.h>

#include <cstdint>

#include "f32_tile.h"
#include "vec.h"

namespace trnd {

enum QFmt : int64_t { Q_NONE = 0, Q_FP8 = 1, Q_MXFP4 = 2 };

// bytes of one k-row of a block
template <int FMT>
constexpr int64_t q_row_bytes() {
  return FMT == Q_FP8 ? F32_BLOCK : F32_BLOCK / 2;
}

#if defined(__AVX512F__)
inline void fp8_row(const uint8_t* p, vf& w0, vf& w1) {
  __m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  h = _mm256_and_si256(_mm256_slli_epi16(h, 7), _mm256_set1_epi16(static_cast<short>(0xBFFF)));
  __m256i h2 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
  h2 = _mm256_and_si256(_mm256_slli_epi16(h2, 7), _mm256_set1_epi16(static_cast<short>(0xBFFF)));
  w0 = _mm512_cvtph_ps(h);
  w1 = _mm512_cvtph_ps(h2);
}
inline void fp4_row(const uint8_t* p, __m128i lut, vf& w0, vf& w1) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i m = _mm_set1_epi8(0x0F);
  w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_shuffle_epi8(lut, _mm_and_si128(b, m))));
  w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(b, 4), m))));
}
inline void e8m0_scales(const uint8_t* p, vf& s0, vf& s1) {  // 2^(s - 128): half of the e8m0 value
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i b2 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16));
  s0 = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu8_epi32(b), 23)), _mm512_set1_ps(0.5f));
  s1 = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu8_epi32(b2), 23)), _mm512_set1_ps(0.5f));
}
#else
inline void fp8_row(const uint8_t* p, vf& w0, vf& w1) {
  __m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  h = _mm256_and_si256(_mm256_slli_epi16(h, 7), _mm256_set1_epi16(static_cast<short>(0xBFFF)));
  w0 = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
  w1 = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}
inline void fp4_row(const uint8_t* p, __m128i lut, vf& w0, vf& w1) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m128i m = _mm_set1_epi8(0x0F);
  w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_shuffle_epi8(lut, _mm_and_si128(b, m))));
  w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(b, 4), m))));
}
inline void e8m0_scales(const uint8_t* p, vf& s0, vf& s1) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  s0 = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu8_epi32(b), 23)), _mm256_set1_ps(0.5f));
  s1 = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)), 23)),
                     _mm256_set1_ps(0.5f));
}
#endif

// 2x the e2m1 values of codes 0-15 as int8 (the shuffle's table)
inline __m128i fp4_lut() { return _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12); }

// out[r][BLOCK] = x[r] . block's columns. blk: the block's codes [K][row bytes]; sc: its scales [G][BLOCK] (fp32 x 256
// for FP8, e8m0 bytes for MXFP4); pf: prefetch this block's stream ahead (the first tile over a block) or not.
template <int R, int FMT>
inline void q_tile(const float* x, int64_t xs, int64_t K, int64_t group, const uint8_t* blk, const void* sc,
                   bool pf, float* out, int64_t os = F32_BLOCK) {
  constexpr int64_t RB = q_row_bytes<FMT>();
  constexpr int64_t AHEAD = 4096 / RB;  // k-rows of prefetch distance: 4 KB of the stream
  vf acc[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = vzero();
  const __m128i lut = fp4_lut();
  for (int64_t k0 = 0, g = 0; k0 < K; k0 += group, ++g) {
    vf s0, s1;
    if constexpr (FMT == Q_FP8) {
      const float* s = static_cast<const float*>(sc) + g * F32_BLOCK;
      s0 = vload(s);
      s1 = vload(s + W);
    } else {
      e8m0_scales(static_cast<const uint8_t*>(sc) + g * F32_BLOCK, s0, s1);
    }
    const int64_t k1 = k0 + group < K ? k0 + group : K;
    for (int64_t k = k0; k < k1; ++k) {
      const uint8_t* w = blk + k * RB;
      if (pf) _mm_prefetch(reinterpret_cast<const char*>(w + AHEAD * RB), _MM_HINT_T1);
      vf w0, w1;
      if constexpr (FMT == Q_FP8) fp8_row(w, w0, w1);
      else fp4_row(w, lut, w0, w1);
      w0 = vmul(w0, s0);
      w1 = vmul(w1, s1);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const vf xb = vset(x[r * xs + k]);
        acc[r][0] = vfma(xb, w0, acc[r][0]);
        acc[r][1] = vfma(xb, w1, acc[r][1]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    vstore(out + r * os, acc[r][0]);
    vstore(out + r * os + W, acc[r][1]);
  }
}

}  // namespace trnd
