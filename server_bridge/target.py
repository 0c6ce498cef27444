"""The target model as the verifier sees it: session states over an engine (server_bridge/engines/__init__.py).

A `TargetState` holds the committed prefix of one session and its engine
sequence, whose KV covers all but the last committed token (the last one is fed
with the next draft, so its logits come out of the same forward pass). A round
forwards only the new tokens; `commit` says which positions stay valid, and the
next pass starts there, so the engine never attends to rejected positions.

`Target.extend` runs several sessions in one pass. On the llamacpp engine the
batch is ragged (one llama_decode, each session its own sequence id and
positions); on the torch engine each session writes into its own preallocated
KV slot. Batching changes no session's tokens (tests/server_bridge/test_batching.py).

A vision-language target (`sees`) holds a prompt's images by the text index of
their marker (protocol/images.py); `extend` hands each pass the images among its
new ids, and the engine expands each marker to the image's positions. A state
counts text ids, as the wire does; `positions` adds what the images take.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from protocol.grammar import GrammarError, vocab_only
from protocol.structured import KINDS, Constraint, Vocabulary

from .engines import Engine, Pass, Sequence, load_engine

if TYPE_CHECKING:
    from .engines.llamacpp import LlamaCppEngine

log = logging.getLogger(__name__)


class Extension(Pass):
    """One session's part of a forward pass: the engine's `Pass`, placed by the session's state. Its new ids
    (uncached committed ids, then the draft) go at state.cached, its images are the state's among them, and
    `state` is kept for the pass's bookkeeping (`Target.extend`) and the estimator (`member`)."""

    def __init__(
        self,
        state: TargetState,
        new_ids: list[int],
        keep: int,  # logits rows wanted: the last `keep` of new_ids (0: KV only)
        taps: Mapping[int, Callable[[Any], None]] | None = None,  # see Target.score
    ):
        super().__init__(state.seq, state.cached, list(new_ids), keep, taps, _images_in(state, len(new_ids)))
        self.state = state

    @property
    def member(self) -> tuple[int, int]:
        """(L_cached, L_new) for the verification-time estimator."""
        return self.start, len(self.new_ids)


@dataclass(eq=False)
class TargetState:
    ids: list[int]  # the committed prefix, prompt included
    seq: Sequence  # the engine's KV for ids[:cached] (and whatever the last pass added)
    cached: int = 0  # valid KV positions; < len(ids), except == while a split
    # rejection waits for the robot's correction (see Verifier.fix)
    passes: int = 0  # forward passes spent on this session
    images: dict = field(default_factory=dict)  # text index of a marker in ids -> its PromptImage
    image_extra: int = 0  # KV positions the images add beyond their markers
    free: Callable[[], Any] = field(default=lambda: None, repr=False)  # gives seq back to the engine, once
    # (set by Target.new_state; also done when the state is collected): only where no pass can still use it

    @property
    def positions(self) -> int:
        """KV positions the committed prefix takes (its ids, each image's marker expanded)."""
        return len(self.ids) + self.image_extra


