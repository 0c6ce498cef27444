"""The verifier's engine: the handful of operations verification needs, nothing of the backend.

    seq = engine.new_sequence()              an empty KV sequence for one session
    rows = engine.forward([Pass(...), ...])  one batched pass over many sessions' new tokens
    engine.truncate(seq, n)                  roll a sequence back to its first n positions
    engine.free(seq)                         give its KV back (also done when the handle is collected)

A `Pass` names where its tokens go (`start`: the positions of the sequence
that stay valid; anything the engine holds past them is dropped first, so a
pass that died earlier can never leave KV that a later pass attends to), the
new ids, how many of the last rows need logits, and taps: {layer: fn} called
during the pass with the residual stream after decoder block `layer`
(1-based) at those rows, hidden [keep, hidden] (the early exits read it).
A pass may also carry images {index in new_ids: PromptImage}: a vision engine
expands each image marker there to the image's positions; `start`, `keep`
and a sequence's `length` still count text ids (a marker is one).

Two backends implement it (`load_engine`): `llamacpp` (llamacpp.py; the
default for GGUF targets, no torch) and `torch` (torch.py; any transformers
model on any device). The verifier, batcher, exits and tools see only this
interface. Its types live in types.py (what the backends import, so the
backends never import this package's __init__ back) and are importable from here.
"""

from __future__ import annotations

import logging
from pathlib import Path

from .types import COMPILE_MODES, Engine, EngineFull, EngineInfo, NoRoom, Pass, Sequence, SequenceIds, check_batch

__all__ = [
    "COMPILE_MODES",
    "DTYPES",
    "ENGINES",
    "Engine",
    "EngineFull",
    "EngineInfo",
    "NoRoom",
    "Pass",
    "Sequence",
    "SequenceIds",
    "check_batch",
    "load_engine",
]

log = logging.getLogger(__name__)

ENGINES = ("auto", "llamacpp", "torch")
DTYPES = ("auto", "float32", "bfloat16", "float16")


_gpu_backend: dict[str, str] = {}  # backend -> the target it holds on the GPU, in this process


def _claim_gpu(backend: str, name: str, uses_gpu: bool) -> None:
    """One backend on the GPU per process: a CUDA llama.cpp and a CUDA torch in one process end in
    `free(): invalid pointer` (measured on an H100), so the second is refused with the reason."""
    if not uses_gpu:
        return
    other = next((b for b in _gpu_backend if b != backend), None)
    if other is not None:
        raise RuntimeError(
            f"this process holds {_gpu_backend[other]} on the GPU through the {other} engine; a "
            f"{backend} engine on the GPU beside it crashes the process: run it in its own process"
        )
    _gpu_backend[backend] = name


def _llama_offloads(n_gpu_layers: int) -> bool:
    import llama_cpp

    return bool(llama_cpp.llama_supports_gpu_offload()) and n_gpu_layers != 0


def _torch_on_cuda(device: str) -> bool:
    import torch

    return device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())


def load_engine(
    target: str,
    engine: str = "auto",
    device: str = "auto",
    dtype: str = "auto",
    threads: int = 0,
    max_sequences: int = 64,
    kv_tokens: int = 0,
    n_gpu_layers: int = -1,
    tap_layers: list[int] | None = None,
    max_len: int = 2048,
    kv_type: str = "f16",
    torch_compile: str = "off",
    batch_invariant: str = "auto",
    **llama_options,
) -> Engine:
    """The target behind one engine.

    engine auto: llamacpp for a GGUF target (the shipped smollm2-f32 is one), torch for a Hugging
    Face model directory. tap_layers: the decoder blocks the early exits may tap (llama.cpp must know
    them when its context is made). torch_compile: the torch engine's pass through torch.compile
    (compile_torch.py; auto: on CUDA): a server's config says auto, tools and tests off unless they ask.
    batch_invariant: every verify row as the engine's one-token pass computes it: the torch engine's mode
    (invariant_torch.py; auto: wherever the dtype is not float32), the llamacpp engine's (llamacpp._invariant;
    auto: off, for it gives up batching).
    llama_options: the llamacpp engine's own (kv_unified, n_ubatch, flash_attn). A process holds one
    backend on the GPU at most (`_claim_gpu`).
    """
    from protocol import modelfiles

    if target in modelfiles.TARGETS:
        from .llamacpp import prepare_target

        prepare_target(target)
    src = modelfiles.resolve_target(target)
    if engine == "auto":
        engine = "llamacpp" if Path(src).suffix == ".gguf" else "torch"
    name = modelfiles.target_name(target)  # the built file's path: the name it was built for (exits, estimator)
    if engine == "llamacpp":
        if Path(src).suffix != ".gguf":
            raise ValueError(f"the llamacpp engine needs a GGUF target, got {src}")
        from .llamacpp import LlamaCppEngine

        gpu = _llama_offloads(n_gpu_layers)
        _claim_gpu("llamacpp", name, gpu)
        return LlamaCppEngine(
            src,
            name,
            threads=threads,
            max_sequences=max_sequences,
            kv_tokens=kv_tokens,
            n_gpu_layers=n_gpu_layers,
            tap_layers=tap_layers or [],
            kv_type=kv_type,
            batch_invariant=batch_invariant == "on",  # auto: off (its price: docs/benchmarks/batch_invariant_cpu/)
            **llama_options,
        )
    if engine == "torch":
        if llama_options.get("mmproj"):
            raise ValueError(
                "mmproj is the llamacpp engine's: a torch vision-language target is a Hugging Face "
                "directory that holds its own vision tower and processor"
            )
        from .torch import TorchEngine

        _claim_gpu("torch", name, _torch_on_cuda(device))
        return TorchEngine(
            src,
            name,
            device=device,
            dtype=dtype,
            threads=threads,
            max_sequences=max_sequences,
            kv_tokens=kv_tokens,
            max_len=max_len,
            compile=torch_compile,
            batch_invariant=batch_invariant,
        )
    raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
