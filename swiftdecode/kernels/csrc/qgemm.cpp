// Batch-invariant GEMM on GGUF block-quantized weights: y[M,N] = x[M,K] @ W[N,K]^T (+ b[N]).
//
// Why hand-written: decoding streams every weight once per step, so the weights must stay 4-6 bits wide in
// memory, and verification must return for each row bit-for-bit what a one-row product returns (that is what
// keeps speculative decoding lossless). No library kernel we could use promises the second property.
//
// Numerics (the same on every ISA): each input row is quantized to int8 per group of ACT_BLOCKS 32-blocks
// (scale dx = amax/127, round to nearest even): per 32 values (ACT_BLOCKS = 1) like llama.cpp's Q8_0
// activations, or per 256 (-DSD_ACT_BLOCKS=8) like its Q8_K. Per (output row n, 32-block b) the kernel forms
// exact integer dot products of the weight's unsigned codes u with the int8 codes, then adds its float
// contribution to one fp32 accumulator per (m, n), blocks in order b = 0, 1, ..., with the per-format formula
// below: per 32, acc += (a dx) s; per 256, the group's acc_g += a s (no dx: one multiply per row and block
// fewer) and acc = dx_g acc_g + acc at the group's end. Integer sums are exact and the float sequence depends
// only on (m, n), never on M, the thread split or the ISA, so row m of an M-row product is bit-identical to the
// 1-row product, and the AVX2, AVX-VNNI and AMX builds return exactly what the AVX-512 build returns (the AMX
// build's many-row pass: qgemm_tiles.h).
//
// Weight layout (written by swiftdecode/kernels/qweight.py from the GGUF blocks, same bits, rows interleaved):
// rows in tiles of 16 lanes; per tile and 32-block, `lo` holds 4 loads of [16 lanes x 4 bytes]: load h, lane j,
// byte t = u[j, 8h+t] & 15 | (u[j, 8h+4+t] & 15) << 4, so a 64-byte load yields the 4-value groups 2h and 2h+1
// of every lane, ready for dpbusd against a broadcast dword of x. 8-bit codes (hb=8) instead take 8 loads of
// whole bytes (load g, lane j, byte t = u[j, 4g+t]), which the AVX-512 build feeds to dpbusd as loaded (two
// nibble planes cost 24 vector operations per block and tile: Qwen2.5-0.5B's Q8_0 output head, 4-8 rows,
// 0.87-0.92x with bytes). High bits: hb=2 2 loads whose byte t of lane j holds bits 4-5 of values 4g+t at bits
// 2(g%4) for g/4 = load; hb=1 one load whose byte t holds bit 4 of value 4g+t at bit g. Scales per format (fp16
// as stored in GGUF):
//   F_Q4_0, F_Q5_0, F_Q8_0  y = d (u - off)                      d [T, K/32, 16]
//   F_Q4_1, F_Q5_1          y = d u + m                          d, m [T, K/32, 16]
//   F_Q4_K, F_Q5_K          y = d sc u - dmin mn                 d, dmin [T, K/256, 16]; sc, mn u8 [T, K/32, 16]
//   F_Q6_K                  y = d sc (u - 32), sc per 16 values  d [T, K/256, 16]; sc i8 [T, K/16, 16]
//   F_Q3_K                  y = d sc (u - 4), sc per 16 values   d [T, K/256, 16]; sc i8 [T, K/16, 16]
//   F_Q2_K                  y = d sc u - dmin mn, per 16 values  d, dmin [T, K/256, 16]; sc | mn << 4 u8 [T, K/16, 16]
//   F_IQ4_NL                y = d (v[u] - 128)                   d [T, K/32, 16]
//   F_IQ4_XS                y = d sc (v[u] - 128)                d [T, K/256, 16]; sc i8 [T, K/32, 16]
//   F_F16, F_BF16           y = the value itself                 d [T, K, 16] (fp16 or bf16 bits), no other plane
// Q3_K's 3-bit codes keep their low 2 bits in a 2-bit `lo` plane (the layout of hb=2's high plane: 2 loads,
// bits 2s of byte t of lane j = value 16p + 4s + t for load p) and bit 2 in an hb=1 plane; Q2_K's codes are the
// 2-bit plane alone. The IQ4 formats keep 4-bit indices in `lo`; unpacking maps them through their codebook v
// (IQ4_CODES + 128) to 8-bit codes.
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <memory>
#include <type_traits>

#include "qgemm.h"
#include "split.h"

enum { F_Q4_0 = 0, F_Q4_1 = 1, F_Q5_0 = 2, F_Q5_1 = 3, F_Q8_0 = 4, F_Q4_K = 5, F_Q5_K = 6, F_Q6_K = 7, F_Q3_K = 8,
       F_IQ4_NL = 9, F_IQ4_XS = 10, F_Q2_K = 11, F_F16 = 12, F_BF16 = 13 };
static inline bool float_format(int fmt) { return fmt == F_F16 || fmt == F_BF16; }  // csrc/qgemm_float.h
#ifndef SD_ACT_BLOCKS
#define SD_ACT_BLOCKS 1
#endif
#define ACT_BLOCKS SD_ACT_BLOCKS  // 32-blocks per activation scale (1 or 8), fixed per library (kernels/qgemm.py)
#define LANES 16  // rows per tile
#define LOAD 64   // bytes per plane load: 16 lanes x 4 codes

struct QW {  // one quantized weight; plane pointers may be null when the format lacks them
  const uint8_t* lo;
  const uint8_t* hi;
  const uint16_t* d;    // fp16
  const uint16_t* d2;   // fp16: m (Q4_1/Q5_1) or dmin (K formats)
  const uint8_t* sc;    // u8 (Q4_K/Q5_K) or i8 (Q6_K)
  const uint8_t* mn;    // u8 (Q4_K/Q5_K)
  int64_t N, K;
};

struct QX {  // quantized input rows
  const int8_t* q;      // [M, K]
  const float* d;       // [M, K/32]
  const int32_t* noff16;  // [M, K/16] -32 * (sum of each 16 values' q): Q6_K's offset term per 16 values
  const float* ds;      // [M, K/32] d * (float)(sum of the block's q): the min terms' factor, formed once per row
  const float* ds16;    // [M, K/16] the same per 16 values: Q2_K's per-16 min terms' factor
  const int32_t* noff;  // [OFF_PLANES, M, K/32] -OFFSETS[i] * (sum of the block's q): an offset format's term
  int64_t K, M;
  const float* xf;      // [M, K] the rows as given (the float formats' products read them)
};

