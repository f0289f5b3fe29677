// Batch-invariant fp32 CPU kernels for decode/verify: a skinny GEMM y[M,N] = x[M,K] @ w[N,K]^T (+ b[N])
// (made for M = 1..16, any M works: 64-row passes), and an order-invariant attention (end of file).
//
// Each weight row is streamed from memory once for all M input rows (the products are weight-bandwidth
// bound, so k rows cost about what one row costs). Batch-invariant: every output y[m,n] is one dot product
// accumulated in one vector register over k in fixed VW-wide chunks (masked zero tail), then reduced in a
// fixed order; neither M, the tile shapes, nor the thread split change that order, so a row's result is
// bit-identical whether it is computed alone or together with others.
//
// Compiled once per ISA: -DSD_AVX512 (-mavx512f -mfma) or AVX2 (-mavx2 -mfma). Plain C ABI, loaded with
// ctypes; OpenMP resolves to the libgomp torch has already loaded, so threads are shared with torch.
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>

#define MC 64  // rows per pass over the weights: keeps the x panel in L2 for long inputs

#if defined(SD_AVX512)
typedef __m512 vf;
#define VW 16
#define MB 6
#define NB 4
static inline vf vzero() { return _mm512_setzero_ps(); }
static inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
static inline vf vload_tail(const float* p, int n) { return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vset1(float a) { return _mm512_set1_ps(a); }
static inline void vstore(float* p, vf a) { _mm512_storeu_ps(p, a); }
static inline float vsum(vf a) {
  __m256 h = _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
}
#define SD_NAME sd_linear_avx512
#define SD_ATTN sd_attention_avx512
#else
typedef __m256 vf;
#define VW 8
#define MB 2
#define NB 4
static inline vf vzero() { return _mm256_setzero_ps(); }
static inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
static inline vf vload_tail(const float* p, int n) {
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), idx));
}
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vset1(float a) { return _mm256_set1_ps(a); }
static inline void vstore(float* p, vf a) { _mm256_storeu_ps(p, a); }
static inline float vsum(vf a) {
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
}
#define SD_NAME sd_linear_avx2
#define SD_ATTN sd_attention_avx2
#endif

// One MT x NT tile: rows x[0..MT) (stride ldx) against weight rows w[0..NT) (stride K).
template <int MT, int NT>
static inline void tile(const float* x, int64_t ldx, const float* w, int64_t K, float* y, int64_t ldy,
                        const float* b, const float* pf, int64_t pf_len) {
  vf acc[MT][NT];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) acc[i][j] = vzero();
  const int64_t pf_step = ((pf_len * VW / K + 15) / 16) * 16;  // floats to prefetch per k step (whole lines)
  int64_t pf_pos = 0, k = 0;
  for (; k + VW <= K; k += VW) {
    vf wv[NT];
    if (pf && pf_pos < pf_len) {  // this tile's share of the next weight block, spread over its k loop
      for (int64_t f = pf_pos; f < pf_pos + pf_step; f += 16) _mm_prefetch((const char*)(pf + f), _MM_HINT_T0);
      pf_pos += pf_step;
    }
    for (int j = 0; j < NT; ++j) wv[j] = vload(w + j * K + k);
    for (int i = 0; i < MT; ++i) {
      vf xv = vload(x + i * ldx + k);
      for (int j = 0; j < NT; ++j) acc[i][j] = vfma(xv, wv[j], acc[i][j]);
    }
  }
  if (k < K) {
    int n = (int)(K - k);
    vf wv[NT];
    for (int j = 0; j < NT; ++j) wv[j] = vload_tail(w + j * K + k, n);
    for (int i = 0; i < MT; ++i) {
      vf xv = vload_tail(x + i * ldx + k, n);
      for (int j = 0; j < NT; ++j) acc[i][j] = vfma(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) y[i * ldy + j] = b ? vsum(acc[i][j]) + b[j] : vsum(acc[i][j]);
}

template <int MT>
static inline void tile_n(int nt, const float* x, int64_t ldx, const float* w, int64_t K, float* y,
                          int64_t ldy, const float* b, const float* pf, int64_t pf_len) {
  switch (nt) {
    case 4: tile<MT, 4>(x, ldx, w, K, y, ldy, b, pf, pf_len); break;
    case 3: tile<MT, 3>(x, ldx, w, K, y, ldy, b, pf, pf_len); break;
    case 2: tile<MT, 2>(x, ldx, w, K, y, ldy, b, pf, pf_len); break;
    default: tile<MT, 1>(x, ldx, w, K, y, ldy, b, pf, pf_len); break;
  }
}

static void tile_mn(int mt, int nt, const float* x, int64_t ldx, const float* w, int64_t K, float* y,
                    int64_t ldy, const float* b, const float* pf, int64_t pf_len) {
  switch (mt) {
#if MB >= 6
    case 6: tile_n<6>(nt, x, ldx, w, K, y, ldy, b, pf, pf_len); break;
    case 5: tile_n<5>(nt, x, ldx, w, K, y, ldy, b, pf, pf_len); break;
    case 4: tile_n<4>(nt, x, ldx, w, K, y, ldy, b, pf, pf_len); break;
    case 3: tile_n<3>(nt, x, ldx, w, K, y, ldy, b, pf, pf_len); break;
#endif
    case 2: tile_n<2>(nt, x, ldx, w, K, y, ldy, b, pf, pf_len); break;
    default: tile_n<1>(nt, x, ldx, w, K, y, ldy, b, pf, pf_len); break;
  }
}

// x: [M,K] contiguous, w: [N,K] contiguous, b: [N] or NULL, y: [M,N] contiguous.
extern "C" void SD_NAME(const float* x, const float* w, const float* b, float* y, int64_t M, int64_t N,
                        int64_t K, int nthreads) {
  const int64_t nblocks = (N + NB - 1) / NB;
  for (int64_t mc = 0; mc < M; mc += MC) {
    const int64_t mend = M - mc < MC ? M : mc + MC;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t blk = 0; blk < nblocks; ++blk) {
      const int64_t n0 = blk * NB;
      const int nt = (int)(N - n0 < NB ? N - n0 : NB);
      const int64_t tiles = (mend - mc + MB - 1) / MB, per = (mend - mc + tiles - 1) / tiles;  // balanced
      for (int64_t m0 = mc; m0 < mend; m0 += per) {
        const int mt = (int)(mend - m0 < per ? mend - m0 : per);
        // Software prefetch of the next weight block keeps memory busy while the tiles compute; for M = 1
        // the hardware prefetcher alone is faster.
        const int64_t share = NB * K / tiles;
        const float* pf = M > 1 ? w + (n0 + NB) * K + (m0 - mc) / per * share : nullptr;
        tile_mn(mt, nt, x + m0 * K, K, w + n0 * K, K, y + m0 * N + n0, N, b ? b + n0 : nullptr, pf, share);
      }
    }
  }
}

