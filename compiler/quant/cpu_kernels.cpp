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
// Every row count (decode, a decode bucket, a prefill chunk, a whole prompt), one numerics: x is
// rounded to int8 per block of 32 inputs (scale max|x| / 127, llama.cpp's Q8 activations) and each
// block's dot product is integer (maddubs, or vpdpbusd at VNNI: 32 multiply-adds in a few
// instructions), scaled once per block and added in one fixed order per (row, output) (the row
// tiles below); the m term (int4 / int5 / int8g offsets) multiplies the sums of the rounded x (as
// llama.cpp's Q8_1 / Q8_K block sums), so a row's output is exactly W times the rounded x. So a row's output is the same bits whatever other rows share the call and
// however the outputs split between threads (batch invariance: a served answer does not depend on
// the path its cache took). Reading the codes without widening them to floats is also what makes
// a matrix-vector product as fast as the memory (a float32 FMA loop over the widened codes measured
// 2-3x slower), and prefill reuses each decoded block across a tile of rows.
// float_rows > 0 (runtime.quant_prefill=float) gives the invariance up: calls of more rows
// dequantize a chunk of weight rows at a time into float32 and multiply by at::mm (the BLAS GEMM),
// activations unrounded.
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

// 16 lanes of scales: lane l takes s[idx[l]] (2 blocks x 8 lanes, or 4 half-blocks x 4 lanes)
inline __m512 spread(const float* s, int n, __m512i idx) {
  const __m128 v = n == 2 ? _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(s))) : _mm_loadu_ps(s);
  return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(v));
}
const __m512i kTwoBlocks = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
const __m512i kFourHalves = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);

#endif

// the fifth bit of input t of a Q5 block (its 4 high bytes at qh) as 0 or 16; 0 for int4
template <bool Q5>
inline int32_t high5(const uint8_t* qh, int64_t t) {
  if constexpr (Q5)
    return ((qh[t >> 3] >> (t & 7)) & 1) << 4;
  else
    return 0;
}
// ----------------------------------------------------------------------------- the row tiles
//
// One numerics for every M (decode, a decode bucket, a chunk, a whole prefill) and every thread
// split: each output of each row of x is
//   sum over blocks b of  (db[b] * dx[b]) * (the block's integer dot)   [+ sum_g m[g] xs[g]]
// the float products added into four sums by the block's index (b & 3; at AVX512, pairs of blocks
// by p & 3), combined as (s0 + s1) + (s2 + s3), then reduced across lanes, then the m term (and,
// for int8 per channel, times the row's scale). A tile is up to kTile rows of x against one weight
// row: each block's codes are decoded once for all the tile's rows (what makes prefill fast: the
// codes are read and unpacked once per kTile rows, not per row), and each row keeps its own sums,
// so a row's result is the same whichever rows share its tile. Threads split the outputs only:
// an output of a row is always computed whole by one thread, in that one order.
// (ISA levels differ from each other in their lane layout; within a level the order is fixed.)
constexpr int64_t kTile = 8;      // rows of x per pass over a weight row
constexpr int64_t kOutTile = 16;  // outputs per thread task: their weight rows stay in cache while x passes

// The activations of M rows as the dots take them: xq [M, I] int8 and dx [M, I/32] (quantize_rows),
// and xs [M, ng] the per-group sums of the rounded x the m term multiplies (sums, as llama.cpp's
// Q8_1 block sums; none without it). Rows are prepared in parallel, each on its own (the same
// values whatever M).
struct Activations {
  std::vector<int8_t> xq;
  std::vector<float> dx, xs;
  Activations(const float* x, int64_t M, int64_t I, int64_t group, bool sums)
      : xq(M * I), dx(M * (I / kBlock)), xs(sums ? M * (I / group) : 0, 0.f) {
    const int64_t nb = I / kBlock, ng = I / group;
    at::parallel_for(0, M, 4, [&](int64_t a, int64_t b) {
      quantize_rows(x + a * I, b - a, I, xq.data() + a * I, dx.data() + a * nb);
      for (int64_t r = a; r < b && sums; ++r)
        for (int64_t k = 0; k < nb; ++k)  // a block's codes summed per group (groups of 16: two a block)
          for (int64_t t0 = 0, len = std::min(group, kBlock); t0 < kBlock; t0 += len) {
            int32_t s = 0;
            for (int64_t t = t0; t < t0 + len; ++t) s += xq[r * I + k * kBlock + t];
            xs[r * ng + (k * kBlock + t0) / group] += dx[r * nb + k] * float(s);
          }
    });
  }
};

// Every (row, output) of y [M, O] once: tasks of kOutTile outputs between the threads; in a task
// the rows kTile at a time, each tile over the task's outputs. tile(o, r0, R, scratch): rows
// r0 .. r0 + R of output o; scratch: the task's nscratch floats.
template <typename Tile>
void over_tiles(int64_t M, int64_t O, int64_t nscratch, Tile tile) {
  at::parallel_for(0, (O + kOutTile - 1) / kOutTile, 1, [&](int64_t a, int64_t b) {
    std::vector<float> scratch(nscratch);
    for (int64_t t = a; t < b; ++t) {
      const int64_t o0 = t * kOutTile, o1 = std::min(O, o0 + kOutTile);
      for (int64_t r0 = 0; r0 < M; r0 += kTile)
        for (int64_t o = o0; o < o1; ++o) tile(o, r0, std::min(kTile, M - r0), scratch.data());
    }
  });
}

