// Quantized linears for the CPU: y [M, O] = x [M, I] W^T with W stored quantized.
// Built and loaded by cpu_kernels.py, where the reference in torch ops lives; registered as
// torch ops so the compiled graphs call them like any aten op.
//
//   zoo_quant::int4_linear(x, qs, sm, group)
//       x  [M, I] float32
//       qs [O, I/2] uint8, llama.cpp's Q4 block layout: in each block of 32 inputs, byte t holds
//          input t (low nibble) and input t + 16 (high nibble), q in 0..15
//       sm [O, 2, I/g] float16 or float32: d = sm[o, 0], m = sm[o, 1] per group of g inputs (g a
//          multiple of 32): W[o, i] = q[o, i] * d[i / g] + m[i / g]
//          (GGUF Q4_1's values; Q4_0 is m = -8 d; Q4_K's d * sc and -dmin * m need float32)
//   zoo_quant::int5_linear(x, qs, qh, sm, group)
//       as int4_linear with a fifth bit per code, q in 0..31 (GGUF Q5_0 / Q5_1 at their stored width):
//       qs [O, I/2] uint8 the low nibbles as int4's, qh [O, I/8] uint8 the high bits (4 bytes per
//          block of 32, a little-endian word: bit t is input t's), q = nibble | bit << 4
//       (Q5_1's d, m; Q5_0 is m = -16 d)
//   zoo_quant::int8_linear(x, qw, scale)
//       qw [O, I] int8, scale [O] float32: W[o, i] = qw[o, i] * scale[o]
//   zoo_quant::int8g_linear(x, qw, sm, group)
//       qw [O, I] int8, sm [O, 2, I/g] float32 or float16, g 16 or a multiple of 32:
//          W[o, i] = qw[o, i] * d[i / g] + m[i / g]   (every GGUF block type's codes, exactly)
//       or sm [O, 1, I/g]: d only, W = qw * d (the types without an offset, Q8_0 / Q3_K / ...:
//          no m term); float16 where the type's d is a stored float16 (Q8_0: 34 bytes per 32
//          weights, as the file)
//   zoo_quant::q6k_linear(x, blocks)
//       blocks [O, I/256 * 210] uint8: GGUF Q6_K blocks as stored (6.5625 bits a weight), I a
//          multiple of 256: W = d * sc[i / 16] * (q - 32), q 6 bits (the layout at q6k_rows)
//
// Few rows (M <= 16, decode): x is rounded to int8 per block of 32 inputs (scale max|x| / 127,
// llama.cpp's Q8 activations) and each block's dot product is integer (maddubs: 32 multiply-adds
// in one instruction), scaled once per block; the m term of int4 uses float sums of x, int5's
// those of the rounded x (as llama.cpp's Q5 dots). That
// reads the codes without widening them to floats, which is what makes a matrix-vector product
// as fast as the memory: a float32 FMA loop over the widened codes measured 2-3x slower.
// Many rows (prefill): a chunk of weight rows at a time is dequantized into float32 and
// multiplied by at::mm (the BLAS GEMM), activations unrounded.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define ZOO_AVX2 1
#endif
// AVX512 (native.py's "avx512" level, F + BW + VL): 512-bit vectors take two blocks of 32 codes at
// a time; with VNNI ("avx512_vnni") vpdpbusd takes a 4-byte dot product per int32 lane in one
// instruction (maddubs + madd without it)
#if defined(ZOO_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define ZOO_AVX512 1
#if defined(__AVX512VNNI__)
#define ZOO_VNNI 1
#endif
#endif

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kGemvRows = 16;  // up to this many rows of x (a decode batch): integer dots, else GEMM
constexpr int64_t kMaxBlocks = 2048;  // inputs / 32 of the few-row path's stack buffers (I <= 65536)

inline float half_to_float(const at::Half* h) { return static_cast<float>(*h); }
inline float half_to_float(const float* h) { return *h; }

// x [M, I] -> codes xq [M, I] int8 and scales dx [M, I/32]: x ~= xq * dx per block of 32.
void quantize_rows(const float* x, int64_t M, int64_t I, int8_t* xq, float* dx) {
  for (int64_t b = 0; b < M * I / kBlock; ++b) {
    const float* v = x + b * kBlock;
    float amax = 0.f;
    for (int64_t t = 0; t < kBlock; ++t) amax = std::max(amax, std::fabs(v[t]));
    const float id = amax > 0.f ? 127.f / amax : 0.f;
    dx[b] = amax / 127.f;
    for (int64_t t = 0; t < kBlock; ++t) xq[b * kBlock + t] = static_cast<int8_t>(std::nearbyint(v[t] * id));
  }
}

#ifdef ZOO_AVX2
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 32 unsigned codes times 32 signed activations -> 8 int32 partial sums, as floats
inline __m256 dot32(__m256i w_u8, __m256i x_i8) {
#ifdef ZOO_VNNI
  return _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), w_u8, x_i8));
#else
  const __m256i p16 = _mm256_maddubs_epi16(w_u8, x_i8);
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
#endif
}

// 8 scales as floats, from float16 or float32
inline __m256 load8(const at::Half* h) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
}
inline __m256 load8(const float* f) { return _mm256_loadu_ps(f); }

// sum_g m[g] xs[g], 8 groups at a time
template <typename S>
inline float m_term(const S* m, const float* xs, int64_t ng) {
  __m256 am = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= ng; g += 8) am = _mm256_fmadd_ps(load8(m + g), _mm256_loadu_ps(xs + g), am);
  float tail = 0.f;
  for (; g < ng; ++g) tail += half_to_float(m + g) * xs[g];
  return hsum(am) + tail;
}

// sum over steps i < n of step(i, acc) into four sums of vector type V (__m256 or __m512): each
// step's scaled add depends on the previous one into the same sum, so one sum would wait on the
// FMA latency every step
template <typename V, typename Step>
inline V sum_in_four(int64_t n, Step step) {
  V a0{}, a1{}, a2{}, a3{};
  int64_t i = 0;
  for (; i + 3 < n; i += 4) {
    a0 = step(i, a0);
    a1 = step(i + 1, a1);
    a2 = step(i + 2, a2);
    a3 = step(i + 3, a3);
  }
  for (; i < n; ++i) a0 = step(i, a0);
  return (a0 + a1) + (a2 + a3);
}

// over the blocks of 32 inputs (AVX2)
template <typename Block>
inline __m256 sum_blocks(int64_t nb, Block block) { return sum_in_four<__m256>(nb, block); }

// the 32 codes of one Q4 block (16 bytes) as 32 bytes in input order: the 16 bytes broadcast to
// both halves, the upper half shifted by a nibble (three instructions, the load included)
inline __m256i q4_codes(const uint8_t* qs) {
  const __m256i raw = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
  return _mm256_and_si256(_mm256_srlv_epi64(raw, _mm256_set_epi64x(4, 4, 0, 0)), _mm256_set1_epi8(0x0F));
}

