// The machine's peak rate of the integer multiply-accumulate instruction the quantized product is built on, for
// `doctor`'s roofline: how far a k-row forward is from what the instruction alone would allow.
//
// AVX-512 build: vpdpbusd zmm (64 u8 x s8 products summed into 16 int32 lanes); AVX-VNNI build: vpdpbusd ymm;
// AMX build: tdpbsud on full tiles (16 x 16 x 64 products). AVX2 build: vpmaddubsw ymm (32 u8 x s8 products
// summed in pairs to 16 int16 lanes; the kernel then adds those in int16 and widens once per chunk, instructions
// that run beside it on other ports). CHAINS independent accumulators keep the unit busy past the instruction's
// latency; each thread of the OpenMP team runs its own, so the result is the team's rate.
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#define CHAINS 12  // > latency (5 cycles) x issue rate (at most 2 a cycle) on the CPUs we meet

#if defined(SD_AMX)  // tdpbsud on full tiles (16 x 16 int32 sums of 64 s8 x u8 products), CHAINS result tiles
#include "tiles.h"
#undef CHAINS
#define CHAINS 4  // result tiles: two already keep one multiply unit busy past the instruction's latency
#define MACS_PER_OP (TILE_ROWS * TILE_ROWS * TILE_COLSB)
#define SD_ISA amx
#elif defined(SD_AVX512)
#define MACS_PER_OP 64
typedef __m512i vi;
static inline vi splat(int v) { return _mm512_set1_epi32(v); }
static inline vi step(vi acc, vi a, vi b) { return _mm512_dpbusd_epi32(acc, a, b); }
static inline int64_t fold(vi v) { return _mm512_reduce_add_epi32(v); }
#define SD_ISA avx512
#elif defined(SD_AVXVNNI)  // vpdpbusd ymm (32 products into 8 int32 lanes), VEX-encoded (EVEX without -mavxvnni)
#define MACS_PER_OP 32
typedef __m256i vi;
static inline vi splat(int v) { return _mm256_set1_epi32(v); }
#if defined(__AVXVNNI__)
static inline vi step(vi acc, vi a, vi b) { return _mm256_dpbusd_avx_epi32(acc, a, b); }
#else
static inline vi step(vi acc, vi a, vi b) { return _mm256_dpbusd_epi32(acc, a, b); }
#endif
static inline int64_t fold(vi v) { return _mm256_extract_epi32(v, 0) + _mm256_extract_epi32(v, 7); }
#define SD_ISA avxvnni
#else
#define MACS_PER_OP 32
typedef __m256i vi;
static inline vi splat(int v) { return _mm256_set1_epi32(v); }
static inline vi step(vi acc, vi a, vi b) { (void)a; return _mm256_maddubs_epi16(acc, b); }  // acc feeds the next
static inline int64_t fold(vi v) { return _mm256_extract_epi32(v, 0) + _mm256_extract_epi32(v, 7); }
#define SD_ISA avx2
#endif

#define SD_PASTE(a, b) a##_##b
#define SD_EXPORT(a, b) SD_PASTE(a, b)

// `reps` rounds of CHAINS dependent-chain steps per thread; the seed comes from the caller so nothing is constant.
#if defined(SD_AMX)
// -1 where this thread's tiles do not take the configuration.
static int64_t spin(int64_t reps, int seed) {
  TileConfig cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  for (int t = 0; t < CHAINS + 2; t++) cfg.rows[t] = TILE_ROWS, cfg.colsb[t] = TILE_COLSB;
  if (!tile_configure(cfg)) return -1;
  alignas(64) int32_t buf[TILE_ROWS * TILE_COLSB / 4];
  for (int i = 0; i < TILE_ROWS * TILE_COLSB / 4; i++) buf[i] = seed + i;
  tile_load<CHAINS>(buf, TILE_COLSB);
  tile_load<CHAINS + 1>(buf, TILE_COLSB);
  tile_zero<0>(), tile_zero<1>(), tile_zero<2>(), tile_zero<3>();
  for (int64_t r = 0; r < reps; r++) {
    tile_dp_su<0, CHAINS, CHAINS + 1>();
    tile_dp_su<1, CHAINS, CHAINS + 1>();
    tile_dp_su<2, CHAINS, CHAINS + 1>();
    tile_dp_su<3, CHAINS, CHAINS + 1>();
  }
  int64_t sum = 0;
  tile_store<0>(buf, TILE_COLSB);
  sum += buf[0];
  tile_store<3>(buf, TILE_COLSB);
  tile_release();
  return sum + buf[TILE_ROWS * TILE_COLSB / 4 - 1];
}
#else
static int64_t spin(int64_t reps, int seed) {
  vi acc[CHAINS];
  const vi a = splat(seed | 0x01010101), b = splat(seed ^ 0x02020202);
  for (int j = 0; j < CHAINS; j++) acc[j] = splat(seed + j);
  for (int64_t r = 0; r < reps; r++)
#pragma GCC unroll 12
    for (int j = 0; j < CHAINS; j++) acc[j] = step(acc[j], a, b);
  int64_t sum = 0;
  for (int j = 0; j < CHAINS; j++) sum += fold(acc[j]);
  return sum;
}
#endif

// Multiply-accumulates per second of `nthreads` threads each running `reps` rounds (best of `tries` timings).
// `sink` receives a value depending on every result, so the compiler keeps the loop.
extern "C" double SD_EXPORT(sd_peak_macs, SD_ISA)(int64_t reps, int nthreads, int tries, int64_t* sink) {
  double best = 0.0;
  for (int t = 0; t < tries; t++) {
    int64_t total = 0, failed = 0;
    const double t0 = omp_get_wtime();
#pragma omp parallel num_threads(nthreads) reduction(+ : total, failed)
    {
      const int64_t v = spin(reps, omp_get_thread_num() + t);
      total += v, failed += v == -1;
    }
    const double dt = omp_get_wtime() - t0;
    if (failed) return 0.0;  // a thread could not run the instruction: no rate
    *sink += total;
    const double rate = (double)nthreads * (double)reps * CHAINS * MACS_PER_OP / dt;
    if (rate > best) best = rate;
  }
  return best;
}
