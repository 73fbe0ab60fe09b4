// GGUF K-quant blocks repacked into zoo's kernel layouts at load, natively: one pass over the
// (mapped) stored bytes, written straight into the final buffers, parallel over rows. Built and
// loaded by repack.py, whose torch reference (gguf_blocks.int4_parts / int5_parts) these equal bit
// for bit (tests/test_repack.py).
//
//   zoo_repack::q4k_int4(blocks, qs, d, m)
//       blocks [R, nb * 144] uint8: Q4_K blocks of R rows (inner dim contiguous, any row stride)
//       qs [R, nb * 128] uint8: zoo's int4 layout (per 32 inputs, byte t = input t | input t + 16 << 4)
//       d, m [R, nb * 8] float32: d * sc and -(dmin * mn) per group of 32 (exact products)
//   zoo_repack::q5k_int5(blocks, qs, qh, d, m)
//       blocks [R, nb * 176] uint8: Q5_K; qs as above (the codes' low nibbles), qh [R, nb * 32]
//       uint8 (byte b of a 32-input group: bit t is input 8 b + t's fifth bit), d, m as above
//
//   zoo_repack::k_to_zq8(blocks, type, g, out)
//       Q4_K (type 4) / Q5_K (5) / Q6_K (6) blocks [R, nb * nbytes] -> out [R, nb * 256 / g * (g + 8)]
//       uint8 in gguf_blocks' ZQ8_G<g> format (g int8 codes | d f32 | m f32), g 16 or 32: the
//       parts of a weight joined across types (Q4_K_M's wqkv), re-blocked without int32 or float copies
//   zoo_repack::zq8_int8g(blocks, g, q, d, m)
//       ZQ8_G<g> bytes [R, n * (g + 8)] -> int8g's q [R, n * g] int8, d, m [R, n] float32 (a split)
//
// The outputs may be strided views (the scales' d / m rows of [O, 2, I/32] or [E * O, 2, I/32]):
// only each row's inner dim must be contiguous. q4k_int4 / q5k_int5 also take 3-D [E, n, ...]
// blocks and outputs (a part of an expert stack: w13's gate or up rows of every expert, one call).

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t QK = 256;

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(h);
}

// ggml's get_scale_min_k4: the 8 6-bit (scale, min) pairs of a Q4_K / Q5_K block's 12 bytes
inline void scale_min_k4(const uint8_t* s, uint8_t* sc, uint8_t* mn) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63;
    mn[j] = s[j + 4] & 63;
    sc[j + 4] = (s[j + 8] & 0x0F) | ((s[j] >> 2) & 0x30);
    mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30);
  }
}

inline void scales_k(const uint8_t* b, float* d, float* m) {
  const float dd = half_at(b), dmin = half_at(b + 2);
  uint8_t sc[8], mn[8];
  scale_min_k4(b + 4, sc, mn);
  for (int j = 0; j < 8; ++j) {
    d[j] = dd * static_cast<float>(sc[j]);
    m[j] = -(dmin * static_cast<float>(mn[j]));
  }
}

// one run of 32 bytes (64 codes: low nibbles inputs 0..31, high nibbles 32..63) -> two 16-byte
// int4 groups
inline void nibbles_run(const uint8_t* q, uint8_t* out) {
  for (int t = 0; t < 16; ++t) {
    out[t] = (q[t] & 0x0F) | (q[t + 16] << 4);
    out[16 + t] = (q[t] >> 4) | (q[t + 16] & 0xF0);
  }
}

// rows of a 2-D [R, cols] or 3-D [E, n, cols] tensor (R = E * n: the rows of a part of an expert
// stack, strided per expert) addressed by their index r
struct Rows {
  int64_t n, s0, s1;
  Rows(const at::Tensor& t)
      : n(t.dim() == 3 ? t.size(1) : t.size(0)), s0(t.dim() == 3 ? t.stride(0) : 0), s1(t.stride(t.dim() - 2)) {}
  int64_t at(int64_t r) const { return (r / n) * s0 + (r % n) * s1; }
};