// the fifth bits of one Q5 block (4 bytes, bit t is input t's) as 0x10 in the bytes of the inputs
// that have it: byte k of the word copied to bytes 8k..8k+7, each ORed with all bits but its own
// (llama.cpp's bytes_from_bits_32), 0xFF where the bit is set
inline __m256i q5_high(const uint8_t* qh) {
  uint32_t h;
  std::memcpy(&h, qh, 4);
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(int(h)), _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)),
                                        _mm256_set1_epi64x(-1));
  return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

// block b's 32 codes in input order: int4's nibbles, and with Q5 their fifth bits (qh)
template <bool Q5>
inline __m256i codes32(const uint8_t* qs, const uint8_t* qh, int64_t b) {
  if constexpr (Q5)
    return _mm256_or_si256(q4_codes(qs + 16 * b), q5_high(qh + 4 * b));
  else
    return q4_codes(qs + 16 * b);
}

// 32 codes (int8 lanes, in input order) -> out[0..31] = q * d (+ m with Offset) in float32,
// inputs 0-15 with (d0, m0) and 16-31 with (d1, m1) (Q6_K's groups of 16; one group of 32 passes
// the same twice). Codes of 0..31 read as signed bytes are themselves. Without an offset a product
// stays a product (its signed zeros too), as the scalar loops compute it.
template <bool Offset>
inline void widen32(__m256i q, float d0, float m0, float d1, float m1, float* out) {
  const __m128i half[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
  for (int j = 0; j < 4; ++j) {
    const __m128i eight = (j & 1) ? _mm_srli_si128(half[j >> 1], 8) : half[j >> 1];
    const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eight));
    const bool second = j >= 2;
    const __m256 d = _mm256_set1_ps(second ? d1 : d0);
    _mm256_storeu_ps(out + 8 * j, Offset ? _mm256_fmadd_ps(v, d, _mm256_set1_ps(second ? m1 : m0)) : _mm256_mul_ps(v, d));
  }
}

#endif

// ds[b] = d[b / per] dx[b]: the scale of each block of 32 inputs (groups of per blocks) times the
// activation scale (the block loop then broadcasts one float instead of converting and multiplying)
template <typename S>
inline void group_block_scales(const S* d, int64_t per, const float* dx, int64_t nb, float* ds) {
  int64_t b = 0;
#ifdef ZOO_AVX2
  if (per == 1)
    for (; b + 8 <= nb; b += 8) _mm256_storeu_ps(ds + b, _mm256_mul_ps(load8(d + b), _mm256_loadu_ps(dx + b)));
#endif
  // (no integer division per block: at a few hundred inputs a row it costs more than the block's dot)
  for (int64_t g = b / per; b < nb; ++g)
    for (int64_t k = 0; k < per && b < nb; ++k, ++b) ds[b] = half_to_float(d + g) * dx[b];
}

#ifdef ZOO_AVX512
inline float hsum512(__m512 v) { return _mm512_reduce_add_ps(v); }

// the 64 codes of two consecutive Q4 blocks (32 bytes) in input order: each block's 16 bytes in
// two 128-bit lanes, the second shifted by a nibble
inline __m512i q4_codes2(const uint8_t* qs) {
  const __m512i r = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs)));
  const __m512i lanes = _mm512_shuffle_i64x2(r, r, 0x50);  // 128-bit lanes 0, 0, 1, 1
  return _mm512_and_si512(_mm512_srlv_epi64(lanes, _mm512_set_epi64(4, 4, 0, 0, 4, 4, 0, 0)), _mm512_set1_epi8(0x0F));
}

// the 64 codes of blocks 2p and 2p + 1 in input order (codes32 for a pair): the two blocks' high
// words are one 64-bit mask, bit j for input j of the pair, 0x10 where set
template <bool Q5>
inline __m512i codes64(const uint8_t* qs, const uint8_t* qh, int64_t p) {
  const __m512i low = q4_codes2(qs + 32 * p);
  if constexpr (Q5) {
    uint64_t h;
    std::memcpy(&h, qh + 8 * p, 8);
    return _mm512_or_si512(low, _mm512_maskz_mov_epi8(_cvtu64_mask64(h), _mm512_set1_epi8(0x10)));
  } else {
    return low;
  }
}

// 64 unsigned codes times 64 signed activations -> 16 int32 sums (8 per block of 32), as floats
inline __m512 dot64(__m512i w_u8, __m512i x_i8) {
#ifdef ZOO_VNNI
  return _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w_u8, x_i8));
#else
  const __m512i p16 = _mm512_maddubs_epi16(w_u8, x_i8);
  return _mm512_cvtepi32_ps(_mm512_madd_epi16(p16, _mm512_set1_epi16(1)));
#endif
}

// signed codes: |w| times x with w's sign (vpdpbusd multiplies unsigned by signed)
inline __m512 dot64_signed(__m512i w, __m512i x) {
  const __mmask64 neg = _mm512_movepi8_mask(w);
  return dot64(_mm512_abs_epi8(w), _mm512_mask_sub_epi8(x, neg, _mm512_setzero_si512(), x));
}

// 16 lanes of scales: lane l takes s[idx[l]] (2 blocks x 8 lanes, or 4 half-blocks x 4 lanes)
inline __m512 spread(const float* s, int n, __m512i idx) {
  const __m128 v = n == 2 ? _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(s))) : _mm_loadu_ps(s);
  return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(v));
}
const __m512i kTwoBlocks = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
const __m512i kFourHalves = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);

// over pairs of blocks (AVX512)
template <typename Pair>
inline __m512 sum_pairs(int64_t np, Pair pair) { return sum_in_four<__m512>(np, pair); }
#endif

// the fifth bit of input t of a Q5 block (its 4 high bytes at qh) as 0 or 16; 0 for int4
template <bool Q5>
inline int32_t high5(const uint8_t* qh, int64_t t) {
  if constexpr (Q5)
    return ((qh[t >> 3] >> (t & 7)) & 1) << 4;
  else
    return 0;
}

// One output of an int4 (int5 with Q5) row over one int8-rounded row of x:
//   sum_b d[b >> sh] dx[b] sum_{i in b} q[i] xq[i]  +  sum_g m[g] xs[g]
// d, m: the row's scales (sm[o, 0], sm[o, 1], float16 or float32); sh = log2(blocks per group);
// xs [ng]: the float sums of x over each group; qh: the row's high bits (Q5 only).
template <typename S, bool Q5>
inline float q4_row(const uint8_t* qs, const uint8_t* qh, const S* d, const S* m, int64_t ng, int sh, int64_t nb,
                    const int8_t* xq, const float* dx, const float* xs) {
#ifdef ZOO_AVX512
  float ds[kMaxBlocks];
  group_block_scales(d, int64_t(1) << sh, dx, nb, ds);
  auto pair = [&](int64_t p, __m512 acc) {
    const __m512i xv = _mm512_loadu_si512(xq + 2 * p * kBlock);
    return _mm512_fmadd_ps(dot64(codes64<Q5>(qs, qh, p), xv), spread(ds + 2 * p, 2, kTwoBlocks), acc);
  };
  float acc = hsum512(sum_pairs(nb / 2, pair));
  if (nb % 2) {
    const int64_t b = nb - 1;
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * kBlock));
    acc += ds[b] * hsum(dot32(codes32<Q5>(qs, qh, b), xv));
  }
  return acc + m_term(m, xs, ng);
