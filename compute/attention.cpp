// Causal attention for CPUs with AMX or AVX512-BF16, forward and backward, bf16 in and out, softmax in fp32 (see
// attention.py).
//
// Per (batch, head), a block of Q_ROWS queries at a time against all the keys it sees (causal: none after it).
// The block's scores S = Q K^T / sqrt(D) are at most Q_ROWS x T fp32, 256 KB at T 1024: they stay in the core's
// L2 cache, so the softmax is exact over each row (no online rescaling, as flash attention needs for longer rows).
// Every product goes through oneDNN's batch-reduce GEMM, which PyTorch ships (at::native::cpublas::brgemm): AMX tile
// products, or without AMX AVX-512's vdpbf16ps; A row-major bf16, B in "VNNI" pairs (two consecutive values along
// the summed dimension side by side: the layout both read), C fp32. The operands are put into that layout here, one
// (batch, head) at a time, while they are in cache.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>
#include <immintrin.h>
#include <torch/library.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <exception>
#include <vector>

using at::BFloat16;
using Vec = at::vec::Vectorized<float>;

constexpr int64_t Q_ROWS = 64;  // queries per block
constexpr float MASKED = -1e30f;  // a score that exp() turns into 0

// C (M, N) = A (M, K) @ B (K, N) (add: C +=), A row-major, B in VNNI pairs [K/2][ld_b][2]. One call per product:
// oneDNN compiles a kernel for each shape it sees (a few dozen here) and keeps it; small calls cost more in overhead
// than they save (measured: products of 64 x 64 x 64 reach half the rate of 64 x 1024 x 64 ones).
static void gemm(int64_t M, int64_t N, int64_t K, const BFloat16* A, int64_t ld_a, const BFloat16* B, int64_t ld_b,
                 float* C, int64_t ld_c, bool add) {
  at::native::cpublas::brgemm(M, N, K, ld_a, ld_b, ld_c, add, A, B, C, true);
}

// 16 x 16 32-bit words, rows[i][0..15] -> out[j * ld_out + i] (AVX-512: pairs of rows, then of pairs, then of 4s
// and of 8s swap halves: four rounds of shuffles instead of 256 scattered moves)
static void transpose16(const uint32_t* const rows[16], uint32_t* out, int64_t ld_out) {
  __m512i r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(rows[i]);
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4)
    for (int j = 0; j < 2; ++j) {
      r[i + j] = _mm512_unpacklo_epi64(t[i + j], t[i + j + 2]);
      r[i + j + 2] = _mm512_unpackhi_epi64(t[i + j], t[i + j + 2]);
    }
  for (int i = 0; i < 16; i += 8)
    for (int j = 0; j < 4; ++j) {
      t[i + j] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0x88);
      t[i + j + 4] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
  }
  // r[j] now holds column j with its bits 0 and 1 swapped (0 2 1 3 4 6 5 7 ...), rows 0..15 in order
  for (int j = 0; j < 16; ++j) _mm512_storeu_si512(out + ((j & ~3) | (j & 1) << 1 | (j >> 1 & 1)) * ld_out, r[j]);
}

// The layouts, from n rows of D values (row stride ld) to T >= n rows (a multiple of 16), the extra rows zero.
// x^T in VNNI pairs [D/2][L][2] (L >= T: the leading dimension): the pair (x[t][2p], x[t][2p+1]) is one 32-bit word,
// moved to [p][t]
static void pack_vnni_t(const BFloat16* x, int64_t ld, int64_t n, int64_t T, int64_t D, BFloat16* out, int64_t L,
                        const BFloat16* zeros) {
  const uint32_t* rows[16];
  for (int64_t t0 = 0; t0 < T; t0 += 16)
    for (int64_t p0 = 0; p0 < D / 2; p0 += 16) {
      for (int i = 0; i < 16; ++i)
        rows[i] = reinterpret_cast<const uint32_t*>(t0 + i < n ? x + (t0 + i) * ld + 2 * p0 : zeros);
      transpose16(rows, reinterpret_cast<uint32_t*>(out) + p0 * L + t0, L);
    }
}

