// One-query attention over a KV cache on the CPU (a decode step), registered as a torch op.
// Built and loaded by one_query.py, where the torch-op reference lives.
//
//   zoo_attn::decode_attention(q, k, v, n, scale) -> o
//       q [B, H, Dh] float32, k and v [B, Hkv, S, Dh] float32 (H a multiple of Hkv: query head
//       h reads KV head h / (H / Hkv)), n [B] int64: row b sees cache slots 0..n[b]-1
//       o [B, H, Dh] float32 = softmax(scale q k^T over the visible slots) v
//
// Why a kernel: a decode step reads each layer's cache once and does little arithmetic on it,
// so its time is the read plus per-op overhead. As aten/inductor ops it is a scores kernel, a
// softmax and a small bmm, each over all S slots of the static cache (2-3x the read time on an
// AVX2 EPYC at SmolLM2's shapes); here each slot is read once and only the n[b] visible ones.
// Work is split flash-decoding style over (row, KV head, chunk of slots), each chunk keeping
// its own max and sum, then merged, so two threads share even one KV head's cache.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kChunk = 128;  // cache slots per task
constexpr int64_t kMaxVecs = 64;  // Dh / Vec::size() (Dh <= 512)

inline float hsum(Vec v) { return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, v); }

// One task: the g query heads q [g, Dh] of one KV head over cache slots [s0, s1) of k, v
// [.., Dh] -> per head j: max score m[j], sum of exp l[j], unnormalised output acc + j astride [Dh].
// NV = Dh / Vec::size() when known at compile time (the loops unroll, q and the output stay in
// registers), 0 for any multiple of the vector width.
// idx: where logical slot s lies in k, v (row idx[s]; a window read off a ring or a chunk), or
// nullptr: slot s is row s. Either way the sums run over logical slots in the same order.
template <int NV>
void chunk(const float* q, int64_t g, const float* k, const float* v, int64_t Dh, int64_t s0, int64_t s1, float sc,
           float* p, float* m, float* l, float* acc, int64_t astride, const int64_t* idx) {
  const int64_t nv = NV > 0 ? NV : Dh / Vec::size(), W = Vec::size(), len = s1 - s0;
  auto row = [&](int64_t s) { return idx ? idx[s] : s; };
  for (int64_t j = 0; j < g; ++j) {
    Vec qv[NV > 0 ? NV : kMaxVecs];
    for (int64_t d = 0; d < nv; ++d) qv[d] = Vec::loadu(q + j * Dh + d * W);
    float* pj = p + j * kChunk;
    int64_t s = s0;
    for (; s + 4 <= s1; s += 4) {  // four slots at once: four independent FMA chains
      Vec a0(0.f), a1(0.f), a2(0.f), a3(0.f);
      const float *k0 = k + row(s) * Dh, *k1 = k + row(s + 1) * Dh, *k2 = k + row(s + 2) * Dh,
                  *k3 = k + row(s + 3) * Dh;
      for (int64_t d = 0; d < nv; ++d) {
        a0 = at::vec::fmadd(qv[d], Vec::loadu(k0 + d * W), a0);
        a1 = at::vec::fmadd(qv[d], Vec::loadu(k1 + d * W), a1);
        a2 = at::vec::fmadd(qv[d], Vec::loadu(k2 + d * W), a2);
        a3 = at::vec::fmadd(qv[d], Vec::loadu(k3 + d * W), a3);
      }
      pj[s - s0] = sc * hsum(a0);
      pj[s - s0 + 1] = sc * hsum(a1);
      pj[s - s0 + 2] = sc * hsum(a2);
      pj[s - s0 + 3] = sc * hsum(a3);
    }
    for (; s < s1; ++s) {
      Vec a(0.f);
      for (int64_t d = 0; d < nv; ++d) a = at::vec::fmadd(qv[d], Vec::loadu(k + row(s) * Dh + d * W), a);
      pj[s - s0] = sc * hsum(a);
    }
    const float top = *std::max_element(pj, pj + len);
    Vec vsum(0.f);
    int64_t t = 0;
    for (; t + W <= len; t += W) {
      const Vec e = (Vec::loadu(pj + t) - Vec(top)).exp_u20();  // inductor's softmax exp
      e.store(pj + t);
      vsum = vsum + e;
    }
    float sum = hsum(vsum);
    for (; t < len; ++t) sum += (pj[t] = std::exp(pj[t] - top));
    m[j] = top;
    l[j] = sum;
    Vec o[NV > 0 ? NV : kMaxVecs];
    for (int64_t d = 0; d < nv; ++d) o[d] = Vec(0.f);
    for (int64_t u = 0; u < len; ++u) {
      const Vec pu(pj[u]);
      const float* vr = v + row(s0 + u) * Dh;
      for (int64_t d = 0; d < nv; ++d) o[d] = at::vec::fmadd(pu, Vec::loadu(vr + d * W), o[d]);
    }
    for (int64_t d = 0; d < nv; ++d) o[d].store(acc + j * astride + d * W);
  }
}