// db[b] = d[b / per] as float: each block's (or with per = 0, each half-block's: groups of 16) d
template <typename S>
inline void block_d(const S* d, int64_t per, int64_t nb, float* db) {
  if (per == 0) {
    for (int64_t j = 0; j < 2 * nb; ++j) db[j] = half_to_float(d + j);
    return;
  }
  for (int64_t b = 0, g = 0; b < nb; ++g)
    for (int64_t k = 0; k < per && b < nb; ++k, ++b) db[b] = half_to_float(d + g);
}

// sum_g m[g] xs[g] (the m term), the same code for every row
template <typename S>
inline float m_sum(const S* m, const float* xs, int64_t ng) {
#ifdef ZOO_AVX2
  return m_term(m, xs, ng);
#else
  float mt = 0.f;
  for (int64_t g = 0; g < ng; ++g) mt += half_to_float(m + g) * xs[g];
  return mt;
#endif
}

// R rows of x (xq [R, I] with row stride I, dx [R, nb], xs [R, ng]) against one int4 (int5 with
// Q5: high bits qh) weight row: out[r * O] for r < R. db [nb]: the row's d per block; m [ng]: its
// offsets (sm[o, 1]).
template <typename S, bool Q5>
void q4_tile(const uint8_t* qs, const uint8_t* qh, const float* db, const S* m, int64_t ng, int64_t nb,
             const int8_t* xq, const float* dx, const float* xs, int64_t R, int64_t I, float* out, int64_t O) {
#ifdef ZOO_AVX512
  __m512 acc[kTile][4];
  for (int64_t r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  const int64_t np = nb / 2;
  for (int64_t p0 = 0; p0 < np; p0 += 4)
    for (int j = 0; j < 4; ++j) {
      const int64_t p = p0 + j;
      if (p >= np) break;
      const __m512i w = codes64<Q5>(qs, qh, p);
      const __m512 d = spread(db + 2 * p, 2, kTwoBlocks);
      for (int64_t r = 0; r < R; ++r) {
        const __m512i xv = _mm512_loadu_si512(xq + r * I + 2 * p * kBlock);
        const __m512 s = _mm512_mul_ps(d, spread(dx + r * nb + 2 * p, 2, kTwoBlocks));
        acc[r][j] = _mm512_fmadd_ps(dot64(w, xv), s, acc[r][j]);
      }
    }
  for (int64_t r = 0; r < R; ++r) {
    float v = hsum512(_mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]), _mm512_add_ps(acc[r][2], acc[r][3])));
    if (nb % 2) {  // the odd block: its dot reduced, then scaled
      const int64_t b = nb - 1;
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * I + b * kBlock));
      v += (db[b] * dx[r * nb + b]) * hsum(dot32(codes32<Q5>(qs, qh, b), xv));
    }
    out[r * O] = v + m_sum(m, xs + r * ng, ng);
  }
#elif defined(ZOO_AVX2)
  __m256 acc[kTile][4];
  for (int64_t r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int64_t b0 = 0; b0 < nb; b0 += 4)
    for (int j = 0; j < 4; ++j) {
      const int64_t b = b0 + j;
      if (b >= nb) break;
      const __m256i w = codes32<Q5>(qs, qh, b);
      for (int64_t r = 0; r < R; ++r) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * I + b * kBlock));
        acc[r][j] = _mm256_fmadd_ps(dot32(w, xv), _mm256_set1_ps(db[b] * dx[r * nb + b]), acc[r][j]);
      }
    }
  for (int64_t r = 0; r < R; ++r)
    out[r * O] = hsum(_mm256_add_ps(_mm256_add_ps(acc[r][0], acc[r][1]), _mm256_add_ps(acc[r][2], acc[r][3]))) +
                 m_sum(m, xs + r * ng, ng);
#else
  float acc[kTile][4] = {};
  for (int64_t b = 0; b < nb; ++b) {
    int32_t q[kBlock];
    const uint8_t* h = qh + 4 * b;
    for (int64_t t = 0; t < 16; ++t) {
      q[t] = int32_t(qs[16 * b + t] & 0x0F) | high5<Q5>(h, t);
      q[t + 16] = int32_t(qs[16 * b + t] >> 4) | high5<Q5>(h, t + 16);
    }
    for (int64_t r = 0; r < R; ++r) {
      int32_t dot = 0;
      for (int64_t t = 0; t < kBlock; ++t) dot += q[t] * xq[r * I + b * kBlock + t];
      acc[r][b & 3] += (db[b] * dx[r * nb + b]) * float(dot);
    }
  }
  for (int64_t r = 0; r < R; ++r)
    out[r * O] = ((acc[r][0] + acc[r][1]) + (acc[r][2] + acc[r][3])) + m_sum(m, xs + r * ng, ng);
#endif
}