// hb: high-bit plane width (8: whole-byte codes in `lo`, no high plane); lo2: 2-bit low codes (else 4-bit);
// lut: 4-bit indices into the IQ4 codebook; off: the code that means 0; kq: K-quant (d per 256, sc per 32 or
// 16); mins: a min term (per 16 values with sub16: Q2_K's 4-bit scale and min share a byte); sub16: scales per
// 16 values; ssc: signed per-32 scales.
template <int F> struct Fmt;
template <> struct Fmt<F_Q4_0> { enum { hb = 0, lo2 = 0, lut = 0, off = 8, kq = 0, mins = 0, sub16 = 0, ssc = 0 }; };
template <> struct Fmt<F_Q4_1> { enum { hb = 0, lo2 = 0, lut = 0, off = 0, kq = 0, mins = 1, sub16 = 0, ssc = 0 }; };
template <> struct Fmt<F_Q5_0> { enum { hb = 1, lo2 = 0, lut = 0, off = 16, kq = 0, mins = 0, sub16 = 0, ssc = 0 }; };
template <> struct Fmt<F_Q5_1> { enum { hb = 1, lo2 = 0, lut = 0, off = 0, kq = 0, mins = 1, sub16 = 0, ssc = 0 }; };
template <> struct Fmt<F_Q8_0> { enum { hb = 8, lo2 = 0, lut = 0, off = 128, kq = 0, mins = 0, sub16 = 0, ssc = 0 }; };
template <> struct Fmt<F_Q4_K> { enum { hb = 0, lo2 = 0, lut = 0, off = 0, kq = 1, mins = 1, sub16 = 0, ssc = 0 }; };
template <> struct Fmt<F_Q5_K> { enum { hb = 1, lo2 = 0, lut = 0, off = 0, kq = 1, mins = 1, sub16 = 0, ssc = 0 }; };
template <> struct Fmt<F_Q6_K> { enum { hb = 2, lo2 = 0, lut = 0, off = 32, kq = 1, mins = 0, sub16 = 1, ssc = 0 }; };
template <> struct Fmt<F_Q3_K> { enum { hb = 1, lo2 = 1, lut = 0, off = 4, kq = 1, mins = 0, sub16 = 1, ssc = 0 }; };
template <> struct Fmt<F_IQ4_NL> { enum { hb = 0, lo2 = 0, lut = 1, off = 128, kq = 0, mins = 0, sub16 = 0, ssc = 0 }; };
template <> struct Fmt<F_IQ4_XS> { enum { hb = 0, lo2 = 0, lut = 1, off = 128, kq = 1, mins = 0, sub16 = 0, ssc = 1 }; };
template <> struct Fmt<F_Q2_K> { enum { hb = 0, lo2 = 1, lut = 0, off = 0, kq = 1, mins = 1, sub16 = 1, ssc = 0 }; };
template <int F> constexpr bool codes8() { return Fmt<F>::hb == 8 || Fmt<F>::lut; }  // 8-bit codes once unpacked
template <int F> constexpr int lo_bytes() { return Fmt<F>::hb == 8 ? 8 * LOAD : Fmt<F>::lo2 ? 2 * LOAD : 4 * LOAD; }
template <int F> constexpr int hi_bytes() { return Fmt<F>::hb == 2 ? 2 * LOAD : Fmt<F>::hb == 1 ? LOAD : 0; }
// The IQ4 codebook (ggml's kvalues_iq4nl), as signed values; the kernel's codes are these + 128.
static constexpr int8_t IQ4_CODES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
struct Iq4Tables {  // the codes (IQ4_CODES + 128), and their low and high nibbles (AVX2's split dot products)
  uint8_t u8[16], lo[16], hi[16];
};
static constexpr Iq4Tables iq4_tables() {
  Iq4Tables t{};
  for (int i = 0; i < 16; i++) t.u8[i] = (uint8_t)(IQ4_CODES[i] + 128), t.lo[i] = t.u8[i] & 15, t.hi[i] = t.u8[i] >> 4;
  return t;
}
static constexpr Iq4Tables IQ4 = iq4_tables();
// The per-16 offset format's offset (Q6_K): -OFF16 * (sum of 16 values' q) is formed once per input row and
// starts that half block's chain, instead of a broadcast, a multiply and a subtraction per row, block and tile
// (with its high bits merged by one ternary-logic op each: Q6_K products of 8-16 rows 0.83-0.87x, weights in
// cache, Zen 4).
#define OFF16 32
static_assert(Fmt<F_Q6_K>::off == OFF16 && OFF16 % Fmt<F_Q3_K>::off == 0, "per-16 terms derive from OFF16's");
// The offsets of the whole-block offset formats (Q4_0, Q5_0, Q8_0). Their term -off * (sum of a block's q) is
// formed once per input row and block and starts the dot product's chain, instead of a scalar multiply, a
// broadcast and a subtraction per output tile (products of 8 rows 0.93x; whole forwards of 8 rows 0.96-1.00x,
// 16 rows 0.92-0.99x, Qwen2.5-Coder-0.5B/1.5B, both builds).
#define OFF_PLANES 3
static constexpr int OFFSETS[OFF_PLANES] = {Fmt<F_Q4_0>::off, Fmt<F_Q5_0>::off, Fmt<F_Q8_0>::off};
template <int F> constexpr int off_plane() {  // F's plane of QX.noff, -1 if F has no whole-block offset
  for (int i = 0; i < OFF_PLANES; i++)
    if (!Fmt<F>::sub16 && Fmt<F>::off == OFFSETS[i]) return i;
  return -1;
}

// fn(std::integral_constant<int, F>()) for the format id `fmt` (one switch for every entry point that needs
// the format as a compile-time constant).
template <class Fn>
static inline void with_format(int fmt, Fn&& fn) {
  switch (fmt) {
    case F_Q4_0: fn(std::integral_constant<int, F_Q4_0>()); break;
    case F_Q4_1: fn(std::integral_constant<int, F_Q4_1>()); break;
    case F_Q5_0: fn(std::integral_constant<int, F_Q5_0>()); break;
    case F_Q5_1: fn(std::integral_constant<int, F_Q5_1>()); break;
    case F_Q8_0: fn(std::integral_constant<int, F_Q8_0>()); break;
    case F_Q4_K: fn(std::integral_constant<int, F_Q4_K>()); break;
    case F_Q5_K: fn(std::integral_constant<int, F_Q5_K>()); break;
    case F_Q6_K: fn(std::integral_constant<int, F_Q6_K>()); break;
    case F_Q3_K: fn(std::integral_constant<int, F_Q3_K>()); break;
    case F_IQ4_NL: fn(std::integral_constant<int, F_IQ4_NL>()); break;
    case F_IQ4_XS: fn(std::integral_constant<int, F_IQ4_XS>()); break;
    case F_Q2_K: fn(std::integral_constant<int, F_Q2_K>()); break;
  }
}

