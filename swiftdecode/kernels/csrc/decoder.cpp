// A Llama-family decoder's layers (pre-norm RMSNorm, rotary, grouped-query attention, SiLU-gated MLP; Qwen3's
// per-head query/key norms; Phi-3's fused projections and partial rotary; SmolLM3's layers without rotary; Gemma 3's
// GeLU, norms of the sublayers' outputs, sliding-window layers with their own rotary) in one native call over
// block-quantized weights, for one or more sequences each on its own KV cache.
//
// Why: at 1-8 rows a small model's layer spends ~0.4 ms in its seven projections, and driving the dozen kernel
// calls around them from Python costs about as much again. This loop calls the same kernels, in the same order
// and on the same buffers' values, as the Python forward in swiftdecode/lean.py: the products here, the fp32
// operations (RMSNorm, rotary, attention, SiLU, GeLU) through pointers to the one fp32 kernel library the process
// uses, so both forwards return the same bits and only the interpreter is gone.
#include <stdint.h>
#include <string.h>
#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "qgemm.h"

enum { SKIP_ATTN = 1, SKIP_MLP = 2 };                    // per-layer skip flags (the draft's skip set)
enum { NO_ROTARY = -1 };                                 // DecLayer.rotary of a layer without rotary (SmolLM3 NoPE)
enum { W_Q, W_K, W_V, W_O, W_GATE, W_UP, W_DOWN, N_W };  // a layer's projections

struct DecConfig {
  int64_t hidden, heads, kv_heads, head_dim, inter;
  float eps, scale;
  int64_t kv_half;  // the caches hold keys/values as fp16 (else fp32)
  int64_t rot_dim;  // each head's first rot_dim dims are rotated (head_dim, or less: Phi-4's partial rotary)
  int64_t gelu;     // the MLP's activation: GeLU, tanh approximation (Gemma), else SiLU
  float softcap;    // attention scores become softcap * tanh(score / softcap) (Gemma 2), or 0: as they are
};

struct DecLayer {  // w[W_K], w[W_V] null: w[W_Q] is q, k, v fused (Phi-3); w[W_UP] null: w[W_GATE] is gate, up fused
  const QWDesc* w[N_W];
  const float* b[N_W];  // biases or null
  const float* norm_attn;
  const float* norm_mlp;
  const float* norm_q;  // per-head RMSNorm of queries and keys before rotary (Qwen3, Gemma 3), or null
  const float* norm_k;
  int64_t rotary;  // the rotary table (of the call's tables) that turns its queries and keys; NO_ROTARY: none
  const float* norm_attn_out;  // RMSNorm of the attention's and the MLP's outputs before the residual add
  const float* norm_mlp_out;   // (Gemma 3), or null
  int64_t sliding;             // attends under the sequences' windowed masks (DecSeq.mask_local)
};

struct DecOps {  // the fp32 kernels (swiftdecode/csrc/skinny_gemm.cpp), bound from Python
  void (*rmsnorm)(const float* x, const float* w, float* y, int64_t M, int64_t H, float eps, int nthreads);
  void (*rope)(float* x, const float* cos_, const float* sin_, int64_t q, int64_t heads, int64_t D);
  void (*attention_many)(const float* q, const void* const* ks, const void* const* vs, const float* const* masks,
                         const int64_t* dims, float* out, int64_t nseq, int64_t H, int64_t Hkv, int64_t D,
                         float scale, float* scratch, int64_t max_t, int nthreads, int kv_half, float softcap);
  void (*silu_mul)(float* g, const float* u, int64_t n, int nthreads);
  void (*gelu_mul)(float* g, const float* u, int64_t n, int nthreads);
};

struct DecSeq {  // a sequence's rows [row0, row0 + rows) and its additive masks [rows, >= keys] (row stride)
  int64_t rows, row0;
  const float* mask;
  int64_t mask_stride;
  const float* mask_local;  // the sliding layers' (keys a window or more positions back hidden too), or null
};

// A (sequence, layer) cache buffer: keys/values [kv_heads, capacity, D] holding the entries first .. length - 1
// (a sliding layer's buffer drops entries a window behind: runtime/cache.py), entry t at buffer slot t - first.
struct DecKV {
  void* k;  // fp32, or fp16 bits (DecConfig.kv_half)
  void* v;
  int64_t head_stride, length, first;
};