// R rows of x against one row of signed int8 codes qw [I]: int8g (db [nb] the row's d per block,
// or with Half (groups of 16) db [2 nb] per half-block; m [ng] its offsets or null) and int8 per
// channel (db all ones, times post = the row's scale): out[r * O] = post * sum + m term.
template <typename S, bool Half>
void i8_tile(const int8_t* qw, const float* db, const S* m, int64_t ng, int64_t nb, float post, const int8_t* xq,
             const float* dx, const float* xs, int64_t R, int64_t I, float* out, int64_t O) {
#ifdef ZOO_AVX512
  __m512 acc[kTile][4];
  for (int64_t r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  const int64_t np = nb / 2;
  for (int64_t p0 = 0; p0 < np; p0 += 4)
    for (int j = 0; j < 4; ++j) {
      const int64_t p = p0 + j;
      if (p >= np) break;
      const __m512i w = _mm512_loadu_si512(qw + 2 * p * kBlock);
      // |w| times x with w's sign (vpdpbusd multiplies unsigned by signed)
      const __mmask64 neg = _mm512_movepi8_mask(w);
      const __m512i aw = _mm512_abs_epi8(w);
      // lanes 0-7 the first block's, 8-15 the second's (Half: 4 lanes per half-block)
      const __m512 d = Half ? spread(db + 4 * p, 4, kFourHalves) : spread(db + 2 * p, 2, kTwoBlocks);
      for (int64_t r = 0; r < R; ++r) {
        const __m512i xv = _mm512_loadu_si512(xq + r * I + 2 * p * kBlock);
        const __m512i sx = _mm512_mask_sub_epi8(xv, neg, _mm512_setzero_si512(), xv);
        const __m512 s = _mm512_mul_ps(d, spread(dx + r * nb + 2 * p, 2, kTwoBlocks));
        acc[r][j] = _mm512_fmadd_ps(dot64(aw, sx), s, acc[r][j]);
      }
    }
  for (int64_t r = 0; r < R; ++r) {
    float v = hsum512(_mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]), _mm512_add_ps(acc[r][2], acc[r][3])));
    if (nb % 2) {
      const int64_t b = nb - 1;
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qw + b * kBlock));
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * I + b * kBlock));
      const __m256 p = dot32(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xv, w));
      const float dxb = dx[r * nb + b];
      v += Half ? hsum(_mm256_mul_ps(p, _mm256_set_m128(_mm_set1_ps(db[2 * b + 1] * dxb), _mm_set1_ps(db[2 * b] * dxb))))
                : (db[b] * dxb) * hsum(p);
    }
    out[r * O] = post * v + (m ? m_sum(m, xs + r * ng, ng) : 0.f);
  }
#elif defined(ZOO_AVX2)
  __m256 acc[kTile][4];
  for (int64_t r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int64_t b0 = 0; b0 < nb; b0 += 4)
    for (int j = 0; j < 4; ++j) {
      const int64_t b = b0 + j;
      if (b >= nb) break;
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qw + b * kBlock));
      const __m256i aw = _mm256_sign_epi8(w, w);  // maddubs multiplies unsigned by signed
      // the 8 int32 sums of dot32: lanes 0-3 hold inputs 0-15, lanes 4-7 inputs 16-31
      const __m256 d = Half ? _mm256_set_m128(_mm_set1_ps(db[2 * b + 1]), _mm_set1_ps(db[2 * b])) : _mm256_set1_ps(db[b]);
      for (int64_t r = 0; r < R; ++r) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * I + b * kBlock));
        const __m256 s = _mm256_mul_ps(d, _mm256_set1_ps(dx[r * nb + b]));
        acc[r][j] = _mm256_fmadd_ps(dot32(aw, _mm256_sign_epi8(xv, w)), s, acc[r][j]);
      }
    }
  for (int64_t r = 0; r < R; ++r)
    out[r * O] = post * hsum(_mm256_add_ps(_mm256_add_ps(acc[r][0], acc[r][1]), _mm256_add_ps(acc[r][2], acc[r][3]))) +
                 (m ? m_sum(m, xs + r * ng, ng) : 0.f);
#else
  float acc[kTile][4] = {};
  for (int64_t b = 0; b < nb; ++b)
    for (int64_t r = 0; r < R; ++r) {
      const int8_t* xb = xq + r * I + b * kBlock;
      const float dxb = dx[r * nb + b];
      int32_t lo = 0, hi = 0;
      for (int64_t t = 0; t < 16; ++t) lo += int32_t(qw[b * kBlock + t]) * xb[t];
      for (int64_t t = 16; t < kBlock; ++t) hi += int32_t(qw[b * kBlock + t]) * xb[t];
      if (Half)
        acc[r][b & 3] += (db[2 * b] * dxb) * float(lo) + (db[2 * b + 1] * dxb) * float(hi);
      else
        acc[r][b & 3] += (db[b] * dxb) * float(lo + hi);
    }
  for (int64_t r = 0; r < R; ++r)
    out[r * O] = post * ((acc[r][0] + acc[r][1]) + (acc[r][2] + acc[r][3])) + (m ? m_sum(m, xs + r * ng, ng) : 0.f);
#endif
}

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

void check_x(const at::Tensor& x, int64_t I, const char* op, int64_t float_rows) {
  TORCH_CHECK(float_rows >= 0, op, ": float_rows must be 0 (int8 activations at every row count) or a row count ",
              "above which the float GEMM runs, got ", float_rows);
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2,
              op, ": x must be a 2-D float32 CPU tensor, got ", x.scalar_type(), " of ", x.sizes());
  TORCH_CHECK(x.size(1) == I && I % kBlock == 0, op, ": x has ", x.size(1), " inputs, the weight ", I,
              " (a multiple of 32)");
}

template <typename S, bool Q5>
at::Tensor int4_linear_impl(const at::Tensor& x, const at::Tensor& qs, const uint8_t* qh, const at::Tensor& sm,
                            int64_t group, int64_t float_rows);

