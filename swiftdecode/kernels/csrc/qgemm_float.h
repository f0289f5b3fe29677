// Products with 16-bit float weights (GGUF F16 and BF16 tensors), included by qgemm.cpp after its vector traits.
//
// Why in this library: a file's F16/BF16 matrices then run where its quantized ones do (the native layer loop,
// one call for q/k/v), at 2 bytes a value, instead of dequantized to float32 at twice the memory and bytes
// streamed per token.
//
// Layout: plane `d` holds tile t as [K, 16] 16-bit values (lane = output row), so one vector load is one input
// value's weights for 16 (AVX2: 8) output rows. Numerics: the input stays fp32 (no quantization); each output is
// CHAINS fma chains, chain c over k = c, c + CHAINS, ... in increasing order from zero, summed in a fixed order at
// the end, then + bias. Lane-wise only (the AVX2 build's two 8-lane halves run the same chains), so every build,
// and every row count, returns the same bits; 16-bit values widen to fp32 exactly.
#pragma once

#define CHAINS 2  // independent fma chains per output: two hide the fma latency at one row
#if W == 16
#define FLOAT_ROWS 8  // input rows per pass over a tile's weights (accumulators in registers)
#else
#define FLOAT_ROWS 3
#endif
#define FLOAT_PREFETCH 32  // input values ahead that a tile's weights are prefetched (1 KB)

template <bool BF>
static inline vf widen(const uint16_t* p) {  // W 16-bit values -> fp32, exactly
#if W == 16
  if (BF) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)),
                                                       16));
#else
  if (BF) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
#endif
  return h2f(p);
}

// Rows [m0, m0 + R) of y [M, N] for tile t: lanes below N - 16 t stored.
template <bool BF, int R>
static void float_rows(const QW& w, const float* x, const float* bias, float* y, int64_t t, int64_t m0) {
  const int64_t K = w.K, n0 = t * LANES;
  const uint16_t* p = w.d + t * K * LANES;
  vf acc[R][CHAINS][LANES / W];
  for (int r = 0; r < R; r++)
    for (int c = 0; c < CHAINS; c++)
      for (int h = 0; h < LANES / W; h++) acc[r][c][h] = fzero();
  for (int64_t k = 0; k < K; k += CHAINS) {
    _mm_prefetch((const char*)(p + (k + FLOAT_PREFETCH) * LANES), _MM_HINT_T0);  // 64 bytes: 2 values of the tile
    for (int c = 0; c < CHAINS; c++) {
      vf wv[LANES / W];
      for (int h = 0; h < LANES / W; h++) wv[h] = widen<BF>(p + (k + c) * LANES + h * W);
      for (int r = 0; r < R; r++) {
        const vf xb = fset(x[(m0 + r) * K + k + c]);
        for (int h = 0; h < LANES / W; h++) acc[r][c][h] = ffma(xb, wv[h], acc[r][c][h]);
      }
    }
  }
  const int live = (int)std::min<int64_t>(LANES, w.N - n0);
  for (int r = 0; r < R; r++)
    for (int h = 0; h < LANES / W && h * W < live; h++) {
      vf s = acc[r][0][h];
      for (int c = 1; c < CHAINS; c++) s = fadd(s, acc[r][c][h]);
      const int n = std::min(W, live - h * W);
      if (bias) s = fadd(s, fload(bias + n0 + h * W, n));
      fstore(y + (m0 + r) * w.N + n0 + h * W, s, n);
    }
}

template <bool BF>
static void float_tile_rows(const QW& w, const float* x, const float* bias, float* y, int64_t t, int64_t M) {
  int64_t m = 0;
  for (; m + FLOAT_ROWS <= M; m += FLOAT_ROWS) float_rows<BF, FLOAT_ROWS>(w, x, bias, y, t, m);
  switch (M - m) {  // the rest in one pass too
    case 1: return float_rows<BF, 1>(w, x, bias, y, t, m);
    case 2: return float_rows<BF, 2>(w, x, bias, y, t, m);
    case 3: return float_rows<BF, 3>(w, x, bias, y, t, m);
#if FLOAT_ROWS > 4
    case 4: return float_rows<BF, 4>(w, x, bias, y, t, m);
    case 5: return float_rows<BF, 5>(w, x, bias, y, t, m);
    case 6: return float_rows<BF, 6>(w, x, bias, y, t, m);
    case 7: return float_rows<BF, 7>(w, x, bias, y, t, m);
#endif
  }
}

// y [M, N] rows of tile t = x [M, K] (fp32) times the tile's 16 weight rows, + bias.
static void float_tile(bool bf, const QW& w, const float* x, const float* bias, float* y, int64_t t, int64_t M) {
  if (bf) return float_tile_rows<true>(w, x, bias, y, t, M);
  float_tile_rows<false>(w, x, bias, y, t, M);
}

// Row n of the weight -> out [K] fp32.
static void float_row(bool bf, const QWDesc* wd, int64_t n, float* out) {
  const uint16_t* p = wd->d + (n / LANES) * wd->K * LANES + n % LANES;
  for (int64_t k = 0; k < wd->K; k++) {
    const uint16_t v = p[k * LANES];
    if (bf) {
      const uint32_t bits = (uint32_t)v << 16;
      memcpy(out + k, &bits, 4);
    } else {
      out[k] = _cvtsh_ss(v);
    }
  }
}
