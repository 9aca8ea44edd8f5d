"""ggml's backend registry as ggufspec calls it, through llama-cpp-python's handle on libggml (and, through it,
ggml-base): one table of the functions used and their ctypes signatures, declared once (cpu_backend.py, rpc.py,
isolated.py). llama-cpp-python binds llama.h, not these."""

from __future__ import annotations

import ctypes
from functools import cache

# enum ggml_backend_dev_type
DEV_CPU, DEV_GPU, DEV_IGPU, DEV_ACCEL = 0, 1, 2, 3
ABORT_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_char_p)  # ggml_abort_callback_t: called before abort()

_vp, _size, _str = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p
SIGNATURES: dict[str, tuple[object, list[object]]] = {  # name: (restype, argtypes)
    "ggml_backend_dev_count": (_size, []),
    "ggml_backend_dev_get": (_vp, [_size]),
    "ggml_backend_dev_type": (ctypes.c_int, [_vp]),
    "ggml_backend_dev_by_type": (_vp, [ctypes.c_int]),
    "ggml_backend_dev_backend_reg": (_vp, [_vp]),
    "ggml_backend_reg_by_name": (_vp, [_str]),
    "ggml_backend_reg_dev_count": (_size, [_vp]),
    "ggml_backend_reg_dev_get": (_vp, [_vp, _size]),
    "ggml_backend_reg_get_proc_address": (_vp, [_vp, _str]),
    "ggml_backend_buft_name": (_str, [_vp]),
    "ggml_set_abort_callback": (_vp, [ABORT_CALLBACK]),
}


@cache
def ggml():
    """libggml with SIGNATURES declared."""
    from llama_cpp._ggml import libggml as g

    for name, (restype, argtypes) in SIGNATURES.items():
        fn = getattr(g, name)
        fn.restype, fn.argtypes = restype, argtypes
    return g


def proc(reg: int | None, name: str, restype: object, *argtypes: object):
    """A backend's own function `name` (ggml_backend_reg_get_proc_address, as llama.cpp's tools find them) with this
    signature; None where the backend is missing or lacks it."""
    address = ggml().ggml_backend_reg_get_proc_address(reg, name.encode()) if reg else None
    return ctypes.CFUNCTYPE(restype, *argtypes)(address) if address else None


def devices() -> list[int]:
    """The devices this build registered (ggml_backend_dev_t addresses); RPC servers' are added apart."""
    g = ggml()
    return [g.ggml_backend_dev_get(i) for i in range(g.ggml_backend_dev_count())]
