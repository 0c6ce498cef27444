"""llama.cpp's native libraries load before numpy's, in every process of this project.

Measured on an H100 with llama.cpp built for CUDA (llama-cpp-python 0.3.36, `-DGGML_CUDA=on`):
a fresh interpreter that imports numpy and then loads a model with layers offloaded dies with
SIGSEGV inside `llama_model_load_from_file`; the same two imports in the other order load and
serve. Users of llama-cpp-python report the same order dependence (its issue #1581: import
llama_cpp before numpy or pandas). The order is the whole difference, so every package here
(`agent`, `server_bridge`, `protocol`, `runtime`, `tools`, `tests`) calls `load_llama_first()` in its `__init__`,
which Python runs before any of the package's modules, and so before anything they import
pulls in numpy: the console scripts, `python -m tools.X`, the systemd units and the tests all
come through one of them. `tests/test_native_order.py` checks the order in fresh interpreters.

`import llama_cpp` loads libllama and libggml* (ctypes, in `llama_cpp.llama_cpp`) before its
own `llama.py` imports numpy, so importing the package is the whole fix. A process that has
imported numpy already (a user's script, a notebook) cannot be fixed from here: it gets one
warning naming the cause when it first loads a model with GPU offload (`warn_if_numpy_first`).

A CUDA llama.cpp and a CUDA torch in one process end in `free(): invalid pointer` on the same
machine; `server_bridge.engines.load_engine` refuses the second (tools that compare engines run
each in its own process).
"""

from __future__ import annotations

import ctypes
import logging
import sys

log = logging.getLogger(__name__)

LLAMA_LIB = "libllama"
NUMPY_LIB = "_multiarray_umath"  # numpy's core extension, the first native library numpy loads
_warned = False


def load_llama_first() -> None:
    """Import llama_cpp (its shared libraries) now, if it is installed and not imported yet."""
    if "llama_cpp" in sys.modules:
        return
    try:
        import llama_cpp  # noqa: F401  (loads libllama and libggml*, then numpy)
    except ImportError:  # a verifier on the torch engine alone, or a bare protocol install
        pass


def loaded_libraries() -> list[str]:
    """The paths of the shared objects in this process, in the order they were loaded (glibc's link map)."""
    names: list[str] = []

    class Info(ctypes.Structure):  # the head of struct dl_phdr_info
        _fields_ = [("addr", ctypes.c_void_p), ("name", ctypes.c_char_p)]

    callback_t = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(Info), ctypes.c_size_t, ctypes.c_void_p)

    def visit(info: ctypes._Pointer[Info], _size: int, _data: int | None) -> int:
        names.append((info.contents.name or b"").decode(errors="replace"))
        return 0

    try:
        ctypes.CDLL(None).dl_iterate_phdr(callback_t(visit), None)
    except (AttributeError, OSError):  # not glibc: no link map to read
        return []
    return names


def numpy_loaded_first() -> bool | None:
    """True if numpy's native core was loaded before libllama in this process; None if either is absent."""
    libs = loaded_libraries()
    at = {
        key: next((i for i, n in enumerate(libs) if key in n.rsplit("/", 1)[-1]), None)
        for key in (LLAMA_LIB, NUMPY_LIB)
    }
    llama, numpy = at[LLAMA_LIB], at[NUMPY_LIB]
    if llama is None or numpy is None:
        return None
    return numpy < llama


def warn_if_numpy_first(gpu_offload: bool) -> None:
    """Called where a model is loaded with GPU offload: say once if this process loaded numpy first."""
    global _warned
    if gpu_offload and not _warned and numpy_loaded_first():
        _warned = True
        log.warning(
            "numpy was imported before llama_cpp in this process: on a CUDA build of llama.cpp a model "
            "load with GPU layers is known to crash that way; import agent, server_bridge, protocol "
            "or llama_cpp before numpy (see runtime/native.py)"
        )