#elif defined(ZOO_AVX2)
  float ds[kMaxBlocks];
  group_block_scales(d, int64_t(1) << sh, dx, nb, ds);
  auto block = [&](int64_t b, __m256 acc) {
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * kBlock));
    return _mm256_fmadd_ps(dot32(codes32<Q5>(qs, qh, b), xv), _mm256_broadcast_ss(ds + b), acc);
  };
  return hsum(sum_blocks(nb, block)) + m_term(m, xs, ng);
#else
  float acc = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    int32_t dot = 0;
    const uint8_t* h = qh + 4 * b;
    for (int64_t t = 0; t < 16; ++t)
      dot += (int32_t(qs[16 * b + t] & 0x0F) | high5<Q5>(h, t)) * xq[b * kBlock + t] +
             (int32_t(qs[16 * b + t] >> 4) | high5<Q5>(h, t + 16)) * xq[b * kBlock + t + 16];
    acc += half_to_float(d + (b >> sh)) * dx[b] * float(dot);
  }
  for (int64_t g = 0; g < ng; ++g) acc += half_to_float(m + g) * xs[g];
  return acc;
#endif
}

#ifdef ZOO_AVX2
// Several rows of x (2..kGemvRows) against one int4 (int5) weight row: each block's codes are
// widened once and used for every row; out[r * O] for r < M.
template <typename S, bool Q5>
inline void q4_rows(const uint8_t* qs, const uint8_t* qh, const S* d, const S* m, int64_t ng, int sh, int64_t nb,
                    const int8_t* xq, const float* dx, const float* xsum, int64_t M, int64_t I, float* out,
                    int64_t O) {
  __m256 acc[kGemvRows];
  for (int64_t r = 0; r < M; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const __m256i w = codes32<Q5>(qs, qh, b);
    const float db = half_to_float(d + (b >> sh));
    for (int64_t r = 0; r < M; ++r) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * I + b * kBlock));
      acc[r] = _mm256_fmadd_ps(dot32(w, xv), _mm256_set1_ps(db * dx[r * nb + b]), acc[r]);
    }
  }
  for (int64_t r = 0; r < M; ++r)
    out[r * O] = hsum(acc[r]) + m_term(m, xsum + r * ng, ng);
}

// The same for int8 weights (times the row scale sc).
inline void int8_rows(const int8_t* qw, float sc, int64_t nb, const int8_t* xq, const float* dx, int64_t M,
                      int64_t I, float* out, int64_t O) {
  __m256 acc[kGemvRows];
  for (int64_t r = 0; r < M; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qw + b * kBlock));
    const __m256i aw = _mm256_sign_epi8(w, w);
    for (int64_t r = 0; r < M; ++r) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * I + b * kBlock));
      acc[r] = _mm256_fmadd_ps(dot32(aw, _mm256_sign_epi8(xv, w)), _mm256_set1_ps(dx[r * nb + b]), acc[r]);
    }
  }
  for (int64_t r = 0; r < M; ++r) out[r * O] = sc * hsum(acc[r]);
}
#endif

// sum_b dx[b] sum_{i in b} qw[i] xq[i] over the blocks of one int8 row (times the row scale later)
inline float int8_row(const int8_t* qw, int64_t nb, const int8_t* xq, const float* dx) {
#ifdef ZOO_AVX512
  auto pair = [&](int64_t p, __m512 acc) {
    const __m512i w = _mm512_loadu_si512(qw + 2 * p * kBlock);
    const __m512i xv = _mm512_loadu_si512(xq + 2 * p * kBlock);
    return _mm512_fmadd_ps(dot64_signed(w, xv), spread(dx + 2 * p, 2, kTwoBlocks), acc);
  };
  float acc = hsum512(sum_pairs(nb / 2, pair));
  if (nb % 2) {
    const int64_t b = nb - 1;
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qw + b * kBlock));
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * kBlock));
    acc += dx[b] * hsum(dot32(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xv, w)));
  }
  return acc;
#elif defined(ZOO_AVX2)
  auto block = [&](int64_t b, __m256 acc) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qw + b * kBlock));
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * kBlock));
    // maddubs multiplies unsigned by signed: |w| times x with w's sign
    return _mm256_fmadd_ps(dot32(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xv, w)), _mm256_set1_ps(dx[b]), acc);
  };
  return hsum(sum_blocks(nb, block));
#else
  float acc = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    int32_t dot = 0;
    for (int64_t t = 0; t < kBlock; ++t) dot += int32_t(qw[b * kBlock + t]) * xq[b * kBlock + t];
    acc += dx[b] * float(dot);
  }
  return acc;
#endif
}

// ds[2b], ds[2b + 1]: the scales of inputs 32b..32b+15 and 32b+16..32b+31 (groups of 16) times
// the activation scale dx[b]
template <typename S>
inline void half_block_scales(const S* d, const float* dx, int64_t nb, float* ds) {
  for (int64_t b = 0; b < nb; ++b) {
    ds[2 * b] = half_to_float(d + 2 * b) * dx[b];
    ds[2 * b + 1] = half_to_float(d + 2 * b + 1) * dx[b];
  }
}

// One output of a grouped int8 row over one int8-rounded row of x:
//   sum_b ds[b] sum_{i in b} qw xq  (groups of 32 or more: int8_row over the block scales)
//   sum_b (ds[2b] sum_{t < 16} qw xq + ds[2b + 1] sum_{t >= 16} qw xq)  (groups of 16)
// plus sum_g m[g] xs[g]; ds: scratch of 2 nb floats; m null: no offsets (no m term).
template <typename S>
inline float i8g_row(const int8_t* qw, const S* d, const S* m, int64_t ng, int64_t group, int64_t nb,
                     const int8_t* xq, const float* dx, const float* xs, float* ds) {
#ifdef ZOO_AVX2
  const float mt = m ? m_term(m, xs, ng) : 0.f;
#else
  float mt = 0.f;
  for (int64_t g = 0; m && g < ng; ++g) mt += half_to_float(m + g) * xs[g];
#endif
  if (group != 16) {
    group_block_scales(d, group / kBlock, dx, nb, ds);
    return int8_row(qw, nb, xq, ds) + mt;
  }
  half_block_scales(d, dx, nb, ds);
#ifdef ZOO_AVX512
  auto pair = [&](int64_t p, __m512 acc) {
    const __m512i w = _mm512_loadu_si512(qw + 2 * p * kBlock);
    const __m512i xv = _mm512_loadu_si512(xq + 2 * p * kBlock);
    // lanes 0-3, 4-7, 8-11, 12-15: inputs 0-15 and 16-31 of the first block, then the second's
    return _mm512_fmadd_ps(dot64_signed(w, xv), spread(ds + 4 * p, 4, kFourHalves), acc);
  };
  float acc = hsum512(sum_pairs(nb / 2, pair));
  if (nb % 2) {
    const int64_t b = nb - 1;
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qw + b * kBlock));
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * kBlock));
    const __m256 sc = _mm256_set_m128(_mm_set1_ps(ds[2 * b + 1]), _mm_set1_ps(ds[2 * b]));
    acc += hsum(_mm256_mul_ps(dot32(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xv, w)), sc));
  }
  return acc + mt;
