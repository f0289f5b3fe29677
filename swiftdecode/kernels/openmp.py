"""The process's OpenMP runtime: libgomp, the one torch loads and the kernel libraries bind to.

Why: libgomp keeps a thread pool for each thread that starts parallel regions, and once it manages more threads
than the machine has cores it stops spinning between regions: its threads sleep and every region pays a
wake-up. The server decodes on a worker thread while the main thread loaded the model (and so owns a pool). On
2 cores that tripled a forward (SmolLM2's native layer loop, ~300 regions: 3.0 ms on the main thread, 9.2-9.9
ms on another). Releasing the main thread's pool before the worker starts leaves one pool, and the worker's
forward costs what the main thread's did (3.3 ms).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: free the thread pool, keep what can be rebuilt cheaply


def release_thread_pool() -> bool:
    """Free the calling thread's OpenMP thread pool (`omp_pause_resource_all(omp_pause_soft)`); a later parallel
    region started from this thread builds a new one. Call it from a thread that hands its kernel work to
    another. False where no libgomp is loaded or it lacks the call (OpenMP < 5.0)."""
    lib = _libgomp()
    fn = getattr(lib, "omp_pause_resource_all", None) if lib is not None else None
    if fn is None:
        return False
    fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
    return fn(OMP_PAUSE_SOFT) == 0


def _libgomp() -> ctypes.CDLL | None:
    """The libgomp this process has loaded (torch's), or None."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return None
    paths = {fields[-1] for fields in (line.split() for line in maps) if len(fields) >= 6}
    found = sorted(p for p in paths if Path(p).name.startswith("libgomp"))
    return ctypes.CDLL(found[0]) if found else None
