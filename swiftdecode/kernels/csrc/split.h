// Work items [0, n) of one parallel region over a team of threads, split so that a slow thread does not hold
// the others at the region's end (shared by qgemm.cpp and skinny_gemm.cpp).
//
// Thread t owns a contiguous range (what a static schedule would give it) and claims its front a quarter of
// what is left at a time (guided: few atomic operations, each of which waits for the thread's loads in flight);
// a thread whose range is done takes single items from the back of the others'. On these machines a core's
// speed drifts 10-20% from one region to the next (other tenants, a server's event loop), and static splits
// left each thread waiting ~20% of its time at the regions' ends (perf, 16-row SmolLM2 forwards). Callers'
// items are computed independently of which thread runs them, so the split never changes a result's bits.
#pragma once
#include <stdint.h>

#include <algorithm>
#include <atomic>
#include <memory>

class WorkSplit {
  struct alignas(64) Range { std::atomic<uint64_t> v; };  // [lo, hi) as lo | hi << 32: one CAS moves either end
  std::unique_ptr<Range[]> r;
  int T;
  static bool take(Range& q, bool front, int64_t* b, int64_t* e) {
    uint64_t v = q.v.load(std::memory_order_relaxed);
    for (;;) {
      const uint32_t lo = (uint32_t)v, hi = (uint32_t)(v >> 32), n = front ? std::max(1u, (hi - lo) / 4) : 1;
      if (lo >= hi) return false;
      const uint64_t nv = front ? v + n : v - ((uint64_t)n << 32);
      if (q.v.compare_exchange_weak(v, nv, std::memory_order_relaxed)) {
        *b = front ? lo : hi - n, *e = front ? lo + n : hi;
        return true;
      }
    }
  }

 public:
  // A range per requested thread (threads >= 1), thread t's from bound(t) to bound(t + 1) (bound(0) = 0,
  // bound(threads) = n, n < 2^32); a smaller team takes the missing threads' ranges by stealing.
  template <class Bound>
  WorkSplit(int threads, Bound bound) : r(new Range[threads]), T(threads) {
    for (int t = 0; t < T; t++) r[t].v.store((uint64_t)bound(t) | (uint64_t)bound(t + 1) << 32);
  }
  bool next(int me, int64_t* b, int64_t* e) {  // the next items [b, e) for thread `me`; false when all are done
    if (take(r[me], true, b, e)) return true;
    for (int k = 1; k < T; k++)
      if (take(r[(me + k) % T], false, b, e)) return true;
    return false;
  }
};