// ------------------------------------------------------------------ vector traits: W lanes of a 16-lane tile
#if defined(SD_AVX512)
#define W 16
typedef __m512i vi;
typedef __m512 vf;
static inline vi ld(const uint8_t* p) { return _mm512_loadu_si512((const void*)p); }
static inline vi and_(vi a, vi b) { return _mm512_and_si512(a, b); }
static inline vi or_(vi a, vi b) { return _mm512_or_si512(a, b); }
static inline vi srl16(vi a, int n) { return _mm512_srli_epi16(a, n); }
static inline vi sll16(vi a, int n) { return _mm512_slli_epi16(a, n); }
static inline vi set8(int v) { return _mm512_set1_epi8((char)v); }
static inline vi bcast16(const uint8_t* p) { return _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)p)); }
static inline vi shuf(vi table, vi idx) { return _mm512_shuffle_epi8(table, idx); }  // per 16-byte lane
static inline vi seti(int32_t v) { return _mm512_set1_epi32(v); }
static inline vi izero() { return _mm512_setzero_si512(); }
static inline vi addi(vi a, vi b) { return _mm512_add_epi32(a, b); }
static inline vi slli32(vi a, int n) { return _mm512_slli_epi32(a, n); }
static inline vi srli32(vi a, int n) { return _mm512_srli_epi32(a, n); }
static inline vi u8i(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)); }
// acc += u8 x s8 products, 4 per lane, of codes u and the 4 int8 at p broadcast to every lane. The broadcast is
// the instruction's memory operand ({1to16}), written in asm: GCC emits a vpbroadcastd of its own before each
// vpdpbusd, and that extra instruction cost the rolled many-row pass 1.2x (32 rows, Xeon; a loop of this step
// alone ran 1.3-1.9x faster).
typedef int32_t __attribute__((may_alias)) i32_alias;  // the asm's memory operand reads int8 codes as one dword
static inline vi dot_bcast(vi acc, vi u, const int8_t* p) {
  __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*(const i32_alias*)p));
  return acc;
}
static inline vf cvt(vi a) { return _mm512_cvtepi32_ps(a); }
static inline vf fzero() { return _mm512_setzero_ps(); }
static inline vf fset(float v) { return _mm512_set1_ps(v); }
static inline vf fmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf ffma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf ffnma(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }
static inline vf fadd(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf h2f(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
static inline vf u2f(const uint8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p))); }
static inline vf s2f(const uint8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p))); }
static inline void fstore(float* p, vf a, int n) { _mm512_mask_storeu_ps(p, (__mmask16)((1u << n) - 1), a); }
static inline vf fload(const float* p, int n) { return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p); }
static inline vf floadu(const float* p) { return _mm512_loadu_ps(p); }
static inline vf fabs_(vf a) { return _mm512_abs_ps(a); }
static inline vf fmax_(vf a, vf b) { return _mm512_max_ps(a, b); }  // b where a is NaN (as fmaxf(b, a))
static inline vi fround(vf a) { return _mm512_cvtps_epi32(a); }      // current rounding mode: nearest even
static inline float hmax(vf a) { return _mm512_reduce_max_ps(a); }  // callers' lanes hold no NaN: any order is exact
static inline int32_t hsum(vi a) { return _mm512_reduce_add_epi32(a); }
// The 32 int32 codes of a block -> 32 int8 (their low bytes, as an (int8_t) cast keeps), q[0..31].
static inline void store_codes(int8_t* q, const vi c[32 / W]) {
  _mm_storeu_si128((__m128i*)q, _mm512_cvtepi32_epi8(c[0]));
  _mm_storeu_si128((__m128i*)(q + 16), _mm512_cvtepi32_epi8(c[1]));
}
// Rows unrolled with register accumulators; more run the rolled pass (accumulators in L1). The rolled pass was
// faster from 5 rows on here (Qwen2.5-0.5B's products, Xeon: 8 rows 0.93x, 12 rows 0.88x), not on AVX2 (1.06x).
#define UNROLLED_ROWS 4
#if defined(SD_AMX)  // the AVX-512 build with AMX tiles for products of several rows (qgemm_tiles.h)
#define SD_ISA amx
#else
#define SD_ISA avx512
#endif
#else
#if defined(SD_AVXVNNI)
// The AVX-VNNI build (Intel client CPUs since Alder Lake: VEX vpdpbusd on ymm, no AVX-512): the AVX2 build's
// 8-lane traits with the AVX-512 build's dot products. Rows unrolled as on AVX-512 (16 ymm registers hold 8
// codes and the accumulators: 8 rows would spill).
#define UNROLLED_ROWS 4
#else
#define UNROLLED_ROWS 8
#endif
#define W 8
typedef __m256i vi;
typedef __m256 vf;
static inline vi ld(const uint8_t* p) { return _mm256_loadu_si256((const __m256i*)p); }
static inline vi and_(vi a, vi b) { return _mm256_and_si256(a, b); }
static inline vi or_(vi a, vi b) { return _mm256_or_si256(a, b); }
static inline vi srl16(vi a, int n) { return _mm256_srli_epi16(a, n); }
static inline vi sll16(vi a, int n) { return _mm256_slli_epi16(a, n); }
static inline vi set8(int v) { return _mm256_set1_epi8((char)v); }
static inline vi bcast16(const uint8_t* p) { return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)p)); }
static inline vi shuf(vi table, vi idx) { return _mm256_shuffle_epi8(table, idx); }  // per 16-byte lane
static inline vi seti(int32_t v) { return _mm256_set1_epi32(v); }
static inline vi bcast4(const int8_t* p) { int32_t v; memcpy(&v, p, 4); return _mm256_set1_epi32(v); }
#if defined(SD_AVXVNNI)
// acc += u8 x s8 products, 4 per lane, of codes u and the 4 int8 at p broadcast to every lane (VEX has no
// embedded broadcast: a vpbroadcastd from memory, a load-port operation). Without -mavxvnni (a CPU with AVX-512
// VL + VNNI testing this build) the same instruction in its EVEX encoding.
static inline vi dot_bcast(vi acc, vi u, const int8_t* p) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, bcast4(p));
#else
  return _mm256_dpbusd_epi32(acc, u, bcast4(p));