#elif defined(ZOO_AVX2)
  auto block = [&](int64_t b, __m256 acc) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qw + b * kBlock));
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * kBlock));
    // the 8 int32 sums of dot32: lanes 0-3 hold inputs 0-15, lanes 4-7 inputs 16-31
    const __m256 sc = _mm256_set_m128(_mm_set1_ps(ds[2 * b + 1]), _mm_set1_ps(ds[2 * b]));
    return _mm256_fmadd_ps(dot32(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xv, w)), sc, acc);
  };
  return hsum(sum_blocks(nb, block)) + mt;
#else
  float acc = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    int32_t lo = 0, hi = 0;
    for (int64_t t = 0; t < 16; ++t) lo += int32_t(qw[b * kBlock + t]) * xq[b * kBlock + t];
    for (int64_t t = 16; t < kBlock; ++t) hi += int32_t(qw[b * kBlock + t]) * xq[b * kBlock + t];
    acc += ds[2 * b] * float(lo) + ds[2 * b + 1] * float(hi);
  }
  return acc + mt;
#endif
}

#ifdef ZOO_AVX2
// Several rows of x (2..kGemvRows) against one grouped int8 weight row (as int8_rows: each block's
// codes loaded once for every row); out[r * O] for r < M.
template <typename S>
inline void i8g_rows(const int8_t* qw, const S* d, const S* m, int64_t ng, int64_t group, int64_t nb,
                     const int8_t* xq, const float* dx, const float* xsum, int64_t M, int64_t I, float* out,
                     int64_t O) {
  __m256 acc[kGemvRows];
  for (int64_t r = 0; r < M; ++r) acc[r] = _mm256_setzero_ps();
  const int64_t per = group == 16 ? 0 : group / kBlock;
  for (int64_t b = 0, g = 0, k = 0; b < nb; ++b) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qw + b * kBlock));
    const __m256i aw = _mm256_sign_epi8(w, w);
    // lanes 0-3 hold inputs 0-15, lanes 4-7 inputs 16-31: their group scales
    const __m256 db = per ? _mm256_set1_ps(half_to_float(d + g))
                          : _mm256_set_m128(_mm_set1_ps(half_to_float(d + 2 * b + 1)), _mm_set1_ps(half_to_float(d + 2 * b)));
    if (per && ++k == per) k = 0, ++g;
    for (int64_t r = 0; r < M; ++r) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * I + b * kBlock));
      acc[r] = _mm256_fmadd_ps(dot32(aw, _mm256_sign_epi8(xv, w)), _mm256_mul_ps(db, _mm256_set1_ps(dx[r * nb + b])),
                               acc[r]);
    }
  }
  for (int64_t r = 0; r < M; ++r) out[r * O] = hsum(acc[r]) + (m ? m_term(m, xsum + r * ng, ng) : 0.f);
}
#endif

// Weight rows [r0, r1) of int8g dequantized into out [r1 - r0, I] float32; ns: sm's rows per
// output, 2 (d, m) or 1 (d only). A group at a time: the inner loop vectorizes.
template <typename S>
void i8g_dequantize(const int8_t* qw, const S* sm, int64_t ns, int64_t I, int64_t group, int64_t r0, int64_t r1,
                    float* out) {
  const int64_t ng = I / group;
  at::parallel_for(r0, r1, 16, [&](int64_t a, int64_t b) {
    for (int64_t o = a; o < b; ++o) {
      const S* d = sm + o * ng * ns;
      const int8_t* q = qw + o * I;
      float* w = out + (o - r0) * I;
      for (int64_t g = 0; g < ng; ++g) {
        const float dg = half_to_float(d + g), mg = ns == 2 ? half_to_float(d + ng + g) : 0.f;
        for (int64_t i = g * group; i < (g + 1) * group; ++i) w[i] = float(q[i]) * dg + mg;
      }
    }
  });
}

// Weight rows [r0, r1) of int4 (int5 with Q5: high bits qh) dequantized into out [r1 - r0, I] float32.
template <typename S, bool Q5>
void q4_dequantize(const uint8_t* qs, const uint8_t* qh, const S* sm, int64_t I, int64_t group, int64_t r0,
                   int64_t r1, float* out) {
  const int64_t ng = I / group;
  at::parallel_for(r0, r1, 16, [&](int64_t a, int64_t b) {
    for (int64_t o = a; o < b; ++o) {
      const uint8_t* q = qs + o * (I / 2);
      const uint8_t* h = Q5 ? qh + o * (I / 8) : nullptr;
      const S* s = sm + o * ng * 2;
      float* w = out + (o - r0) * I;
      for (int64_t i = 0; i < I; i += kBlock, q += 16, h += Q5 ? 4 : 0) {
        const float d = half_to_float(s + i / group), m = half_to_float(s + ng + i / group);
#ifdef ZOO_AVX2
        widen32<true>(codes32<Q5>(q, h, 0), d, m, d, m, w + i);  // (q d is exact: fused or not, the same sum)
#else
        for (int64_t t = 0; t < 16; ++t) {
          w[i + t] = float(int32_t(q[t] & 0x0F) | high5<Q5>(h, t)) * d + m;
          w[i + t + 16] = float(int32_t(q[t] >> 4) | high5<Q5>(h, t + 16)) * d + m;
        }
#endif
      }
    }
  });
}

void int8_dequantize(const int8_t* qw, const float* scale, int64_t I, int64_t r0, int64_t r1, float* out) {
  at::parallel_for(r0, r1, 16, [&](int64_t a, int64_t b) {
    for (int64_t o = a; o < b; ++o)
      for (int64_t i = 0; i < I; ++i) out[(o - r0) * I + i] = float(qw[o * I + i]) * scale[o];
  });
}

// Many rows: y[:, r0:r1] = x @ dequantize(rows r0..r1)^T, a chunk of weight rows at a time so the
// float32 copy stays small (about 16 MB) whatever the weight's size.
template <typename Dequant>
at::Tensor chunked_gemm(const at::Tensor& x, int64_t O, int64_t I, Dequant dequant) {
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, O}, x.options());
  const int64_t rows = std::max<int64_t>(64, ((int64_t(1) << 22) / I) / 64 * 64);
  at::Tensor w = at::empty({std::min(rows, O), I}, x.options());
  for (int64_t r0 = 0; r0 < O; r0 += rows) {
    const int64_t r1 = std::min(O, r0 + rows);
    at::Tensor wc = w.narrow(0, 0, r1 - r0);
    dequant(r0, r1, wc.data_ptr<float>());
    y.narrow(1, r0, r1 - r0).copy_(at::mm(x, wc.t()));
  }
  return y;
}

