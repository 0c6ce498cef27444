"""llama.cpp's own convert_hf_to_gguf.py, offline: it writes the test VLMs' GGUFs (make_test_vlm.py, qwen_vlm.py).

The converter comes from the llama-cpp-python sdist that the Makefile pins (its vendor/llama.cpp), extracted once
into ~/.cache/edgespec/llama-convert-<version>/; LLAMA_SDIST names a tarball or an extracted sdist for an
offline machine, else pip downloads it once.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

LLAMA_CPP_VERSION = "0.3.36"  # the sdist whose convert_hf_to_gguf.py writes the GGUFs (as the Makefile pins)


def cache_root() -> Path:
    return Path.home() / ".cache" / "edgespec"


CONVERTER_FILES = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")  # what convert_hf_to_gguf.py imports


def converter_dir(log=print) -> Path:
    """A folder with llama.cpp's convert_hf_to_gguf.py, its conversion/ package and its gguf-py/, taken
    from the llama-cpp-python sdist once (as tools/build_llama_server.sh takes the sources)."""
    cache = cache_root() / f"llama-convert-{LLAMA_CPP_VERSION}"
    if (cache / "convert_hf_to_gguf.py").is_file():
        return cache
    cache_root().mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="llama-convert.", dir=cache_root()))  # same filesystem: renamed at the end
    try:
        sdist = os.environ.get("LLAMA_SDIST")
        if sdist and Path(sdist).is_dir():
            src = Path(sdist) / "vendor" / "llama.cpp"
            log(f"make_test_vlm: copying the converter from {src}")
            for w in CONVERTER_FILES:
                (shutil.copytree if w.endswith("/") else shutil.copy2)(src / w.rstrip("/"), tmp / w.rstrip("/"))
        elif sdist:
            _extract_converter(Path(sdist), tmp, log)
        else:
            with tempfile.TemporaryDirectory(prefix="llama-sdist.") as dl:
                _extract_converter(_download_sdist(Path(dl), log), tmp, log)
        if not (tmp / "convert_hf_to_gguf.py").is_file():
            raise FileNotFoundError(
                f"no vendor/llama.cpp/convert_hf_to_gguf.py in the llama-cpp-python "
                f"{LLAMA_CPP_VERSION} sdist ({sdist or 'downloaded'})"
            )
        shutil.rmtree(cache, ignore_errors=True)
        os.replace(tmp, cache)  # atomic: a half-extracted converter never looks cached
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return cache


def _download_sdist(into: Path, log) -> Path:
    log(f"make_test_vlm: downloading the llama-cpp-python {LLAMA_CPP_VERSION} sdist (~75 MB and ~1 min, once)")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--no-binary",
            ":all:",
            "-d",
            str(into),
            f"llama-cpp-python=={LLAMA_CPP_VERSION}",
        ],
        check=True,
    )
    return into / f"llama_cpp_python-{LLAMA_CPP_VERSION}.tar.gz"


def _extract_converter(tarball: Path, into: Path, log) -> None:
    """Only CONVERTER_FILES out of the sdist's vendor/llama.cpp/ (~1 s of its 75 MB)."""
    log(f"make_test_vlm: extracting the converter from {tarball}")
    prefix = f"llama_cpp_python-{LLAMA_CPP_VERSION}/vendor/llama.cpp/"
    with tarfile.open(tarball) as tar:
        for m in tar:
            rel = m.name[len(prefix) :] if m.name.startswith(prefix) else ""
            if (
                m.isfile()
                and ".." not in rel.split("/")
                and any(rel == w or (w.endswith("/") and rel.startswith(w)) for w in CONVERTER_FILES)
            ):
                dst = into / rel
                dst.parent.mkdir(parents=True, exist_ok=True)
                with tar.extractfile(m) as f_in, open(dst, "wb") as f_out:
                    shutil.copyfileobj(f_in, f_out)


# Runs convert_hf_to_gguf.py as its command line would, once per argv, in one interpreter: torch,
# transformers and the converter's modules are imported once (10 s against 24 s for three processes).
_RUN_CONVERTER = """
import json, runpy, sys
for argv in json.loads(sys.argv[1]):
    sys.argv = ["convert_hf_to_gguf.py"] + argv
    runpy.run_path("convert_hf_to_gguf.py", run_name="__main__")
"""


def convert(conv: Path, hf_dir: Path, jobs: list[tuple[Path, str, bool]], log=print) -> None:
    """llama.cpp's convert_hf_to_gguf.py on hf_dir for each (output, outtype, mmproj)."""
    argvs = [
        [str(hf_dir), "--outtype", outtype, "--outfile", str(out) + ".tmp"] + (["--mmproj"] if mmproj else [])
        for out, outtype, mmproj in jobs
    ]
    done = subprocess.run(
        [sys.executable, "-c", _RUN_CONVERTER, json.dumps(argvs)],
        cwd=conv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed (rc {done.returncode}):\n{done.stdout[-3000:]}")
    for out, outtype, mmproj in jobs:
        os.replace(str(out) + ".tmp", out)
        log(f"make_test_vlm: {out.name} ({'mmproj, ' if mmproj else ''}{outtype}) written by llama.cpp's converter")


def quiet() -> None:
    """llama.cpp and libmtmd log every tensor and tile; keep their errors only."""
    import llama_cpp._logger
    import llama_cpp.mtmd_cpp as mtmd

    llama_cpp._logger.set_verbose(False)
    mtmd.mtmd_log_set(llama_cpp._logger.llama_log_callback, ctypes.c_void_p(0))
    mtmd.mtmd_helper_log_set(llama_cpp._logger.llama_log_callback, ctypes.c_void_p(0))
