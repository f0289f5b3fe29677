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

#include <algorithm>
#include <vector>

#include "split.h"

#define MC 64  // rows per pass over the weights: keeps the x panel in L2 for long inputs

#if defined(SD_AVX512)
typedef __m512 vf;
#define VW 16
#define MB 6
#define NB 4
#define RT 6  // transposed kernel register tile: RT rows x VT vectors
#define VT 4
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
static inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
// Lane j = the lane sum of a[j], for VW vectors at once, in one fixed order (a transposing tree: 128-bit lanes
// (0 + 2) + (1 + 3), then within a lane (0 + 2) + (1 + 3)): ~3 instructions per vector instead of vsum's 8.
static inline vf vsums(const vf* a) {
  vf r[8], w[4], z[2];
  for (int p = 0; p < 8; ++p)  // 128-bit lanes 0-1: vector 2p, 2-3: vector 2p+1
    r[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int q = 0; q < 4; ++q)  // 128-bit lane L: vector 4q + L
    w[q] = _mm512_add_ps(_mm512_shuffle_f32x4(r[2 * q], r[2 * q + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(r[2 * q], r[2 * q + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int q = 0; q < 2; ++q)  // lane L, floats 0-1: vector 8q + L, floats 2-3: vector 8q + 4 + L
    z[q] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * q], w[2 * q + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(w[2 * q], w[2 * q + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const vf v = _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_ps(z[0], z[1], _MM_SHUFFLE(3, 1, 3, 1)));  // float 4L + f: vector 4f + L
  const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(idx, v);
}
static inline vf vgather(const float* base, const int32_t* idx) {  // base[idx[j]] in lane j
  return _mm512_i32gather_ps(_mm512_loadu_si512((const void*)idx), base, 4);
}
static inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vround(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf vpow2_mul(vf y, vf n) { return _mm512_scalef_ps(y, n); }  // y * 2^n
static inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline vf vabs(vf a) { return _mm512_abs_ps(a); }
static inline vf vsel_ge0(vf x, vf a, vf b) {  // lanes with x >= 0 take a, the others b
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OQ), b, a);
}
static inline void vstore_tail(float* p, vf a, int n) { _mm512_mask_storeu_ps(p, (__mmask16)((1u << n) - 1), a); }
static inline vf vload_h(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
static inline bool vall_gt(const float* p, float x) {  // p[0..VW) > x in every lane (NaN: false)
  return _mm512_cmp_ps_mask(_mm512_loadu_ps(p), _mm512_set1_ps(x), _CMP_GT_OQ) == 0xFFFF;
}
static inline int vcount_gt(const float* p, float x) {  // lanes of p[0..VW) above x (NaN: not)
  return __builtin_popcount(_mm512_cmp_ps_mask(_mm512_loadu_ps(p), _mm512_set1_ps(x), _CMP_GT_OQ));
}
static inline void viota(int32_t* p, int32_t t) {  // p[j] = t + j, j < VW
  _mm512_storeu_si512((void*)p, _mm512_add_epi32(_mm512_set1_epi32(t), _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8,
                                                                                           9, 10, 11, 12, 13, 14, 15)));
}
#define SD_ISA avx512
#else
typedef __m256 vf;
#define VW 8
#define MB 2
#define NB 4
#define RT 4
#define VT 2
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
static inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
// Lane j = the lane sum of a[j], for VW vectors at once, in one fixed order (a transposing tree: halves
// lo + hi, then within a half (0 + 2) + (1 + 3)).
static inline vf vsums(const vf* a) {
  vf r[4], z[2];
  for (int p = 0; p < 4; ++p)  // low half: vector 2p, high half: vector 2p+1
    r[p] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * p], a[2 * p + 1], 0x20),
                         _mm256_permute2f128_ps(a[2 * p], a[2 * p + 1], 0x31));
  for (int q = 0; q < 2; ++q)  // half L, floats 0-1: vector 4q + L, floats 2-3: vector 4q + 2 + L
    z[q] = _mm256_add_ps(_mm256_shuffle_ps(r[2 * q], r[2 * q + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm256_shuffle_ps(r[2 * q], r[2 * q + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const vf v = _mm256_add_ps(_mm256_shuffle_ps(z[0], z[1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm256_shuffle_ps(z[0], z[1], _MM_SHUFFLE(3, 1, 3, 1)));  // float 4L + f: vector 2f + L
  return _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
static inline vf vgather(const float* base, const int32_t* idx) {  // base[idx[j]] in lane j
  return _mm256_i32gather_ps(base, _mm256_loadu_si256((const __m256i*)idx), 4);
}
static inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vround(vf a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf vpow2_mul(vf y, vf n) {  // y * 2^n for integral n in [-126, 127]
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
static inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
static inline vf vabs(vf a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a); }
static inline vf vsel_ge0(vf x, vf a, vf b) {  // lanes with x >= 0 take a, the others b
  return _mm256_blendv_ps(b, a, _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ));
}
static inline void vstore_tail(float* p, vf a, int n) {
  float t[VW];
  _mm256_storeu_ps(t, a);
  for (int i = 0; i < n; ++i) p[i] = t[i];
}
static inline vf vload_h(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
static inline bool vall_gt(const float* p, float x) {
  return _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(p), _mm256_set1_ps(x), _CMP_GT_OQ)) == 0xFF;
}
static inline int vcount_gt(const float* p, float x) {
  return __builtin_popcount(_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(p), _mm256_set1_ps(x), _CMP_GT_OQ)));
}
static inline void viota(int32_t* p, int32_t t) {
  _mm256_storeu_si256((__m256i*)p, _mm256_add_epi32(_mm256_set1_epi32(t), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}
#define SD_ISA avx2
#endif
#define SD_PASTE(a, b) a##_##b
#define SD_EXPORT(a, b) SD_PASTE(a, b)  // sd_linear + avx512 -> sd_linear_avx512
#define SD_NAME SD_EXPORT(sd_linear, SD_ISA)
#define SD_NAME_T SD_EXPORT(sd_linear_t, SD_ISA)
#define SD_ATTN SD_EXPORT(sd_attention, SD_ISA)

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

// The same product with the weight stored transposed, wt: [K,N] contiguous (N a multiple of VW), and optionally
// sparse in its input: only the k where some row has |x[m,k]| > thr are read, other inputs count as zero
// (thr <= 0: dense). Reading only the selected rows of wt is what makes an activation-sparse draft cheap.
// Batch-invariant as above: y[m,n] is the chain of fmas over the selected k in increasing order, starting from
// zero, in lane n % VW of one vector; M, the blocking and the thread split do not change it (an fma with a
// zeroed input adds exactly zero). Blocking: rows in MT_T chunks, columns in slices whose accumulators fit in
// L1 (one row: the thread's whole column range, so each weight row is one contiguous read), k in groups of 4
// (four weight vectors reused across the row chunk).
// Register tile of the transposed kernel for many rows: R rows x V vectors of columns, accumulated over the
// selected k in order from zero (the same fma chain per lane as the one-row path), then stored (+ bias).
template <int R, int V>
static inline void tile_t(const float* __restrict__ x, int64_t K, const float* __restrict__ wt, int64_t N,
                          const int32_t* __restrict__ idx, int64_t nk, float* __restrict__ y,
                          const float* __restrict__ b) {
  vf acc[R][V];
  for (int i = 0; i < R; ++i)
    for (int v = 0; v < V; ++v) acc[i][v] = vzero();
  for (int64_t j = 0; j < nk; ++j) {
    const int64_t k = idx[j];
    if (j + 8 < nk)
      for (int v = 0; v < V; ++v) _mm_prefetch((const char*)(wt + idx[j + 8] * N + v * VW), _MM_HINT_T0);
    vf w[V];
    for (int v = 0; v < V; ++v) w[v] = vload(wt + k * N + v * VW);
    for (int i = 0; i < R; ++i) {
      const vf xb = vset1(x[i * K + k]);
      for (int v = 0; v < V; ++v) acc[i][v] = vfma(xb, w[v], acc[i][v]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int v = 0; v < V; ++v) vstore(y + i * N + v * VW, b ? vadd(acc[i][v], vload(b + v * VW)) : acc[i][v]);
}

template <int R>
static void tile_t_v(int nv, const float* x, int64_t K, const float* wt, int64_t N, const int32_t* idx, int64_t nk,
                     float* y, const float* b) {
  switch (nv) {
#if VT >= 4
    case 4: tile_t<R, 4>(x, K, wt, N, idx, nk, y, b); break;
    case 3: tile_t<R, 3>(x, K, wt, N, idx, nk, y, b); break;
#endif
    case 2: tile_t<R, 2>(x, K, wt, N, idx, nk, y, b); break;
    default: tile_t<R, 1>(x, K, wt, N, idx, nk, y, b); break;
  }
}

static void tile_t_rv(int nr, int nv, const float* x, int64_t K, const float* wt, int64_t N, const int32_t* idx,
                      int64_t nk, float* y, const float* b) {
  switch (nr) {
#if RT >= 6
    case 6: tile_t_v<6>(nv, x, K, wt, N, idx, nk, y, b); break;
    case 5: tile_t_v<5>(nv, x, K, wt, N, idx, nk, y, b); break;
#endif
    case 4: tile_t_v<4>(nv, x, K, wt, N, idx, nk, y, b); break;
    case 3: tile_t_v<3>(nv, x, K, wt, N, idx, nk, y, b); break;
    case 2: tile_t_v<2>(nv, x, K, wt, N, idx, nk, y, b); break;
    default: tile_t_v<1>(nv, x, K, wt, N, idx, nk, y, b); break;
  }
}

#define MT_T 16
#define RT_MIN 24  // rows from which the register-tile path is used (below: the L1-accumulator path is faster)
#define G_T 8  // k per group
#define ACC_T 6144  // accumulator floats per thread (24 KB, in L1): column slice = ACC_T / rows

// Selected k (any row with |x[m,k]| > thr) into idx, the input with the rest zeroed into xs; returns their count.
static int64_t select_inputs(const float* __restrict__ x, int64_t M, int64_t K, float thr, float* __restrict__ xs,
                             int32_t* __restrict__ idx) {
  int64_t nk = 0;
  for (int64_t k = 0; k < K; ++k) {
    bool any = false;
    for (int64_t m = 0; m < M; ++m) {
      const float v = x[m * K + k];
      const bool on = fabsf(v) > thr;
      xs[m * K + k] = on ? v : 0.0f;
      any |= on;
    }
    if (any) idx[nk++] = (int32_t)k;
  }
  return nk;
}

// L1-accumulator path: y[m0..m0+mt, s0..s1) = the selected k's fmas in order (G_T weight rows per pass, the next
// group's rows prefetched since sparse selections jump), then + bias. One row keeps its inputs in registers.
static void slice_t(const float* __restrict__ xin, int64_t K, const float* __restrict__ wt, int64_t N,
                    const int32_t* __restrict__ idx, int64_t nk, float* __restrict__ y, const float* __restrict__ b,
                    int64_t m0, int64_t mt, int64_t s0, int64_t s1) {
  for (int64_t m = m0; m < m0 + mt; ++m)
    for (int64_t n = s0; n < s1; n += VW) vstore(y + m * N + n, vzero());
  int64_t j = 0;
  for (; j + G_T <= nk; j += G_T) {
    const float* w[G_T];
    const float* p[G_T];
    const int64_t jn = j + 2 * G_T <= nk ? j + G_T : j;
    for (int g = 0; g < G_T; ++g) w[g] = wt + idx[j + g] * N, p[g] = wt + idx[jn + g] * N;
    if (mt == 1) {
      vf xb[G_T];
      for (int g = 0; g < G_T; ++g) xb[g] = vset1(xin[m0 * K + idx[j + g]]);
      for (int64_t n = s0; n < s1; n += VW) {
        vf acc = vload(y + m0 * N + n);
        for (int g = 0; g < G_T; ++g) {
          _mm_prefetch((const char*)(p[g] + n), _MM_HINT_T0);
          acc = vfma(xb[g], vload(w[g] + n), acc);
        }
        vstore(y + m0 * N + n, acc);
      }
      continue;
    }
    for (int64_t n = s0; n < s1; n += VW) {
      vf a[G_T];
      for (int g = 0; g < G_T; ++g) {
        _mm_prefetch((const char*)(p[g] + n), _MM_HINT_T0);
        a[g] = vload(w[g] + n);
      }
      for (int64_t m = m0; m < m0 + mt; ++m) {
        vf acc = vload(y + m * N + n);
        for (int g = 0; g < G_T; ++g) acc = vfma(vset1(xin[m * K + idx[j + g]]), a[g], acc);
        vstore(y + m * N + n, acc);
      }
    }
  }
  for (; j < nk; ++j)
    for (int64_t n = s0; n < s1; n += VW) {
      const vf a0 = vload(wt + idx[j] * N + n);
      for (int64_t m = m0; m < m0 + mt; ++m)
        vstore(y + m * N + n, vfma(vset1(xin[m * K + idx[j]]), a0, vload(y + m * N + n)));
    }
  if (b)
    for (int64_t m = m0; m < m0 + mt; ++m)
      for (int64_t n = s0; n < s1; n += VW) vstore(y + m * N + n, vadd(vload(y + m * N + n), vload(b + n)));
}

extern "C" void SD_NAME_T(const float* __restrict__ x, const float* __restrict__ wt, const float* __restrict__ b,
                          float* __restrict__ y, int64_t M, int64_t N, int64_t K, float thr, float* __restrict__ xs,
                          int32_t* __restrict__ idx, int nthreads) {
  int64_t nk = K;
  if (thr > 0)
    nk = select_inputs(x, M, K, thr, xs, idx);
  else
    for (int64_t k = 0; k < K; ++k) idx[k] = (int32_t)k;
  const float* __restrict__ xin = thr > 0 ? xs : x;
  const int64_t chunks = N / VW;
#pragma omp parallel num_threads(nthreads)
  {
    const int t = omp_get_thread_num(), T = omp_get_num_threads();
    const int64_t n0 = chunks * t / T * VW, n1 = chunks * (t + 1) / T * VW;  // this thread's columns
    if (M >= RT_MIN) {  // many rows: register tiles, RT rows at a time over VT-vector column blocks
      const int64_t tiles = (M + RT - 1) / RT, per = (M + tiles - 1) / tiles;  // balanced row tiles
      for (int64_t n = n0; n < n1; n += VT * VW) {
        const int nv = (int)((n1 - n) / VW < VT ? (n1 - n) / VW : VT);
        for (int64_t r = 0; r < M; r += per) {
          const int nr = (int)(M - r < per ? M - r : per);
          tile_t_rv(nr, nv, xin + r * K, K, wt + n, N, idx, nk, y + r * N + n, b ? b + n : nullptr);
        }
      }
    } else {
      for (int64_t m0 = 0; m0 < M; m0 += MT_T) {
        const int64_t mt = M - m0 < MT_T ? M - m0 : MT_T, nc = (ACC_T / mt) / VW * VW;
        for (int64_t s0 = n0; s0 < n1; s0 += nc)
          slice_t(xin, K, wt, N, idx, nk, y, b, m0, mt, s0, s0 + nc < n1 ? s0 + nc : n1);
      }
    }
  }
}

// exp(x) for x <= 0 lane by lane (Cephes expf: range reduction by ln 2, degree-6 polynomial; ~1 ulp). x < -87.3
// gives ~1e-38 instead of a denormal. Each lane's result depends only on that lane's input.
static inline vf vexp(vf x) {
  x = vmax(x, vset1(-87.3f));
  const vf n = vround(vmul(x, vset1(1.44269504088896341f)));
  vf r = vfma(n, vset1(-0.693359375f), x);
  r = vfma(n, vset1(2.12194440e-4f), r);
  vf y = vset1(1.9875691500e-4f);
  y = vfma(y, r, vset1(1.3981999507e-3f));
  y = vfma(y, r, vset1(8.3334519073e-3f));
  y = vfma(y, r, vset1(4.1665795894e-2f));
  y = vfma(y, r, vset1(1.6666665459e-1f));
  y = vfma(y, r, vset1(5.0000001201e-1f));
  y = vfma(y, vmul(r, r), vadd(r, vset1(1.0f)));
  return vpow2_mul(y, n);
}

// sigmoid(z) lane by lane: with e = exp(-|z|) (vexp), 1 / (1 + e) for z >= 0 and e / (1 + e) below, so exp never
// overflows. Both ISA builds run the same float operations per lane.
static inline vf vsigmoid(vf z) {
  const vf one = vset1(1.0f), e = vexp(vmul(vabs(z), vset1(-1.0f)));
  return vdiv(vsel_ge0(z, one, e), vadd(one, e));
}

// cap * tanh(s / cap) lane by lane (Gemma 2's soft-capped attention scores), tanh(y) = 2 sigmoid(2y) - 1.
static inline vf vsoftcap(vf s, float cap) {
  const vf y2 = vmul(s, vset1(2.0f / cap));
  return vmul(vfma(vset1(2.0f), vsigmoid(y2), vset1(-1.0f)), vset1(cap));
}

// Keys ahead that a decoding row's attention prefetches its keys and values: a cache is read once per token from
// memory (the weights streamed since evicted it), and the hardware prefetcher alone kept too few bytes in flight.
// Greedy decoding after 500-2000-token prompts, alternated in one process: SmolLM2 1.18x (AVX2 build 1.09x),
// Qwen2.5-0.5B 1.06x. Only rows of short forwards (decoding, trees: at most ATTN_PREFETCH_ROWS rows of a
// sequence) and the first head group of a key/value head (the others find its keys cached); a prefill's rows
// share their keys in cache already.
#define ATTN_PREFETCH_KEYS 64
#define ATTN_PREFETCH_ROWS 16
template <typename KV> static inline void pf_row(const KV* p, int64_t D) {  // one key's or value's cache lines
  for (int64_t b = 0; b < D * (int64_t)sizeof(KV); b += 64) _mm_prefetch((const char*)p + b, _MM_HINT_T0);
}
#define ITEM_OVERHEAD 32  // keys' worth of fixed work per attention item (query loads, softmax, stores)
#define HB 4  // query heads (sharing one key/value head) computed together: key and value loads are shared
#define SCORE_LANES 16            // lanes of an attention score's dot product, on every build
#define SPLIT (SCORE_LANES / VW)  // vectors per score accumulator: 1 (AVX-512), 2 (AVX2)

// The SPLIT accumulators of one score, as one vector of VW lanes: lane j + lane j + 8 (the 16-lane tree's first
// level) on AVX2, the accumulator itself on AVX-512.
static inline vf score_lanes(const vf* part) { return SPLIT == 1 ? part[0] : vadd(part[0], part[SPLIT - 1]); }

// Attention for HN <= HB heads sharing k/v and one query row, over its nv visible keys vis[0..nv) in key order.
// s, p: scratch [HB][T]. Per head: score s_t = fma(lane-sum(q . k_t over head-dim chunks in order), scale, mask_t),
// the lane sums taken VW visible keys at a time (vsums, when D is whole chunks: CH > 0) and then one by one.
// The dot product runs in 16 lanes on every build (lane j: elements j, j + 16, ... in order): the AVX2 build
// keeps SPLIT = 2 accumulators, for its even and odd 8-wide chunks, and adds them before its 8-lane tree, which
// is the first level of the 16-lane tree. So scores, and with them whole quantized models, are the same bits on
// AVX2 and AVX-512 machines (everything after the scores is lane-wise or a scalar chain);
// p_t = exp(s_t - max); denom and output are sums over the visible keys in key order (one scalar chain for
// the denominator, one vector chain per head-dim chunk). Nothing depends on other heads, rows or masked keys.
template <int CH>  // chunk c of a head-dim vector: whole when D = CH * VW (CH > 0), else with a masked tail
static inline vf chunk(const float* p, int64_t c, int64_t D) {
  if constexpr (CH > 0) return vload(p + c * VW);
  const int n = (int)(D - c * VW < VW ? D - c * VW : VW);
  return n == VW ? vload(p + c * VW) : n > 0 ? vload_tail(p + c * VW, n) : vzero();
}

// Keys/values stored as fp16 (IEEE half bits): each value widened to fp32 exactly, then as above.
template <int CH>
static inline vf chunk(const uint16_t* p, int64_t c, int64_t D) {
  const int n = CH > 0 ? VW : (int)(D - c * VW < VW ? D - c * VW : VW);
  if (n == VW) return vload_h(p + c * VW);
  uint16_t t[VW] = {0};
  for (int i = 0; i < n; ++i) t[i] = p[c * VW + i];
  return vload_h(t);
}

// CH > 0: compiled for D = CH * VW (loops unrolled, accumulators in registers); CH = 0: any D, one key at a time.
// KV: float, or uint16_t for fp16 keys/values.
template <int HN, int CH, typename KV>
static void attend_row(const float* const* qr, const KV* kh, int64_t k_st, const KV* vh, int64_t v_st,
                       const float* mr, const int32_t* vis, int64_t nv, int64_t T, int64_t D, float scale, float* s,
                       float* const* orow, int pf, float cap) {  // pf: keys ahead to prefetch (0: none)
  const int64_t chunks = CH > 0 ? CH : (D + VW - 1) / VW;
  static_assert(CH % SPLIT == 0, "whole head-dim chunks fill whole 16-lane score accumulators");
  const int64_t dot_chunks = CH > 0 ? CH : (D + SCORE_LANES - 1) / SCORE_LANES * SPLIT;  // past D: zero lanes
  float mx[HN];
  vf mxv[HN];
  for (int h = 0; h < HN; ++h) mx[h] = -INFINITY, mxv[h] = vset1(-INFINITY);
  int64_t i = 0;
  const bool prefix = nv == 0 || vis[nv - 1] == nv - 1;  // visible keys 0..nv-1 (causal): the mask loads in a row
  for (; CH > 0 && i + VW <= nv; i += VW) {  // VW keys at a time (whole chunks only): one transposing reduction
    if (pf)
      for (int j = 0; j < VW && i + pf + j < nv; ++j) pf_row(kh + vis[i + pf + j] * k_st, D);
    const vf mv = !mr ? vzero() : prefix ? vload(mr + i) : vgather(mr, vis + i);  // per head instead of VW
    for (int h = 0; h < HN; ++h) {
      vf acc[VW];
#pragma GCC unroll 16
      for (int j = 0; j < VW; ++j) {
        const KV* kt = kh + vis[i + j] * k_st;
        vf part[SPLIT];
        for (int p = 0; p < SPLIT; ++p) part[p] = vzero();
#pragma GCC unroll 8
        for (int64_t c = 0; c < dot_chunks; ++c)
          part[c % SPLIT] = vfma(chunk<CH>(qr[h], c, D), chunk<CH>(kt, c, D), part[c % SPLIT]);
        acc[j] = score_lanes(part);
      }
      const vf sc = vfma(vsums(acc), vset1(scale), mv);
      vstore(s + h * T + i, sc);
      mxv[h] = vmax(mxv[h], sc);
    }
  }
  for (int h = 0; h < HN; ++h) {  // max is exact: the lanes' order does not matter
    float lanes[VW];
    vstore(lanes, mxv[h]);
    for (int j = 0; j < VW; ++j) mx[h] = lanes[j] > mx[h] ? lanes[j] : mx[h];
  }
  for (; i < nv; ++i) {  // the rest one key at a time
    const int64_t t = vis[i];
    vf part[HN][SPLIT];
    for (int h = 0; h < HN; ++h)
      for (int p = 0; p < SPLIT; ++p) part[h][p] = vzero();
#pragma GCC unroll 8
    for (int64_t c = 0; c < dot_chunks; ++c) {
      const vf kv = chunk<CH>(kh + t * k_st, c, D);
      for (int h = 0; h < HN; ++h) part[h][c % SPLIT] = vfma(chunk<CH>(qr[h], c, D), kv, part[h][c % SPLIT]);
    }
    for (int h = 0; h < HN; ++h) {
      const float sc = fmaf(vsum(score_lanes(part[h])), scale, mr ? mr[t] : 0.0f);  // as above: one rounding
      s[h * T + i] = sc;
      mx[h] = sc > mx[h] ? sc : mx[h];
    }
  }
  if (cap > 0.0f)  // soft-capped scores (visible keys' masks are 0): capped in place, lane-wise, then their max
    for (int h = 0; h < HN; ++h) {
      float* sh = s + h * T;
      for (int64_t i = 0; i < nv; i += VW) {
        const int w = nv - i < VW ? (int)(nv - i) : VW;
        vstore_tail(sh + i, vsoftcap(vload_tail(sh + i, w), cap), w);
      }
      mx[h] = -INFINITY;
      for (int64_t j = 0; j < nv; ++j) mx[h] = sh[j] > mx[h] ? sh[j] : mx[h];
    }
  for (int h = 0; h < HN; ++h) {  // p = exp(s - max) in place, VW keys at a time (lane-wise: no cross-key effect)
    float* sh = s + h * T;
    int64_t i = 0;
    for (; i + VW <= nv; i += VW) vstore(sh + i, vexp(vadd(vload(sh + i), vset1(-mx[h]))));
    if (i < nv) {
      float tmp[VW];
      vstore(tmp, vexp(vadd(vload_tail(sh + i, (int)(nv - i)), vset1(-mx[h]))));
      for (int64_t j = i; j < nv; ++j) sh[j] = tmp[j - i];
    }
  }
  // Per head one scalar chain over the keys in order, in a loop of its own: inside the loop below GCC packed
  // the chains and moved them through a general register every key (~9 cycles a key, the loop's bound).
  float denom[HN];
  for (int h = 0; h < HN; ++h) denom[h] = 0.0f;
  for (int64_t i = 0; i < nv; ++i)
    for (int h = 0; h < HN; ++h) denom[h] += s[h * T + i];
  for (int64_t c0 = 0; c0 < chunks; c0 += 4) {  // 4 head-dim chunks at a time: HN * 4 accumulators
    const int64_t cn = chunks - c0 < 4 ? chunks - c0 : 4;
    vf o[HN][4];
    for (int h = 0; h < HN; ++h)
      for (int c = 0; c < 4; ++c) o[h][c] = vzero();
    for (int64_t i = 0; i < nv; ++i) {
      const KV* vt = vh + vis[i] * v_st;
      if (pf && c0 == 0 && i + pf < nv) pf_row(vh + vis[i + pf] * v_st, D);
      vf p[HN];
      for (int h = 0; h < HN; ++h) p[h] = vset1(s[h * T + i]);
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        if (c >= cn) break;
        const vf vv = chunk<CH>(vt, c0 + c, D);
        for (int h = 0; h < HN; ++h) o[h][c] = vfma(p[h], vv, o[h][c]);
      }
    }
    for (int h = 0; h < HN; ++h)
      for (int64_t c = 0; c < cn; ++c) {
        float tmp[VW];
        vstore(tmp, o[h][c]);
        const int64_t d0 = (c0 + c) * VW;
        for (int64_t d = d0; d < D && d < d0 + VW; ++d) orow[h][d] = tmp[d - d0] / denom[h];
      }
  }
}

template <int CH, typename KV>
static inline void attend_heads(int64_t hn, const float* const* qr, const KV* kh, int64_t k_st, const KV* vh,
                                int64_t v_st, const float* mr, const int32_t* vis, int64_t nv, int64_t T, int64_t D,
                                float scale, float* s, float* const* orow, int pf, float cap) {
  switch (hn) {
    case 4: attend_row<4, CH, KV>(qr, kh, k_st, vh, v_st, mr, vis, nv, T, D, scale, s, orow, pf, cap); break;
    case 3: attend_row<3, CH, KV>(qr, kh, k_st, vh, v_st, mr, vis, nv, T, D, scale, s, orow, pf, cap); break;
    case 2: attend_row<2, CH, KV>(qr, kh, k_st, vh, v_st, mr, vis, nv, T, D, scale, s, orow, pf, cap); break;
    default: attend_row<1, CH, KV>(qr, kh, k_st, vh, v_st, mr, vis, nv, T, D, scale, s, orow, pf, cap); break;
  }
}

// The keys t < tend that row mask mr leaves visible (mr[t] > -1e30; all when mr is null) -> vis, in order; their
// count. VW at a time where all are (most of a causal row): a key at a time took ~6% of a long prefill.
static inline int64_t visible_keys(const float* mr, int64_t tend, int32_t* vis) {
  int64_t nv = 0, t = 0;
  for (; t + VW <= tend; t += VW)
    if (!mr || vall_gt(mr + t, -1e30f)) {
      viota(vis + nv, (int32_t)t);
      nv += VW;
    } else {
      for (int64_t j = t; j < t + VW; ++j)
        if (mr[j] > -1e30f) vis[nv++] = (int32_t)j;
    }
  for (; t < tend; ++t)
    if (!mr || mr[t] > -1e30f) vis[nv++] = (int32_t)t;
  return nv;
}

// One attention work item: query row m of heads h0.. (up to HB sharing key/value head g) against its visible keys.
template <typename KV>
static inline void attend_item(const float* q, int64_t q_sh, int64_t q_sm, const KV* k, int64_t k_sh, int64_t k_st,
                               const KV* v, int64_t v_sh, int64_t v_st, const float* mask, int64_t mask_sm,
                               float* out, int64_t H, int64_t Hkv, int64_t M, int64_t T, int64_t D, float scale,
                               float* s, int64_t g, int64_t sb, int64_t m, float cap) {
  const int64_t group = H / Hkv;
  int32_t* vis = (int32_t*)(s + HB * T);
  const float* mr = mask ? mask + m * mask_sm : nullptr;
  const int64_t nv = visible_keys(mr, mask ? T : T - M + m + 1, vis);
  const int64_t h0 = g * group + sb * HB, hn = group - sb * HB < HB ? group - sb * HB : HB;
  const float* qr[HB];
  float* orow[HB];
  for (int64_t h = 0; h < hn; ++h) {
    qr[h] = q + (h0 + h) * q_sh + m * q_sm;
    orow[h] = out + (m * H + h0 + h) * D;
  }
  const KV *kh = k + g * k_sh, *vh = v + g * v_sh;
  const int pf = M <= ATTN_PREFETCH_ROWS && sb == 0 ? ATTN_PREFETCH_KEYS : 0;
  if (D == 4 * VW) attend_heads<4>(hn, qr, kh, k_st, vh, v_st, mr, vis, nv, T, D, scale, s, orow, pf, cap);
  else if (D == 8 * VW) attend_heads<8>(hn, qr, kh, k_st, vh, v_st, mr, vis, nv, T, D, scale, s, orow, pf, cap);
  else if (D == 16 * VW) attend_heads<16>(hn, qr, kh, k_st, vh, v_st, mr, vis, nv, T, D, scale, s, orow, pf, cap);
  else attend_heads<0>(hn, qr, kh, k_st, vh, v_st, mr, vis, nv, T, D, scale, s, orow, pf, cap);
}

// The keys row m of M (keys aligned at the end of T) sees: those its mask row mr leaves visible, else causally.
static inline int64_t row_keys(const float* mr, int64_t T, int64_t M, int64_t m) {
  if (!mr) return T - M + m + 1;
  int64_t n = 0, t = 0;
  for (; t + VW <= T; t += VW) n += vcount_gt(mr + t, -1e30f);
  for (; t < T; ++t) n += mr[t] > -1e30f;
  return n;
}

// The work items of a team, thread t first owning a contiguous run of about 1/nt of the total cost (cost[i]: the
// cost of the items before item i; an item's cost: the keys its row sees plus ITEM_OVERHEAD), then stealing
// (split.h). Rows see different numbers of keys (a causal prefill's first rows few, its last ones many;
// requests' caches differ in length), so equal counts of items are unequal work: counted as T keys each, a
// 1024-token prefill gave one of two threads 1.17x the other's work. Contiguous runs keep a sequence's rows,
// which read the same keys and values, on one core.
static inline WorkSplit share(const std::vector<int64_t>& cost, int nt) {
  const int64_t total = cost.back();
  return WorkSplit(nt, [&](int t) {  // t = nt: every item (each costs at least ITEM_OVERHEAD)
    return std::lower_bound(cost.begin(), cost.end() - 1, total * t / nt) - cost.begin();
  });
}

// Attention for M query rows of one sequence, order-invariant: each (head, row) output is a function of that
// row's query and its visible keys/values in key order only (see attend_row): not of M, the other rows, or
// masked keys in between (skipped). Heads sharing a key/value head are computed together.
// q[h, m, :] at q + h*q_sh + m*q_sm; k/v[g, t, :] at k + g*k_sh + t*k_st (g = h / (H / Hkv));
// mask[m, t] additive (<= -1e30: masked) at mask + m*mask_sm, or NULL for causal (row m sees t <= T - M + m);
// out[m, h, :] contiguous [M, H, D]; scratch: nthreads * (HB + 1) * T floats. softcap > 0: each visible key's
// score s becomes softcap * tanh(s / softcap) before the softmax (Gemma 2; visible keys' masks must be 0).
extern "C" void SD_ATTN(const float* q, int64_t q_sh, int64_t q_sm, const float* k, int64_t k_sh, int64_t k_st,
                        const float* v, int64_t v_sh, int64_t v_st, const float* mask, int64_t mask_sm, float* out,
                        int64_t H, int64_t Hkv, int64_t M, int64_t T, int64_t D, float scale, float* scratch,
                        int nthreads, float softcap) {
  const int64_t subs = (H / Hkv + HB - 1) / HB, items = Hkv * subs * M;  // item (g, sb, m), m fastest
  std::vector<int64_t> keys(M), cost(items + 1, 0);
  for (int64_t m = 0; m < M; ++m) keys[m] = row_keys(mask ? mask + m * mask_sm : nullptr, T, M, m);
  for (int64_t it = 0; it < items; ++it) cost[it + 1] = cost[it] + keys[it % M] + ITEM_OVERHEAD;
  WorkSplit split = share(cost, nthreads);
#pragma omp parallel num_threads(nthreads)
  {
    float* sc = scratch + (int64_t)omp_get_thread_num() * (HB + 1) * T;
    for (int64_t lo, hi; split.next(omp_get_thread_num(), &lo, &hi);)
      for (int64_t it = lo; it < hi; ++it)
        attend_item(q, q_sh, q_sm, k, k_sh, k_st, v, v_sh, v_st, mask, mask_sm, out, H, Hkv, M, T, D, scale, sc,
                    it / (subs * M), (it / M) % subs, it % M, softcap);
  }
}

// Attention of several sequences in one parallel pass (continuous batching). Queries q [R, H, D] and output
// out [R, H, D] hold the sequences' rows one after another: sequence i owns rows dims[5i+4] .. + M_i (M_i =
// dims[5i]), attends to its own keys/values ks[i]/vs[i] [Hkv, *, D] (head stride dims[5i+2], key stride D,
// T_i = dims[5i+1] keys; fp32, or fp16 bits when kv_half) under its additive mask masks[i] [M_i, T_i] (row
// stride dims[5i+3]). Every item is computed exactly as sd_attention computes it for that sequence alone (with
// fp16 keys/values: as it computes it on those values widened to fp32; softcap as sd_attention's).
extern "C" void SD_EXPORT(sd_attention_many, SD_ISA)(const float* q, const void* const* ks, const void* const* vs,
                                                   const float* const* masks, const int64_t* dims, float* out,
                                                   int64_t nseq, int64_t H, int64_t Hkv, int64_t D, float scale,
                                                   float* scratch, int64_t max_t, int nthreads, int kv_half,
                                                   float softcap) {
  const int64_t subs = (H / Hkv + HB - 1) / HB;
  std::vector<int64_t> first(nseq + 1, 0);  // first work item of each sequence
  for (int64_t i = 0; i < nseq; ++i) first[i + 1] = first[i] + Hkv * subs * dims[5 * i];
  std::vector<int64_t> cost(first[nseq] + 1, 0), keys;  // see `share`
  for (int64_t i = 0, it = 0; i < nseq; ++i) {
    const int64_t M = dims[5 * i], T = dims[5 * i + 1];
    keys.resize(M);
    for (int64_t m = 0; m < M; ++m) keys[m] = row_keys(masks[i] ? masks[i] + m * dims[5 * i + 3] : nullptr, T, M, m);
    for (; it < first[i + 1]; ++it) cost[it + 1] = cost[it] + keys[(it - first[i]) % M] + ITEM_OVERHEAD;
  }
  WorkSplit split = share(cost, nthreads);
#pragma omp parallel num_threads(nthreads)
  {
    float* sc = scratch + (int64_t)omp_get_thread_num() * (HB + 1) * max_t;
    for (int64_t lo, hi; split.next(omp_get_thread_num(), &lo, &hi);)
      for (int64_t it = lo, i = 0; it < hi; ++it) {
        while (it >= first[i + 1]) ++i;
        const int64_t* di = dims + 5 * i;
        const int64_t M = di[0], r = it - first[i], g = r / (subs * M), sb = (r / M) % subs, m = r % M;
        if (kv_half)
          attend_item(q + di[4] * H * D, D, H * D, (const uint16_t*)ks[i], di[2], D, (const uint16_t*)vs[i], di[2],
                      D, masks[i], di[3], out + di[4] * H * D, H, Hkv, M, di[1], D, scale, sc, g, sb, m, softcap);
        else
          attend_item(q + di[4] * H * D, D, H * D, (const float*)ks[i], di[2], D, (const float*)vs[i], di[2], D,
                      masks[i], di[3], out + di[4] * H * D, H, Hkv, M, di[1], D, scale, sc, g, sb, m, softcap);
      }
  }
}

// RMSNorm of M rows: y = w * (x * 1/sqrt(mean(x^2) + eps)). Row-local with a fixed summation order (8 partial
// sums, sum j taking the values i = j mod 8 in order, then combined pairwise), so a row's result never depends on
// M, the thread split or the ISA build. The 8 sums are the lanes of one 8-wide vector, and RMS_ROWS rows run
// their chains side by side (one row's chain is latency-bound: GCC had made it 8 scalar chains); 8 rows of
// Qwen2.5-0.5B took 0.21-0.3 ms of a 23 ms forward before.
#define RMS_ROWS 4
extern "C" void SD_EXPORT(sd_rmsnorm, SD_ISA)(const float* x, const float* w, float* y, int64_t M, int64_t H,
                                            float eps, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (M >= 16)
  for (int64_t m0 = 0; m0 < M; m0 += RMS_ROWS) {
    const int nr = (int)(M - m0 < RMS_ROWS ? M - m0 : RMS_ROWS);
    __m256 acc[RMS_ROWS];
    for (int r = 0; r < nr; ++r) acc[r] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= H; i += 8)
      for (int r = 0; r < nr; ++r) {
        const __m256 v = _mm256_loadu_ps(x + (m0 + r) * H + i);
        acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(v, v));  // separate rounding: no contraction (build flags)
      }
    for (int r = 0; r < nr; ++r) {
      const float* xr = x + (m0 + r) * H;
      float a[8];
      _mm256_storeu_ps(a, acc[r]);
      for (int64_t k = i; k < H; ++k) a[k % 8] += xr[k] * xr[k];
      const float sum = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
      const float rs = 1.0f / sqrtf(sum / (float)H + eps);
      float* yr = y + (m0 + r) * H;
      for (int64_t k = 0; k < H; ++k) yr[k] = w[k] * (xr[k] * rs);
    }
  }
}

// g <- act(g) * u over n values, lane by lane (each value depends on its own inputs only): SiLU's g * sigmoid(g),
// or GeLU's tanh approximation (Gemma's gelu_pytorch_tanh), 0.5 g (1 + tanh(y)) = g * sigmoid(2y) with
// y = sqrt(2/pi) (g + 0.044715 g^3).
// Values from which the team shares the work: ~4 us of one thread's work at 16k values, past the fork's cost; at
// 8 rows of Qwen2.5-0.5B (39k values) the serial pass took 0.36 ms of a 23 ms forward (24 layers).
#define GATED_PARALLEL_MIN (1 << 14)
#define GELU_CUBIC 0.044715f
#define GELU_TWO_SQRT_2_OVER_PI 1.5957691216057308f  // 2 sqrt(2 / pi): the sigmoid's argument is 2y
template <bool GELU>
static void gated_mul(float* g, const float* u, int64_t n, int nthreads) {
  const int64_t chunks = (n + VW - 1) / VW;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (n >= GATED_PARALLEL_MIN)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t i = c * VW;
    const int w = n - i < VW ? (int)(n - i) : VW;
    const vf x = vload_tail(g + i, w), y = vload_tail(u + i, w);
    const vf z = GELU ? vmul(vset1(GELU_TWO_SQRT_2_OVER_PI), vfma(vmul(vset1(GELU_CUBIC), vmul(x, x)), x, x)) : x;
    vstore_tail(g + i, vmul(vmul(x, vsigmoid(z)), y), w);
  }
}
extern "C" void SD_EXPORT(sd_silu_mul, SD_ISA)(float* g, const float* u, int64_t n, int nthreads) {
  gated_mul<false>(g, u, n, nthreads);
}
extern "C" void SD_EXPORT(sd_gelu_mul, SD_ISA)(float* g, const float* u, int64_t n, int nthreads) {
  gated_mul<true>(g, u, n, nthreads);
}

// Rotary embedding in place: x [q, heads, D] (rows contiguous), cos/sin [q, D]; per element the same three
// float operations as HF's x * cos + rotate_half(x) * sin, so results equal transformers' bit for bit.
extern "C" void SD_EXPORT(sd_rope, SD_ISA)(float* x, const float* cos_, const float* sin_, int64_t q, int64_t heads,
                                         int64_t D) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < q; ++i)
    for (int64_t h = 0; h < heads; ++h) {
      float* r = x + (i * heads + h) * D;
      const float *c = cos_ + i * D, *s = sin_ + i * D;
      for (int64_t j = 0; j < half; ++j) {
        const float a = r[j], b = r[j + half];
        r[j] = a * c[j] + (-b) * s[j];
        r[j + half] = b * c[j + half] + a * s[j + half];
      }
    }
}