// n values into the cache: copied, or rounded to fp16 (to nearest even, as torch's .half() rounds).
static void store_kv(void* dst, const float* src, int64_t n, bool half) {
  if (!half) {
    memcpy(dst, src, n * sizeof(float));
    return;
  }
  uint16_t* d = (uint16_t*)dst;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128((__m128i*)(d + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
  for (; i < n; ++i) d[i] = _cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT);
}

static void add_into(float* x, const float* y, int64_t n) {
  for (int64_t i = 0; i < n; i++) x[i] += y[i];
}

static void project(const DecLayer& L, const int* which, int n, const float* in, float* const* out, int64_t R,
                    int nthreads) {
  const QWDesc* w[3];
  const float* b[3];
  for (int i = 0; i < n; i++) w[i] = L.w[which[i]], b[i] = L.b[which[i]];
  SD_QNAME(sd_qlinear, SD_QISA)(w, b, out, n, in, R, nthreads);
}

// A fused projection's rows [R, sum of widths] split into its parts' buffers [R, width_i].
static void split_rows(const float* in, int64_t R, float* const* out, const int64_t* widths, int n) {
  int64_t total = 0;
  for (int i = 0; i < n; i++) total += widths[i];
  for (int64_t r = 0; r < R; r++)
    for (int i = 0, off = 0; i < n; off += widths[i], i++)
      memcpy(out[i] + r * widths[i], in + r * total + off, widths[i] * sizeof(float));
}

// q, k, v (or gate, up) of the layer's input h: three (two) projections in one kernel call, or the fused weight's
// one projection split into them (the same bits: each output row's dot products do not depend on the others).
static void project_parts(const DecLayer& L, const int* which, int n, const float* h, float* const* out,
                          const int64_t* widths, int64_t R, float* fused, int nthreads) {
  if (L.w[which[1]]) return project(L, which, n, h, out, R, nthreads);
  float* one[1] = {fused};
  project(L, which, 1, h, one, R, nthreads);
  split_rows(fused, R, out, widths, n);
}

// Rotary on each head's first rot_dim dims of x [R, heads, D] (cos/sin [R, rot_dim]).
static void rotate(const DecConfig& c, const DecOps& ops, float* x, const float* cos_, const float* sin_, int64_t R,
                   int64_t heads) {
  const int64_t D = c.head_dim, rot = c.rot_dim;
  if (rot == D) return ops.rope(x, cos_, sin_, R, heads, D);
  for (int64_t r = 0; r < R; r++)
    for (int64_t h = 0; h < heads; h++) ops.rope(x + (r * heads + h) * D, cos_ + r * rot, sin_ + r * rot, 1, 1, rot);
}

// Appends each sequence's new keys/values to its cache (advancing the entry's length) and runs attention of all
// rows (a sliding layer's under the sequences' windowed masks); q [R, heads * D] in, att [R, heads * D] out.
// kv[j][l]: sequence j's entry of this layer l. Attention sees the buffer's entries under the mask's columns from
// `first` on (the mask hides every entry before it: a sliding layer drops only keys beyond its window).
static void attend(const DecConfig& c, const DecOps& ops, const DecSeq* seqs, int64_t nseq, DecKV* const* kv,
                   int64_t l, bool sliding, const float* q, const float* k, const float* v, float* att, float* scratch,
                   int nthreads) {
  const int64_t D = c.head_dim, KD = c.kv_heads * D;
  std::vector<const void*> ks(nseq), vs(nseq);
  std::vector<const float*> masks(nseq);
  const int64_t elem = c.kv_half ? 2 : 4;
  std::vector<int64_t> dims(5 * nseq);
  int64_t max_t = 0;
  for (int64_t j = 0; j < nseq; j++) {
    DecKV& e = kv[j][l];
    const DecSeq& s = seqs[j];
    for (int64_t r = 0; r < s.rows; r++)
      for (int64_t g = 0; g < c.kv_heads; g++) {
        const int64_t src = (s.row0 + r) * KD + g * D, dst = g * e.head_stride + (e.length - e.first + r) * D;
        store_kv((char*)e.k + dst * elem, k + src, D, c.kv_half);
        store_kv((char*)e.v + dst * elem, v + src, D, c.kv_half);
      }
    ks[j] = e.k, vs[j] = e.v, masks[j] = (sliding ? s.mask_local : s.mask) + e.first;
    e.length += s.rows;
    const int64_t t = e.length - e.first;
    int64_t* d = dims.data() + 5 * j;
    d[0] = s.rows, d[1] = t, d[2] = e.head_stride, d[3] = s.mask_stride, d[4] = s.row0;
    max_t = std::max(max_t, t);
  }
  ops.attention_many(q, ks.data(), vs.data(), masks.data(), dims.data(), att, nseq, c.heads, c.kv_heads, D, c.scale,
                     scratch, max_t, nthreads, (int)c.kv_half, c.softcap);
}

// x [R, hidden] (the embeddings in, the last layer's residual stream out, in place); cos_[i]/sin_[i] [R, rot_dim]:
// rotary table i (DecLayer.rotary); skip [n_layers] flags; kv[j]: sequence j's entries, one per layer; scratch:
// attention's, for the longest cache.
// Skipped sublayers neither run nor touch their cache; the layers whose attention ran advance their lengths.
extern "C" void SD_QNAME(sd_decoder, SD_QISA)(const DecConfig* c, const DecLayer* layers, int64_t n_layers,
                                              const uint8_t* skip, const DecOps* ops, float* x, int64_t R,
                                              const float* const* cos_, const float* const* sin_,
                                              const DecSeq* seqs, int64_t nseq,
                                              DecKV* const* kv, float* scratch, int nthreads) {
  const int64_t H = c->hidden, QD = c->heads * c->head_dim, KD = c->kv_heads * c->head_dim, I = c->inter;
  std::vector<float> h(R * H), q(R * QD), k(R * KD), v(R * KD), att(R * QD), o(R * H), g(R * I), u(R * I);
  std::vector<float> fused(R * std::max(QD + 2 * KD, 2 * I));  // a fused projection's output, before its split
  const int64_t qkv_widths[3] = {QD, KD, KD}, gu_widths[2] = {I, I};
  static const int QKV[3] = {W_Q, W_K, W_V}, O[1] = {W_O}, GATE_UP[2] = {W_GATE, W_UP}, DOWN[1] = {W_DOWN};
  for (int64_t l = 0; l < n_layers; l++) {
    const DecLayer& L = layers[l];
    if (!(skip[l] & SKIP_ATTN)) {
      ops->rmsnorm(x, L.norm_attn, h.data(), R, H, c->eps, nthreads);
      float* qkv[3] = {q.data(), k.data(), v.data()};
      project_parts(L, QKV, 3, h.data(), qkv, qkv_widths, R, fused.data(), nthreads);
      if (L.norm_q) ops->rmsnorm(q.data(), L.norm_q, q.data(), R * c->heads, c->head_dim, c->eps, nthreads);
      if (L.norm_k) ops->rmsnorm(k.data(), L.norm_k, k.data(), R * c->kv_heads, c->head_dim, c->eps, nthreads);
      if (L.rotary != NO_ROTARY) {
        rotate(*c, *ops, q.data(), cos_[L.rotary], sin_[L.rotary], R, c->heads);
        rotate(*c, *ops, k.data(), cos_[L.rotary], sin_[L.rotary], R, c->kv_heads);
      }
      attend(*c, *ops, seqs, nseq, kv, l, L.sliding, q.data(), k.data(), v.data(), att.data(), scratch, nthreads);
      float* out[1] = {o.data()};
      project(L, O, 1, att.data(), out, R, nthreads);
      if (L.norm_attn_out) ops->rmsnorm(o.data(), L.norm_attn_out, o.data(), R, H, c->eps, nthreads);
      add_into(x, o.data(), R * H);
    }
    if (!(skip[l] & SKIP_MLP)) {
      ops->rmsnorm(x, L.norm_mlp, h.data(), R, H, c->eps, nthreads);
      float* gu[2] = {g.data(), u.data()};
      project_parts(L, GATE_UP, 2, h.data(), gu, gu_widths, R, fused.data(), nthreads);
      (c->gelu ? ops->gelu_mul : ops->silu_mul)(g.data(), u.data(), R * I, nthreads);
      float* out[1] = {o.data()};
      project(L, DOWN, 1, g.data(), out, R, nthreads);
      if (L.norm_mlp_out) ops->rmsnorm(o.data(), L.norm_mlp_out, o.data(), R, H, c->eps, nthreads);
      add_into(x, o.data(), R * H);
    }
  }
}
