"""A load that maps the model file without reading it (`no_populate`).

llama.cpp's loader maps each model file with MAP_POPULATE and advises WILLNEED over all of it
(llama_model_loader::init_mappings, llama_mmap in llama-mmap.cpp): every byte is read at load,
the experts bmoe never reads through that mapping included. It skips both when the CPU backend
registry's `get_proc_address("ggml_backend_cpu_is_numa")` gives a function that answers true;
the file is then mapped as is and advised MADV_RANDOM. That answer is asked for only there (the
CPU compute code reads ggml's own NUMA state), so answering true for the duration of a load, and
putting the registry's function back after it, changes what the load reads and nothing else.
The registry is a writable `static struct ggml_backend_reg` in ggml-cpu.cpp; its layout is
checked (`registry_problem`) before it is touched.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from llama_cpp._ggml import libggml

GGML_BACKEND_DEVICE_TYPE_CPU = 0  # enum ggml_backend_dev_type (ggml-backend.h)
REGISTRY_API_VERSION = 2  # GGML_BACKEND_API_VERSION (ggml-backend-impl.h) of the pinned ggml
IS_NUMA = b"ggml_backend_cpu_is_numa"

_GetName = ctypes.CFUNCTYPE(ctypes.c_char_p, ctypes.c_void_p)
_GetProcAddress = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)
_IsNuma = ctypes.CFUNCTYPE(ctypes.c_bool)


class BackendRegI(ctypes.Structure):
    """Mirror of `struct ggml_backend_reg_i` (ggml-backend-impl.h): four function pointers."""

    _fields_ = [
        ("get_name", ctypes.c_void_p),
        ("get_device_count", ctypes.c_void_p),
        ("get_device", ctypes.c_void_p),
        ("get_proc_address", ctypes.c_void_p),
    ]


class BackendReg(ctypes.Structure):
    """Mirror of `struct ggml_backend_reg` (ggml-backend-impl.h)."""

    _fields_ = [("api_version", ctypes.c_int), ("iface", BackendRegI), ("context", ctypes.c_void_p)]


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


libggml.ggml_backend_dev_by_type.argtypes = [ctypes.c_int]
libggml.ggml_backend_dev_by_type.restype = ctypes.c_void_p
libggml.ggml_backend_dev_backend_reg.argtypes = [ctypes.c_void_p]
libggml.ggml_backend_dev_backend_reg.restype = ctypes.c_void_p
libggml.ggml_backend_reg_name.argtypes = [ctypes.c_void_p]
libggml.ggml_backend_reg_name.restype = ctypes.c_char_p
libggml.ggml_backend_reg_get_proc_address.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
libggml.ggml_backend_reg_get_proc_address.restype = ctypes.c_void_p
_libc = ctypes.CDLL(None)
_libc.dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
_libc.dladdr.restype = ctypes.c_int


def cpu_registry() -> int | None:
    """Address of the CPU backend's registry, found the way llama.cpp's loader finds it."""
    dev = libggml.ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU)
    return libggml.ggml_backend_dev_backend_reg(dev) if dev else None


def library_of(addr: int) -> str | None:
    """The file name of the shared library that holds code address `addr` (dladdr), or None."""
    info = _DlInfo()
    if not addr or not _libc.dladdr(addr, ctypes.byref(info)) or not info.dli_fname:
        return None
    return os.path.basename(info.dli_fname.decode(errors="replace"))


def registry_problem(reg: int | None) -> str | None:
    """None when the CPU registry at `reg` is the layout bmoe knows; else what differs.

    Read before anything is called through it: the API version, then every function pointer must
    be code in ggml's CPU backend library; only then are two of them called and their answers
    compared with ggml's public accessors (name "CPU", the same `is_numa` function)."""
    if not reg:
        return "llama.cpp has no CPU backend registry"
    r = BackendReg.from_address(reg)
    if r.api_version != REGISTRY_API_VERSION:
        return f"the CPU backend registry has api_version {r.api_version}, not {REGISTRY_API_VERSION}"
    for entry in BackendRegI._fields_:
        name = entry[0]
        lib = library_of(getattr(r.iface, name))
        if lib is None or "ggml-cpu" not in lib:
            return f"the CPU backend registry's {name} is not ggml-cpu code ({lib or 'no library'})"
    if _GetName(r.iface.get_name)(reg) != libggml.ggml_backend_reg_name(reg) or \
            libggml.ggml_backend_reg_name(reg) != b"CPU":
        return "the CPU backend registry's get_name does not answer as ggml_backend_reg_name"
    mine = _GetProcAddress(r.iface.get_proc_address)(reg, IS_NUMA)
    if not mine or mine != libggml.ggml_backend_reg_get_proc_address(reg, IS_NUMA):
        return "the CPU backend registry's get_proc_address does not answer as ggml's accessor"
    return None


_no_populate_lock = threading.Lock()


@contextmanager
def no_populate() -> Iterator[str | None]:
    """While open, llama.cpp's loads in this process map model files without reading them.

    Yields None when that is in force, or why not (the registry is not the known layout): the
    load then reads the file as it always did, and the caller says so. The registry's own
    `get_proc_address` is back in place when the block ends, however it ends."""
    with _no_populate_lock:
        reg = cpu_registry()
        problem = registry_problem(reg)
        if problem is not None:
            yield problem
            return
        assert reg is not None  # registry_problem names a missing registry
        iface = BackendReg.from_address(reg).iface
        original = iface.get_proc_address
        forward = _GetProcAddress(original)
        answer_true = _IsNuma(lambda: True)
        true_addr = ctypes.cast(answer_true, ctypes.c_void_p).value

        def get_proc_address(r: int, name: bytes) -> int | None:
            return true_addr if name == IS_NUMA else forward(r, name)

        patched = _GetProcAddress(get_proc_address)
        iface.get_proc_address = ctypes.cast(patched, ctypes.c_void_p).value
        try:
            yield None
        finally:
            iface.get_proc_address = original