void check_rows(const at::Tensor& t, const char* what, at::ScalarType dtype, const at::Tensor& like, int64_t cols) {
  const bool dims = t.dim() == like.dim() && (t.dim() == 2 || (t.dim() == 3 && t.size(0) == like.size(0))) &&
                    t.size(t.dim() - 2) == like.size(like.dim() - 2) && t.size(t.dim() - 1) == cols;
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && dims && (cols <= 1 || t.stride(-1) == 1),
              "zoo_repack: ", what, " must be a CPU ", c10::toString(dtype), " with the blocks' rows ", like.sizes(),
              " and ", cols, " contiguous columns, got ", t.scalar_type(), " ", t.sizes(), " strides ", t.strides());
}

void check(const at::Tensor& t, const char* what, at::ScalarType dtype, int64_t rows, int64_t cols) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.dim() == 2 && t.size(0) == rows &&
                  t.size(1) == cols && (cols <= 1 || t.stride(1) == 1),
              "zoo_repack: ", what, " must be a CPU ", c10::toString(dtype), " [", rows, ", ", cols,
              "] with a contiguous inner dim, got ", t.scalar_type(), " ", t.sizes(), " strides ", t.strides());
}

// the blocks' rows: [R, nb * bytes] or a stack [E, n, nb * bytes] (R = E n) -> nb (blocks a row)
int64_t block_rows(const at::Tensor& blocks, int64_t bytes, const char* op) {
  TORCH_CHECK((blocks.dim() == 2 || blocks.dim() == 3) && blocks.size(-1) % bytes == 0, "zoo_repack::", op,
              ": blocks [R, nb * ", bytes, "] or [E, n, nb * ", bytes, "], got ", blocks.sizes());
  return blocks.size(-1) / bytes;
}

void q4k_int4(const at::Tensor& blocks, const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m) {
  const int64_t nb = block_rows(blocks, 144, "q4k_int4");
  const int64_t R = blocks.dim() == 3 ? blocks.size(0) * blocks.size(1) : blocks.size(0);
  check_rows(blocks, "blocks", at::kByte, blocks, nb * 144);
  check_rows(qs, "qs", at::kByte, blocks, nb * 128);
  check_rows(d, "d", at::kFloat, blocks, nb * 8);
  check_rows(m, "m", at::kFloat, blocks, nb * 8);
  const uint8_t* src = blocks.const_data_ptr<uint8_t>();
  uint8_t* q = qs.data_ptr<uint8_t>();
  float* dp = d.data_ptr<float>();
  float* mp = m.data_ptr<float>();
  const Rows rb(blocks), rq(qs), rd(d), rm(m);
  at::parallel_for(0, R, 16, [&](int64_t a, int64_t e) {
    for (int64_t r = a; r < e; ++r) {
      const uint8_t* row = src + rb.at(r);
      uint8_t* qrow = q + rq.at(r);
      float* drow = dp + rd.at(r);
      float* mrow = mp + rm.at(r);
      for (int64_t k = 0; k < nb; ++k) {
        const uint8_t* b = row + k * 144;
        scales_k(b, drow + k * 8, mrow + k * 8);
        for (int j = 0; j < 4; ++j) nibbles_run(b + 16 + 32 * j, qrow + k * 128 + 32 * j);
      }
    }
  });
}