// acc[d] += w x[d]
inline void axpy(float w, const float* x, float* acc, int64_t n) {
  for (int64_t d = 0; d < n; d += Vec::size())
    at::vec::fmadd(Vec(w), Vec::loadu(x + d), Vec::loadu(acc + d)).store(acc + d);
}

// The attention of R query rows, each its own decode step: row r's H query heads qp[r] [H, Dh]
// over slots 0..n[r]-1 of KV row kv[r] of k, v [.., Hkv, S, Dh] -> op [R, H, Dh]. A row's result
// depends on its own query, cache and n only (chunks of kChunk slots from slot 0, merged in chunk
// order), never on the other rows: a decode step, a prefill and an extend that hand the same
// query and cache get the same bits (batch invariance, issue #46).
// idx (or nullptr): row r's logical slot s lies at row idx[r] + s of its KV row (see chunk).
void attend_rows(const float* qp, const float* kp, const float* vp, const int64_t* kv, const int64_t* n, int64_t R,
                 int64_t H, int64_t Hkv, int64_t S, int64_t Dh, float sc, float* op,
                 const int64_t* const* idx = nullptr) {
  const int64_t g = H / Hkv;
  int64_t most = 0;
  for (int64_t r = 0; r < R; ++r) most = std::max(most, n[r]);
  const int64_t chunks = (most + kChunk - 1) / kChunk;
  // per (row, query head, chunk): the chunk's max score, sum of exp and unnormalised output
  std::vector<float> cmax(R * H * chunks, -std::numeric_limits<float>::infinity()), csum(R * H * chunks, 0.f);
  std::vector<float> cacc(R * H * chunks * Dh, 0.f);
  auto run = Dh == 64 ? &chunk<64 / Vec::size()> : Dh == 128 ? &chunk<128 / Vec::size()> : &chunk<0>;
  at::parallel_for(0, R * Hkv * chunks, 1, [&](int64_t t0, int64_t t1) {
    float p[kChunk * 64];  // scores of up to 64 query heads per KV head (checked by the callers)
    float m[64], l[64];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t c = t % chunks, rh = t / chunks, r = rh / Hkv, kh = rh % Hkv;
      const int64_t s0 = c * kChunk, s1 = std::min(n[r], s0 + kChunk);
      if (s0 >= s1) continue;  // this row sees fewer slots
      const int64_t kvo = (kv[r] * Hkv + kh) * S * Dh, h0 = r * H + kh * g;
      run(qp + h0 * Dh, g, kp + kvo, vp + kvo, Dh, s0, s1, sc, p, m, l, cacc.data() + (h0 * chunks + c) * Dh,
          chunks * Dh, idx ? idx[r] : nullptr);
      for (int64_t j = 0; j < g; ++j) {
        cmax[(h0 + j) * chunks + c] = m[j];
        csum[(h0 + j) * chunks + c] = l[j];
      }
    }
  });
  at::parallel_for(0, R * H, 16, [&](int64_t a, int64_t b) {
    for (int64_t rh = a; rh < b; ++rh) {
      const float* m = cmax.data() + rh * chunks;
      const float top = *std::max_element(m, m + chunks);
      float total = 0.f;
      float* out = op + rh * Dh;
      std::fill(out, out + Dh, 0.f);
      for (int64_t c = 0; c < chunks; ++c) {
        if (csum[rh * chunks + c] == 0.f) continue;
        const float w = std::exp(m[c] - top);
        total += w * csum[rh * chunks + c];
        axpy(w, cacc.data() + (rh * chunks + c) * Dh, out, Dh);
      }
      for (int64_t d = 0; d < Dh; ++d) out[d] /= total;
    }
  });
}