#endif
}
#endif
static inline vi izero() { return _mm256_setzero_si256(); }
static inline vi addi(vi a, vi b) { return _mm256_add_epi32(a, b); }
static inline vi slli32(vi a, int n) { return _mm256_slli_epi32(a, n); }
static inline vi srli32(vi a, int n) { return _mm256_srli_epi32(a, n); }
static inline vi u8i(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
static inline vf cvt(vi a) { return _mm256_cvtepi32_ps(a); }
static inline vf fzero() { return _mm256_setzero_ps(); }
static inline vf fset(float v) { return _mm256_set1_ps(v); }
static inline vf fmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf ffma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf ffnma(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
static inline vf fadd(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf h2f(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
static inline vf u2f(const uint8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p))); }
static inline vf s2f(const uint8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p))); }
static inline void fstore(float* p, vf a, int n) {
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  _mm256_maskstore_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), idx), a);
}
static inline vf fload(const float* p, int n) {
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), idx));
}
static inline vf floadu(const float* p) { return _mm256_loadu_ps(p); }
static inline vf fabs_(vf a) { return _mm256_and_ps(a, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff))); }
static inline vf fmax_(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline vi fround(vf a) { return _mm256_cvtps_epi32(a); }
static inline float hmax(vf a) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}
static inline int32_t hsum(vi a) {
  __m128i v = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
  v = _mm_add_epi32(v, _mm_shuffle_epi32(v, 0x4e));
  return _mm_cvtsi128_si32(_mm_add_epi32(v, _mm_shuffle_epi32(v, 0xb1)));
}
static inline void store_codes(int8_t* q, const vi c[32 / W]) {  // low bytes: packs of values 0..255 are exact
  const vi m8 = _mm256_set1_epi32(0xFF);
  const vi a = _mm256_packus_epi32(_mm256_and_si256(c[0], m8), _mm256_and_si256(c[1], m8));
  const vi b = _mm256_packus_epi32(_mm256_and_si256(c[2], m8), _mm256_and_si256(c[3], m8));
  const vi bytes = _mm256_packus_epi16(a, b);  // per 128-bit half: 4 values of each of c[0..3], in turn
  _mm256_storeu_si256((__m256i*)q, _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}
#if defined(SD_AVXVNNI)
#define SD_ISA avxvnni
#else
#define SD_ISA avx2
#endif
#endif
#if defined(SD_AVX512) || defined(SD_AVXVNNI)
#define SD_VNNI  // u8 x s8 dot products into int32 (vpdpbusd): no saturation, whole-byte codes fed as loaded
#endif

#define SD_PASTE(a, b) a##_##b
#define SD_EXPORT(a, b) SD_PASTE(a, b)
#define RMAX 32            // input rows per pass over a tile's weights: their accumulators (on the stack) and int8
                          // codes (32 x K bytes) stay in L1/L2 while each block's codes are unpacked once for all
#define PREFETCH_BLOCKS 16  // 32-blocks ahead that a tile's code planes are prefetched (~4-8 KB): at 4-16 rows the
                            // hardware prefetcher alone left a forward up to 1.2x slower (Qwen2.5-0.5B, 4 rows);
                            // 16 blocks rather than 4 keep enough bytes in flight at 1-9 rows: greedy decoding 1.11x
                            // on Qwen2.5-0.5B (AVX2 build 1.20x), 1.04x on SmolLM2 (8 prompts, one process)

// Codes of one 32-block for W lanes starting at lane e: 8 vectors of 4-value groups (u[g], g = 0..7). For
// 8-bit codes on AVX2 the low nibbles go to u and the high ones to uh (dot products with codes above 63 could
// saturate there).
template <int F>
__attribute__((always_inline)) static inline void unpack(const uint8_t* lo, const uint8_t* hi, int e, vi u[8], vi uh[8]) {
  const vi m4 = set8(15);
  if (Fmt<F>::hb == 8) {
    for (int g = 0; g < 8; g++) {
      vi v = ld(lo + g * LOAD + e * 4);
#if defined(SD_VNNI)
      u[g] = v;
#else
      u[g] = and_(v, m4);
      uh[g] = and_(srl16(v, 4), m4);
#endif
    }
    return;
  }
  if (Fmt<F>::lo2) {  // 2-bit codes: load p, bits 2s of each byte -> group 4p + s
    const vi m3 = set8(3);
    for (int p = 0; p < 2; p++) {
      vi v = ld(lo + p * LOAD + e * 4);
      for (int s = 0; s < 4; s++) u[4 * p + s] = and_(s ? srl16(v, 2 * s) : v, m3);
    }
  } else {
    for (int h = 0; h < 4; h++) {
      vi v = ld(lo + h * LOAD + e * 4);
      u[2 * h] = and_(v, m4);
      u[2 * h + 1] = and_(srl16(v, 4), m4);
    }
  }
  if (Fmt<F>::hb == 2) {
#if defined(SD_AVX512)  // bits 2s..2s+1 of each byte shifted to bits 4-5 and merged in one ternary-logic op
    const vi m30 = set8(0x30);
    for (int p = 0; p < 2; p++) {
      vi v = ld(hi + p * LOAD + e * 4);
      for (int s = 0; s < 4; s++) {
        const vi t = s < 2 ? sll16(v, 4 - 2 * s) : s == 2 ? v : srl16(v, 2);  // 16-bit shifts: what crosses a
        u[4 * p + s] = _mm512_ternarylogic_epi32(u[4 * p + s], t, m30, 0xF8);  // byte lands outside bits 4-5
      }
    }
#else
    const vi m2 = set8(3);
    for (int p = 0; p < 2; p++) {
      vi v = ld(hi + p * LOAD + e * 4);
      for (int s = 0; s < 4; s++) u[4 * p + s] = or_(u[4 * p + s], sll16(and_(srl16(v, 2 * s), m2), 4));
    }
#endif
  } else if (Fmt<F>::hb == 1) {  // the bit above the low codes: bit 4, or bit 2 above 2-bit codes
    constexpr int at = Fmt<F>::lo2 ? 2 : 4;
    vi v = ld(hi + e * 4);
#if defined(SD_AVX512)  // bit g of each byte -> +2^at on group g's codes: a mask test and a masked add
    for (int g = 0; g < 8; g++) u[g] = _mm512_mask_add_epi8(u[g], _mm512_test_epi8_mask(v, set8(1 << g)), u[g], set8(1 << at));
#else
    const vi m1 = set8(1);
    for (int g = 0; g < 8; g++) u[g] = or_(u[g], sll16(and_(srl16(v, g), m1), at));
#endif
  }
  if (Fmt<F>::lut) {  // indices -> codebook codes (AVX2: their nibbles, as its 8-bit codes)
#if defined(SD_VNNI)
    const vi t = bcast16(IQ4.u8);
    for (int g = 0; g < 8; g++) u[g] = shuf(t, u[g]);
#else
    const vi tl = bcast16(IQ4.lo), th = bcast16(IQ4.hi);
    for (int g = 0; g < 8; g++) uh[g] = shuf(th, u[g]), u[g] = shuf(tl, u[g]);
#endif
  }
  (void)uh;
}

// Integer dot products of one input row's 32-block with the unpacked codes, each sum starting from its offset
// term (or zero): s[0] over values 0..15 from init[0], s[1] over 16..31 from init[1] (only Q6_K needs them
// apart; otherwise s[0] holds the whole block, from init[0]).
#if defined(SD_VNNI)
template <int F>
__attribute__((always_inline)) static inline void block_dot(const vi u[8], const vi uh[8], const int8_t* xq, vi s[2],
                                                           const vi init[2]) {
  (void)uh;
  if (Fmt<F>::sub16) {  // values 0..15 and 16..31 apart, a chain each
    s[0] = init[0];
    s[1] = init[1];
    for (int g = 0; g < 8; g++) s[g >> 2] = dot_bcast(s[g >> 2], u[g], xq + 4 * g);
  } else {  // two chains: the tile's other rows give the core parallel work
    vi p[2] = {init[0], izero()};
    for (int g = 0; g < 8; g++) p[g & 1] = dot_bcast(p[g & 1], u[g], xq + 4 * g);
    s[0] = addi(p[0], p[1]);
    s[1] = izero();
  }
}
#else
// AVX2 has no u8 x s8 -> s32 dot: maddubs gives s16 pair sums, which are added in s16 over a chunk of C groups
// before one widening madd. |pair sum| <= 2 * 127 * max code, so a chunk of C stays below 2^15 when
// C * 254 * max code < 32768: C = 8 for 4-bit codes, 4 for 5-bit, 2 for 6-bit. The sums are exact integers,
// so the result is the same as widening every product (and as the AVX-512 build).
template <int G, int C>
__attribute__((always_inline)) static inline __m256i chunk16(const vi u[8], const int8_t* xq) {
  if constexpr (C == 1) {
    return _mm256_maddubs_epi16(u[G], bcast4(xq + 4 * G));
  } else {
    return _mm256_add_epi16(chunk16<G, C / 2>(u, xq), chunk16<G + C / 2, C / 2>(u, xq));
  }
}
template <int G, int C>
__attribute__((always_inline)) static inline vi chunk32(const vi u[8], const int8_t* xq) {
  return _mm256_madd_epi16(chunk16<G, C>(u, xq), _mm256_set1_epi16(1));
}
template <int F>
__attribute__((always_inline)) static inline void block_dot(const vi u[8], const vi uh[8], const int8_t* xq, vi s[2],
                                                           const vi init[2]) {
  constexpr int C = Fmt<F>::sub16 ? 2 : Fmt<F>::hb == 1 ? 4 : 8;  // 8-bit codes: u and uh are nibbles
  vi p[4];
  if constexpr (C == 8) {
    p[0] = chunk32<0, 8>(u, xq);
    p[1] = init[0];
    p[2] = p[3] = izero();
  } else if constexpr (C == 4) {
    p[0] = chunk32<0, 4>(u, xq), p[2] = chunk32<4, 4>(u, xq);
    p[1] = init[0];
    p[3] = izero();
  } else {
    p[0] = chunk32<0, 2>(u, xq), p[1] = chunk32<2, 2>(u, xq);
    p[2] = chunk32<4, 2>(u, xq), p[3] = chunk32<6, 2>(u, xq);
  }
  if (codes8<F>()) p[0] = addi(p[0], slli32(chunk32<0, 8>(uh, xq), 4));
  if (Fmt<F>::sub16) {
    s[0] = addi(addi(p[0], p[1]), init[0]);
    s[1] = addi(addi(p[2], p[3]), init[1]);
  } else {
    s[0] = addi(addi(p[0], p[1]), addi(p[2], p[3]));
    s[1] = izero();
  }
}
#endif

// The offset terms that begin input row m's integer sums of 32-block `blk` (zero for formats without one).
template <int F>
__attribute__((always_inline)) static inline void block_init(const QX& x, int64_t blk, int64_t m, vi init[2]) {
  const int64_t nb = x.K / 32;
  constexpr int plane = off_plane<F>();
  init[0] = init[1] = izero();
  if (Fmt<F>::sub16 && Fmt<F>::off) {  // Q6_K, Q3_K: each 16 values' offset term begins their chain (exact:
                                       // OFF16 / off divides it)
    init[0] = seti(x.noff16[m * 2 * nb + 2 * blk] / (OFF16 / Fmt<F>::off));
    init[1] = seti(x.noff16[m * 2 * nb + 2 * blk + 1] / (OFF16 / Fmt<F>::off));
  } else if (plane >= 0) {  // a whole-block offset term begins the block's chain
    init[0] = seti(x.noff[(plane * x.M + m) * nb + blk]);
  }
}

// A block's scales for W lanes: a0 (a1: a per-16 format's second 16 values) multiply the integer sums, b0 (b1)
// the min terms' sums of q.
struct BlockScales {
  vf a0, a1, b0, b1;
};

// acc += input row m's float contribution of 32-block `blk`, from its exact integer sums s (begun from
// block_init's terms) and the block's scales. With per-32 activation scales the scale product a * dx is formed
// per row and block; with per-group scales (ACT_BLOCKS > 1) acc is the group's sum in the units of its scale,
// which group_end applies once per group. The one float sequence of every build and pass.
template <int F>
__attribute__((always_inline)) static inline void scale_block(const QX& x, int64_t blk, int64_t m, const vi s[2],
                                                             const BlockScales& k, vf& acc) {
  const int64_t nb = x.K / 32;
  vf a0 = k.a0, a1 = k.a1;
  if (ACT_BLOCKS == 1) {
    const vf vdx = fset(x.d[m * nb + blk]);
    a0 = fmul(a0, vdx);
    if (Fmt<F>::sub16) a1 = fmul(a1, vdx);
  }
  acc = ffma(a0, cvt(s[0]), acc);
  if (Fmt<F>::sub16) acc = ffma(a1, cvt(s[1]), acc);
  if (Fmt<F>::sub16 && Fmt<F>::mins) {  // Q2_K: each 16 values' min term
    acc = ffnma(k.b0, fset(x.ds16[m * 2 * nb + 2 * blk]), acc);
    acc = ffnma(k.b1, fset(x.ds16[m * 2 * nb + 2 * blk + 1]), acc);
  } else if (Fmt<F>::mins) {
    const vf fsx = fset(x.ds[m * nb + blk]);  // the block's sum of q (times d per 32), a broadcast from memory
    acc = Fmt<F>::kq ? ffnma(k.b0, fsx, acc) : ffma(k.b0, fsx, acc);
  }
}

// acc += one input row m's contribution of 32-block `blk`, from the block's unpacked codes and its scales.
template <int F>
__attribute__((always_inline)) static inline void row_block(const QX& x, int64_t blk, int64_t m, const vi u[8],
                                                           const vi uh[8], const BlockScales& k, vf& acc) {
  vi s[2], init[2];
  block_init<F>(x, blk, m, init);
  block_dot<F>(u, uh, x.q + m * x.K + blk * 32, s, init);
  scale_block<F>(x, blk, m, s, k, acc);
}

// The scales of W lanes of tile `t` from lane e for 32-block `blk`.
template <int F>
__attribute__((always_inline)) static inline BlockScales block_scales(const QW& w, int64_t t, int64_t blk, int e) {
  const int64_t tb = t * (w.K / 32) + blk;
  BlockScales k = {fzero(), fzero(), fzero(), fzero()};
  if (Fmt<F>::kq) {
    const int64_t ts = t * (w.K / 256) + blk / 8;
    vf d = h2f(w.d + ts * LANES + e);
    if (Fmt<F>::sub16 && Fmt<F>::mins) {  // Q2_K: scale | min << 4 per 16 values
      const uint8_t* sc = w.sc + (t * (w.K / 16) + 2 * blk) * LANES + e;
      const vi m15 = seti(15), c0 = u8i(sc), c1 = u8i(sc + LANES);
      const vf dmin = h2f(w.d2 + ts * LANES + e);
      k.a0 = fmul(d, cvt(and_(c0, m15))), k.a1 = fmul(d, cvt(and_(c1, m15)));
      k.b0 = fmul(dmin, cvt(srli32(c0, 4))), k.b1 = fmul(dmin, cvt(srli32(c1, 4)));
    } else if (Fmt<F>::sub16) {
      const uint8_t* sc = w.sc + (t * (w.K / 16) + 2 * blk) * LANES + e;
      k.a0 = fmul(d, s2f(sc));
      k.a1 = fmul(d, s2f(sc + LANES));
    } else {
      k.a0 = fmul(d, Fmt<F>::ssc ? s2f(w.sc + tb * LANES + e) : u2f(w.sc + tb * LANES + e));
      if (Fmt<F>::mins) k.b0 = fmul(h2f(w.d2 + ts * LANES + e), u2f(w.mn + tb * LANES + e));
    }
  } else {
    k.a0 = h2f(w.d + tb * LANES + e);
    if (Fmt<F>::mins) k.b0 = h2f(w.d2 + tb * LANES + e);
  }
  return k;
}

// acc[i] += contribution of 32-block `blk` for input rows m0..m0+rows-1 (rows <= R, or <= RMAX when R = 0), W lanes
// of tile `t` from lane e.
template <int F, int R>
__attribute__((always_inline)) static inline void tile_block(const QW& w, const QX& x, int64_t t, int64_t blk, int e, int64_t m0,
                                                            int rows, vf* acc) {
  const int64_t tb = t * (w.K / 32) + blk;
  vi u[8], uh[8];
  unpack<F>(w.lo + tb * lo_bytes<F>(), w.hi ? w.hi + tb * hi_bytes<F>() : nullptr, e, u, uh);
  const BlockScales k = block_scales<F>(w, t, blk, e);
  if constexpr (R == 0 || Fmt<F>::sub16) {  // rolled: run-time passes, and Q6_K/Q3_K (unrolled, they spill)
    for (int i = 0; i < rows; i++) row_block<F>(x, blk, m0 + i, u, uh, k, acc[i]);
  } else {  // unrolled to R, the most rows: the accumulators stay in registers
#pragma GCC unroll 16
    for (int i = 0; i < R; i++)
      if (i < rows) row_block<F>(x, blk, m0 + i, u, uh, k, acc[i]);
  }
}

// Prefetches the code planes of the 32-block PREFETCH_BLOCKS after block `blk` of tile `t` (planes are tile-major:
// near a tile's end this runs on into tile t + 1).
template <int F>
__attribute__((always_inline)) static inline void prefetch_ahead(const QW& w, int64_t t, int64_t blk) {
  const int pf_lo = lo_bytes<F>(), pf_hi = hi_bytes<F>();
  const int64_t ahead = t * (w.K / 32) + blk + PREFETCH_BLOCKS;
  for (int c = 0; c < pf_lo; c += 64) _mm_prefetch((const char*)(w.lo + ahead * pf_lo + c), _MM_HINT_T0);
  for (int c = 0; c < pf_hi; c += 64) _mm_prefetch((const char*)(w.hi + ahead * pf_hi + c), _MM_HINT_T0);
}

// After 32-block `blk`: where it ends an activation group (ACT_BLOCKS > 1), out[i] += dx_g acc[i] (out[i] =
// on the first group) for rows m0..m0+rows-1, and acc[i] restarts at zero.
static inline void group_end(const QX& x, int64_t blk, int64_t m0, int rows, vf* acc, vf* out) {
  const int64_t nb = x.K / 32;
  if (ACT_BLOCKS == 1 || (blk % ACT_BLOCKS != ACT_BLOCKS - 1 && blk != nb - 1)) return;
  for (int i = 0; i < rows; i++) {
    const vf dx = fset(x.d[(m0 + i) * nb + blk]);
    out[i] = blk < ACT_BLOCKS ? fmul(dx, acc[i]) : ffma(dx, acc[i], out[i]);
    acc[i] = fzero();
  }
}

// y rows m0..m0+rows-1, lanes n0..n0+n-1 = their sums (acc, or out with activation groups) + bias.
static inline void store_rows(const float* bias, float* y, int64_t N, int64_t n0, int n, int64_t m0, int rows,
                              const vf* acc, const vf* out) {
  for (int i = 0; i < rows; i++) {
    const vf r = ACT_BLOCKS > 1 ? out[i] : acc[i];
    fstore(y + (m0 + i) * N + n0, bias ? fadd(r, fload(bias + n0, n)) : r, n);
  }
}

// Rows m0..m0+rows-1 (rows <= R, or <= RMAX when R = 0) against W lanes of tile `t` at a time, blocks in
// order. Each block's codes are unpacked once for all the rows, and the next blocks' planes are prefetched so
// memory keeps streaming while the rows compute.
template <int F, int R>
static void tile_rows(const QW& w, const QX& x, const float* bias, float* y, int64_t t, int64_t m0, int rows) {
  const int64_t nb = w.K / 32;
  for (int e = 0; e < LANES; e += W) {
    const int64_t n0 = t * LANES + e;
    if (n0 >= w.N) break;
    vf acc[R ? R : RMAX], out[ACT_BLOCKS > 1 ? (R ? R : RMAX) : 1];  // out: the sum of scaled groups
    for (int i = 0; i < rows; i++) acc[i] = fzero();
    for (int64_t blk = 0; blk < nb; blk++) {
      if (e == 0) prefetch_ahead<F>(w, t, blk);  // later lane groups find the planes cached
      tile_block<F, R>(w, x, t, blk, e, m0, rows, acc);
      group_end(x, blk, m0, rows, acc, out);
    }
    store_rows(bias, y, w.N, n0, (int)std::min<int64_t>(w.N - n0, W), m0, rows, acc, out);
  }
}

#if defined(SD_AMX)
#include "qgemm_tiles.h"
#else
struct TileScratch;  // tiles are the AMX build's
#endif

// Every input row against one row tile: on tiles when `ts` is given (the AMX build, this thread's tiles
// configured); else up to UNROLLED_ROWS rows unrolled at compile time for their exact count
// (accumulators in registers), more in passes of up to RMAX rows that unpack each block once per pass.
template <int F>
static void tile_all_rows(const QW& w, const QX& x, const float* bias, float* y, int64_t t, int64_t M,
                          TileScratch* ts) {
#if defined(SD_AMX)
  if (ts) return tiles_all_rows<F>(w, x, bias, y, t, M, *ts);
#else
  (void)ts;
#endif
  switch (UNROLLED_ROWS >= M ? M : 0) {
    case 1: return tile_rows<F, 1>(w, x, bias, y, t, 0, 1);
    case 2: return tile_rows<F, 2>(w, x, bias, y, t, 0, 2);
    case 3: return tile_rows<F, 3>(w, x, bias, y, t, 0, 3);
    case 4: return tile_rows<F, 4>(w, x, bias, y, t, 0, 4);
#if UNROLLED_ROWS > 4
    case 5: return tile_rows<F, 5>(w, x, bias, y, t, 0, 5);
    case 6: return tile_rows<F, 6>(w, x, bias, y, t, 0, 6);
    case 7: return tile_rows<F, 7>(w, x, bias, y, t, 0, 7);
    case 8: return tile_rows<F, 8>(w, x, bias, y, t, 0, 8);
#endif
  }
  for (int64_t m = 0; m < M; m += RMAX) tile_rows<F, 0>(w, x, bias, y, t, m, (int)(M - m < RMAX ? M - m : RMAX));
}

#include "qgemm_float.h"

static void run_tile(int fmt, const QW& w, const QX& x, const float* bias, float* y, int64_t t, int64_t M,
                     TileScratch* ts) {
  if (float_format(fmt)) return float_tile(fmt == F_BF16, w, x.xf, bias, y, t, M);
  with_format(fmt, [&](auto f) { tile_all_rows<decltype(f)::value>(w, x, bias, y, t, M, ts); });
}

// 32-blocks [b0, b1) of row m of x [M, K] fp32 -> q int8 [K], d [K/32], noff16 [K/16], ds [K/32], ds16 [K/16]
// (at row m of each), and its offset terms noff [OFF_PLANES, M, K/32], in groups of ACT_BLOCKS blocks sharing one
// scale (b0 a group's first block). Lane-wise float operations only (|x| and max are exact, then one multiply and a round to
// nearest even per value), so every build returns the same codes as the scalar definition: per group,
// amax = max |x_i| (NaN values skipped), d = amax / 127, q_i = (int8_t)nearbyint(x_i * (1 / d)); every block of
// the group stores d; ds = d * (float)(the block's sum of q) per 32, the exact (float)sum with groups, and ds16
// the same of each 16 values; noff16 = -OFF16 * the sums of each 16 values' int32 codes.
static void quantize_blocks(const float* x, int8_t* q, float* d, int32_t* noff16, float* ds, float* ds16,
                            int32_t* noff, int64_t m, int64_t b0, int64_t b1, int64_t M, int64_t K) {
  for (int64_t g0 = b0; g0 < b1; g0 += ACT_BLOCKS) {
    const int64_t g1 = std::min(b1, g0 + ACT_BLOCKS);
    vf mx = fzero();
    for (int64_t j = g0 * 32; j < g1 * 32; j += W)
      mx = fmax_(fabs_(floadu(x + m * K + j)), mx);  // a NaN |x| keeps mx: no NaN lanes
    const float db = hmax(mx) / 127.0f, id = db != 0.0f ? 1.0f / db : 0.0f;
    for (int64_t b = g0; b < g1; b++) {
      const float* xb = x + m * K + b * 32;
      vi c[32 / W];
      for (int j = 0; j < 32; j += W) c[j / W] = fround(fmul(floadu(xb + j), fset(id)));
      store_codes(q + m * K + b * 32, c);
#if W == 16  // integer sums: any order is exact
      const int32_t s0 = hsum(c[0]), s1 = hsum(c[1]);
#else
      const int32_t s0 = hsum(addi(c[0], c[1])), s1 = hsum(addi(c[2], c[3]));
#endif
      d[m * (K / 32) + b] = db;
      ds[m * (K / 32) + b] = ACT_BLOCKS == 1 ? db * (float)(s0 + s1) : (float)(s0 + s1);
      ds16[m * (K / 16) + 2 * b] = ACT_BLOCKS == 1 ? db * (float)s0 : (float)s0;
      ds16[m * (K / 16) + 2 * b + 1] = ACT_BLOCKS == 1 ? db * (float)s1 : (float)s1;
      for (int i = 0; i < OFF_PLANES; i++) noff[(i * M + m) * (K / 32) + b] = -OFFSETS[i] * (s0 + s1);
      noff16[m * (K / 16) + 2 * b] = -OFF16 * s0;
      noff16[m * (K / 16) + 2 * b + 1] = -OFF16 * s1;
    }
  }
}

// 32-blocks per item of the input's quantization: a one-row input (decoding) is split between the threads too
// (quantized whole by one thread, the other waited 0.1-0.3 ms a Qwen2.5-0.5B forward at its barrier).
#define QUANT_BLOCKS 8
static_assert(QUANT_BLOCKS % ACT_BLOCKS == 0, "a work item holds whole activation groups");

// ys[i] [M, N_i] = x [M, K] W_i^T (+ biases[i]) for nw weights of the same K: x is quantized once (scratch owned
// here), then one parallel pass runs over the row tiles of all weights, so small projections (k/v) share a
// fork with large ones. A tile's result does not depend on which call or pass computed it.
extern "C" void SD_EXPORT(sd_qlinear, SD_ISA)(const QWDesc* const* wds, const float* const* biases, float* const* ys,
                                            int nw, const float* xf, int64_t M, int nthreads) {
  const int64_t K = wds[0]->K, nb = K / 32, parts = (nb + QUANT_BLOCKS - 1) / QUANT_BLOCKS;
#if defined(SD_AMX)
  const int rc = tile_chunk_rows(M);
  const TileConfig cfg = tile_config(rc);
  const int64_t rows_q = pad_rows(M, rc);  // tiles read whole chunks of codes
#else
  const int64_t rows_q = M;
#endif
  std::unique_ptr<int8_t[]> q(new int8_t[rows_q * K]);
  memset(q.get() + M * K, 0, (rows_q - M) * K);
  std::unique_ptr<float[]> d(new float[M * K / 32]);
  std::unique_ptr<int32_t[]> noff16(new int32_t[M * K / 16]);
  std::unique_ptr<float[]> ds(new float[M * K / 32]);
  std::unique_ptr<float[]> ds16(new float[M * K / 16]);
  std::unique_ptr<int32_t[]> noff(new int32_t[OFF_PLANES * M * K / 32]);
  const QX x = {q.get(), d.get(), noff16.get(), ds.get(), ds16.get(), noff.get(), K, M, xf};
  QW w[MAX_WEIGHTS];
  int64_t first[MAX_WEIGHTS + 1] = {0};  // first global tile of each weight
  int64_t quantized_rows = 0;              // M where some weight takes int8 codes (F16/BF16 read xf as it is)
  for (int i = 0; i < nw; i++) {
    const QWDesc* wd = wds[i];
    w[i] = {wd->lo, wd->hi, wd->d, wd->d2, wd->sc, wd->mn, wd->N, K};
    first[i + 1] = first[i] + (wd->N + LANES - 1) / LANES;
    if (!float_format((int)wd->fmt)) quantized_rows = M;
  }
  WorkSplit split(nthreads, [&](int t) { return first[nw] * t / nthreads; });  // equal tiles per thread
#pragma omp parallel num_threads(nthreads)
  {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < quantized_rows * parts; i++) {  // (row, run of QUANT_BLOCKS blocks): one row shared too
      const int64_t m = i / parts, b0 = i % parts * QUANT_BLOCKS, b1 = std::min(nb, b0 + QUANT_BLOCKS);
      quantize_blocks(xf, q.get(), d.get(), noff16.get(), ds.get(), ds16.get(), noff.get(), m, b0, b1, M, K);
    }
    TileScratch* ts = nullptr;  // this thread's tiles, where it runs them
#if defined(SD_AMX)
    TileScratch scratch;
    if (tile_configure(cfg)) {  // a thread whose tiles do not take the configuration runs vectors
      memset(scratch.b, 0, sizeof scratch.b);
      scratch.rc = rc;
      ts = &scratch;
    }
#endif
    const int me = omp_get_thread_num();
    for (int64_t b, e; split.next(me, &b, &e);)
      for (int64_t g = b, i = 0; g < e; g++) {
        while (g >= first[i + 1]) i++;
        run_tile((int)wds[i]->fmt, w[i], x, biases[i], ys[i], g - first[i], M, ts);
      }
#if defined(SD_AMX)
    tile_release();  // leaves no tile state to this thread's next user (torch's pool)
#endif
  }
}