// Two rows a, b (n values each) as VNNI pairs: a0 b0 a1 b1 ... (AVX-512's two-source word permute, 32 at a time)
static void interleave(const BFloat16* a, const BFloat16* b, int64_t n, BFloat16* out) {
  int64_t c = 0;
  const __m512i low = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                       39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
  for (; c + 32 <= n; c += 32) {
    __m512i va = _mm512_loadu_si512(a + c), vb = _mm512_loadu_si512(b + c);
    _mm512_storeu_si512(out + 2 * c, _mm512_permutex2var_epi16(va, low, vb));
    _mm512_storeu_si512(out + 2 * c + 32, _mm512_permutex2var_epi16(va, high, vb));
  }
  for (; c < n; ++c) out[2 * c] = a[c], out[2 * c + 1] = b[c];
}

// The reverse: VNNI pairs (n of them) back to two rows
static void deinterleave(const BFloat16* pairs, int64_t n, BFloat16* a, BFloat16* b) {
  int64_t c = 0;
  const __m512i evens = _mm512_set_epi16(62, 60, 58, 56, 54, 52, 50, 48, 46, 44, 42, 40, 38, 36, 34, 32,
                                         30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odds = _mm512_add_epi16(evens, _mm512_set1_epi16(1));
  for (; c + 32 <= n; c += 32) {
    __m512i lo = _mm512_loadu_si512(pairs + 2 * c), hi = _mm512_loadu_si512(pairs + 2 * c + 32);
    _mm512_storeu_si512(a + c, _mm512_permutex2var_epi16(lo, evens, hi));
    _mm512_storeu_si512(b + c, _mm512_permutex2var_epi16(lo, odds, hi));
  }
  for (; c < n; ++c) a[c] = pairs[2 * c], b[c] = pairs[2 * c + 1];
}

// x in VNNI pairs of rows [T/2][D][2]
static void pack_vnni(const BFloat16* x, int64_t ld, int64_t n, int64_t T, int64_t D, BFloat16* out,
                      const BFloat16* zeros) {
  for (int64_t t = 0; t < T; t += 2)
    interleave(t < n ? x + t * ld : zeros, t + 1 < n ? x + (t + 1) * ld : zeros, D, out + t * D);
}

// x^T plain [D][L]: x^T in VNNI pairs, each pair of rows then taken apart (scratch: D * L values)
static void pack_t(const BFloat16* x, int64_t ld, int64_t n, int64_t T, int64_t D, BFloat16* out, int64_t L,
                   const BFloat16* zeros, BFloat16* scratch) {
  pack_vnni_t(x, ld, n, T, D, scratch, L, zeros);
  for (int64_t p = 0; p < D / 2; ++p) deinterleave(scratch + 2 * p * L, T, out + 2 * p * L, out + (2 * p + 1) * L);
}

// 16 floats to bf16, rounded to nearest even, by AVX512-BF16's own instruction (every CPU this kernel runs on has
// it: AMX Xeons too); ATen's cvtfp32_bf16 does the same rounding in six integer instructions.
static inline __m256i bf16_of(const Vec& x) { return (__m256i)_mm512_cvtneps_pbh(__m512(x)); }
static inline void store_bf16(const Vec& x, BFloat16* out) { _mm256_storeu_si256((__m256i*)out, bf16_of(x)); }

static void store_row(const float* x, int64_t n, BFloat16* out) {  // n (a multiple of 16) floats to bf16
  for (int64_t c = 0; c < n; c += Vec::size()) store_bf16(Vec::loadu(x + c), out + c);
}

// Rows a and b (16 floats each) as 16 VNNI pairs of bf16, a0 b0 a1 b1 ... (one 64-byte store)
static inline void store_pairs(const Vec& a, const Vec& b, BFloat16* out) {
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                         23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  _mm512_storeu_si512(out, _mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(__m512(b), __m512(a))));
}

// The dot product of two rows of n (a multiple of 32) bf16 values, in fp32: AVX512-BF16's pair products (exact)
static float dot_bf16(const BFloat16* a, const BFloat16* b, int64_t n) {
  __m512 sum = _mm512_setzero_ps();
  for (int64_t c = 0; c < n; c += 32)
    sum = _mm512_dpbf16_ps(sum, (__m512bh)_mm512_loadu_si512(a + c), (__m512bh)_mm512_loadu_si512(b + c));
  return _mm512_reduce_add_ps(sum);
}