// the checks of int4_linear and int5_linear (op: the name for the errors), then the kernel on the
// contiguous tensors; qh: int5's high bits (checked by int5_linear) or null
at::Tensor int4_or_int5(const char* op, const at::Tensor& x_, const at::Tensor& qs_, const uint8_t* qh,
                        const at::Tensor& sm_, int64_t group, int64_t float_rows) {
  const int64_t O = qs_.size(0), I = qs_.size(1) * 2;
  check_x(x_, I, op, float_rows);
  TORCH_CHECK(group % kBlock == 0 && I % group == 0, op, ": group ", group, " must be a multiple of 32 ",
              "dividing the inputs (", I, ")");
  TORCH_CHECK(qs_.scalar_type() == at::kByte && (sm_.scalar_type() == at::kHalf || sm_.scalar_type() == at::kFloat) &&
                  sm_.dim() == 3 && sm_.size(0) == O && sm_.size(1) == 2 && sm_.size(2) == I / group,
              op, ": expected qs [O, I/2] uint8 and sm [O, 2, I/g] float16 or float32, got ", qs_.sizes(), " ",
              qs_.scalar_type(), " and ", sm_.sizes(), " ", sm_.scalar_type());
  const at::Tensor x = x_.contiguous(), qs = qs_.contiguous(), sm = sm_.contiguous();
  if (qh != nullptr)
    return sm.scalar_type() == at::kHalf ? int4_linear_impl<at::Half, true>(x, qs, qh, sm, group, float_rows)
                                         : int4_linear_impl<float, true>(x, qs, qh, sm, group, float_rows);
  return sm.scalar_type() == at::kHalf ? int4_linear_impl<at::Half, false>(x, qs, qh, sm, group, float_rows)
                                       : int4_linear_impl<float, false>(x, qs, qh, sm, group, float_rows);
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& sm, int64_t group,
                       int64_t float_rows) {
  return int4_or_int5("int4_linear", x, qs, nullptr, sm, group, float_rows);
}

at::Tensor int5_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& qh_, const at::Tensor& sm,
                       int64_t group, int64_t float_rows) {
  TORCH_CHECK(qh_.scalar_type() == at::kByte && qh_.dim() == 2 && qs.dim() == 2 && qh_.size(0) == qs.size(0) &&
                  qh_.size(1) * 4 == qs.size(1),
              "int5_linear: expected qh [O, I/8] uint8 beside qs [O, I/2], got ", qh_.sizes(), " ", qh_.scalar_type(),
              " and ", qs.sizes());
  const at::Tensor qh = qh_.contiguous();  // (kept alive to the end of the call)
  return int4_or_int5("int5_linear", x, qs, qh.data_ptr<uint8_t>(), sm, group, float_rows);
}

// whether this call takes the float GEMM: float_rows > 0 (runtime.quant_prefill=float) and more rows
inline bool float_gemm(const at::Tensor& x, int64_t float_rows) { return float_rows > 0 && x.size(0) > float_rows; }

template <typename S, bool Q5>
at::Tensor int4_linear_impl(const at::Tensor& x, const at::Tensor& qs, const uint8_t* qh, const at::Tensor& sm,
                            int64_t group, int64_t float_rows) {
  const int64_t O = qs.size(0), I = qs.size(1) * 2;
  const uint8_t* q = qs.data_ptr<uint8_t>();
  const S* s = sm.data_ptr<S>();
  const int64_t M = x.size(0), ng = I / group, nb = I / kBlock;
  if (float_gemm(x, float_rows))
    return chunked_gemm(x, O, I, [&](int64_t r0, int64_t r1, float* out) { q4_dequantize<S, Q5>(q, qh, s, I, group, r0, r1, out); });
  TORCH_CHECK(group % kBlock == 0 && ((group / kBlock) & (group / kBlock - 1)) == 0, "int4_linear: group ", group,
              " must be 32 times a power of two");
  at::Tensor y = at::empty({M, O}, x.options());
  float* yp = y.data_ptr<float>();
  // the m term over the int8-rounded x, as llama.cpp's Q4_1 / Q5_1 (Q8_1's block sums) and Q4_0 /
  // Q5_0 (signed codes) take it: m (-8 d, -16 d, or a min near -q d) then cancels the rounding of
  // q d, where over x itself the unsigned codes' rounding adds up (perplexity further from float:
  // scripts/results/gguf_accuracy.json)
  const Activations a(x.data_ptr<float>(), M, I, group, true);
  over_tiles(M, O, nb, [&](int64_t o, int64_t r0, int64_t R, float* db) {
    const S* so = s + o * ng * 2;
    block_d(so, group / kBlock, nb, db);
    q4_tile<S, Q5>(q + o * (I / 2), Q5 ? qh + o * (I / 8) : nullptr, db, so + ng, ng, nb, a.xq.data() + r0 * I,
                   a.dx.data() + r0 * nb, a.xs.data() + r0 * ng, R, I, yp + r0 * O + o, O);
  });
  return y;
}

at::Tensor int8_linear(const at::Tensor& x_, const at::Tensor& qw_, const at::Tensor& scale_, int64_t float_rows) {
  const int64_t O = qw_.size(0), I = qw_.size(1);
  check_x(x_, I, "int8_linear", float_rows);
  TORCH_CHECK(qw_.scalar_type() == at::kChar && scale_.scalar_type() == at::kFloat && scale_.numel() == O,
              "int8_linear: expected qw [O, I] int8 and scale [O] float32, got ", qw_.sizes(), " ",
              qw_.scalar_type(), " and ", scale_.sizes(), " ", scale_.scalar_type());
  const at::Tensor x = x_.contiguous(), qw = qw_.contiguous(), scale = scale_.contiguous();
  const int8_t* q = qw.data_ptr<int8_t>();
  const float* sc = scale.data_ptr<float>();
  const int64_t M = x.size(0), nb = I / kBlock;
  if (float_gemm(x, float_rows))
    return chunked_gemm(x, O, I, [&](int64_t r0, int64_t r1, float* out) { int8_dequantize(q, sc, I, r0, r1, out); });
  at::Tensor y = at::empty({M, O}, x.options());
  float* yp = y.data_ptr<float>();
  const Activations a(x.data_ptr<float>(), M, I, kBlock, false);
  const std::vector<float> ones(nb, 1.f);  // per channel: each block's scale is dx alone
  over_tiles(M, O, 0, [&](int64_t o, int64_t r0, int64_t R, float*) {
    i8_tile<float, false>(q + o * I, ones.data(), nullptr, 0, nb, sc[o], a.xq.data() + r0 * I, a.dx.data() + r0 * nb,
                          nullptr, R, I, yp + r0 * O + o, O);
  });
  return y;
}