void check_x(const at::Tensor& x, int64_t I, const char* op) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2,
              op, ": x must be a 2-D float32 CPU tensor, got ", x.scalar_type(), " of ", x.sizes());
  TORCH_CHECK(x.size(1) == I && I % kBlock == 0, op, ": x has ", x.size(1), " inputs, the weight ", I,
              " (a multiple of 32)");
}

template <typename S, bool Q5>
at::Tensor int4_linear_impl(const at::Tensor& x, const at::Tensor& qs, const uint8_t* qh, const at::Tensor& sm,
                            int64_t group);

// the checks of int4_linear and int5_linear (op: the name for the errors), then the kernel on the
// contiguous tensors; qh: int5's high bits (checked by int5_linear) or null
at::Tensor int4_or_int5(const char* op, const at::Tensor& x_, const at::Tensor& qs_, const uint8_t* qh,
                        const at::Tensor& sm_, int64_t group) {
  const int64_t O = qs_.size(0), I = qs_.size(1) * 2;
  check_x(x_, I, op);
  TORCH_CHECK(group % kBlock == 0 && I % group == 0, op, ": group ", group, " must be a multiple of 32 ",
              "dividing the inputs (", I, ")");
  TORCH_CHECK(qs_.scalar_type() == at::kByte && (sm_.scalar_type() == at::kHalf || sm_.scalar_type() == at::kFloat) &&
                  sm_.dim() == 3 && sm_.size(0) == O && sm_.size(1) == 2 && sm_.size(2) == I / group,
              op, ": expected qs [O, I/2] uint8 and sm [O, 2, I/g] float16 or float32, got ", qs_.sizes(), " ",
              qs_.scalar_type(), " and ", sm_.sizes(), " ", sm_.scalar_type());
  const at::Tensor x = x_.contiguous(), qs = qs_.contiguous(), sm = sm_.contiguous();
  if (qh != nullptr)
    return sm.scalar_type() == at::kHalf ? int4_linear_impl<at::Half, true>(x, qs, qh, sm, group)
                                         : int4_linear_impl<float, true>(x, qs, qh, sm, group);
  return sm.scalar_type() == at::kHalf ? int4_linear_impl<at::Half, false>(x, qs, qh, sm, group)
                                       : int4_linear_impl<float, false>(x, qs, qh, sm, group);
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& sm, int64_t group) {
  return int4_or_int5("int4_linear", x, qs, nullptr, sm, group);
}

at::Tensor int5_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& qh_, const at::Tensor& sm,
                       int64_t group) {
  TORCH_CHECK(qh_.scalar_type() == at::kByte && qh_.dim() == 2 && qs.dim() == 2 && qh_.size(0) == qs.size(0) &&
                  qh_.size(1) * 4 == qs.size(1),
              "int5_linear: expected qh [O, I/8] uint8 beside qs [O, I/2], got ", qh_.sizes(), " ", qh_.scalar_type(),
              " and ", qs.sizes());
  const at::Tensor qh = qh_.contiguous();  // (kept alive to the end of the call)
  return int4_or_int5("int5_linear", x, qs, qh.data_ptr<uint8_t>(), sm, group);
}

