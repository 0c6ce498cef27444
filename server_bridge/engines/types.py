"""The engine interface's types: what the verifier and every backend share.

`Pass`, `Sequence`, `EngineInfo`, the `Engine` protocol, `EngineFull` (`NoRoom`), `SequenceIds` and
`check_batch` (server_bridge/engines/__init__.py describes the operations). The backends import this
module, never the package's __init__, so its `load_engine` may import them without a cycle.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

COMPILE_MODES = ("auto", "on", "off")  # the torch engine's torch_compile (compile_torch.py)


class EngineFull(RuntimeError):
    """No room left in the engine's KV memory (or its sequence ids) for this pass."""


class NoRoom(EngineFull):
    """The room the sessions share (the sequence ids, a unified KV pool's cells) is all held: freeing
    another session's sequence makes room, where a pass too long for a session's own slot never fits."""


@dataclass
class Sequence:
    """One session's KV in the engine. `id` is the engine's slot or sequence id."""

    id: int
    length: int = 0  # positions the engine holds (may exceed the caller's committed length
    # after a pass; the next pass's `start` decides what is kept)


@dataclass
class Pass:
    """One session's part of a forward pass."""

    seq: Sequence
    start: int  # positions of seq that stay valid; new_ids go at start, start + 1, ...
    new_ids: list[int]
    keep: int  # logits rows wanted: the last `keep` of new_ids (0: KV only)
    taps: Mapping[int, Callable[[Any], None]] | None = None
    images: Mapping[int, Any] | None = None  # index in new_ids of an image marker -> its protocol.images
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

    engine: str  # llamacpp | torch
    device: str  # cpu, cuda:0, gpu (llama.cpp offload)
    dtype: str  # float32, bfloat16, ... (the weights' type as computed)
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"engine": self.engine, "device": self.device, "dtype": self.dtype, **self.extra}


class Engine(Protocol):
    name: str  # the target's name (smollm2-f32 or a file name)
    path: Path  # where it was loaded from (a GGUF's vocabulary serves grammars, the exits read its head)
    info: EngineInfo
    vocab_size: int  # logits rows' width
    vocab_hash: str  # modelfiles.vocab_hash: over the real part only
    vocab_real: int  # vocab_size less a tail of padding ids (modelfiles.real_vocab_size): what is served
    eos_ids: list[int]
    n_layers: int
    hidden_size: int
    kv_bytes_per_token: int  # KV of one token in every layer (the memory budget's unit)
    kv_capacity: int  # tokens of KV the engine can hold over all sequences
    max_sequences: int  # sessions it holds at once (serve's max_batch by default)
    batchable: bool  # False: a batch runs one pass per session (same tokens)
    packed: bool  # True: a pass packs its sessions' tokens, unpadded (llama.cpp); False: padded to a rectangle
    tokenizer: Any  # encode(text) -> ids with the target's vocabulary (tools, tests)
    image_token_id: int | None  # the image marker's id (SmolVLM's <image>); None: the vocabulary has none
    vision: Any  # truthy when passes may carry images (a projector, a VLM's vision tower)

    @property
    def kv_used(self) -> int: ...  # KV cells held by live sequences (/metrics)

    def new_sequence(self) -> Sequence: ...
    def forward(self, batch: list[Pass]) -> list[Any]: ...
    def truncate(self, seq: Sequence, n: int) -> None: ...
    def free(self, seq: Sequence) -> None: ...
    def to_numpy(self, rows: Any) -> np.ndarray: ...
    # images (ValueError for bytes that are no image or a text-only engine; runtime.vision.UnknownImage for
    # a sha256-only image the engine no longer holds): the verifier asks both at open, before any pass
    def image_positions(self, image: Any) -> int: ...  # KV positions the image's marker expands to
    def resolve(self, image: Any) -> Any: ...  # the PromptImage with its bytes (from the cache)
    def kv_pos(self, seq: Sequence, t: int) -> int: ...  # the KV position of text index t (images before it)


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
            raise NoRoom(f"all {self.capacity} sequences are in use")
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


def image_extra(batch: list[Pass], marker: int | None, seeing: Callable[[], Any]) -> list[int]:
    """Each pass's extra KV cells for its images (0 for text): an image's cells (its tokens) less its marker.
    Its positions are another count (fewer, for M-RoPE): each engine keeps them per sequence.

    Raises ValueError (or the vision's UnknownImage) for a pass the engine cannot run, before anything
    is written: images off the marker, an image among a tapped pass's kept rows, or no vision at all
    (`seeing()` returns the engine's vision or raises)."""
    extra = [0] * len(batch)
    for k, p in enumerate(batch):
        if not p.images:
            continue
        vision = seeing()
        wrong = [i for i in p.images if p.new_ids[i] != marker]
        if wrong:
            raise ValueError(
                f"images at {wrong} are not on the image marker {marker}: "
                f"the ids there are {[p.new_ids[i] for i in wrong]}"
            )
        if p.taps and max(p.images) >= len(p.new_ids) - p.keep:
            raise ValueError("taps read text rows only: an image may not be among a tapped pass's kept rows")
        extra[k] = sum(vision.cells(img) - 1 for img in p.images.values())
    return extra