template <typename S>
at::Tensor int8g_linear_impl(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& sm, int64_t group,
                             int64_t float_rows) {
  const int64_t O = qw.size(0), I = qw.size(1);
  const int8_t* q = qw.data_ptr<int8_t>();
  const S* s = sm.data_ptr<S>();
  const int64_t M = x.size(0), ng = I / group, nb = I / kBlock, ns = sm.size(1);
  if (float_gemm(x, float_rows))
    return chunked_gemm(x, O, I, [&](int64_t r0, int64_t r1, float* out) { i8g_dequantize(q, s, ns, I, group, r0, r1, out); });
  at::Tensor y = at::empty({M, O}, x.options());
  float* yp = y.data_ptr<float>();
  const Activations a(x.data_ptr<float>(), M, I, group, ns == 2);
  const bool half = group == 16;
  over_tiles(M, O, 2 * nb, [&](int64_t o, int64_t r0, int64_t R, float* db) {
    const S* so = s + o * ng * ns;
    const S* mo = ns == 2 ? so + ng : nullptr;
    block_d(so, half ? 0 : group / kBlock, nb, db);
    const int8_t* xq = a.xq.data() + r0 * I;
    const float* dx = a.dx.data() + r0 * nb;
    const float* xs = mo ? a.xs.data() + r0 * ng : nullptr;
    if (half)
      i8_tile<S, true>(q + o * I, db, mo, ng, nb, 1.f, xq, dx, xs, R, I, yp + r0 * O + o, O);
    else
      i8_tile<S, false>(q + o * I, db, mo, ng, nb, 1.f, xq, dx, xs, R, I, yp + r0 * O + o, O);
  });
  return y;
}