template <typename S, bool Q5>
at::Tensor int4_linear_impl(const at::Tensor& x, const at::Tensor& qs, const uint8_t* qh, const at::Tensor& sm,
                            int64_t group) {
  const int64_t O = qs.size(0), I = qs.size(1) * 2;
  const uint8_t* q = qs.data_ptr<uint8_t>();
  const S* s = sm.data_ptr<S>();
  const int64_t M = x.size(0), ng = I / group, nb = I / kBlock;
  if (M > kGemvRows || nb > kMaxBlocks)  // (no model has more inputs than the stack buffers hold)
    return chunked_gemm(x, O, I, [&](int64_t r0, int64_t r1, float* out) { q4_dequantize<S, Q5>(q, qh, s, I, group, r0, r1, out); });
  at::Tensor y = at::empty({M, O}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  std::vector<int8_t> xq(M * I);
  std::vector<float> dx(M * nb), xsum(M * ng, 0.f);  // xsum: the m term is sum_g m[g] * xsum[g]
  quantize_rows(xp, M, I, xq.data(), dx.data());
  if constexpr (Q5) {
    // int5's m term over the int8-rounded x, as llama.cpp's Q5_0 (signed codes) and Q5_1 (Q8_1's
    // block sums) take it: Q5_0's m = -16 d then cancels the rounding of q d for q near 16, where
    // over x itself decode perplexity drifted 5x further from float (SmolLM2 Q4_K_M / Q5_K_M)
    for (int64_t r = 0; r < M; ++r)
      for (int64_t b = 0; b < nb; ++b) {
        int32_t sum = 0;
        for (int64_t t = 0; t < kBlock; ++t) sum += xq[r * I + b * kBlock + t];
        xsum[r * ng + b * kBlock / group] += dx[r * nb + b] * float(sum);
      }
  } else {
    for (int64_t r = 0; r < M; ++r)
      for (int64_t g = 0; g < ng; ++g)
        for (int64_t i = 0; i < group; ++i) xsum[r * ng + g] += xp[r * I + g * group + i];
  }
  int sh = 0;
  while ((kBlock << sh) < group) ++sh;
  TORCH_CHECK((kBlock << sh) == group, "int4_linear: group ", group, " must be 32 times a power of two");
  at::parallel_for(0, O, 32, [&](int64_t a, int64_t b) {
    for (int64_t o = a; o < b; ++o) {
      const uint8_t* qo = q + o * (I / 2);
      const uint8_t* ho = Q5 ? qh + o * (I / 8) : nullptr;
      const S* so = s + o * ng * 2;
#ifdef ZOO_AVX2
      if (M > 1) {
        q4_rows<S, Q5>(qo, ho, so, so + ng, ng, sh, nb, xq.data(), dx.data(), xsum.data(), M, I, yp + o, O);
        continue;
      }
#endif
      for (int64_t r = 0; r < M; ++r)
        yp[r * O + o] = q4_row<S, Q5>(qo, ho, so, so + ng, ng, sh, nb, xq.data() + r * I, dx.data() + r * nb, xsum.data() + r * ng);
    }
  });
  return y;
}

at::Tensor int8_linear(const at::Tensor& x_, const at::Tensor& qw_, const at::Tensor& scale_) {
  const int64_t O = qw_.size(0), I = qw_.size(1);
  check_x(x_, I, "int8_linear");
  TORCH_CHECK(qw_.scalar_type() == at::kChar && scale_.scalar_type() == at::kFloat && scale_.numel() == O,
              "int8_linear: expected qw [O, I] int8 and scale [O] float32, got ", qw_.sizes(), " ",
              qw_.scalar_type(), " and ", scale_.sizes(), " ", scale_.scalar_type());
  const at::Tensor x = x_.contiguous(), qw = qw_.contiguous(), scale = scale_.contiguous();
  const int8_t* q = qw.data_ptr<int8_t>();
  const float* sc = scale.data_ptr<float>();
  const int64_t M = x.size(0), nb = I / kBlock;
  if (M > kGemvRows || nb > kMaxBlocks)  // (no model has more inputs than the stack buffers hold)
    return chunked_gemm(x, O, I, [&](int64_t r0, int64_t r1, float* out) { int8_dequantize(q, sc, I, r0, r1, out); });
  at::Tensor y = at::empty({M, O}, x.options());
  float* yp = y.data_ptr<float>();
  std::vector<int8_t> xq(M * I);
  std::vector<float> dx(M * nb);
  quantize_rows(x.data_ptr<float>(), M, I, xq.data(), dx.data());
  at::parallel_for(0, O, 32, [&](int64_t a, int64_t b) {
    for (int64_t o = a; o < b; ++o) {
#ifdef ZOO_AVX2
      if (M > 1) {
        int8_rows(q + o * I, sc[o], nb, xq.data(), dx.data(), M, I, yp + o, O);
        continue;
      }
#endif
      for (int64_t r = 0; r < M; ++r) yp[r * O + o] = sc[o] * int8_row(q + o * I, nb, xq.data() + r * I, dx.data() + r * nb);
    }
  });
  return y;
}

template <typename S>
at::Tensor int8g_linear_impl(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& sm, int64_t group) {
  const int64_t O = qw.size(0), I = qw.size(1);
  const int8_t* q = qw.data_ptr<int8_t>();
  const S* s = sm.data_ptr<S>();
  const int64_t M = x.size(0), ng = I / group, nb = I / kBlock, ns = sm.size(1);
  if (M > kGemvRows || nb > kMaxBlocks)
    return chunked_gemm(x, O, I, [&](int64_t r0, int64_t r1, float* out) { i8g_dequantize(q, s, ns, I, group, r0, r1, out); });
  at::Tensor y = at::empty({M, O}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  std::vector<int8_t> xq(M * I);
  std::vector<float> dx(M * nb), xsum(M * ng, 0.f);
  quantize_rows(xp, M, I, xq.data(), dx.data());
  for (int64_t r = 0; r < M && ns == 2; ++r)
    for (int64_t g = 0; g < ng; ++g)
      for (int64_t i = 0; i < group; ++i) xsum[r * ng + g] += xp[r * I + g * group + i];
  at::parallel_for(0, O, 32, [&](int64_t a, int64_t b) {
    float ds[2 * kMaxBlocks];
    for (int64_t o = a; o < b; ++o) {
      const S* so = s + o * ng * ns;
      const S* mo = ns == 2 ? so + ng : nullptr;
#ifdef ZOO_AVX2
      if (M > 1) {
        i8g_rows(q + o * I, so, mo, ng, group, nb, xq.data(), dx.data(), xsum.data(), M, I, yp + o, O);
        continue;
      }
#endif
      for (int64_t r = 0; r < M; ++r)
        yp[r * O + o] = i8g_row(q + o * I, so, mo, ng, group, nb, xq.data() + r * I, dx.data() + r * nb,
                                xsum.data() + r * ng, ds);
    }
  });
  return y;
}

at::Tensor int8g_linear(const at::Tensor& x_, const at::Tensor& qw_, const at::Tensor& sm_, int64_t group) {
  const int64_t O = qw_.size(0), I = qw_.size(1);
  check_x(x_, I, "int8g_linear");
  TORCH_CHECK((group == 16 || group % kBlock == 0) && I % group == 0, "int8g_linear: group ", group,
              " must be 16 or a multiple of 32 dividing the inputs (", I, ")");
  TORCH_CHECK(qw_.scalar_type() == at::kChar && (sm_.scalar_type() == at::kFloat || sm_.scalar_type() == at::kHalf) &&
                  sm_.dim() == 3 && sm_.size(0) == O && (sm_.size(1) == 2 || sm_.size(1) == 1) && sm_.size(2) == I / group,
              "int8g_linear: expected qw [O, I] int8 and sm [O, 2, I/g] or [O, 1, I/g] float32 or float16, got ",
              qw_.sizes(), " ", qw_.scalar_type(), " and ", sm_.sizes(), " ", sm_.scalar_type());
  const at::Tensor x = x_.contiguous(), qw = qw_.contiguous(), sm = sm_.contiguous();
  return sm.scalar_type() == at::kHalf ? int8g_linear_impl<at::Half>(x, qw, sm, group)
                                       : int8g_linear_impl<float>(x, qw, sm, group);
}

// ----------------------------------------------------------------------------- Q6_K as stored
//
// One Q6_K block (210 bytes, 256 inputs): ql[128] | qh[64] | sc[16] int8 | d float16. In each half
// h of 128 inputs (ql[64h..], qh[32h..]) input 32k + t (k < 4, t < 32) has the code
//   q = (k & 1 ? ql[32 + t] : ql[t]) >> (k & 2 ? 4 : 0) & 15  |  (qh[t] >> 2k & 3) << 4
// and W = d * sc[i / 16] * (q - 32) (gguf_blocks.py's _q6_k). The dots take the codes unsigned
// (0..63) and add -32 * (the sum of the activations) per 4 inputs, off[] below, in integers.
constexpr int64_t kQ6Bytes = 210, kQ6Block = 256;

inline float q6_d(const uint8_t* blk) {
  uint16_t bits;
  std::memcpy(&bits, blk + 208, 2);
#ifdef ZOO_AVX2
  return _cvtsh_ss(bits);
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

// the row of x as the Q6_K dots take it: codes xq and scales dx per 32 (quantize_rows), off [I/4]
// int32 = -32 * the sum of each 4 codes, dx2 [I/16] = the scale of each 16 inputs' block
void q6_activations(const int8_t* xq, const float* dx, int64_t I, int32_t* off, float* dx2) {
  for (int64_t j = 0; j < I / 4; ++j)
    off[j] = -32 * (int32_t(xq[4 * j]) + xq[4 * j + 1] + xq[4 * j + 2] + xq[4 * j + 3]);
  for (int64_t j = 0; j < I / 16; ++j) dx2[j] = dx[j / 2];
}

// the 16 group scales of one block times d, as floats
inline void q6_scales(const uint8_t* blk, float* dsc) {
  const float d = q6_d(blk);
  for (int j = 0; j < 16; ++j) dsc[j] = d * float(int8_t(blk[192 + j]));
}

#ifdef ZOO_AVX2
// d * sc of the 8 groups 8u .. 8u + 7 of a block, as floats
inline __m256 q6_scales8(const uint8_t* blk, int u) {
  const __m128i sc = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 192 + 8 * u));
  return _mm256_mul_ps(_mm256_set1_ps(q6_d(blk)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
}

// the 32 codes of block k of half h (inputs 128h + 32k ..) as bytes 0..63
inline __m256i q6_codes32(const uint8_t* blk, int h, int k) {
  const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h + 32 * (k & 1)));
  const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h));
  const __m256i lo = _mm256_and_si256(k & 2 ? _mm256_srli_epi16(ql, 4) : ql, _mm256_set1_epi8(0x0F));
  // bits 2k, 2k + 1 of each qh byte to bits 4, 5 (16-bit shifts: the bits crossing bytes are masked off)
  const __m256i hi = k == 0 ? _mm256_slli_epi16(qh, 4) : k == 1 ? _mm256_slli_epi16(qh, 2)
                   : k == 2 ? qh : _mm256_srli_epi16(qh, 2);
  return _mm256_or_si256(lo, _mm256_and_si256(hi, _mm256_set1_epi8(0x30)));
}