// Attention for M query rows of one sequence, order-invariant: each (head, row) is computed alone, with every sum
// taken over the visible keys in key order (one scalar chain for the softmax denominator, one vector chain per
// head-dim chunk for the output). Masked keys are skipped, which is exactly adding zero, so the result for a row
// depends only on its visible keys' values and order: not on M, on the other rows, or on masked keys in between.
// q[h, m, :] at q + h*q_sh + m*q_sm; k/v[g, t, :] at k + g*k_sh + t*k_st (g = h / (H / Hkv));
// mask[m, t] additive (<= -1e30: masked) at mask + m*mask_sm, or NULL for causal (row m sees t <= T - M + m);
// out[m, h, :] contiguous [M, H, D]; scratch: nthreads * T floats.
extern "C" void SD_ATTN(const float* q, int64_t q_sh, int64_t q_sm, const float* k, int64_t k_sh, int64_t k_st,
                        const float* v, int64_t v_sh, int64_t v_st, const float* mask, int64_t mask_sm, float* out,
                        int64_t H, int64_t Hkv, int64_t M, int64_t T, int64_t D, float scale, float* scratch,
                        int nthreads) {
  const int64_t group = H / Hkv, chunks = (D + VW - 1) / VW;
#pragma omp parallel for num_threads(nthreads) schedule(static) collapse(2)
  for (int64_t h = 0; h < H; ++h)
    for (int64_t m = 0; m < M; ++m) {
      float* s = scratch + (int64_t)omp_get_thread_num() * T;
      const float* qr = q + h * q_sh + m * q_sm;
      const float* kh = k + (h / group) * k_sh;
      const float* vh = v + (h / group) * v_sh;
      const float* mr = mask ? mask + m * mask_sm : nullptr;
      const int64_t tend = mask ? T : T - M + m + 1;
      float mx = -INFINITY;
      for (int64_t t = 0; t < tend; ++t) {
        if (mr && mr[t] <= -1e30f) {
          s[t] = -INFINITY;
          continue;
        }
        vf acc = vzero();
        for (int64_t c = 0; c < chunks; ++c) {
          const int n = (int)(D - c * VW < VW ? D - c * VW : VW);
          acc = n == VW ? vfma(vload(qr + c * VW), vload(kh + t * k_st + c * VW), acc)
                        : vfma(vload_tail(qr + c * VW, n), vload_tail(kh + t * k_st + c * VW, n), acc);
        }
        s[t] = vsum(acc) * scale + (mr ? mr[t] : 0.0f);
        mx = s[t] > mx ? s[t] : mx;
      }
      float denom = 0.0f;
      vf o[32];  // D <= 32 * VW
      for (int64_t c = 0; c < chunks; ++c) o[c] = vzero();
      for (int64_t t = 0; t < tend; ++t) {
        if (s[t] == -INFINITY) continue;
        const float p = expf(s[t] - mx);
        denom += p;
        const vf pv = vset1(p);
        for (int64_t c = 0; c < chunks; ++c) {
          const int n = (int)(D - c * VW < VW ? D - c * VW : VW);
          o[c] = vfma(pv, n == VW ? vload(vh + t * v_st + c * VW) : vload_tail(vh + t * v_st + c * VW, n), o[c]);
        }
      }
      float* orow = out + (m * H + h) * D;
      float tmp[VW];
      for (int64_t c = 0; c < chunks; ++c) {
        vstore(tmp, o[c]);
        for (int64_t i = c * VW; i < D && i < (c + 1) * VW; ++i) orow[i] = tmp[i - c * VW] / denom;
      }
    }
}
