"""llama.cpp's own convert_hf_to_gguf.py, offline: it writes the test VLMs' GGUFs (make_test_vlm.py, qwen_vlm.py);
and the libmtmd prefill both read those GGUFs back with (mtmd_prefill).

The converter comes from the llama-cpp-python sdist that the Makefile pins (its vendor/llama.cpp), extracted once
into ~/.cache/edgespec/llama-convert-<version>/; LLAMA_SDIST names a tarball or an extracted sdist for an
offline machine, else pip downloads it once.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
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
    tmp = f".{os.getpid()}.tmp"  # this process's own: two test runs may convert into one models/build
    argvs = [
        [str(hf_dir), "--outtype", outtype, "--outfile", str(out) + tmp] + (["--mmproj"] if mmproj else [])
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
        os.replace(str(out) + tmp, out)
        log(f"make_test_vlm: {out.name} ({'mmproj, ' if mmproj else ''}{outtype}) written by llama.cpp's converter")


def vlm_files(directory: str | Path) -> tuple[Path, Path, Path, Path, Path, Path]:
    """Where a test VLM's files lie: (directory, hf/, target.gguf, target-mmproj.gguf, draft.gguf,
    draft-mmproj.gguf), the first fields of make_test_vlm.TinyVLM and qwen_vlm.QwenVLM."""
    d = Path(directory)
    return d, d / "hf", d / "target.gguf", d / "target-mmproj.gguf", d / "draft.gguf", d / "draft-mmproj.gguf"


def make_vlm(directory: Path, key: dict, vlm_of, write_hf, draft_ftype: str, names: tuple[str, str], log=print):
    """A test VLM's five outputs in `directory`, made once: found by its manifest.json after, while that holds
    `key` and every file is there. vlm_of(vocab, image_token_id): the VLM's paths in `directory` with those
    fields; write_hf(hf_dir) writes the random Hugging Face model and its processor and returns (vocab size,
    image token id); llama.cpp's converter and quantizer write the GGUFs from it (write_ggufs). names: what
    the log calls the model ("" or "qwen2vl ") and what it calls its construction ("Idefics3", "qwen2vl");
    sentencepiece is needed: the converter imports it for every Llama or Qwen vocabulary, even a BPE one."""
    manifest = directory / "manifest.json"
    label, construction = names
    if manifest.is_file():
        saved = json.loads(manifest.read_text())
        vlm = vlm_of(saved.get("vocab", 0), saved.get("image_token_id", 0))
        files = (vlm.target, vlm.target_mmproj, vlm.draft, vlm.draft_mmproj, vlm.hf_dir / "config.json")
        if saved.get("key") == key and all(f.is_file() for f in files):
            log(f"make_test_vlm: {label}cached in {directory}")
            return vlm
    if importlib.util.find_spec("sentencepiece") is None:
        raise ModuleNotFoundError(
            "llama.cpp's convert_hf_to_gguf.py imports sentencepiece for every Llama or Qwen vocabulary (even a "
            "BPE one): pip install sentencepiece (setup.py's dev extra)"
        )
    t0 = time.perf_counter()
    directory.mkdir(parents=True, exist_ok=True)
    manifest.unlink(missing_ok=True)  # the manifest comes last: present means complete
    conv = converter_dir(log)
    vlm = vlm_of(0, 0)
    shutil.rmtree(vlm.hf_dir, ignore_errors=True)
    log(f"make_test_vlm: writing the random {construction} and its processor to {vlm.hf_dir}")
    vocab, image_id = write_hf(vlm.hf_dir)
    write_ggufs(conv, vlm, draft_ftype, t0, log)
    made = round(time.perf_counter() - t0, 1)
    manifest.write_text(json.dumps({"key": key, "vocab": vocab, "image_token_id": image_id, "made_s": made}, indent=1))
    log(f"make_test_vlm: {label}made in {made}s")
    return vlm_of(vocab, image_id)


def write_ggufs(conv: Path, vlm, draft_ftype: str, t0: float, log=print) -> None:
    """A test VLM's four GGUFs from vlm.hf_dir (vlm: a TinyVLM or QwenVLM): target and target mmproj in f32
    and the draft mmproj in f16 by llama.cpp's converter (conv: converter_dir()), then the draft text model
    quantized from the target to draft_ftype by llama.cpp's quantizer. t0: when the make began (for the log)."""
    log(
        f"make_test_vlm: converting with llama.cpp {LLAMA_CPP_VERSION}'s convert_hf_to_gguf.py "
        f"({time.perf_counter() - t0:.1f}s so far)"
    )
    convert(
        conv,
        vlm.hf_dir,
        [(vlm.target, "f32", False), (vlm.target_mmproj, "f32", True), (vlm.draft_mmproj, "f16", True)],
        log,
    )
    from server_bridge.engines.llamacpp import requantize

    quiet()
    requantize(str(vlm.target), str(vlm.draft), draft_ftype)
    log(f"make_test_vlm: {vlm.draft.name} quantized by llama.cpp ({draft_ftype})")