void q5k_int5(const at::Tensor& blocks, const at::Tensor& qs, const at::Tensor& qh, const at::Tensor& d,
              const at::Tensor& m) {
  const int64_t nb = block_rows(blocks, 176, "q5k_int5");
  const int64_t R = blocks.dim() == 3 ? blocks.size(0) * blocks.size(1) : blocks.size(0);
  check_rows(blocks, "blocks", at::kByte, blocks, nb * 176);
  check_rows(qs, "qs", at::kByte, blocks, nb * 128);
  check_rows(qh, "qh", at::kByte, blocks, nb * 32);
  check_rows(d, "d", at::kFloat, blocks, nb * 8);
  check_rows(m, "m", at::kFloat, blocks, nb * 8);
  const uint8_t* src = blocks.const_data_ptr<uint8_t>();
  uint8_t* q = qs.data_ptr<uint8_t>();
  uint8_t* h = qh.data_ptr<uint8_t>();
  float* dp = d.data_ptr<float>();
  float* mp = m.data_ptr<float>();
  const Rows rb(blocks), rq(qs), rh(qh), rd(d), rm(m);
  at::parallel_for(0, R, 16, [&](int64_t a, int64_t e) {
    for (int64_t r = a; r < e; ++r) {
      for (int64_t k = 0; k < nb; ++k) {
        const uint8_t* b = src + rb.at(r) + k * 176;
        scales_k(b, dp + rd.at(r) + k * 8, mp + rm.at(r) + k * 8);
        uint8_t* out = q + rq.at(r) + k * 128;
        for (int j = 0; j < 4; ++j) nibbles_run(b + 48 + 32 * j, out + 32 * j);
        // the stored high bits: input 32 k + t's is bit k of qh[t]; out: byte i / 8, bit i % 8
        const uint8_t* hb = b + 16;
        uint8_t* ho = h + rh.at(r) + k * 32;
        for (int g = 0; g < 32; ++g) {  // output byte g: inputs 8 g .. 8 g + 7
          const int bit = g >> 2, t0 = (g & 3) * 8;
          uint8_t v = 0;
          for (int t = 0; t < 8; ++t) v |= ((hb[t0 + t] >> bit) & 1) << t;
          ho[g] = v;
        }
      }
    }
  });
}

// one K-quant block -> its 256 integer codes and per-group d, m (group G: 32 for Q4_K / Q5_K, 16
// for Q6_K, which has no offset: m = +0, as gguf_blocks.to_mixed writes it)
int decode_k(int type, const uint8_t* b, int8_t* q, float* d, float* m) {
  if (type == 6) {  // Q6_K: ql[128] | qh[64] | scales[16] int8 | d f16
    const float dd = half_at(b + 208);
    for (int i = 0; i < 256; ++i) {
      const int h = i / 128, j = i % 128;
      const int lo = (b[h * 64 + (j % 64)] >> (4 * (j / 64))) & 0xF;
      const int hi = (b[128 + h * 32 + (j % 32)] >> (2 * (j / 32))) & 3;
      q[i] = static_cast<int8_t>((lo | (hi << 4)) - 32);
    }
    for (int k = 0; k < 16; ++k) {
      d[k] = dd * static_cast<float>(static_cast<int8_t>(b[192 + k]));
      m[k] = 0.0f;
    }
    return 16;
  }
  scales_k(b, d, m);  // Q4_K / Q5_K
  const uint8_t* qs = b + (type == 5 ? 48 : 16);
  for (int i = 0; i < 256; ++i) {
    const int j = i / 64, w = i % 64;
    int v = (qs[32 * j + (w % 32)] >> (w >= 32 ? 4 : 0)) & 0xF;
    if (type == 5) v |= ((b[16 + (i % 32)] >> (i / 32)) & 1) << 4;
    q[i] = static_cast<int8_t>(v);
  }
  return 32;
}

