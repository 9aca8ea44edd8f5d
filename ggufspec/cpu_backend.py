"""llama.cpp's CPU weight buffer types, and the known-broken ones ggufspec turns off before any model loads.

Besides plain memory, llama.cpp's CPU device offers "extra" buffer types that lay weights out for faster
matrix products (CPU_REPACK: Q4_0, Q4_K, IQ4_NL, Q8_0...; AMX on Intel Xeons with AMX). A model load takes,
for each weight, the first of them that supports its operation, so removing a broken one from the device's
list leaves exactly the placement of a build without it, repacking included.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from functools import cache

import llama_cpp

from .errors import GGUFSpecError
from .ggml_api import DEV_CPU, ggml, proc

# Buffer types whose kernels crash the process in llama-cpp-python 0.3.36 as pip builds it, and why.
BROKEN = {
    "AMX": "llama.cpp's AMX matrix kernels fault at `ldtilecfg` on the first prompt batch (a general-protection "
           "fault in ggml_backend_amx_mul_mat) when built with GCC 12, which zeroes half of the tile configuration",
}
ALLOW_ENV = "GGUFSPEC_ALLOW_{}"  # GGUFSPEC_ALLOW_AMX=1 keeps AMX, for a llama.cpp build whose AMX kernels work
REBUILD = ('CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON '
           '-DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON" '
           "pip install --force-reinstall --no-cache-dir llama-cpp-python==0.3.36")


@dataclass(frozen=True)
class CpuBackend:
    """What the CPU device offered, what ggufspec turned off (and why), what models now get."""

    offered: tuple[str, ...]
    dropped: dict[str, str]
    kept_broken: tuple[str, ...]  # known-broken types the user kept with GGUFSPEC_ALLOW_<NAME>=1

    @property
    def in_use(self) -> tuple[str, ...]:
        return tuple(n for n in self.offered if n not in self.dropped)


def extra_buffer_types():
    """(the ggml library, the CPU device's NULL-terminated array of extra buffer types), which llama.cpp reads at
    every model load; the array is None where this build does not let it be reached."""
    g = ggml()
    dev = g.ggml_backend_dev_by_type(DEV_CPU)
    fn = proc(g.ggml_backend_dev_backend_reg(dev) if dev else None, "ggml_backend_dev_get_extra_bufts",
              ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)
    return g, fn(dev) if fn else None


def _names(g, arr) -> list[str]:
    out, i = [], 0
    while arr and arr[i]:
        out.append(g.ggml_backend_buft_name(arr[i]).decode())
        i += 1
    return out


@cache
def prepare() -> CpuBackend:
    """Turn off known-broken CPU buffer types for this process (once), or refuse when one cannot be turned off."""
    llama_cpp.llama_backend_init()
    g, arr = extra_buffer_types()
    if arr is None:
        if "AMX_INT8 = 1" in llama_cpp.llama_print_system_info().decode(errors="replace"):
            raise GGUFSpecError(f"this llama.cpp build uses AMX kernels that crash, and ggufspec cannot turn them off "
                                f"here ({BROKEN['AMX']}). Rebuild llama-cpp-python without AMX: {REBUILD}")
        return CpuBackend((), {}, ())
    offered = _names(g, arr)
    kept = tuple(n for n in offered if n in BROKEN and os.environ.get(ALLOW_ENV.format(n)) == "1")
    dropped = {n: BROKEN[n] for n in offered if n in BROKEN and n not in kept}
    if dropped:
        keep = [arr[i] for i, n in enumerate(offered) if n not in dropped]
        for i in range(len(offered)):  # in place: the array is the device's own, and stays NULL-terminated
            arr[i] = keep[i] if i < len(keep) else None
    return CpuBackend(tuple(offered), dropped, kept)