// sum_t (q - 32) x over the 32 inputs of a block as 8 int32 sums of 4 (off: the block's 8 offsets)
inline __m256i q6_dot32(__m256i q, __m256i xv, const int32_t* off) {
  const __m256i o = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(off));
#ifdef ZOO_VNNI
  return _mm256_dpbusd_epi32(o, q, xv);
#else
  return _mm256_add_epi32(o, _mm256_madd_epi16(_mm256_maddubs_epi16(q, xv), _mm256_set1_epi16(1)));
#endif
}
#endif

#ifdef ZOO_AVX512
// d * sc of a block's 16 groups, as floats
inline __m512 q6_scales16(const uint8_t* blk) {
  const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192));
  return _mm512_mul_ps(_mm512_set1_ps(q6_d(blk)), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)));
}

// blocks k, k + 1 (k = 0 or 2) of half h: 64 codes, inputs 128h + 32k .. + 63
inline __m512i q6_codes64(const uint8_t* blk, int h, int k) {
  const __m512i ql = _mm512_loadu_si512(blk + 64 * h);  // bytes 0-31 block k's, 32-63 block k + 1's
  const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h)));
  // block k's high bits (2k, 2k + 1) and block k + 1's (2k + 2, 2k + 3) to bits 4, 5: one shift
  // per 64-bit lane (the bits crossing bytes are masked off below)
  const __m512i hi = k == 0 ? _mm512_sllv_epi64(qh, _mm512_set_epi64(2, 2, 2, 2, 4, 4, 4, 4))
                            : _mm512_srlv_epi64(qh, _mm512_set_epi64(2, 2, 2, 2, 0, 0, 0, 0));
  // the nibbles where 0x0F is set, else hi (ternary logic 0xE4: c ? a : b), then 6 bits
  const __m512i q = _mm512_ternarylogic_epi32(k ? _mm512_srli_epi16(ql, 4) : ql, hi, _mm512_set1_epi8(0x0F), 0xE4);
  return _mm512_and_si512(q, _mm512_set1_epi8(0x3F));
}

// two blocks' dots, 16 int32 sums of 4 (off: their 16 offsets)
inline __m512i q6_dot64(__m512i q, __m512i xv, const int32_t* off) {
  const __m512i o = _mm512_loadu_si512(off);
#ifdef ZOO_VNNI
  return _mm512_dpbusd_epi32(o, q, xv);
#else
  return _mm512_add_epi32(o, _mm512_madd_epi16(_mm512_maddubs_epi16(q, xv), _mm512_set1_epi16(1)));
#endif
}
#endif

// One Q6_K weight row (nsb blocks of 256) against M rows of x (xq [M, I], off [M, I/4], dx2
// [M, I/16]): out[r * O] for r < M. Each block's codes are decoded once for all M rows.
void q6k_rows(const uint8_t* row, int64_t nsb, const int8_t* xq, const int32_t* off, const float* dx2, int64_t M,
              int64_t I, float* out, int64_t O) {
#if defined(ZOO_AVX512)
  // pair p's 16 lanes take groups 4p .. 4p + 3, 4 lanes each, of the block's 16 scales
  const __m512i lanes[4] = {kFourHalves, _mm512_add_epi32(kFourHalves, _mm512_set1_epi32(4)),
                            _mm512_add_epi32(kFourHalves, _mm512_set1_epi32(8)),
                            _mm512_add_epi32(kFourHalves, _mm512_set1_epi32(12))};
  __m512 acc[kGemvRows][2];
  for (int64_t r = 0; r < M; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t s = 0; s < nsb; ++s) {
    const uint8_t* blk = row + s * kQ6Bytes;
    const __m512 dsc = q6_scales16(blk);
    const __m512i q[4] = {q6_codes64(blk, 0, 0), q6_codes64(blk, 0, 2), q6_codes64(blk, 1, 0), q6_codes64(blk, 1, 2)};
    for (int64_t r = 0; r < M; ++r) {
      const int64_t i0 = r * I + s * kQ6Block;  // the block's first input in row r of x
      const __m512 ds = _mm512_mul_ps(dsc, _mm512_loadu_ps(dx2 + i0 / 16));
      for (int p = 0; p < 4; ++p) {
        const __m512i xv = _mm512_loadu_si512(xq + i0 + 64 * p);
        const __m512 dot = _mm512_cvtepi32_ps(q6_dot64(q[p], xv, off + i0 / 4 + 16 * p));
        acc[r][p & 1] = _mm512_fmadd_ps(dot, _mm512_permutexvar_ps(lanes[p], ds), acc[r][p & 1]);
      }
    }
  }
  for (int64_t r = 0; r < M; ++r) out[r * O] = hsum512(_mm512_add_ps(acc[r][0], acc[r][1]));
#elif defined(ZOO_AVX2)
  // block b's 8 lanes take groups 2b (lanes 0-3) and 2b + 1 (4-7) of the 8 scales of its half
  const __m256i lanes[4] = {_mm256_set_epi32(1, 1, 1, 1, 0, 0, 0, 0), _mm256_set_epi32(3, 3, 3, 3, 2, 2, 2, 2),
                            _mm256_set_epi32(5, 5, 5, 5, 4, 4, 4, 4), _mm256_set_epi32(7, 7, 7, 7, 6, 6, 6, 6)};
  __m256 acc[kGemvRows][2];
  for (int64_t r = 0; r < M; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t s = 0; s < nsb; ++s) {
    const uint8_t* blk = row + s * kQ6Bytes;
    const __m256 dsc[2] = {q6_scales8(blk, 0), q6_scales8(blk, 1)};
    __m256i q[8];
    for (int b = 0; b < 8; ++b) q[b] = q6_codes32(blk, b / 4, b % 4);
    for (int64_t r = 0; r < M; ++r) {
      const int64_t i0 = r * I + s * kQ6Block;
      for (int u = 0; u < 2; ++u) {
        const __m256 ds = _mm256_mul_ps(dsc[u], _mm256_loadu_ps(dx2 + i0 / 16 + 8 * u));
        for (int c = 0; c < 4; ++c) {
          const int b = 4 * u + c;
          const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + i0 + 32 * b));
          const __m256 dot = _mm256_cvtepi32_ps(q6_dot32(q[b], xv, off + i0 / 4 + 8 * b));
          acc[r][c & 1] = _mm256_fmadd_ps(dot, _mm256_permutevar8x32_ps(ds, lanes[c]), acc[r][c & 1]);
        }
      }
    }
  }
  for (int64_t r = 0; r < M; ++r) out[r * O] = hsum(_mm256_add_ps(acc[r][0], acc[r][1]));