// 2^t, 16 floats: 2^n by AVX-512's scalef (which also makes 0 of a masked score's huge negative t) times 2^f,
// f = t - n in [-1/2, 1/2], by a polynomial of degree 5 fitted to 2^f's relative error there (Lawson's weighted least
// squares: at most 2.0e-7 evaluated in fp32, under the 2.4e-7 of the degree-6 Taylor polynomial; ATen's exp_u20 is
// within 20 ulps, 2.4e-6): 8 instructions where exp_u20 takes 17, for the softmax's largest elementwise cost.
static inline Vec exp2_of(const Vec& t) {
  const __m512 n = _mm512_roundscale_ps(__m512(t), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(__m512(t), n);
  constexpr float c[] = {0.001328230369836092f, 0.009675590321421623f, 0.05550695210695267f, 0.24022118747234344f,
                         0.6931470036506653f, 1.0000001192092896f};  // f^5 ... f^0
  __m512 p = _mm512_set1_ps(c[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c[i]));
  return _mm512_scalef_ps(p, n);
}
constexpr float LOG2E = 1.4426950408889634f;  // exp(x) = 2^(x log2(e))

static float max_of(const float* x, int64_t n) {
  Vec m(MASKED);
  for (int64_t c = 0; c < n; c += Vec::size()) m = at::vec::maximum(m, Vec::loadu(x + c));
  return _mm512_reduce_max_ps(m);
}

struct Heads {  // one (batch, head)'s rows in a (B, H, T, D) tensor whose D values are contiguous
  const BFloat16* rows;
  int64_t ld;
  Heads(const at::Tensor& x, int64_t b, int64_t h)
      : rows(x.const_data_ptr<BFloat16>() + b * x.stride(0) + h * x.stride(1)), ld(x.stride(2)) {}
};

// Forward: q, k, v (B, H, n, D). Returns out (B, n, H, D) and lse (B, H, n): each row's log-sum-exp of its scaled
// scores, from which backward remakes the softmax without another reduction.
std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const int64_t B = q.size(0), H = q.size(1), n = q.size(2), D = q.size(3), T = (n + Q_ROWS - 1) / Q_ROWS * Q_ROWS;
  const int64_t L = T + 16;  // the buffers' rows of T values, L apart: at T 1024, rows 4 KB apart share one L1 set
  const float scale = 1.0f / std::sqrt(float(D));
  auto out = at::empty({B, n, H, D}, q.options());
  auto lse = at::empty({B, H, n}, q.options().dtype(at::kFloat));
  BFloat16* OUT = out.data_ptr<BFloat16>();
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(Q_ROWS * L), o(Q_ROWS * D), inv_sum(Q_ROWS);
    std::vector<BFloat16> p(Q_ROWS * L), kt(D * L), vv(T * D), zeros(L + D);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      Heads Q(q, b, h), K(k, b, h), V(v, b, h);
      pack_vnni_t(K.rows, K.ld, n, T, D, kt.data(), L, zeros.data());
      pack_vnni(V.rows, V.ld, n, T, D, vv.data(), zeros.data());
      float* LSE = lse.data_ptr<float>() + bh * n;
      for (int64_t i0 = 0; i0 < n; i0 += Q_ROWS) {
        const int64_t rows = std::min(Q_ROWS, n - i0), keys = i0 + Q_ROWS;  // keys: a multiple of Vec::size()
        gemm(rows, keys, D, Q.rows + i0 * Q.ld, Q.ld, kt.data(), L, s.data(), L, false);
        for (int64_t r = 0; r < rows; ++r) {  // P = exp(S - max), unnormalized: out's rows are divided by their sums
          float* row = s.data() + r * L;
          std::fill(row + i0 + r + 1, row + keys, MASKED);  // row i0 + r sees keys 0 .. i0 + r
          const float max = max_of(row, keys) * scale;
          Vec sum(0.0f);
          for (int64_t c = 0; c < keys; c += Vec::size()) {
            const Vec e = exp2_of(Vec::loadu(row + c) * Vec(scale * LOG2E) - Vec(max * LOG2E));
            sum += e;
            store_bf16(e, p.data() + r * L + c);
          }
          inv_sum[r] = 1.0f / _mm512_reduce_add_ps(sum);
          LSE[i0 + r] = max - std::log(inv_sum[r]);
        }
        gemm(rows, D, keys, p.data(), L, vv.data(), D, o.data(), D, false);
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t d = 0; d < D; d += Vec::size())
            store_bf16(Vec::loadu(o.data() + r * D + d) * Vec(inv_sum[r]), OUT + ((b * n + i0 + r) * H + h) * D + d);
      }
    }
    at::native::cpublas::brgemm_release(true);
  });
  return {out, lse};
}

