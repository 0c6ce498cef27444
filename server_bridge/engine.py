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

Two backends implement it (`load_engine`): `llamacpp` (server_bridge/
engine_llamacpp.py; the default for GGUF targets, no torch) and `torch`
(server_bridge/engine_torch.py; any transformers model on any device). The
verifier, batcher, exits and tools see only this interface.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

log = logging.getLogger(__name__)

ENGINES = ("auto", "llamacpp", "torch")
DTYPES = ("auto", "float32", "bfloat16", "float16")


class EngineFull(RuntimeError):
    """No room left in the engine's KV memory (or its sequence ids) for this pass."""


@dataclass
class Sequence:
    """One session's KV in the engine. `id` is the engine's slot or sequence id."""
    id: int
    length: int = 0                 # positions the engine holds (may exceed the caller's committed length
                                    # after a pass; the next pass's `start` decides what is kept)


@dataclass
class Pass:
    """One session's part of a forward pass."""
    seq: Sequence
    start: int                      # positions of seq that stay valid; new_ids go at start, start + 1, ...
    new_ids: list[int]
    keep: int                       # logits rows wanted: the last `keep` of new_ids (0: KV only)
    taps: Mapping[int, Callable[[Any], None]] | None = None
    images: Mapping[int, Any] | None = None     # index in new_ids of an image marker -> its protocol.images
                                                # PromptImage (a vision engine expands the marker; None: text)

    def check(self) -> None:
        if not self.new_ids or not 0 <= self.keep <= len(self.new_ids):
            raise ValueError(f"a pass needs new ids and 0 <= keep <= {len(self.new_ids)}, got {self.keep}")
        if self.images and not all(0 <= i < len(self.new_ids) for i in self.images):
            raise ValueError(f"image indices {sorted(self.images)} must index the pass's {len(self.new_ids)} new ids")
        if not 0 <= self.start <= self.seq.length:
            raise ValueError(f"start {self.start} is past the {self.seq.length} positions the sequence holds")


@dataclass
class EngineInfo:
    """What serves: for welcome, /healthz and /metrics."""
    engine: str                     # llamacpp | torch
    device: str                     # cpu, cuda:0, gpu (llama.cpp offload)
    dtype: str                      # float32, bfloat16, ... (the weights' type as computed)
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"engine": self.engine, "device": self.device, "dtype": self.dtype, **self.extra}


class Engine(Protocol):
    name: str                       # the target's name (smollm2-f32 or a file name)
    info: EngineInfo
    vocab_size: int
    vocab_hash: str
    eos_ids: list[int]
    n_layers: int
    hidden_size: int
    kv_bytes_per_token: int         # KV of one token in every layer (the memory budget's unit)
    kv_capacity: int                # tokens of KV the engine can hold over all sequences
    batchable: bool                 # False: a batch runs one pass per session (same tokens)
    tokenizer: Any                  # encode(text) -> ids with the target's vocabulary (tools, tests)
    image_token_id: int | None      # the image marker's id (SmolVLM's <image>); None: the vocabulary has none
    vision: Any                     # truthy when passes may carry images (a projector, a VLM's vision tower)

    def new_sequence(self) -> Sequence: ...
    def forward(self, batch: list[Pass]) -> list[Any]: ...
    def truncate(self, seq: Sequence, n: int) -> None: ...
    def free(self, seq: Sequence) -> None: ...
    def to_numpy(self, rows: Any) -> np.ndarray: ...
    # images (ValueError for bytes that are no image or a text-only engine; protocol.vision.UnknownImage for
    # a sha256-only image the engine no longer holds): the verifier asks both at open, before any pass
    def image_positions(self, image: Any) -> int: ...     # KV positions the image's marker expands to
    def resolve(self, image: Any) -> Any: ...             # the PromptImage with its bytes (from the cache)
    def kv_pos(self, seq: Sequence, t: int) -> int: ...   # the KV position of text index t (images before it)


