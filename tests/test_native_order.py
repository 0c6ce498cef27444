"""llama.cpp's native libraries load before numpy's in every process the project starts.

On a CUDA build of llama.cpp, numpy loaded first crashes the model load (runtime/native.py). The
order cannot be seen from the CPU build's behaviour, so these tests read it where the dynamic
linker keeps it: the link map, in load order, of a fresh interpreter after each entry point's
import. Without `load_llama_first()` in the packages' __init__ files, numpy comes first (or
llama.cpp not at all) and they fail.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

from runtime import native

# every way a process of the project starts: the console scripts' modules, the tools, the test run
ENTRY_POINTS = [
    "server_bridge.cli",
    "agent.app.cli",
    "server_bridge.server",
    "agent.app.daemon",
    "protocol.wire",
    "protocol.compile_worker",  # protocol/sandbox.py's worker processes
    "tools.demo",
    "tools.bench.divergence",
    "tools.bench.loadgen",
    "tools.bench.gpu_engine",
    "tests.conftest",
]

PROBE = """
import importlib, json, sys
importlib.import_module(sys.argv[1])
from runtime import native
libs = [p.rsplit("/", 1)[-1] for p in native.loaded_libraries()]
print(json.dumps({"numpy_first": native.numpy_loaded_first(), "libs": libs}))
"""


def probe(module: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, module], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_each_entry_point_loads_llama_before_numpy(module):
    r = probe(module)
    assert r["numpy_first"] is False, (
        f"importing {module} loaded "
        + ("no libllama" if r["numpy_first"] is None else "numpy's core first")
        + f": {[n for n in r['libs'] if 'llama' in n or 'multiarray' in n]}"
    )


def test_the_link_map_sees_numpy_first_when_a_script_imports_it_first():
    """The detector itself: a script that imports numpy and then llama_cpp is caught, and warned about."""
    code = (
        "import numpy, llama_cpp, logging\n"
        "from runtime import native\n"  # runtime's own load_llama_first finds llama_cpp already loaded
        "logging.basicConfig(level=logging.WARNING)\n"
        "print(native.numpy_loaded_first())\n"
        "native.warn_if_numpy_first(gpu_offload=False)\n"
        "native.warn_if_numpy_first(gpu_offload=True)\n"
        "native.warn_if_numpy_first(gpu_offload=True)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"
    assert out.stderr.count("numpy was imported before llama_cpp") == 1  # once, and only with GPU offload


def test_this_test_process_loaded_llama_first(caplog):
    assert native.numpy_loaded_first() is False
    with caplog.at_level(logging.WARNING):
        native.warn_if_numpy_first(gpu_offload=True)
    assert not caplog.records


def test_one_backend_holds_the_gpu_per_process(monkeypatch):
    from server_bridge import engines

    monkeypatch.setattr(engines, "_gpu_backend", {})
    engines._claim_gpu("llamacpp", "big.gguf", uses_gpu=True)
    engines._claim_gpu("llamacpp", "other.gguf", uses_gpu=True)  # the same backend twice is fine
    engines._claim_gpu("torch", "hf-dir", uses_gpu=False)  # torch on the CPU beside it is fine
    with pytest.raises(RuntimeError, match="own process"):
        engines._claim_gpu("torch", "hf-dir", uses_gpu=True)