// Backward, per query block i (keys 0 .. e):  P = exp(S - lse),  dP = dO V^T,  dS = P (dP - delta) / sqrt(D),
//   dQ_i = dS K,   dK^T += Q_i^T dS,   dV^T += dO_i^T P   (dK^T and dV^T summed over the blocks in fp32),
// where delta = rowsum(dO * out). Returns dq, dk, dv, each (B, n, H, D).
std::tuple<at::Tensor, at::Tensor, at::Tensor> backward(const at::Tensor& d_out, const at::Tensor& q,
    const at::Tensor& k, const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse) {
  const int64_t B = q.size(0), H = q.size(1), n = q.size(2), D = q.size(3), T = (n + Q_ROWS - 1) / Q_ROWS * Q_ROWS;
  const int64_t L = T + 16;  // (as in forward)
  const float scale = 1.0f / std::sqrt(float(D));
  auto dq = at::empty({B, n, H, D}, q.options()), dk = at::empty_like(dq), dv = at::empty_like(dq);
  BFloat16 *DQ = dq.data_ptr<BFloat16>(), *DK = dk.data_ptr<BFloat16>(), *DV = dv.data_ptr<BFloat16>();
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(Q_ROWS * L), dp(Q_ROWS * L), dqi(Q_ROWS * D), dkt(D * L), dvt(D * L), delta(T), grad_rows(16 * D);
    std::vector<BFloat16> p_vnni(Q_ROWS * L), ds(Q_ROWS * L), ds_vnni(Q_ROWS * L), zeros(L + D);
    std::vector<BFloat16> kt(D * L), vt(D * L), kv(T * D), qt(D * L), dot(D * L), scratch(D * L);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      Heads Q(q, b, h), K(k, b, h), V(v, b, h), dO(d_out, b, h), O(out, b, h);
      pack_vnni_t(K.rows, K.ld, n, T, D, kt.data(), L, zeros.data());
      pack_vnni_t(V.rows, V.ld, n, T, D, vt.data(), L, zeros.data());
      pack_vnni(K.rows, K.ld, n, T, D, kv.data(), zeros.data());
      pack_t(Q.rows, Q.ld, n, T, D, qt.data(), L, zeros.data(), scratch.data());
      pack_t(dO.rows, dO.ld, n, T, D, dot.data(), L, zeros.data(), scratch.data());
      for (int64_t t = 0; t < n; ++t) delta[t] = dot_bf16(dO.rows + t * dO.ld, O.rows + t * O.ld, D);
      std::fill(dkt.begin(), dkt.end(), 0.0f);
      std::fill(dvt.begin(), dvt.end(), 0.0f);
      const float* LSE = lse.const_data_ptr<float>() + bh * n;
      for (int64_t i0 = 0; i0 < n; i0 += Q_ROWS) {
        const int64_t rows = std::min(Q_ROWS, n - i0), keys = i0 + Q_ROWS;
        gemm(rows, keys, D, Q.rows + i0 * Q.ld, Q.ld, kt.data(), L, s.data(), L, false);
        gemm(rows, keys, D, dO.rows + i0 * dO.ld, dO.ld, vt.data(), L, dp.data(), L, false);
        for (int64_t r = 0; r < rows; ++r) std::fill(s.data() + r * L + i0 + r + 1, s.data() + r * L + keys, MASKED);
        for (int64_t r = 0; r < Q_ROWS; r += 2) {  // two rows at a time: P and dS also as VNNI pairs of rows
          const float* prow[2] = {s.data() + r * L, s.data() + (r + 1) * L};
          const float* dprow[2] = {dp.data() + r * L, dp.data() + (r + 1) * L};
          for (int64_t c = 0; c < keys; c += Vec::size()) {
            Vec pc[2] = {Vec(0.0f), Vec(0.0f)}, dsc[2] = {Vec(0.0f), Vec(0.0f)};  // (rows past n: zero)
            for (int j = 0; j < 2; ++j)
              if (r + j < rows) {
                pc[j] = exp2_of(Vec::loadu(prow[j] + c) * Vec(scale * LOG2E) - Vec(LSE[i0 + r + j] * LOG2E));
                dsc[j] = (Vec::loadu(dprow[j] + c) - Vec(delta[i0 + r + j])) * pc[j] * Vec(scale);
              }
            store_bf16(dsc[0], ds.data() + r * L + c);
            store_bf16(dsc[1], ds.data() + (r + 1) * L + c);
            store_pairs(pc[0], pc[1], p_vnni.data() + r * L + 2 * c);
            store_pairs(dsc[0], dsc[1], ds_vnni.data() + r * L + 2 * c);
          }
        }
        gemm(rows, D, keys, ds.data(), L, kv.data(), D, dqi.data(), D, false);
        for (int64_t r = 0; r < rows; ++r) store_row(dqi.data() + r * D, D, DQ + ((b * n + i0 + r) * H + h) * D);
        gemm(D, keys, Q_ROWS, qt.data() + i0, L, ds_vnni.data(), L, dkt.data(), L, true);
        gemm(D, keys, Q_ROWS, dot.data() + i0, L, p_vnni.data(), L, dvt.data(), L, true);
      }
      for (auto [grad_t, grad] : {std::pair(dkt.data(), DK), std::pair(dvt.data(), DV)})
        for (int64_t t0 = 0; t0 < n; t0 += 16) {  // (D, T) fp32 -> 16 rows of D at a time -> bf16 rows of the output
          for (int64_t d0 = 0; d0 < D; d0 += 16) {
            const uint32_t* block[16];
            for (int i = 0; i < 16; ++i) block[i] = reinterpret_cast<const uint32_t*>(grad_t + (d0 + i) * L + t0);
            transpose16(block, reinterpret_cast<uint32_t*>(grad_rows.data()) + d0, D);
          }
          for (int64_t t = t0; t < std::min(t0 + 16, n); ++t)
            store_row(grad_rows.data() + (t - t0) * D, D, grad + ((b * n + t) * H + h) * D);
        }
    }
    at::native::cpublas::brgemm_release(true);
  });
  return {dq, dk, dv};
}

