// The AMX build's many-row pass (included by qgemm.cpp after the vector pass's helpers, whose epilogue it shares).
//
// Per row tile and 32-block, one TDPBSUD per chunk of up to 16 input rows forms every (row, lane) integer dot
// product at once: A = the rows' int8 codes of the block (signed; read in place from the quantized input, rows K
// bytes apart), B = the block's unsigned codes in the weight layout as it is (B's row g is load g: 16 lanes x 4
// codes, the dword groups TDPBSUD takes; 8-bit codes are tile-loaded straight from the weight planes, narrower
// ones unpacked by the vector code into a 512-byte buffer in L1). The int32 sums are stored and handed, with
// the block's offset terms added (integer additions: exact), to scale_block: the same float sequence per
// (row, lane) as the vector pass, so the tile pass returns the vector builds' bits at any row count. The
// per-16 formats (Q6_K, Q3_K) sum their two 16-value halves apart: B0 holds the codes of values 0..15 (groups
// 0-3, groups 4-7 zero), B1 those of 16..31, one TDPBSUD each.
#pragma once
#include "tiles.h"

// Every product runs on tiles, one row included: the build exists to measure where tiles pay (`doctor --builds`
// on an AMX CPU times its k-curve beside the AVX-512 build's), and no AMX CPU has measured it yet.
#define TILE_CHUNKS (RMAX / TILE_ROWS)  // row chunks per pass, each its own A and C tiles
static_assert(TILE_CHUNKS == 2, "the tile registers below hold two chunks");
enum { T_A = 0, T_B0 = 2, T_B1 = 3, T_C = 4 };  // A chunk c: T_A + c; C chunk c, half h: T_C + 2c + h

struct TileScratch {  // one thread's: unpacked codes (B0, B1) and the stored sums of each chunk and half
  alignas(64) uint8_t b[2][8][LOAD];
  alignas(64) int32_t c[2 * TILE_CHUNKS][TILE_ROWS][LANES];
  int rc;  // rows per chunk (the configured A and C rows)
};

// The tile shapes of a call whose chunks hold rc rows: A rc x 32 bytes (one block of codes), B 8 x 64 (8 dword
// groups x 16 lanes), C rc x 64 (16 int32 lanes).
static inline TileConfig tile_config(int rc) {
  TileConfig c;
  memset(&c, 0, sizeof c);
  c.palette = 1;
  for (int i = 0; i < TILE_CHUNKS; i++) c.rows[T_A + i] = (uint8_t)rc, c.colsb[T_A + i] = 32;
  for (int t : {T_B0, T_B1}) c.rows[t] = 8, c.colsb[t] = LOAD;
  for (int i = 0; i < 2 * TILE_CHUNKS; i++) c.rows[T_C + i] = (uint8_t)rc, c.colsb[T_C + i] = LANES * 4;
  return c;
}

// Rows per chunk for an M-row product (every chunk the same, so one configuration serves the call; 1 for M = 0).
// The quantized input is padded to a whole number of chunks (pad_rows), zero codes whose sums are never read.
static inline int tile_chunk_rows(int64_t M) {
  const int64_t chunks = std::max<int64_t>(1, (M + TILE_ROWS - 1) / TILE_ROWS);
  return (int)std::max<int64_t>(1, (M + chunks - 1) / chunks);
}
static inline int64_t pad_rows(int64_t M, int rc) { return (M + rc - 1) / rc * rc; }

// B0 (and B1) = the unsigned codes of block tb of a row tile.
template <int F>
__attribute__((always_inline)) static inline void load_codes(const QW& w, int64_t tb, TileScratch& s) {
  if (Fmt<F>::hb == 8) return tile_load<T_B0>(w.lo + tb * lo_bytes<F>(), LOAD);
  vi u[8], uh[8];
  unpack<F>(w.lo + tb * lo_bytes<F>(), w.hi ? w.hi + tb * hi_bytes<F>() : nullptr, 0, u, uh);
  for (int g = 0; g < 8; g++)  // per-16 formats: groups 4-7 to B1 (their B0 rows and B1's rows 0-3 stay zero)
    _mm512_store_si512((void*)s.b[Fmt<F>::sub16 && g >= 4][g], u[g]);
  tile_load<T_B0>(s.b[0], LOAD);
  if (Fmt<F>::sub16) tile_load<T_B1>(s.b[1], LOAD);
}