void check_kv(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t H, int64_t Dh) {
  TORCH_CHECK(k.dim() == 4 && v.sizes() == k.sizes() && k.size(3) == Dh && H % k.size(1) == 0, op, ": q ", q.sizes(),
              " does not match k, v [B, Hkv, S, Dh] ", k.sizes(), ", ", v.sizes());
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat &&
                  q.device().is_cpu(), op, ": q, k, v must be float32 CPU tensors");
  TORCH_CHECK(H / k.size(1) <= 64 && Dh % at::vec::Vectorized<float>::size() == 0 && Dh <= 512, op, ": ",
              "supports up to 64 query heads per KV head and Dh a multiple of ",
              at::vec::Vectorized<float>::size(), " up to 512, got ", H / k.size(1), " and ", Dh);
}

at::Tensor decode_attention(const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_, const at::Tensor& n_,
                            double scale) {
  TORCH_CHECK(q_.dim() == 3, "decode_attention: expected q [B, H, Dh], got ", q_.sizes());
  const int64_t B = q_.size(0), H = q_.size(1), Dh = q_.size(2);
  check_kv("decode_attention", q_, k_, v_, H, Dh);
  TORCH_CHECK(k_.size(0) == B, "decode_attention: q ", q_.sizes(), " does not match k ", k_.sizes());
  TORCH_CHECK(n_.scalar_type() == at::kLong && n_.numel() == B, "decode_attention: n must be [B] int64, got ",
              n_.sizes(), " ", n_.scalar_type());
  const at::Tensor q = q_.contiguous(), k = k_.contiguous(), v = v_.contiguous(), nt = n_.contiguous();
  const int64_t S = k.size(2);
  const int64_t* n = nt.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(n[b] >= 1 && n[b] <= S, "decode_attention: row ", b, " sees ", n[b], " slots (expected 1..", S, ")");
  std::vector<int64_t> kv(B);
  for (int64_t b = 0; b < B; ++b) kv[b] = b;
  at::Tensor o = at::empty({B, H, Dh}, q.options());
  attend_rows(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), kv.data(), n, B, H, k.size(1), S, Dh,
              static_cast<float>(scale), o.data_ptr<float>());
  return o;
}

// zoo_attn::prefix_attention(q [B, H, L, Dh], k, v [B, Hkv, S, Dh], start [B], scale) -> [B, H, L, Dh]:
// query t of row b sees slots 0..start[b] + t, each query computed as its decode step would be.
at::Tensor prefix_attention(const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_, const at::Tensor& start_,
                            double scale) {
  TORCH_CHECK(q_.dim() == 4, "prefix_attention: expected q [B, H, L, Dh], got ", q_.sizes());
  const int64_t B = q_.size(0), H = q_.size(1), L = q_.size(2), Dh = q_.size(3);
  check_kv("prefix_attention", q_, k_, v_, H, Dh);
  TORCH_CHECK(k_.size(0) == B, "prefix_attention: q ", q_.sizes(), " does not match k ", k_.sizes());
  TORCH_CHECK(start_.scalar_type() == at::kLong && start_.numel() == B, "prefix_attention: start must be [B] int64, got ",
              start_.sizes(), " ", start_.scalar_type());
  const at::Tensor q = q_.transpose(1, 2).contiguous(), k = k_.contiguous(), v = v_.contiguous(),
                   st = start_.contiguous();  // q [B, L, H, Dh]: row (b, t) is one decode step's query
  const int64_t S = k.size(2);
  const int64_t* s0 = st.data_ptr<int64_t>();
  std::vector<int64_t> kv(B * L), n(B * L);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(s0[b] >= 0 && s0[b] + L <= S, "prefix_attention: row ", b, " starts at ", s0[b], " with ", L,
                " queries over ", S, " slots");
    for (int64_t t = 0; t < L; ++t) kv[b * L + t] = b, n[b * L + t] = s0[b] + t + 1;
  }
  at::Tensor o = at::empty({B, L, H, Dh}, q.options());
  attend_rows(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), kv.data(), n.data(), B * L, H, k.size(1),
              S, Dh, static_cast<float>(scale), o.data_ptr<float>());
  return o.transpose(1, 2).contiguous();  // [B, H, L, Dh] contiguous, as the fake (empty_like(q))
}