at::Tensor int8g_linear(const at::Tensor& x_, const at::Tensor& qw_, const at::Tensor& sm_, int64_t group,
                        int64_t float_rows) {
  const int64_t O = qw_.size(0), I = qw_.size(1);
  check_x(x_, I, "int8g_linear", float_rows);
  TORCH_CHECK((group == 16 || group % kBlock == 0) && I % group == 0, "int8g_linear: group ", group,
              " must be 16 or a multiple of 32 dividing the inputs (", I, ")");
  TORCH_CHECK(qw_.scalar_type() == at::kChar && (sm_.scalar_type() == at::kFloat || sm_.scalar_type() == at::kHalf) &&
                  sm_.dim() == 3 && sm_.size(0) == O && (sm_.size(1) == 2 || sm_.size(1) == 1) && sm_.size(2) == I / group,
              "int8g_linear: expected qw [O, I] int8 and sm [O, 2, I/g] or [O, 1, I/g] float32 or float16, got ",
              qw_.sizes(), " ", qw_.scalar_type(), " and ", sm_.sizes(), " ", sm_.scalar_type());
  const at::Tensor x = x_.contiguous(), qw = qw_.contiguous(), sm = sm_.contiguous();
  return sm.scalar_type() == at::kHalf ? int8g_linear_impl<at::Half>(x, qw, sm, group, float_rows)
                                       : int8g_linear_impl<float>(x, qw, sm, group, float_rows);
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
  __m512 acc[kTile][2];
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
  __m256 acc[kTile][2];
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
  float acc[kTile] = {};
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

at::Tensor q6k_linear(const at::Tensor& x_, const at::Tensor& blocks_, int64_t float_rows) {
  TORCH_CHECK(blocks_.scalar_type() == at::kByte && blocks_.dim() == 2 && blocks_.size(1) % kQ6Bytes == 0,
              "q6k_linear: expected blocks [O, I/256 * 210] uint8 (GGUF Q6_K rows as stored), got ", blocks_.sizes(),
              " ", blocks_.scalar_type());
  const int64_t O = blocks_.size(0), I = blocks_.size(1) / kQ6Bytes * kQ6Block;
  check_x(x_, I, "q6k_linear", float_rows);
  const at::Tensor x = x_.contiguous(), blocks = blocks_.contiguous();
  const uint8_t* q = blocks.data_ptr<uint8_t>();
  const int64_t M = x.size(0), nsb = I / kQ6Block;
  if (float_gemm(x, float_rows))
    return chunked_gemm(x, O, I, [&](int64_t r0, int64_t r1, float* out) { q6k_dequantize(q, I, r0, r1, out); });
  at::Tensor y = at::empty({M, O}, x.options());
  float* yp = y.data_ptr<float>();
  const Activations a(x.data_ptr<float>(), M, I, kBlock, false);
  std::vector<float> dx2(M * I / 16);
  std::vector<int32_t> off(M * I / 4);
  q6_activations(a.xq.data(), a.dx.data(), M * I, off.data(), dx2.data());
  over_tiles(M, O, 0, [&](int64_t o, int64_t r0, int64_t R, float*) {
    q6k_rows(q + o * nsb * kQ6Bytes, nsb, a.xq.data() + r0 * I, off.data() + r0 * I / 4, dx2.data() + r0 * I / 16, R, I,
             yp + r0 * O + o, O);
  });
  return y;
}

// ----------------------------------------------------------------------------- expert stacks
//
// One call for a whole MoE stack (compiler/quant/experts.py): x's rows sorted by expert, offs [E]
// the cumulative end row of each expert's segment, one weight per expert in the linears' layouts.
// The rows' activations are rounded to int8 once (not once per expert), and one parallel region
// covers every (active expert, tile of kOutTile outputs): at decode, 8 experts of one row each still
// give both threads whole tiles, and a tile's weight rows are read once for all the rows that chose
// its expert (the row tiles above, kTile rows at a time while the tile's rows stay in cache). The
// tasks are split between the threads by their rows (a tile's cost: its rows and its weight read),
// so one busy expert of a prefill does not leave the other thread idle. Each (row, output) is the
// tile functions' own sum, in their one order: a row's output is the bits int4_linear & co give
// it alone (batch invariance, whatever other rows chose its expert).
// Gated (act = 1, O = 2F: the gate rows, then the up rows): each task computes an output's gate and
// up values for its rows and writes act(gate) * (up + up_offset), act(g) = g * sigmoid(alpha g)
// after the clamps g <= limit, |up| <= limit (limit > 0), so the [N, 2F] pre-activations are never
// written out as floats (SwiGLU experts: alpha 1; gpt-oss: its alpha, limit and offset 1).
enum ExpertKind : int64_t { kInt4 = 0, kInt5 = 1, kInt8g = 2, kQ6k = 3 };

struct GatedAct {
  float limit, alpha, up_offset;
  float operator()(float g, float u) const {
    if (limit > 0.f) {
      g = std::min(g, limit);
      u = std::min(std::max(u, -limit), limit);
    }
    return g / (1.f + std::exp(-alpha * g)) * (u + up_offset);
  }
};

template <typename S, int64_t K>
at::Tensor expert_impl(const at::Tensor& x, const int64_t* offs, int64_t E, const uint8_t* q, const uint8_t* qh,
                       const S* sm, int64_t ns, int64_t O, int64_t I, int64_t group, bool gated, GatedAct act,
                       int64_t float_rows) {
  const int64_t N = x.size(0), nb = I / kBlock, ng = I / group, Oy = gated ? O / 2 : O;
  const int64_t qrow = K == kQ6k ? I / kQ6Block * kQ6Bytes : K == kInt8g ? I : I / 2;  // bytes per weight row
  const bool sums = K == kInt4 || K == kInt5 || (K == kInt8g && ns == 2);  // an m term
  at::Tensor y = at::empty({N, Oy}, x.options());
  float* yp = y.data_ptr<float>();
  // the segments: tiled experts (int8 activations) and, with float_rows, the float GEMM's
  std::vector<int64_t> tiled, big, first(E);
  for (int64_t e = 0, s = 0; e < E; s = offs[e], ++e) {
    first[e] = s;
    const int64_t n = offs[e] - s;
    if (n > 0) (float_rows > 0 && n > float_rows ? big : tiled).push_back(e);
  }
  auto count = [&](int64_t e) { return offs[e] - first[e]; };
  if (!tiled.empty()) {
    const Activations a(x.data_ptr<float>(), N, I, K == kQ6k ? kBlock : group, sums);
    std::vector<float> dx2;
    std::vector<int32_t> off;
    if constexpr (K == kQ6k) {
      dx2.resize(N * I / 16);
      off.resize(N * I / 4);
      q6_activations(a.xq.data(), a.dx.data(), N * I, off.data(), dx2.data());
    }
    // rows r .. r + R of x against output o of expert e: out[i * ldo] (db: nb * 2 floats of scratch)
    auto row = [&](int64_t e, int64_t o, int64_t r, int64_t R, float* out, int64_t ldo, float* db) {
      const uint8_t* wq = q + (e * O + o) * qrow;
      if constexpr (K == kQ6k) {
        q6k_rows(wq, I / kQ6Block, a.xq.data() + r * I, off.data() + r * I / 4, dx2.data() + r * I / 16, R, I, out, ldo);
      } else if constexpr (K == kInt8g) {
        const S* so = sm + (e * O + o) * ns * ng;
        const S* mo = ns == 2 ? so + ng : nullptr;
        const int8_t* w8 = reinterpret_cast<const int8_t*>(wq);
        const float* xs = mo ? a.xs.data() + r * ng : nullptr;
        if (group == 16) {
          block_d(so, 0, nb, db);
          i8_tile<S, true>(w8, db, mo, ng, nb, 1.f, a.xq.data() + r * I, a.dx.data() + r * nb, xs, R, I, out, ldo);
        } else {
          block_d(so, group / kBlock, nb, db);
          i8_tile<S, false>(w8, db, mo, ng, nb, 1.f, a.xq.data() + r * I, a.dx.data() + r * nb, xs, R, I, out, ldo);
        }
      } else {
        const S* so = sm + (e * O + o) * 2 * ng;
        block_d(so, group / kBlock, nb, db);
        q4_tile<S, K == kInt5>(wq, K == kInt5 ? qh + (e * O + o) * (I / 8) : nullptr, db, so + ng, ng, nb,
                               a.xq.data() + r * I, a.dx.data() + r * nb, a.xs.data() + r * ng, R, I, out, ldo);
      }
    };
    // tasks (expert, output tile) in expert order, split between the threads at equal shares of
    // their cost (rows + kTile: the weight read counted as a tile of rows)
    const int64_t tiles = (Oy + kOutTile - 1) / kOutTile, T = int64_t(tiled.size()) * tiles;
    std::vector<int64_t> cost(T + 1, 0);
    for (int64_t t = 0; t < T; ++t) cost[t + 1] = cost[t] + count(tiled[t / tiles]) + kTile;
    const int64_t W = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), T));
    at::parallel_for(0, W, 1, [&](int64_t wa, int64_t wb) {
      std::vector<float> scratch(2 * nb + 2 * kTile);
      float *gate = scratch.data() + 2 * nb, *up = gate + kTile;
      for (int64_t w = wa; w < wb; ++w) {
        // worker w: the tasks whose cost starts in [w, w + 1) * total / W
        const int64_t lo = cost[T] * w / W, hi = cost[T] * (w + 1) / W;
        const int64_t t0 = std::lower_bound(cost.begin(), cost.end() - 1, lo) - cost.begin();
        const int64_t t1 = w + 1 == W ? T : std::lower_bound(cost.begin(), cost.end() - 1, hi) - cost.begin();
        for (int64_t t = t0; t < t1; ++t) {
          const int64_t e = tiled[t / tiles], o0 = (t % tiles) * kOutTile, o1 = std::min(Oy, o0 + kOutTile);
          const int64_t s = first[e], n = count(e);
          for (int64_t r0 = 0; r0 < n; r0 += kTile) {
            const int64_t R = std::min(kTile, n - r0);
            for (int64_t o = o0; o < o1; ++o) {
              if (!gated) {
                row(e, o, s + r0, R, yp + (s + r0) * Oy + o, Oy, scratch.data());
                continue;
              }
              row(e, o, s + r0, R, gate, 1, scratch.data());
              row(e, o + Oy, s + r0, R, up, 1, scratch.data());
              for (int64_t i = 0; i < R; ++i) yp[(s + r0 + i) * Oy + o] = act(gate[i], up[i]);
            }
          }
        }
      }
    });
  }
  // runtime.quant_prefill=float: the segments of more rows, each through the float GEMM of its
  // dequantized weight (as the linears' calls of more rows)
  for (const int64_t e : big) {
    const at::Tensor xe = x.narrow(0, first[e], count(e));
    const at::Tensor h = chunked_gemm(xe, O, I, [&](int64_t r0, int64_t r1, float* out) {
      const uint8_t* qe = q + e * O * qrow;
      if constexpr (K == kQ6k)
        q6k_dequantize(qe, I, r0, r1, out);
      else if constexpr (K == kInt8g)
        i8g_dequantize(reinterpret_cast<const int8_t*>(qe), sm + e * O * ns * ng, ns, I, group, r0, r1, out);
      else
        q4_dequantize<S, K == kInt5>(qe, K == kInt5 ? qh + e * O * (I / 8) : nullptr, sm + e * O * 2 * ng, I, group,
                                     r0, r1, out);
    });
    const float* hp = h.data_ptr<float>();
    float* ye = yp + first[e] * Oy;
    for (int64_t i = 0; i < count(e); ++i)
      for (int64_t o = 0; o < Oy; ++o) ye[i * Oy + o] = gated ? act(hp[i * O + o], hp[i * O + o + Oy]) : hp[i * O + o];
  }
  return y;
}