// Whether oneDNN's brgemm runs bf16 here: with AMX tiles, or, on AVX512-BF16 CPUs without AMX (AMD Zen 4 and 5,
// Xeons of Cooper Lake), with its AVX-512 kernels (vdpbf16ps, reading the same VNNI pairs). Tried on one small
// product against the exact sum: where oneDNN has no bf16 brgemm (its ISA held below AVX512-BF16 by
// ONEDNN_MAX_CPU_ISA, say) it throws, and that says no. (could_pack(kBFloat16) answers for AMX only.)
bool available() {
  constexpr int64_t M = 4, N = 16, K = 32;
  BFloat16 a[M * K], b[K * N];  // b: VNNI pairs [K/2][N][2]
  float c[M * N];
  for (int64_t i = 0; i < M * K; ++i) a[i] = BFloat16(float(i % 7) - 3.0f);
  for (int64_t i = 0; i < K * N; ++i) b[i] = BFloat16(float(i % 5) - 2.0f);
  try {
    at::native::cpublas::brgemm(M, N, K, K, N, N, false, a, b, c, true);
    at::native::cpublas::brgemm_release(true);
  } catch (const std::exception&) {  // (c10::Error; oneDNN's own, "could not generate a kernel", under ONEDNN_MAX_CPU_ISA)
    return false;
  }
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      float sum = 0.0f;  // (small integers: exact in fp32, whatever the order)
      for (int64_t k = 0; k < K; ++k) sum += float(a[m * K + k]) * float(b[(k / 2) * 2 * N + 2 * n + k % 2]);
      if (c[m * N + n] != sum) return false;
    }
  return true;
}

// How many threads at::parallel_for hands the work to. It is inline code that runs on OpenMP's threads only where the
// extension itself is compiled with -fopenmp; without it, it quietly runs the whole loop on one thread (seen: the
// kernel used one core of two in every training step).
int64_t threads_used() {
  std::atomic<int64_t> seen{0};
  at::parallel_for(0, 256, 1, [&](int64_t, int64_t) { seen |= int64_t(1) << std::min(at::get_thread_num(), 62); });
  return __builtin_popcountll(seen.load());
}

TORCH_LIBRARY(gpt2cpu, m) {
  m.def("attention_forward(Tensor q, Tensor k, Tensor v) -> (Tensor, Tensor)");
  m.def("attention_backward(Tensor d_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse) -> (Tensor, Tensor, Tensor)");
  m.def("attention_available() -> bool", &available);
  m.def("attention_threads_used() -> int", &threads_used);
}

TORCH_LIBRARY_IMPL(gpt2cpu, CPU, m) {
  m.impl("attention_forward", &forward);
  m.impl("attention_backward", &backward);
}