// zoo_attn::window_attention(q [B, H, L, Dh], k, v [B, Hkv, T, Dh], slots [B, P], first [B, L], n [B, L], scale)
// -> [B, H, L, Dh]: query t of row b sees the n[b, t] keys at rows slots[b, first[b, t] + u] (u < n)
// of its k, v, in that order: a sliding window's keys by position, wherever they lie (a prompt, a
// ring, a ring and a chunk). Each query is computed as decode_attention computes one over those keys
// copied to slots 0..n-1, so a window gives a position the same bits on every path (issue #46).
at::Tensor window_attention(const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_, const at::Tensor& slots_,
                            const at::Tensor& first_, const at::Tensor& n_, double scale) {
  TORCH_CHECK(q_.dim() == 4, "window_attention: expected q [B, H, L, Dh], got ", q_.sizes());
  const int64_t B = q_.size(0), H = q_.size(1), L = q_.size(2), Dh = q_.size(3);
  check_kv("window_attention", q_, k_, v_, H, Dh);
  TORCH_CHECK(k_.size(0) == B, "window_attention: q ", q_.sizes(), " does not match k ", k_.sizes());
  TORCH_CHECK(slots_.scalar_type() == at::kLong && slots_.dim() == 2 && slots_.size(0) == B,
              "window_attention: slots must be [B, P] int64, got ", slots_.sizes(), " ", slots_.scalar_type());
  for (const at::Tensor* t : {&first_, &n_})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->dim() == 2 && t->size(0) == B && t->size(1) == L,
                "window_attention: first and n must be [B, L] int64, got ", t->sizes(), " ", t->scalar_type());
  const at::Tensor q = q_.transpose(1, 2).contiguous(), k = k_.contiguous(), v = v_.contiguous(),
                   sl = slots_.contiguous(), ft = first_.contiguous(), nt = n_.contiguous();
  const int64_t T = k.size(2), P = sl.size(1);
  const int64_t *sp = sl.data_ptr<int64_t>(), *f = ft.data_ptr<int64_t>(), *n = nt.data_ptr<int64_t>();
  std::vector<int64_t> kv(B * L);
  std::vector<const int64_t*> idx(B * L);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < L; ++t) {
      const int64_t r = b * L + t;
      TORCH_CHECK(n[r] >= 1 && f[r] >= 0 && f[r] + n[r] <= P, "window_attention: query ", t, " of row ", b,
                  " sees slots[", f[r], ":", f[r] + n[r], "] of ", P);
      for (int64_t u = 0; u < n[r]; ++u)
        TORCH_CHECK(sp[b * P + f[r] + u] >= 0 && sp[b * P + f[r] + u] < T, "window_attention: row ", b, " slot ",
                    sp[b * P + f[r] + u], " outside its ", T, " keys");
      kv[r] = b, idx[r] = sp + b * P + f[r];
    }
  at::Tensor o = at::empty({B, L, H, Dh}, q.options());
  attend_rows(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), kv.data(), n, B * L, H, k.size(1), T, Dh,
              static_cast<float>(scale), o.data_ptr<float>(), idx.data());
  return o.transpose(1, 2).contiguous();
}

}  // namespace

TORCH_LIBRARY(zoo_attn, m) {
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor n, float scale) -> Tensor");
  m.def("prefix_attention(Tensor q, Tensor k, Tensor v, Tensor start, float scale) -> Tensor");
  m.def("window_attention(Tensor q, Tensor k, Tensor v, Tensor slots, Tensor first, Tensor n, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(zoo_attn, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("prefix_attention", &prefix_attention);
  m.impl("window_attention", &window_attention);
}