at::Tensor expert_linear(const at::Tensor& x_, const at::Tensor& offs_, int64_t kind, const at::Tensor& qw_,
                         const std::optional<at::Tensor>& qh_, const std::optional<at::Tensor>& sm_, int64_t group,
                         int64_t act, double limit, double alpha, double up_offset, int64_t float_rows) {
  TORCH_CHECK(kind >= kInt4 && kind <= kQ6k, "expert_linear: kind ", kind, " must be 0 (int4), 1 (int5), 2 (int8g) or 3 (q6k)");
  TORCH_CHECK(act == 0 || act == 1, "expert_linear: act ", act, " must be 0 (none) or 1 (gated: act(gate) * up)");
  TORCH_CHECK(qw_.dim() == 3, "expert_linear: expected a stack qw [E, O, bytes], got ", qw_.sizes());
  const int64_t E = qw_.size(0), O = qw_.size(1);
  const int64_t I = kind == kQ6k ? qw_.size(2) / kQ6Bytes * kQ6Block : kind == kInt8g ? qw_.size(2) : 2 * qw_.size(2);
  check_x(x_, I, "expert_linear", float_rows);
  TORCH_CHECK(offs_.device().is_cpu() && offs_.scalar_type() == at::kLong && offs_.dim() == 1 && offs_.size(0) == E,
              "expert_linear: offs must be [E] = [", E, "] int64 on the CPU, got ", offs_.sizes(), " ", offs_.scalar_type());
  TORCH_CHECK(act == 0 || O % 2 == 0, "expert_linear: a gated stack needs an even O (gate rows, then up rows), got ", O);
  const at::Tensor x = x_.contiguous(), offs = offs_.contiguous(), qw = qw_.contiguous();
  const int64_t* op = offs.data_ptr<int64_t>();
  for (int64_t e = 0; e < E; ++e)
    TORCH_CHECK(op[e] >= (e ? op[e - 1] : 0) && op[e] <= x.size(0), "expert_linear: offs must be non-decreasing ends of ",
                "row segments within the ", x.size(0), " rows, got ", offs_);
  const GatedAct f{float(limit), float(alpha), float(up_offset)};
  const bool gated = act == 1;
  if (kind == kQ6k) {
    TORCH_CHECK(qw.scalar_type() == at::kByte && qw.size(2) % kQ6Bytes == 0,
                "expert_linear: q6k expects qw [E, O, I/256 * 210] uint8, got ", qw.sizes(), " ", qw.scalar_type());
    return expert_impl<float, kQ6k>(x, op, E, qw.data_ptr<uint8_t>(), nullptr, nullptr, 0, O, I, kBlock, gated, f,
                                    float_rows);
  }
  TORCH_CHECK(sm_.has_value(), "expert_linear: kind ", kind, " needs its scales sm");
  const at::Tensor sm = sm_->contiguous();
  const int64_t ns = sm.dim() == 4 ? sm.size(2) : 0;
  TORCH_CHECK((sm.scalar_type() == at::kHalf || sm.scalar_type() == at::kFloat) && sm.dim() == 4 && sm.size(0) == E &&
                  sm.size(1) == O && (ns == 2 || (kind == kInt8g && ns == 1)) && group > 0 && I % group == 0 &&
                  sm.size(3) == I / group,
              "expert_linear: expected sm [E, O, 2, I/g] (int8g: or [E, O, 1, I/g]) float16 or float32 for qw ",
              qw.sizes(), " and group ", group, ", got ", sm.sizes(), " ", sm.scalar_type());
  if (kind == kInt8g) {
    TORCH_CHECK(qw.scalar_type() == at::kChar && (group == 16 || group % kBlock == 0),
                "expert_linear: int8g expects qw [E, O, I] int8 and a group of 16 or a multiple of 32, got ",
                qw.scalar_type(), " and ", group);
    const uint8_t* q = reinterpret_cast<const uint8_t*>(qw.data_ptr<int8_t>());
    return sm.scalar_type() == at::kHalf
               ? expert_impl<at::Half, kInt8g>(x, op, E, q, nullptr, sm.data_ptr<at::Half>(), ns, O, I, group, gated, f, float_rows)
               : expert_impl<float, kInt8g>(x, op, E, q, nullptr, sm.data_ptr<float>(), ns, O, I, group, gated, f, float_rows);
  }
  TORCH_CHECK(qw.scalar_type() == at::kByte && group % kBlock == 0 && ((group / kBlock) & (group / kBlock - 1)) == 0,
              "expert_linear: int4 / int5 expect qw [E, O, I/2] uint8 and a group of 32 times a power of two, got ",
              qw.scalar_type(), " and ", group);
  at::Tensor qh;
  if (kind == kInt5) {
    TORCH_CHECK(qh_.has_value() && qh_->scalar_type() == at::kByte && qh_->dim() == 3 && qh_->size(0) == E &&
                    qh_->size(1) == O && qh_->size(2) == I / 8,
                "expert_linear: int5 expects qh [E, O, I/8] uint8 beside qw ", qw.sizes());
    qh = qh_->contiguous();
  }
  const uint8_t* q = qw.data_ptr<uint8_t>();
  const uint8_t* h = kind == kInt5 ? qh.data_ptr<uint8_t>() : nullptr;
  if (kind == kInt5)
    return sm.scalar_type() == at::kHalf
               ? expert_impl<at::Half, kInt5>(x, op, E, q, h, sm.data_ptr<at::Half>(), 2, O, I, group, gated, f, float_rows)
               : expert_impl<float, kInt5>(x, op, E, q, h, sm.data_ptr<float>(), 2, O, I, group, gated, f, float_rows);
  return sm.scalar_type() == at::kHalf
             ? expert_impl<at::Half, kInt4>(x, op, E, q, nullptr, sm.data_ptr<at::Half>(), 2, O, I, group, gated, f, float_rows)
             : expert_impl<float, kInt4>(x, op, E, q, nullptr, sm.data_ptr<float>(), 2, O, I, group, gated, f, float_rows);
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
  // float_rows: 0 (the default) int8 activations at every row count; n > 0: more rows than n take
  // the float GEMM over dequantized rows (runtime.quant_prefill=float)
  m.def("int4_linear(Tensor x, Tensor qs, Tensor sm, int group, int float_rows=0) -> Tensor");
  m.def("int5_linear(Tensor x, Tensor qs, Tensor qh, Tensor sm, int group, int float_rows=0) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor qw, Tensor scale, int float_rows=0) -> Tensor");
  m.def("int8g_linear(Tensor x, Tensor qw, Tensor sm, int group, int float_rows=0) -> Tensor");
  m.def("q6k_linear(Tensor x, Tensor blocks, int float_rows=0) -> Tensor");
  // a stack of experts [E, O, ...] over rows sorted by expert (offs: their segments' ends); kind 0
  // int4, 1 int5, 2 int8g, 3 q6k; act 1: gated, act(gate) * (up + up_offset) -> [N, O/2]
  m.def("expert_linear(Tensor x, Tensor offs, int kind, Tensor qw, Tensor? qh, Tensor? sm, int group, int act=0, "
        "float limit=0., float alpha=1., float up_offset=0., int float_rows=0) -> Tensor");
  m.def("simd_level() -> int");
}

TORCH_LIBRARY_IMPL(zoo_quant, CPU, m) {
  m.impl("int4_linear", &int4_linear);
  m.impl("int5_linear", &int5_linear);
  m.impl("int8_linear", &int8_linear);
  m.impl("int8g_linear", &int8g_linear);
  m.impl("q6k_linear", &q6k_linear);
  m.impl("expert_linear", &expert_linear);
}

TORCH_LIBRARY_IMPL(zoo_quant, CompositeExplicitAutograd, m) { m.impl("simd_level", &simd_level); }
