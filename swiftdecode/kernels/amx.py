"""Whether this process may run Intel AMX tile instructions (AMX-INT8), and if not why, checked once per process:
the CPU's flags (CPUID, as Linux reports them), the tile state the OS enables (arch_prctl ARCH_GET_XCOMP_SUPP:
the XCR0 components Linux supports) and this process's permission to use tile data (ARCH_REQ_XCOMP_PERM, which
Linux requires before the first tile instruction: without it that instruction faults). `doctor` reports it, and
the quantized kernel's AMX build loads only where it holds.
"""

from __future__ import annotations

import ctypes
import functools
import os

from swiftdecode.kernels.build import KernelUnavailable, check_platform, cpu_flags

AMX_FLAGS = {"amx_tile", "amx_int8"}
SYS_ARCH_PRCTL = 158  # x86-64 syscall number
ARCH_GET_XCOMP_SUPP, ARCH_REQ_XCOMP_PERM = 0x1021, 0x1023
XFEATURE_XTILEDATA = 18  # the XSAVE component of the tile registers' data (bit 18 of XCR0)


@functools.cache
def amx_status() -> tuple[bool, str]:
    """(usable, why): AMX-INT8 tiles usable by this process, or the first check that failed."""
    try:
        check_platform()
    except KernelUnavailable as e:
        return False, str(e)
    if missing := AMX_FLAGS - cpu_flags():
        return False, f"CPU lacks {'+'.join(sorted(missing))}"
    libc = ctypes.CDLL(None, use_errno=True)
    supported = ctypes.c_uint64(0)
    code = libc.syscall(ctypes.c_long(SYS_ARCH_PRCTL), ctypes.c_long(ARCH_GET_XCOMP_SUPP), ctypes.byref(supported))
    if code != 0 or not supported.value >> XFEATURE_XTILEDATA & 1:
        return False, "the OS does not enable the tile state (XCR0)"
    code = libc.syscall(ctypes.c_long(SYS_ARCH_PRCTL), ctypes.c_long(ARCH_REQ_XCOMP_PERM), XFEATURE_XTILEDATA)
    if code != 0:
        return False, f"Linux refused this process tile data ({os.strerror(ctypes.get_errno())})"
    return True, "AMX-INT8 tiles usable (tile data permitted to this process)"