def quiet() -> None:
    """llama.cpp and libmtmd log every tensor and tile; keep their errors only."""
    import llama_cpp._logger
    import llama_cpp.mtmd_cpp as mtmd

    llama_cpp._logger.set_verbose(False)
    mtmd.mtmd_log_set(llama_cpp._logger.llama_log_callback, ctypes.c_void_p(0))
    mtmd.mtmd_helper_log_set(llama_cpp._logger.llama_log_callback, ctypes.c_void_p(0))


@dataclass
class MtmdPrefill:
    model: object  # llama_model pointer, freed when mtmd_prefill's block ends
    ctx: object  # llama_context pointer: the prompt decoded into sequence 0, positions 0 .. n_past - 1
    chunks: list  # ("text", [ids]) and ("image", n_tokens, n_pos), in order
    n_past: int  # the position after the prompt: text tokens + every image's n_pos
    n_vocab: int
    logits: object  # [n_vocab] np.ndarray (a copy): next-token logits after the prompt


@contextlib.contextmanager
def mtmd_prefill(
    gguf: str | Path, mmproj: str | Path, image, prompt: str, marker: str, n_ctx: int, n_threads: int = 1
) -> Iterator[MtmdPrefill]:
    """llama.cpp with libmtmd on `prompt` with `image` ([height, width, 3] uint8) at its `marker`: libmtmd
    tokenizes the text around its own image marker and tiles the image, mtmd_helper_eval_chunks encodes each
    tile and decodes text and image embeddings into the context. The model and context live until the block
    ends, for a caller that decodes on.

    One thread by default: the test models are tiny, and two ggml threads on a busy 2-core machine spin
    against each other for seconds (5 s against 7 ms measured)."""
    import llama_cpp
    import llama_cpp.mtmd_cpp as mtmd
    import numpy as np

    quiet()
    model = llama_cpp.llama_model_load_from_file(str(gguf).encode(), llama_cpp.llama_model_default_params())
    if not model:
        raise RuntimeError(f"llama.cpp could not load {gguf}")
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_threads, cp.n_threads_batch = n_ctx, n_ctx, n_threads, n_threads
    ctx = llama_cpp.llama_init_from_model(model, cp)
    mp = mtmd.mtmd_context_params_default()
    mp.use_gpu, mp.n_threads, mp.print_timings, mp.warmup = False, n_threads, False, False
    mctx = mtmd.mtmd_init_from_file(str(mmproj).encode(), model, mp)
    chunks = mtmd.mtmd_input_chunks_init()
    h, w, _ = image.shape
    bitmap = mtmd.mtmd_bitmap_init(w, h, (ctypes.c_uint8 * image.size).from_buffer_copy(np.ascontiguousarray(image)))
    try:
        if not mctx or not mtmd.mtmd_support_vision(mctx):
            raise RuntimeError(f"libmtmd could not load {mmproj} as a vision projector")
        text = prompt.replace(marker, mtmd.mtmd_default_marker().decode()).encode()
        inp = mtmd.mtmd_input_text(text, len(text), True, True)  # add_special, parse_special
        rc = mtmd.mtmd_tokenize(mctx, chunks, ctypes.byref(inp), (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap), 1)
        if rc != 0:
            raise RuntimeError(f"mtmd_tokenize returned {rc}")
        layout = []
        for i in range(mtmd.mtmd_input_chunks_size(chunks)):
            c = mtmd.mtmd_input_chunks_get(chunks, i)
            if mtmd.mtmd_input_chunk_get_type(c) == mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT:
                k = ctypes.c_size_t()
                ids = mtmd.mtmd_input_chunk_get_tokens_text(c, ctypes.byref(k))
                layout.append(("text", [ids[j] for j in range(k.value)]))
            else:
                layout.append(("image", mtmd.mtmd_input_chunk_get_n_tokens(c), mtmd.mtmd_input_chunk_get_n_pos(c)))
        n_past = llama_cpp.llama_pos(0)
        rc = mtmd.mtmd_helper_eval_chunks(mctx, ctx, chunks, 0, 0, cp.n_batch, True, ctypes.byref(n_past))
        if rc != 0:
            raise RuntimeError(f"mtmd_helper_eval_chunks returned {rc}")
        n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, -1), shape=(n_vocab,)).copy()
        yield MtmdPrefill(model, ctx, layout, n_past.value, n_vocab, logits)
    finally:
        mtmd.mtmd_bitmap_free(bitmap)
        mtmd.mtmd_input_chunks_free(chunks)
        if mctx:
            mtmd.mtmd_free(mctx)
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)