class Target:
    """Session states over one engine. Not thread-safe: the server calls it from one model thread."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.name = engine.name
        # The vocabulary served: the engine's less a tail of padding ids (modelfiles.real_vocab_size), which is
        # what the handshake agrees with the draft. Every logits row leaves `extend` cut to it: [keep, vocab_size].
        self.vocab_size = getattr(engine, "vocab_real", engine.vocab_size)
        self.vocab_hash = engine.vocab_hash
        self.eos_ids = engine.eos_ids
        self.n_layers = engine.n_layers
        self.kv_bytes_per_token = engine.kv_bytes_per_token
        self.batchable = engine.batchable
        self.packed = engine.packed
        self.tokenizer = engine.tokenizer  # encode(text) -> ids, for tools and tests
        self.on_device = engine.info.engine == "torch"  # rows are device tensors: the maths runs there
        # the image marker's id where the engine reads images (a projector or a VLM's vision tower), else None
        self.image_marker = getattr(engine, "image_token_id", None) if getattr(engine, "vision", None) else None
        self._grammars: Vocabulary | None = None
        self._grammars_lock = threading.Lock()

    @property
    def grammars_supported(self) -> bool:
        """Whether sessions may decode under a grammar: LLGuidance reads the target's GGUF vocabulary (the llamacpp
        engine's own model, or the GGUF a torch engine was converted from)."""
        return self.engine.info.engine == "llamacpp" or Path(getattr(self.engine, "path", "")).suffix == ".gguf"

    @property
    def grammar_kinds(self) -> list[str]:
        """The kinds of an open's grammar this target decodes under (protocol.wire.GRAMMAR_KINDS), none without a
        GGUF vocabulary."""
        return [k for k in KINDS if k != "regex"] if self.grammars_supported else []

    def grammar(self, grammar: dict[str, Any], peer: str = "") -> Constraint:
        """An open's grammar ({KIND: text, ...}: protocol.wire) compiled by LLGuidance over the target's vocabulary
        (cached, bounded, in a worker process first: protocol/structured.py); GrammarError (or its SchemaError)
        when it cannot be. `peer`: who sent it (compile work takes turns between peers). Called from the server's
        grammar threads and the model thread: the vocabulary is built once, under a lock."""
        with self._grammars_lock:
            vocabulary = self._grammars or self._vocabulary()
            self._grammars = vocabulary
        return vocabulary.for_wire(grammar, peer)

    def _vocabulary(self) -> Vocabulary:
        """LLGuidance's view of the target's GGUF vocabulary (~0.2 s: built once)."""
        import llama_cpp as L

        owner: object  # what keeps the vocabulary alive: the engine, or a vocabulary-only model
        if self.engine.info.engine == "llamacpp":
            vocab, owner = L.llama_model_get_vocab(cast("LlamaCppEngine", self.engine).model), self.engine
        elif self.grammars_supported:
            owner, vocab, n = vocab_only(str(self.engine.path))  # the vocabulary alone, no weights
            if n != self.engine.vocab_size:
                raise GrammarError(f"{self.engine.path} has {n} tokens, the target {self.engine.vocab_size}")
        else:
            raise GrammarError(
                f"the target {self.name} was not loaded from a GGUF: there is no vocabulary to compile the grammar over"
            )
        return Vocabulary(vocab, self.vocab_size, owner, gguf=self.engine.path)

    @property
    def sees(self) -> bool:
        return self.image_marker is not None

    def prepare_images(self, prompt_ids: list[int], images: list) -> tuple[dict, int]:
        """A prompt's images checked against it: ({marker index: image with its bytes}, extra KV positions).

        Raises ValueError (the wire's bad_image) for an image this target cannot take: no vision,
        not on a marker, bytes that are no image; vision.UnknownImage when only a hash came and the
        engine no longer holds it. Each image is tokenized here, so a batched pass never meets one."""
        if not images:
            return {}, 0
        if not self.sees:
            raise ValueError(f"the target {self.name} reads text only")
        out, extra = {}, 0
        for i, image in enumerate(images):
            if prompt_ids[image.at] != self.image_marker:
                raise ValueError(
                    f"images[{i}].at = {image.at} is not on the image marker (id {self.image_marker}): "
                    f"prompt_ids holds {prompt_ids[image.at]} there"
                )
            image = self.engine.resolve(image)
            extra += self.engine.image_positions(image) - 1
            out[image.at] = image
        return out, extra

    def new_state(self, prompt_ids: list[int], prefill: bool = True, images: list | None = None) -> TargetState:
        """A state for prompt_ids; with prefill, all but the last prompt token are forwarded now.

        Without it nothing is cached and the first `extend` forwards the prompt
        (the server batches prefills with other sessions' rounds). The engine's
        sequence goes back when the state is collected. images: the prompt's
        (protocol/images.py PromptImage, `at` its marker's index), see prepare_images.
        """
        by_index, extra = self.prepare_images(prompt_ids, images or [])
        seq = self.engine.new_sequence()
        state = TargetState(ids=list(prompt_ids), seq=seq, images=by_index, image_extra=extra)
        state.free = weakref.finalize(state, self.engine.free, seq)
        if prefill and len(prompt_ids) > 1:
            self.extend([Extension(state, list(prompt_ids[:-1]), 0)])
            state.cached = len(prompt_ids) - 1
        return state

    def free(self, state: TargetState) -> None:
        """Give the state's engine sequence back now, not when the state is collected (idempotent). Only
        where no pass can still use it: the model thread, between passes."""
        state.free()

    def score(
        self, state: TargetState, draft_ids: list[int], taps: Mapping[int, Callable[[Any], None]] | None = None
    ) -> np.ndarray:
        """One verification pass: logits [k + 1, vocab] for the positions after each draft prefix.

        Row i is the target's distribution for the token after ids + draft[:i]. Call
        `commit` to keep what was accepted. taps: {layer: fn}, see engines.Pass.
        """
        pending = state.ids[state.cached :]
        rows = self.extend([Extension(state, pending + list(draft_ids), len(draft_ids) + 1, taps)])[0]
        return self.engine.to_numpy(rows)

    def extend(self, batch: list[Extension]) -> list[Any]:
        """One forward pass over every session in batch; per session its logits rows [keep, vocab].

        vocab is the served vocabulary (`vocab_size`): the rows of a target's padding ids are dropped. That is
        the target's distribution restricted to its real tokens, the same as setting their logits to -inf before
        the softmax, for greedy, sampled verification, ar and residuals alike, so no id outside the agreed
        vocabulary can come out. Nothing worth keeping is lost: the padding rows of a trained model were never
        a training target, so they carry no probability a real token should have had (greedy never picks them
        in practice).

        The rows are the engine's own (numpy for llamacpp, device tensors for torch; `to_numpy`
        brings them to the host). Each pass starts at state.cached as it was when its Extension was made,
        whatever the engine held after an earlier pass (state.cached is the caller's to advance, by `commit`).
        """
        if len({id(e.state) for e in batch}) != len(batch):
            raise ValueError("a session can be in a batch only once")
        if len(batch) > 1 and not self.batchable:
            rows = [self.engine.forward([e])[0] for e in batch]
        else:
            rows = self.engine.forward(list(batch))
        for e in batch:
            e.state.passes += 1
        if self.vocab_size < self.engine.vocab_size:
            rows = [r[..., : self.vocab_size] for r in rows]  # a view: no copy on either engine
        return rows

    def argmax(self, rows: Any) -> np.ndarray:
        """The greedy ids of a pass's rows [keep] (int64): only they leave the device."""
        return np.asarray(self.engine.to_numpy(rows.argmax(-1)), dtype=np.int64)

    def argmax_each(self, rows: list[Any]) -> list[np.ndarray]:
        """The greedy ids [keep] (int64) of several sessions' rows of one pass, at once: on a device one argmax
        over the pass and one copy of its ids to the host, not one synchronisation per session."""
        if not rows:
            return []
        if self.on_device:
            import torch

            ids = self.engine.to_numpy(torch.cat(rows).argmax(-1))
        else:
            ids = np.concatenate([self.engine.to_numpy(r).argmax(-1) for r in rows])
        return np.split(ids.astype(np.int64, copy=False), np.cumsum([len(r) for r in rows])[:-1])

    def to_numpy(self, rows: Any) -> np.ndarray:
        """A pass's rows on the host, float32 [keep, vocab]."""
        return self.engine.to_numpy(rows)

    def rewind(self, state: TargetState, ids: list[int], images: list | None = None) -> None:
        """Re-point a state at another committed prefix and its images (None: the state's own that fall
        within ids), keeping the KV of the part both share: the ids up to the first that differ, or the
        first image that is not the same."""
        if images is None:
            images = [im for i, im in sorted(state.images.items()) if i < len(ids) and ids[i] == self.image_marker]
        by_index, extra = self.prepare_images(ids, images)
        keep = min(state.cached, shared_prefix(state.ids, state.images, ids, by_index), len(ids) - 1)
        state.ids = list(ids)
        state.images, state.image_extra = by_index, extra
        state.cached = keep
        self.engine.truncate(state.seq, keep)

    def commit(self, state: TargetState, new_ids: list[int], n_valid_in_cache: int) -> None:
        """Extend the committed prefix; keep only the KV positions still on it.

        Normally the last committed token is not in the KV (it is fed with the next
        draft). A split rejection commits only the accepted draft, all of it in the
        KV, and the robot's correction comes next; so the KV may cover every committed id.
        """
        state.ids.extend(new_ids)
        state.cached = min(n_valid_in_cache, len(state.ids))
        self.engine.truncate(state.seq, state.cached)


def load_target(name_or_path: str | None = None, engine: str = "auto", **kw) -> Target:
    """A Target on the engine named (auto: llamacpp for GGUF targets); kw go to engines.load_engine."""
    from protocol import modelfiles

    return Target(load_engine(name_or_path or modelfiles.DEFAULT_TARGET, engine, **kw))


def _images_in(state: TargetState, n_new: int) -> dict | None:
    """The state's images among the n_new ids a pass puts at state.cached, by their index there (None: text)."""
    images, start = state.images, state.cached
    if not images:
        return None
    inside = {i - start: image for i, image in images.items() if start <= i < start + n_new}
    return inside or None


def shared_prefix(ids_a: list[int], images_a: dict, ids_b: list[int], images_b: dict) -> int:
    """How many leading ids two prompts share, an image marker counting only where both hold the same image."""
    n = _common_prefix(ids_a, ids_b)
    differ = [
        i
        for i in set(images_a) | set(images_b)
        if i < n and getattr(images_a.get(i), "sha256", None) != getattr(images_b.get(i), "sha256", None)
    ]
    return min(differ, default=n)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)