// The inner step alone, for `doctor`'s roofline: multiply-accumulates per second of `nthreads` threads running
// row_block<F> (one 32-block's integer dot products and float scaling for LOOP_ROWS input rows, accumulators in
// registers) over codes already unpacked and inputs in L1, best of `tries`. No unpacking, scale loading or
// weight streaming: the rate the many-row products could reach if those cost nothing (the AMX build: its tile
// pass's step, tile_loop). `sink` receives a value depending on every result, so the compiler keeps the loop.
#define LOOP_ROWS 8
#define LOOP_BLOCKS 32  // input rows of 1024 values: 8 KB of codes, in L1
template <int F>
static double loop_rate(int64_t reps, int seed, float* sink) {
  constexpr int64_t K = LOOP_BLOCKS * 32, nb = LOOP_BLOCKS;
  int8_t q[LOOP_ROWS * K];
  float d[LOOP_ROWS * nb], ds[LOOP_ROWS * nb], ds16[LOOP_ROWS * K / 16];
  int32_t noff16[LOOP_ROWS * K / 16], noff[OFF_PLANES * LOOP_ROWS * nb];
  for (int64_t i = 0; i < LOOP_ROWS * K; i++) q[i] = (int8_t)(i * 7 + seed);
  for (int64_t i = 0; i < LOOP_ROWS * nb; i++) d[i] = ds[i] = 1e-3f * (float)(i + 1);
  for (int64_t i = 0; i < LOOP_ROWS * K / 16; i++) noff16[i] = -(int32_t)i, ds16[i] = 1e-3f * (float)(i + 1);
  for (int64_t i = 0; i < OFF_PLANES * LOOP_ROWS * nb; i++) noff[i] = -(int32_t)i;
  const QX x = {q, d, noff16, ds, ds16, noff, K, LOOP_ROWS};
  vi u[8], uh[8];
  for (int g = 0; g < 8; g++) u[g] = uh[g] = set8((seed + g) & 15);
  const BlockScales k = {fset(0.5f), fset(0.25f), fset(0.125f), fset(0.0625f)};
  vf acc[LOOP_ROWS];
  for (int i = 0; i < LOOP_ROWS; i++) acc[i] = fzero();
  const double t0 = omp_get_wtime();
#if defined(SD_AMX)  // the tile pass's step: sums on tiles, the same scaling
  if (!tile_loop<F>(x, reps, u, k, acc)) return -1.0;
#else
  for (int64_t r = 0; r < reps; r++)
    for (int64_t blk = 0; blk < nb; blk++) {
      for (int g = 0; g < 8; g++) __asm__ volatile("" : "+v"(u[g]), "+v"(uh[g]));  // codes "change": no hoisting
#pragma GCC unroll 8
      for (int i = 0; i < LOOP_ROWS; i++) row_block<F>(x, blk, i, u, uh, k, acc[i]);
    }
#endif
  const double dt = omp_get_wtime() - t0;
  float out[W];
  for (int i = 0; i < LOOP_ROWS; i++) {
    fstore(out, acc[i], W);
    *sink += out[0];
  }
  return (double)reps * nb * LOOP_ROWS * 32 * W / dt;
}