class SequenceIds:
    """A bounded pool of sequence ids. `release` may be called from any thread (a handle collected
    by the garbage collector); the ids come back in the model thread at the next `take`."""

    def __init__(self, n: int):
        self.capacity = n
        self.free_ids = list(range(n - 1, -1, -1))
        self._released: list[int] = []
        self._lock = threading.Lock()

    def take(self, on_release: Callable[[int], None]) -> int:
        self.reclaim(on_release)
        if not self.free_ids:
            raise EngineFull(f"all {self.capacity} sequences are in use")
        return self.free_ids.pop()

    def release(self, seq_id: int) -> None:
        with self._lock:
            self._released.append(seq_id)

    def reclaim(self, on_release: Callable[[int], None]) -> None:
        """In the model thread: clear every released sequence's KV and make its id usable again."""
        with self._lock:
            released, self._released = self._released, []
        for seq_id in released:
            on_release(seq_id)
            self.free_ids.append(seq_id)

    def in_use(self) -> int:
        with self._lock:
            return self.capacity - len(self.free_ids) - len(self._released)


def check_batch(batch: list[Pass]) -> None:
    if len({p.seq.id for p in batch}) != len(batch):
        raise ValueError("a session can be in a batch only once")
    for p in batch:
        p.check()


_gpu_backend: dict[str, str] = {}       # backend -> the target it holds on the GPU, in this process


def _claim_gpu(backend: str, name: str, uses_gpu: bool) -> None:
    """One backend on the GPU per process: a CUDA llama.cpp and a CUDA torch in one process end in
    `free(): invalid pointer` (measured on an H100), so the second is refused with the reason."""
    if not uses_gpu:
        return
    other = next((b for b in _gpu_backend if b != backend), None)
    if other is not None:
        raise RuntimeError(f"this process holds {_gpu_backend[other]} on the GPU through the {other} engine; a "
                           f"{backend} engine on the GPU beside it crashes the process: run it in its own process")
    _gpu_backend[backend] = name


def _llama_offloads(n_gpu_layers: int) -> bool:
    import llama_cpp

    return bool(llama_cpp.llama_supports_gpu_offload()) and n_gpu_layers != 0


def _torch_on_cuda(device: str) -> bool:
    import torch

    return device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())


def load_engine(target: str, engine: str = "auto", device: str = "auto", dtype: str = "auto", threads: int = 0,
                max_sequences: int = 64, kv_tokens: int = 0, n_gpu_layers: int = -1,
                tap_layers: list[int] | None = None, max_len: int = 2048, kv_type: str = "f16",
                **llama_options) -> Engine:
    """The target behind one engine.

    engine auto: llamacpp for a GGUF target (the shipped smollm2-f32 is one), torch for a Hugging
    Face model directory. tap_layers: the decoder blocks the early exits may tap (llama.cpp must know
    them when its context is made). llama_options: the llamacpp engine's own (kv_unified, n_ubatch,
    flash_attn). A process holds one backend on the GPU at most (`_claim_gpu`).
    """
    from protocol import modelfiles

    if target in modelfiles.TARGETS:
        from .engine_llamacpp import prepare_target

        prepare_target(target)
    src = modelfiles.resolve_target(target)
    if engine == "auto":
        engine = "llamacpp" if Path(src).suffix == ".gguf" else "torch"
    name = target if target in modelfiles.TARGETS else Path(src).name
    if engine == "llamacpp":
        if Path(src).suffix != ".gguf":
            raise ValueError(f"the llamacpp engine needs a GGUF target, got {src}")
        from .engine_llamacpp import LlamaCppEngine

        gpu = _llama_offloads(n_gpu_layers)
        _claim_gpu("llamacpp", name, gpu)
        return LlamaCppEngine(src, name, threads=threads, max_sequences=max_sequences, kv_tokens=kv_tokens,
                              n_gpu_layers=n_gpu_layers, tap_layers=tap_layers or [], kv_type=kv_type, **llama_options)
    if engine == "torch":
        if llama_options.get("mmproj"):
            raise ValueError("mmproj is the llamacpp engine's: a torch vision-language target is a Hugging Face "
                             "directory that holds its own vision tower and processor")
        from .engine_torch import TorchEngine

        _claim_gpu("torch", name, _torch_on_cuda(device))
        return TorchEngine(src, name, device=device, dtype=dtype, threads=threads, max_sequences=max_sequences,
                           kv_tokens=kv_tokens, max_len=max_len)
    raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
