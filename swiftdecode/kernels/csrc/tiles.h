// Intel AMX tile operations as the quantized kernel uses them: on the CPU's tiles (SD_AMX), or emulated in
// scalar C (SD_AMX_EMULATE) so that the tile kernel's layout and numerics are tested on CPUs without AMX.
//
// The real operations are written in asm with a "memory" clobber rather than GCC's intrinsics: GCC 12 declares
// `_tile_loadconfig` as reading 8 bytes and `_tile_loadd` as reading none, so stores that fill a configuration
// or a tile's source buffer could be dropped or moved past the instruction (a prototype's `ldtilecfg` faulted
// until a compiler barrier went in). The emulation follows the SDM's pseudocode (TDPBSUD: signed bytes of A by
// unsigned bytes of B, four products per dword, int32 accumulation without saturation) and aborts where the
// hardware would fault (#UD/#GP): unconfigured tiles, shapes that do not match, a configuration out of range.
#pragma once
#include <stdint.h>
#include <string.h>

#define TILE_ROWS 16     // palette 1: 16 rows of at most 64 bytes per tile, 8 tiles
#define TILE_COLSB 64
#define TILE_COUNT 8

struct alignas(64) TileConfig {  // LDTILECFG's 64-byte memory operand, palette 1
  uint8_t palette, start_row, reserved0[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
static_assert(sizeof(TileConfig) == 64, "LDTILECFG reads 64 bytes");

#if defined(SD_AMX_EMULATE)
#include <stdio.h>
#include <stdlib.h>

struct TileState {
  TileConfig cfg;
  bool configured;
  uint8_t t[TILE_COUNT][TILE_ROWS][TILE_COLSB];
};
static thread_local TileState tile_state;

[[noreturn]] static void tile_fault(const char* what) {
  fprintf(stderr, "emulated AMX fault: %s\n", what);
  abort();
}
static inline void tile_check(int t) {
  if (!tile_state.configured) tile_fault("tile instruction without a tile configuration");
  if (tile_state.cfg.rows[t] == 0) tile_fault("tile register not configured");
}
static inline void tile_config_load(const TileConfig* c) {
  if (c->palette == 0) {  // the init state: tiles unconfigured and zeroed
    memset(&tile_state, 0, sizeof tile_state);
    return;
  }
  if (c->palette != 1 || c->start_row) tile_fault("palette must be 1, start_row 0");
  for (int i = 0; i < 14; i++)
    if (c->reserved0[i]) tile_fault("reserved configuration bytes must be zero");
  for (int t = 0; t < 16; t++) {
    const bool used = t < TILE_COUNT && (c->rows[t] || c->colsb[t]);
    if (t >= TILE_COUNT && (c->rows[t] || c->colsb[t])) tile_fault("palette 1 has 8 tiles");
    if (used && (!c->rows[t] || !c->colsb[t] || c->rows[t] > TILE_ROWS || c->colsb[t] > TILE_COLSB))
      tile_fault("a tile's rows or bytes per row out of range");
  }
  memcpy(&tile_state.cfg, c, sizeof *c);
  memset(tile_state.t, 0, sizeof tile_state.t);
  tile_state.configured = true;
}
static inline void tile_config_store(TileConfig* c) {
  if (tile_state.configured) memcpy(c, &tile_state.cfg, sizeof *c);
  else memset(c, 0, sizeof *c);
}
static inline void tile_release() { memset(&tile_state, 0, sizeof tile_state); }
template <int T>
static inline void tile_zero() {
  tile_check(T);
  memset(tile_state.t[T], 0, sizeof tile_state.t[T]);
}
template <int T>
static inline void tile_load(const void* p, int64_t stride) {  // rows x colsb bytes from p, rows `stride` apart
  tile_check(T);
  memset(tile_state.t[T], 0, sizeof tile_state.t[T]);
  for (int r = 0; r < tile_state.cfg.rows[T]; r++)
    memcpy(tile_state.t[T][r], (const uint8_t*)p + r * stride, tile_state.cfg.colsb[T]);
}
template <int T>
static inline void tile_store(void* p, int64_t stride) {
  tile_check(T);
  for (int r = 0; r < tile_state.cfg.rows[T]; r++)
    memcpy((uint8_t*)p + r * stride, tile_state.t[T][r], tile_state.cfg.colsb[T]);
}
template <int C, int A, int B>
static inline void tile_dp_su() {  // C[m][n] += sum_k s8 A[m][4k+i] * u8 B[k][4n+i]
  tile_check(C), tile_check(A), tile_check(B);
  const TileConfig& c = tile_state.cfg;
  if (c.colsb[A] / 4 != c.rows[B] || c.colsb[C] != c.colsb[B] || c.rows[C] != c.rows[A] || c.colsb[A] % 4)
    tile_fault("tdpbsud shapes do not match");
  for (int m = 0; m < c.rows[C]; m++)
    for (int n = 0; n < c.colsb[C] / 4; n++) {
      int32_t acc;
      memcpy(&acc, &tile_state.t[C][m][4 * n], 4);
      for (int k = 0; k < c.colsb[A] / 4; k++)
        for (int i = 0; i < 4; i++)
          acc += (int32_t)(int8_t)tile_state.t[A][m][4 * k + i] * (int32_t)tile_state.t[B][k][4 * n + i];
      memcpy(&tile_state.t[C][m][4 * n], &acc, 4);
    }
}
#else
static inline void tile_config_load(const TileConfig* c) { __asm__ volatile("ldtilecfg %0" ::"m"(*c) : "memory"); }
static inline void tile_config_store(TileConfig* c) { __asm__ volatile("sttilecfg %0" : "=m"(*c)::"memory"); }
static inline void tile_release() { __asm__ volatile("tilerelease" ::: "memory"); }
template <int T>
static inline void tile_zero() {
  __asm__ volatile("tilezero %%tmm%c0" ::"n"(T) : "memory");
}
template <int T>
static inline void tile_load(const void* p, int64_t stride) {
  __asm__ volatile("tileloadd (%0,%1,1), %%tmm%c2" ::"r"(p), "r"(stride), "n"(T) : "memory");
}
template <int T>
static inline void tile_store(void* p, int64_t stride) {
  __asm__ volatile("tilestored %%tmm%c2, (%0,%1,1)" ::"r"(p), "r"(stride), "n"(T) : "memory");
}
template <int C, int A, int B>
static inline void tile_dp_su() {  // AT&T order: tdpbsud B, A, C is Intel's tdpbsud C, A, B
  __asm__ volatile("tdpbsud %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"n"(C), "n"(A), "n"(B) : "memory");
}
#endif

// Loads `want` in this thread and reads it back: false if the thread's tiles do not hold it (the caller then
// runs its vector path). Every thread that runs tile instructions calls this first: a configuration belongs to
// the thread that loaded it (llama.cpp's AMX path faults in worker threads that never loaded one).
static inline bool tile_configure(const TileConfig& want) {
  tile_config_load(&want);
  TileConfig got;
  tile_config_store(&got);
  return memcmp(&got, &want, sizeof got) == 0;
}