extern "C" double SD_EXPORT(sd_loop_macs, SD_ISA)(int fmt, int64_t reps, int nthreads, int tries, float* sink) {
  double best = 0.0;
  for (int t = 0; t < tries; t++) {
    double total = 0.0;
    float s = 0.0f;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) reduction(+ : total, s, failed)
    with_format(fmt, [&](auto f) {
      const double rate = loop_rate<decltype(f)::value>(reps, omp_get_thread_num() + t, &s);
      total += rate, failed += rate < 0;
    });
    if (failed) return 0.0;  // a thread's tiles could not be configured: no rate
    *sink += s;
    if (total > best) best = total;
  }
  return best;
}

// Code of value 4g + tt of 32-block tb (tile-major index) in lane j, as the planes hold it (before the codebook).
template <int F>
static inline int code_at(const QWDesc* wd, int64_t tb, int j, int g, int tt) {
  const uint8_t* lo = wd->lo + tb * lo_bytes<F>() + j * 4 + tt;
  const uint8_t* hi = Fmt<F>::hb == 1 || Fmt<F>::hb == 2 ? wd->hi + tb * hi_bytes<F>() + j * 4 + tt : nullptr;
  if (Fmt<F>::hb == 8) return lo[g * LOAD];
  if (Fmt<F>::lo2) return ((lo[(g / 4) * LOAD] >> (2 * (g % 4))) & 3) | (Fmt<F>::hb ? ((hi[0] >> g) & 1) << 2 : 0);
  int u = (lo[(g / 2) * LOAD] >> (4 * (g & 1))) & 15;
  if (Fmt<F>::hb == 2) u |= ((hi[(g / 4) * LOAD] >> (2 * (g % 4))) & 3) << 4;
  if (Fmt<F>::hb == 1) u |= ((hi[0] >> g) & 1) << 4;
  return u;
}