#else
  float dsc[16];
  uint8_t q[kQ6Block];
  float acc[kGemvRows] = {};
  for (int64_t s = 0; s < nsb; ++s) {
    const uint8_t* blk = row + s * kQ6Bytes;
    q6_scales(blk, dsc);
    for (int h = 0; h < 2; ++h)
      for (int k = 0; k < 4; ++k)
        for (int t = 0; t < 32; ++t)
          q[128 * h + 32 * k + t] = ((blk[64 * h + 32 * (k & 1) + t] >> (k & 2 ? 4 : 0)) & 15) |
                                    (((blk[128 + 32 * h + t] >> (2 * k)) & 3) << 4);
    for (int64_t r = 0; r < M; ++r) {
      const int64_t i0 = r * I + s * kQ6Block;
      for (int j = 0; j < 16; ++j) {
        int32_t dot = 0;
        for (int t = 0; t < 16; ++t) dot += int32_t(q[16 * j + t]) * xq[i0 + 16 * j + t];
        for (int t = 0; t < 4; ++t) dot += off[i0 / 4 + 4 * j + t];
        acc[r] += dsc[j] * dx2[i0 / 16 + j] * float(dot);
      }
    }
  }
  for (int64_t r = 0; r < M; ++r) out[r * O] = acc[r];
#endif
}

// Weight rows [r0, r1) of Q6_K blocks dequantized into out [r1 - r0, I] float32 (d * sc * (q - 32)).
void q6k_dequantize(const uint8_t* blocks, int64_t I, int64_t r0, int64_t r1, float* out) {
  const int64_t nsb = I / kQ6Block;
  at::parallel_for(r0, r1, 16, [&](int64_t a, int64_t b) {
    float dsc[16];
    for (int64_t o = a; o < b; ++o)
      for (int64_t s = 0; s < nsb; ++s) {
        const uint8_t* blk = blocks + (o * nsb + s) * kQ6Bytes;
        float* w = out + (o - r0) * I + s * kQ6Block;
        q6_scales(blk, dsc);
        for (int h = 0; h < 2; ++h)
          for (int k = 0; k < 4; ++k) {
#ifdef ZOO_AVX2
            // the 32 codes of inputs 128h + 32k.. at once: nibbles of ql, bits 2k, 2k + 1 of qh
            // (16-bit shifts: what crosses from the next byte is masked off)
            const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h + 32 * (k & 1)));
            const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h));
            const __m256i lo = _mm256_and_si256(_mm256_srl_epi16(ql, _mm_cvtsi32_si128(k & 2 ? 4 : 0)), _mm256_set1_epi8(15));
            const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * k)), _mm256_set1_epi8(3));
            widen32<false>(_mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), _mm256_set1_epi8(32)),
                    dsc[8 * h + 2 * k], 0.f, dsc[8 * h + 2 * k + 1], 0.f, w + 128 * h + 32 * k);
#else
            for (int t = 0; t < 32; ++t) {
              const int i = 128 * h + 32 * k + t;
              const int q = ((blk[64 * h + 32 * (k & 1) + t] >> (k & 2 ? 4 : 0)) & 15) |
                            (((blk[128 + 32 * h + t] >> (2 * k)) & 3) << 4);
              w[i] = dsc[i / 16] * float(q - 32);
            }
#endif
          }
      }
  });
}

at::Tensor q6k_linear(const at::Tensor& x_, const at::Tensor& blocks_) {
  TORCH_CHECK(blocks_.scalar_type() == at::kByte && blocks_.dim() == 2 && blocks_.size(1) % kQ6Bytes == 0,
              "q6k_linear: expected blocks [O, I/256 * 210] uint8 (GGUF Q6_K rows as stored), got ", blocks_.sizes(),
              " ", blocks_.scalar_type());
  const int64_t O = blocks_.size(0), I = blocks_.size(1) / kQ6Bytes * kQ6Block;
  check_x(x_, I, "q6k_linear");
  const at::Tensor x = x_.contiguous(), blocks = blocks_.contiguous();
  const uint8_t* q = blocks.data_ptr<uint8_t>();
  const int64_t M = x.size(0), nb = I / kBlock, nsb = I / kQ6Block;
  if (M > kGemvRows)
    return chunked_gemm(x, O, I, [&](int64_t r0, int64_t r1, float* out) { q6k_dequantize(q, I, r0, r1, out); });
  at::Tensor y = at::empty({M, O}, x.options());
  float* yp = y.data_ptr<float>();
  std::vector<int8_t> xq(M * I);
  std::vector<float> dx(M * nb), dx2(M * I / 16);
  std::vector<int32_t> off(M * I / 4);
  quantize_rows(x.data_ptr<float>(), M, I, xq.data(), dx.data());
  q6_activations(xq.data(), dx.data(), M * I, off.data(), dx2.data());
  at::parallel_for(0, O, 32, [&](int64_t a, int64_t b) {
    for (int64_t o = a; o < b; ++o)
      q6k_rows(q + o * nsb * kQ6Bytes, nsb, xq.data(), off.data(), dx2.data(), M, I, yp + o, O);
  });
  return y;
}

int64_t simd_level() {
#ifdef ZOO_VNNI
  return 4;
#elif defined(ZOO_AVX512)
  return 3;
#elif defined(ZOO_AVX2)
  return 2;
#else
  return 0;
#endif
}

}  // namespace

TORCH_LIBRARY(zoo_quant, m) {
  m.def("int4_linear(Tensor x, Tensor qs, Tensor sm, int group) -> Tensor");
  m.def("int5_linear(Tensor x, Tensor qs, Tensor qh, Tensor sm, int group) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor qw, Tensor scale) -> Tensor");
  m.def("int8g_linear(Tensor x, Tensor qw, Tensor sm, int group) -> Tensor");
  m.def("q6k_linear(Tensor x, Tensor blocks) -> Tensor");
  m.def("simd_level() -> int");
}

TORCH_LIBRARY_IMPL(zoo_quant, CPU, m) {
  m.impl("int4_linear", &int4_linear);
  m.impl("int5_linear", &int5_linear);
  m.impl("int8_linear", &int8_linear);
  m.impl("int8g_linear", &int8g_linear);
  m.impl("q6k_linear", &q6k_linear);
}

TORCH_LIBRARY_IMPL(zoo_quant, CompositeExplicitAutograd, m) { m.impl("simd_level", &simd_level); }
