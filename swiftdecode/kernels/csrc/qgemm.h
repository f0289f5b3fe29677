// The qgemm library's interface shared by its sources (qgemm.cpp: the products; decoder.cpp: the layer loop).
#pragma once
#include <stdint.h>

struct QWDesc {  // one weight's planes, bound once from Python (kernels/qgemm.py: _Desc)
  int64_t fmt, N, K;
  const uint8_t* lo;
  const uint8_t* hi;
  const uint16_t* d;
  const uint16_t* d2;
  const uint8_t* sc;
  const uint8_t* mn;
};

#define MAX_WEIGHTS 8  // weights sharing one input per call (q/k/v, gate/up)

#if defined(SD_AMX)
#define SD_QISA amx
#elif defined(SD_AVX512)
#define SD_QISA avx512
#elif defined(SD_AVXVNNI)
#define SD_QISA avxvnni
#else
#define SD_QISA avx2
#endif
#define SD_QPASTE(a, b) a##_##b
#define SD_QNAME(a, b) SD_QPASTE(a, b)  // sd_qlinear + avx2 -> sd_qlinear_avx2

// ys[i] [M, N_i] = x [M, K] W_i^T (+ biases[i]) for nw <= MAX_WEIGHTS weights of the same K (see qgemm.cpp).
extern "C" void SD_QNAME(sd_qlinear, SD_QISA)(const QWDesc* const* wds, const float* const* biases,
                                              float* const* ys, int nw, const float* xf, int64_t M, int nthreads);