// Row n of the weight -> out [K] fp32, computed as GGUF's reference dequantization does (the float32 operations
// in the same order).
template <int F>
static void dequant_row(const QWDesc* wd, int64_t n, float* out) {
  const int64_t K = wd->K, nb = K / 32, t = n / LANES;
  const int j = (int)(n % LANES);
  for (int64_t k = 0; k < K; k++) {
    const int64_t blk = k / 32, tb = t * nb + blk, ts = t * (K / 256) + blk / 8;
    int u = code_at<F>(wd, tb, j, (int)(k % 32) / 4, (int)(k % 4));
    if (Fmt<F>::lut) u = IQ4.u8[u];
    const float d = _cvtsh_ss(wd->d[(Fmt<F>::kq ? ts : tb) * LANES + j]);
    float v;
    if (Fmt<F>::sub16 && Fmt<F>::mins) {
      const uint8_t sm = wd->sc[(t * (K / 16) + k / 16) * LANES + j];
      v = (d * (float)(sm & 15)) * (float)u - _cvtsh_ss(wd->d2[ts * LANES + j]) * (float)(sm >> 4);
    } else if (Fmt<F>::sub16) {
      v = (d * (float)(int8_t)wd->sc[(t * (K / 16) + k / 16) * LANES + j]) * (float)(u - Fmt<F>::off);
    } else if (Fmt<F>::kq && Fmt<F>::mins) {
      v = (d * (float)wd->sc[tb * LANES + j]) * (float)u - _cvtsh_ss(wd->d2[ts * LANES + j]) * (float)wd->mn[tb * LANES + j];
    } else if (Fmt<F>::kq) {
      v = (d * (float)(int8_t)wd->sc[tb * LANES + j]) * (float)(u - Fmt<F>::off);
    } else if (Fmt<F>::mins) {
      v = d * (float)u + _cvtsh_ss(wd->d2[tb * LANES + j]);
    } else {
      v = d * (float)(u - Fmt<F>::off);
    }
    out[k] = v;
  }
}

// The weight's values of rows `rows` -> out [nrows, K] fp32 (dequant_row), for embedding lookups. Scalar: a
// handful of rows per call.
extern "C" void SD_EXPORT(sd_dequant_rows, SD_ISA)(const QWDesc* wd, const int64_t* rows, int64_t nrows,
                                                 float* out) {
  if (float_format((int)wd->fmt)) {
    for (int64_t r = 0; r < nrows; r++) float_row(wd->fmt == F_BF16, wd, rows[r], out + r * wd->K);
    return;
  }
  with_format((int)wd->fmt, [&](auto f) {
    for (int64_t r = 0; r < nrows; r++) dequant_row<decltype(f)::value>(wd, rows[r], out + r * wd->K);
  });
}