// Chunk c's sums of block `blk`: C = A (its rows' codes, from row m) x B, for each half.
template <int F, int c>
__attribute__((always_inline)) static inline void chunk_sums(const QX& x, int64_t m, int64_t blk, TileScratch& s) {
  tile_zero<T_C + 2 * c>();
  tile_load<T_A + c>(x.q + m * x.K + blk * 32, x.K);
  tile_dp_su<T_C + 2 * c, T_A + c, T_B0>();
  if (Fmt<F>::sub16) {
    tile_zero<T_C + 2 * c + 1>();
    tile_dp_su<T_C + 2 * c + 1, T_A + c, T_B1>();
  }
  tile_store<T_C + 2 * c>(s.c[2 * c], LANES * 4);
  if (Fmt<F>::sub16) tile_store<T_C + 2 * c + 1>(s.c[2 * c + 1], LANES * 4);
}

// acc[i] += block `blk`'s contribution to row m0 + i (i < rows) from the chunks' stored sums and the block's
// scales: scale_block, as in the vector pass.
template <int F>
__attribute__((always_inline)) static inline void scale_sums(const QX& x, int64_t blk, int64_t m0, int rows,
                                                            const TileScratch& s, const BlockScales& k, vf* acc) {
  for (int i = 0; i < rows; i++) {
    const int c = i / s.rc, r = i % s.rc;
    vi sums[2], init[2];
    block_init<F>(x, blk, m0 + i, init);
    sums[0] = addi(init[0], _mm512_load_si512((const void*)s.c[2 * c][r]));
    sums[1] = Fmt<F>::sub16 ? addi(init[1], _mm512_load_si512((const void*)s.c[2 * c + 1][r])) : izero();
    scale_block<F>(x, blk, m0 + i, sums, k, acc[i]);
  }
}

// Rows m0..m0+rows-1 (rows <= TILE_CHUNKS * s.rc) against the 16 lanes of row tile `t`, blocks in order.
template <int F>
static void tile_rows_amx(const QW& w, const QX& x, const float* bias, float* y, int64_t t, int64_t m0, int rows,
                          TileScratch& s) {
  const int64_t nb = w.K / 32, n0 = t * LANES;
  const int chunks = (rows + s.rc - 1) / s.rc;
  vf acc[RMAX], out[ACT_BLOCKS > 1 ? RMAX : 1];
  for (int i = 0; i < rows; i++) acc[i] = fzero();
  for (int64_t blk = 0; blk < nb; blk++) {
    prefetch_ahead<F>(w, t, blk);
    load_codes<F>(w, t * nb + blk, s);
    chunk_sums<F, 0>(x, m0, blk, s);
    if (chunks > 1) chunk_sums<F, 1>(x, m0 + s.rc, blk, s);
    scale_sums<F>(x, blk, m0, rows, s, block_scales<F>(w, t, blk, 0), acc);
    group_end(x, blk, m0, rows, acc, out);
  }
  store_rows(bias, y, w.N, n0, (int)std::min<int64_t>(w.N - n0, LANES), m0, rows, acc, out);
}

template <int F>
static void tiles_all_rows(const QW& w, const QX& x, const float* bias, float* y, int64_t t, int64_t M,
                           TileScratch& s) {
  const int64_t pass = TILE_CHUNKS * s.rc;
  for (int64_t m = 0; m < M; m += pass) tile_rows_amx<F>(w, x, bias, y, t, m, (int)std::min(pass, M - m), s);
}

// The tile pass's inner step for sd_loop_macs: `reps` rounds over x's blocks (x.M <= 16 rows, one chunk) of the
// codes u (unpacked once), sums on tiles and scale_sums into acc; false where the tiles do not take the
// configuration.
template <int F>
static bool tile_loop(const QX& x, int64_t reps, const vi u[8], const BlockScales& k, vf* acc) {
  TileScratch s;
  memset(s.b, 0, sizeof s.b);
  s.rc = (int)x.M;
  if (!tile_configure(tile_config(s.rc))) return false;
  for (int g = 0; g < 8; g++) _mm512_store_si512((void*)s.b[Fmt<F>::sub16 && g >= 4][g], u[g]);
  for (int64_t r = 0; r < reps; r++)
    for (int64_t blk = 0; blk < x.K / 32; blk++) {
      tile_load<T_B0>(s.b[0], LOAD);
      if (Fmt<F>::sub16) tile_load<T_B1>(s.b[1], LOAD);
      chunk_sums<F, 0>(x, 0, blk, s);
      scale_sums<F>(x, blk, 0, (int)x.M, s, k, acc);
    }
  tile_release();
  return true;
}