// blocks [R, nb * nbytes] of Q4_K (4) / Q5_K (5) / Q6_K (6) -> ZQ8_G<g> [R, nb * 256 / g * (g + 8)]
// (g int8 codes | d f32 | m f32 per group of g: gguf_blocks.to_mixed's bytes)
void k_to_zq8(const at::Tensor& blocks, int64_t type, int64_t g, const at::Tensor& out) {
  TORCH_CHECK(type == 4 || type == 5 || type == 6, "zoo_repack::k_to_zq8: type 4 (Q4_K), 5 (Q5_K) or 6 (Q6_K)");
  TORCH_CHECK(g == 16 || (g == 32 && type != 6), "zoo_repack::k_to_zq8: group 16, or 32 for Q4_K / Q5_K");
  const int64_t nbytes = type == 4 ? 144 : type == 5 ? 176 : 210;
  const int64_t R = blocks.size(0);
  TORCH_CHECK(blocks.dim() == 2 && blocks.size(1) % nbytes == 0, "zoo_repack::k_to_zq8: blocks [R, nb * ", nbytes, "]");
  const int64_t nb = blocks.size(1) / nbytes, per = QK / g * (g + 8);
  check(blocks, "blocks", at::kByte, R, nb * nbytes);
  check(out, "out", at::kByte, R, nb * per);
  const uint8_t* src = blocks.const_data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  const int64_t sb = blocks.stride(0), so = out.stride(0);
  at::parallel_for(0, R, 16, [&](int64_t a, int64_t e) {
    int8_t q[256];
    float d[16], m[16];
    for (int64_t r = a; r < e; ++r) {
      for (int64_t k = 0; k < nb; ++k) {
        const int G = decode_k(static_cast<int>(type), src + r * sb + k * nbytes, q, d, m);
        uint8_t* o = dst + r * so + k * per;
        for (int64_t s = 0; s < QK / g; ++s, o += g + 8) {
          std::memcpy(o, q + s * g, g);
          std::memcpy(o + g, d + s * g / G, 4);
          std::memcpy(o + g + 4, m + s * g / G, 4);
        }
      }
    }
  });
}

// ZQ8_G<g> bytes [R, n * (g + 8)] -> the int8g layout's q [R, n * g] int8, d, m [R, n] float32
void zq8_int8g(const at::Tensor& blocks, int64_t g, const at::Tensor& q, const at::Tensor& d, const at::Tensor& m) {
  TORCH_CHECK(g == 16 || g == 32, "zoo_repack::zq8_int8g: group 16 or 32");
  const int64_t R = blocks.size(0);
  TORCH_CHECK(blocks.dim() == 2 && blocks.size(1) % (g + 8) == 0, "zoo_repack::zq8_int8g: blocks [R, n * ", g + 8, "]");
  const int64_t n = blocks.size(1) / (g + 8);
  check(blocks, "blocks", at::kByte, R, n * (g + 8));
  check(q, "q", at::kChar, R, n * g);
  check(d, "d", at::kFloat, R, n);
  check(m, "m", at::kFloat, R, n);
  const uint8_t* src = blocks.const_data_ptr<uint8_t>();
  int8_t* qp = q.data_ptr<int8_t>();
  float* dp = d.data_ptr<float>();
  float* mp = m.data_ptr<float>();
  const int64_t sb = blocks.stride(0), sq = q.stride(0), sd = d.stride(0), sm = m.stride(0);
  at::parallel_for(0, R, 16, [&](int64_t a, int64_t e) {
    for (int64_t r = a; r < e; ++r) {
      const uint8_t* b = src + r * sb;
      for (int64_t k = 0; k < n; ++k, b += g + 8) {
        std::memcpy(qp + r * sq + k * g, b, g);
        std::memcpy(dp + r * sd + k, b + g, 4);
        std::memcpy(mp + r * sm + k, b + g + 4, 4);
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY(zoo_repack, m) {
  m.def("q4k_int4(Tensor blocks, Tensor(a!) qs, Tensor(b!) d, Tensor(c!) m) -> ()");
  m.def("q5k_int5(Tensor blocks, Tensor(a!) qs, Tensor(b!) qh, Tensor(c!) d, Tensor(d!) m) -> ()");
  m.def("k_to_zq8(Tensor blocks, int type, int g, Tensor(a!) out) -> ()");
  m.def("zq8_int8g(Tensor blocks, int g, Tensor(a!) q, Tensor(b!) d, Tensor(c!) m) -> ()");
}

TORCH_LIBRARY_IMPL(zoo_repack, CPU, m) {
  m.impl("q4k_int4", &q4k_int4);
  m.impl("q5k_int5", &q5k_int5);
  m.impl("k_to_zq8", &k_to_zq8);
  m.impl("zq8_int8g", &zq8_int8g);
}
