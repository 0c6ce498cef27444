"""The robot's draft model: a GGUF through llama-cpp-python, proposing k tokens with their q.

Per-token logits come from `llama_get_logits_ith(ctx, -1)` after each decode
(no `logits_all`, which would hold an [n_ctx, vocab] float32 table). The KV
cache follows the committed prefix: a rejection rolls it back by setting
`n_tokens` (llama-cpp's `eval` drops every KV entry past it first).

A vision-language draft (`mmproj` given: libmtmd's projector, runtime/vision.py)
reads the current prompt's images (`use_images`): the context holds each image's
marker expanded to the image's positions, so the KV is indexed by position,
`expand(ids)`, in which an image's positions carry a negative stand-in id of its
own (`n_tokens` is the next free position, not a count of cells: an M-RoPE image,
Qwen-VL's, takes more cells than positions). A step's image and text are
prefilled once and the shared prefix's KV kept, as for text; every rollback cuts
by position.

Not thread-safe: one `Drafter` (one llama context) per thread.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import functools
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from protocol import modelfiles, sampling
from protocol.images import PromptImage
from protocol.payload import DraftQ, PayloadSpec, draw
from protocol.sampling import SamplingParams
from protocol.structured import ConstraintState, Vocabulary
from runtime import llamalog

log = logging.getLogger(__name__)


class DraftContextFull(RuntimeError):
    pass


@dataclass
class Draft:
    ids: list[int]  # [k] proposed token ids; k can be zero
    q: DraftQ | None  # the draft distributions as the payload mode sends them; None when greedy
    ms: float  # wall time spent drafting (gamma * T_p)
    cands: np.ndarray | None = None  # [k, K] int32: the draft's top-K ids per position (for early exits)
    cand_p: np.ndarray | None = None  # [k, K] the draft's probabilities of those ids (for pre-draft guesses)

    def head(self, k: int) -> "Draft":
        """The first k tokens of this draft (a prefix of a draft is a valid draft)."""

        def cut(a: np.ndarray | None) -> np.ndarray | None:
            return None if a is None else a[:k]

        return Draft(
            self.ids[:k], None if self.q is None else self.q.head(k), self.ms, cut(self.cands), cut(self.cand_p)
        )

    def wire_q(self) -> dict[str, Any]:
        """Verify.q for this draft."""
        return {"kind": "none"} if self.q is None else self.q.to_wire()


def top_candidates(
    logits: np.ndarray, k: int, params: SamplingParams, q: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """The k highest-scoring ids (int32, unordered) and their draft probabilities.

    Probabilities are q's where the token was sampled from q (T > 0), else the softmax at T = 1.
    About 0.5 ms for 49,152 logits (argpartition and one softmax).
    """
    ids = np.argpartition(logits, -k)[-k:].astype(np.int32)
    if q is None:
        z = logits.astype(np.float64) - logits.max()
        q = np.exp(z)
        q /= q.sum()
    return ids, q[ids].astype(np.float32)


_params_lock = threading.Lock()


@contextlib.contextmanager
def _model_params(use_extra_bufts: bool) -> Iterator[None]:
    """llama-cpp-python's `Llama` exposes no `use_extra_bufts`; set it on the default params while
    one model loads. Off by default: a llama.cpp 0.3.36 built with -march=native on a CPU with AMX
    crashes in llama_decode on multi-token batches when they are on, and on the portable AVX2 build
    the Makefile makes they measured no faster here (19.0 vs 21.8 ms/token, 2 threads)."""
    import llama_cpp
    import llama_cpp.llama_cpp as bindings_module

    bindings: Any = bindings_module  # the module llama_cpp.llama calls llama_model_default_params through
    with _params_lock:
        original = llama_cpp.llama_model_default_params

        def patched() -> Any:
            p = original()
            p.use_extra_bufts = use_extra_bufts
            return p

        bindings.llama_model_default_params = patched
        try:
            yield
        finally:
            bindings.llama_model_default_params = original


def stack_candidates(
    rows: list[tuple[np.ndarray, np.ndarray]], n_cands: int
) -> tuple[np.ndarray, np.ndarray] | tuple[None, None]:
    """Per-position (ids, probs) -> ([k, K] int32, [k, K] float32); (None, None) when not asked for."""
    if not n_cands:
        return None, None
    if not rows:
        return np.zeros((0, n_cands), np.int32), np.zeros((0, n_cands), np.float32)
    return np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])


def gpu_layers(requested: int, supported: bool) -> int:
    """The layers to offload: the request (-1 = all) where this llama.cpp build can offload, else none."""
    return requested if supported else 0


class Drafter:
    def __init__(
        self,
        model: str = modelfiles.DEFAULT_DRAFT,
        n_ctx: int = 4096,
        threads: int = 2,
        extra_buffers: bool = False,
        n_gpu_layers: int = -1,
        mmproj: str | Path | None = None,
        vision_threads: int = 1,
    ):
        from llama_cpp import Llama, llama_model_get_vocab, llama_supports_gpu_offload, llama_vocab_get_text

        self.path: Path = modelfiles.resolve_draft(model)
        self.name = model if model in modelfiles.DRAFTS else self.path.name
        # llama.cpp's own answer: a CUDA build on the Orin says yes, the CPU wheel no (then -1 would be ignored
        # silently; saying 0 and logging why is what an operator can read)
        supported = bool(llama_supports_gpu_offload())
        layers = gpu_layers(n_gpu_layers, supported)
        self.offload = {
            "device": "gpu" if layers else "cpu",
            "n_gpu_layers": layers,
            "llama_supports_gpu_offload": supported,
        }
        if n_gpu_layers and not supported:
            log.warning(
                "draft on the CPU: this llama.cpp build has no GPU offload (on a Jetson: make setup-robot "
                "builds it with CUDA when nvcc is present)"
            )
        t0 = time.perf_counter()
        with _model_params(extra_buffers):
            self.llm = Llama(
                str(self.path),
                n_ctx=n_ctx,
                n_threads=threads,
                n_threads_batch=threads,
                n_batch=512,
                logits_all=False,
                verbose=llamalog.verbose(),
                n_gpu_layers=layers,
            )
        self.vocab_size = int(self.llm.n_vocab())
        vocab = llama_model_get_vocab(self.llm.model)
        pieces = [llama_vocab_get_text(vocab, i) for i in range(self.vocab_size)]
        self.vocab_hash = modelfiles.vocab_hash(pieces)  # over the real part: a padding tail is no vocabulary
        # Ids drawn and logits rows: the real part alone (Qwen2-VL-2B's 151,936 rows pad its tokenizer with
        # [PAD<id>] rows; the verifier agrees on the real part and never sends past it, so nor does the draft)
        self.vocab_real = modelfiles.real_vocab_size(pieces)
        self.eos_ids = {int(self.llm.token_eos())}
        # compiles structured output's grammars (a peer's in a worker process first: protocol/sandbox.py)
        self.grammars = Vocabulary(vocab, self.vocab_real, owner=self.llm, gguf=self.path)
        self.chat_template = self.llm.metadata.get("tokenizer.chat_template")
        self.vision = None  # libmtmd's projector (runtime/vision.py) when the draft sees
        self.image_marker: int | None = None  # the image marker's id in this vocabulary
        # marker index -> (image, positions, stand-in id, KV cells)
        self._images: dict[int, tuple[PromptImage, int, int, int]] = {}
        if mmproj is not None:
            from runtime.vision import MtmdVision, marker_id

            self.image_marker = marker_id(vocab)
            if self.image_marker is None:
                raise ValueError(
                    f"draft {self.name} has a projector ({mmproj}) but no image marker token in its "
                    "vocabulary: is it a vision-language model?"
                )
            self.vision = MtmdVision(mmproj, self.llm.model, threads=vision_threads, use_gpu=bool(layers))
        log.info(
            "draft %s loaded from %s in %.2fs (vocab %d, %d threads, %s)",
            self.name,
            self.path,
            time.perf_counter() - t0,
            self.vocab_size,
            threads,
            f"GPU: {'all' if layers < 0 else layers} layers" if layers else "CPU",
        )

    def sibling(self) -> Drafter:
        """Another Drafter over this one's loaded model: the same weights (read once, in memory once, on the
        CPU or the GPU), vocabulary, grammars and projector, and a llama.cpp context (KV cache) of its own.

        For a second user of the draft model that takes turns with the first (agent/app/drafting.py: the chat
        endpoint beside the navigation): each keeps the KV of its own prompt, so neither re-prefills the other's
        between turns. Not for use at the same time as this one (they share the projector's state); this one
        is kept alive as long as the sibling (its model)."""
        from llama_cpp import _internals

        llm = self.llm
        # llama-cpp-python's Llama: the model, metadata and settings shared (not copy.copy: Llama pickles by
        # its settings, and a copy would load the model again) ...
        twin = object.__new__(type(llm))
        twin.__dict__.update(llm.__dict__)
        twin._stack = contextlib.ExitStack()  # ... a context, batch and token tables of its own
        twin._ctx = twin._stack.enter_context(
            contextlib.closing(_internals.LlamaContext(model=llm._model, params=llm.context_params, verbose=False))
        )
        twin._batch = twin._stack.enter_context(
            contextlib.closing(
                _internals.LlamaBatch(n_tokens=llm.n_batch, embd=0, n_seq_max=llm.context_params.n_ctx, verbose=False)
            )
        )
        twin._candidates = _internals.LlamaTokenDataArray(n_vocab=llm._n_vocab)
        twin.input_ids = np.empty_like(llm.input_ids)
        twin.scores = np.empty_like(llm.scores)  # as Llama makes it: pages only where written
        twin.n_tokens = 0
        twin._sampler = None
        twin._owner = llm  # type: ignore[attr-defined]  # the model lives as long as the context built over it
        out = copy.copy(self)
        out.llm = twin
        out._images = {}
        return out

    # ------------------------------------------------------------------ text

    def tokenize(self, text: str, chat: bool = False) -> list[int]:
        """Text -> ids. With chat=True the text becomes one user turn in the model's chat template.

        ValueError, before llama.cpp reads a byte, for a text the context cannot hold: every id spells at most
        `longest_token` bytes of it, so over n_ctx * longest_token bytes is over n_ctx ids. llama.cpp splits a
        text at its special tokens in time quadratic in their count: 1 MiB of `<|im_end|>` took 42 s under the
        model's lock, and the OpenAI endpoint's body carries 8 MiB; at this bound, 4 s (docs/guide/trust.md)."""
        if chat:
            text = self.apply_chat_template([{"role": "user", "content": text}])
        raw = text.encode("utf-8")  # UnicodeEncodeError (a ValueError) for a lone surrogate
        n_ctx = self.llm.n_ctx()
        if len(raw) > n_ctx and len(raw) > n_ctx * self.longest_token:
            raise ValueError(
                f"a prompt of {len(raw)} bytes cannot fit the draft's context of {n_ctx} tokens (a token spells "
                f"at most {self.longest_token} bytes): send a shorter prompt"
            )
        return self.llm.tokenize(raw, add_bos=False, special=True)

    @functools.cached_property
    def longest_token(self) -> int:
        """The most bytes one id spells, special ones as their text (as `tokenize` reads them); read once, when
        a text longer than the context in bytes first comes (~0.05 s over a 49,152-token vocabulary)."""
        import llama_cpp as L

        vocab, buf, most = L.llama_model_get_vocab(self.llm.model), ctypes.create_string_buffer(256), 1
        for i in range(self.vocab_size):
            n = L.llama_token_to_piece(vocab, i, buf, len(buf), 0, True)
            most = max(most, abs(n))  # negative: the piece is longer than buf, -n its length
        return most

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> str:
        if not self.chat_template:
            raise ValueError(f"draft {self.name} has no chat template; call without --chat")
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        fmt = Jinja2ChatFormatter(self.chat_template, eos_token="", bos_token="")
        return fmt(messages=messages).prompt  # type: ignore[arg-type]  # plain dicts of llama_cpp's TypedDicts

    def detokenize(self, ids: list[int], skip: set[int] | frozenset[int] = frozenset()) -> str:
        ids = [t for t in ids if t not in skip]
        self.check_ids(ids, "detokenize")
        return self.llm.detokenize(ids, special=True).decode("utf-8", "replace")

    def check_ids(self, ids: Sequence[int] | np.ndarray, what: str = "token ids") -> None:
        """ValueError unless every id is in [0, vocab_size). Every id that reaches llama.cpp passes here
        first: its C++ throws std::out_of_range on an id outside the vocabulary (token_to_piece), which
        aborts the whole process (the robot's e-stop with it), whatever sent the id."""
        if len(ids) and (min(ids) < 0 or max(ids) >= self.vocab_size):
            bad = next(t for t in ids if not 0 <= t < self.vocab_size)
            raise ValueError(f"{what}: token id {bad} is outside the draft's vocabulary of {self.vocab_size}")

    # ------------------------------------------------------------------ images

    def use_images(self, images: list[PromptImage] | None) -> None:
        """The images of the prompts drafted from now on (each on its marker, `at`); [] or None: text only.

        Raises ValueError for an image this draft cannot read (no projector, bytes that are no image)."""
        if not images:
            self._images = {}
            return
        if self.vision is None:
            raise ValueError(
                f"draft {self.name} reads text only: load it with its mmproj (--draft-mmproj) to send images"
            )
        self._images = {
            im.at: (im, self.vision.positions(im), -1 - int(im.sha256[:7], 16), self.vision.cells(im)) for im in images
        }

    def image_prompt(self, text: str, images: list[bytes], chat: bool = False) -> tuple[list[int], list[PromptImage]]:
        """A prompt with images: (ids, each image on its marker). With chat the images lead the user turn as
        the model's chat template lays them out; otherwise `text` holds one marker (SmolVLM's `<image>`) per
        image, or none and the markers go in front of it."""
        if self.image_marker is None:
            raise ValueError(f"draft {self.name} reads text only: load it with its mmproj (--draft-mmproj)")
        import llama_cpp

        from runtime.vision import placeholder

        marker = llama_cpp.llama_vocab_get_text(
            llama_cpp.llama_model_get_vocab(self.llm.model), self.image_marker
        ).decode()
        if chat:
            content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
            text = self.apply_chat_template([{"role": "user", "content": content}])
        elif marker not in text:
            text = placeholder(marker) * len(images) + text
        ids = self.tokenize(text)
        at = [i for i, t in enumerate(ids) if t == self.image_marker]
        if len(at) != len(images):
            raise ValueError(f"the prompt holds {len(at)} image markers ({marker}) for {len(images)} images")
        return ids, [PromptImage.of(data, i) for data, i in zip(images, at, strict=True)]

    @property
    def images(self) -> list[PromptImage]:
        return [im for im, _, _, _ in self._images.values()]

    def expand(self, ids: list[int]) -> list[int]:
        """ids as the KV holds them: each image's marker replaced by the image's positions (its stand-in id)."""
        if not self._images:
            return ids
        out, prev = [], 0
        for at in sorted(self._images):
            if at >= len(ids):
                break
            if ids[at] != self.image_marker:
                raise ValueError(
                    f"the image for index {at} is not on the image marker {self.image_marker}: "
                    f"the ids hold {ids[at]} there"
                )
            _, n, stand_in, _ = self._images[at]
            out += ids[prev:at]
            out += [stand_in] * n
            prev = at + 1
        out += ids[prev:]
        return out

    def kv_len(self, n: int) -> int:
        """KV positions the first n ids take (the position of id n)."""
        return n + sum(positions - 1 for at, (_, positions, _, _) in self._images.items() if at < n)

    def kv_cells(self, n: int) -> int:
        """KV cells the first n ids take (an M-RoPE image's tokens outnumber its positions)."""
        return n + sum(cells - 1 for at, (_, _, _, cells) in self._images.items() if at < n)

    def image_runs(self, kv: list[int], start: int, end: int) -> Iterator[tuple[str, Any, int]]:
        """kv[start:end] as ("text", ids, pos) and ("image", PromptImage, pos) runs; start must not cut an image."""
        stand_ins = {stand_in: image for image, _, stand_in, _ in self._images.values()}
        p = start
        while p < end:
            if kv[p] >= 0:
                q = p
                while q < end and kv[q] >= 0:
                    q += 1
                yield "text", kv[p:q], p
            else:
                if p > 0 and kv[p - 1] == kv[p]:
                    raise ValueError(f"position {p} lies inside an image")
                image = stand_ins[kv[p]]
                q = p
                while q < len(kv) and kv[q] == kv[p]:
                    q += 1
                if q > end:
                    raise ValueError(f"an image at {p} does not end before {end}")
                yield "image", image, p
            p = q

    @staticmethod
    def image_start(kv: list[int], keep: int) -> int:
        """keep moved back to the first position of the image it falls inside (if any)."""
        while 0 < keep < len(kv) and kv[keep] < 0 and kv[keep - 1] == kv[keep]:
            keep -= 1
        return keep

    def _eval(self, kv: list[int], start: int, end: int, logits_last: bool = False) -> None:
        """Decode kv[start:end] into the context at positions start..end-1 (images through libmtmd)."""
        import llama_cpp

        self.llm.n_tokens = start
        for kind, what, pos in self.image_runs(kv, start, end):
            if kind == "text":
                self.llm.eval(what)
                continue
            if self.vision is None:
                raise ValueError(f"an image at position {pos} in the context of a draft without a projector (mmproj)")
            llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(self.llm.ctx), 0, pos, -1)
            n = self.vision.eval(self.llm.ctx, 0, pos, what, self.llm.n_batch, logits_last=logits_last)
            self.llm.input_ids[pos : pos + n] = kv[pos]
            self.llm.n_tokens = pos + n

    # ------------------------------------------------------------------ drafting

    def _logits_after(self, committed: list[int]) -> np.ndarray:
        """Point the KV cache at `committed` and return the logits [vocab] after its last token.

        Reuses the KV of the prefix shared with what the context holds; always
        re-evaluates at least the last token so its logits are fresh, and always in a
        batch of its own: llama.cpp's logits depend on the batch they come from (Q2_K:
        up to 0.5 apart between a prompt's last row and the same token alone), so this
        keeps the draft, and a seeded generation, the same whatever the KV held before.
        """
        self.check_ids(committed, "the committed ids")
        kv = self.expand(committed)
        cells = self.kv_cells(len(committed))
        if cells >= self.llm.n_ctx():
            raise DraftContextFull(f"{cells} KV cells do not fit the draft context of {self.llm.n_ctx()}")
        held = self.llm.input_ids[: self.llm.n_tokens]
        n = min(len(held), len(kv) - 1)
        mismatch = np.flatnonzero(held[:n] != np.asarray(kv[:n]))
        keep = int(mismatch[0]) if mismatch.size else n
        if self._images:
            keep = self.image_start(kv, keep)
            last = self.image_start(kv, len(kv) - 1)  # the last token, or the whole image the ids end on
            if last > keep:
                self._eval(kv, keep, last)
            self._eval(kv, last, len(kv), logits_last=True)
            return self._last_logits()
        self.llm.n_tokens = keep  # KV rollback: eval() drops positions >= keep
        if len(committed) - keep > 1:
            self.llm.eval(committed[keep:-1])
        self.llm.eval(committed[-1:])
        return self._last_logits()

    def next_logits(self, committed: list[int]) -> np.ndarray:
        """The draft's logits [vocab] for the token after `committed` (reusing the KV it holds)."""
        return self._logits_after(committed)

    def _last_logits(self) -> np.ndarray:
        import llama_cpp

        ptr = llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)
        logits: np.ndarray = np.ctypeslib.as_array(ptr, shape=(self.vocab_size,))[: self.vocab_real].copy()
        return logits  # [vocab_real]

    def propose(
        self,
        committed: list[int],
        k: int,
        params: SamplingParams,
        rng: np.random.Generator,
        n_cands: int = 0,
        watch: Callable[[int, np.ndarray], bool] | None = None,
        payload: PayloadSpec = PayloadSpec(),
        grammar: ConstraintState | None = None,
    ) -> Draft:
        """Draft up to k tokens after `committed`; at T > 0 each is drawn from the q it is sent with.

        `payload` says what that q is (protocol/payload.py): the fp16 table (full), the
        renormalized top-K (topk) or the fixed-point table whose q(x) alone is sent (split).

        n_cands > 0 also returns the top-n_cands ids at each position (the early exits' candidates).
        watch(position, logits [vocab]) is asked before each token is drawn; False ends the draft
        there (the rejection predictor's stop), so the draft may be shorter than k.
        grammar: the state after `committed` (left as it is): each token is drawn from q restricted to
        what the grammar allows next (protocol/structured.py), as the target's p will be.
        """
        t0 = time.perf_counter()
        if self.kv_cells(len(committed)) + k >= self.llm.n_ctx():
            raise DraftContextFull(f"drafting {k} after {len(committed)} tokens exceeds the draft context")
        ids: list[int] = []
        rows: list[Any] = []
        cands: list[tuple[np.ndarray, np.ndarray]] = []
        payload = payload.for_params(params)
        logits = self._logits_after(committed) if k else np.empty(0, np.float32)  # [vocab_real]; k = 0: unused
        walk = grammar.clone() if grammar is not None and k else None
        for i in range(k):
            if watch is not None and not watch(i, logits):
                break
            token, q, row = constrained_draw(logits, params, payload, rng, walk)
            if row is not None:
                rows.append(row)
            if n_cands:
                cands.append(top_candidates(logits, n_cands, params, q))
            ids.append(token)
            if walk is not None:
                walk.accept(token)
            if i + 1 < k:  # the last draft token is fed next round
                self.llm.eval([token])
                logits = self._last_logits()
        top, top_p = stack_candidates(cands, n_cands)
        return Draft(ids, DraftQ.stack(payload.kind, ids, rows), (time.perf_counter() - t0) * 1e3, top, top_p)

    def next_token(
        self,
        committed: list[int],
        params: SamplingParams,
        rng: np.random.Generator,
        grammar: ConstraintState | None = None,
    ) -> int:
        """One token from the draft alone (offline generation), under `grammar` (its state after committed)."""
        logits = self._logits_after(committed)
        if params.greedy:
            return int(np.argmax(logits)) if grammar is None else grammar.argmax(logits)
        mask = None if grammar is None else grammar.mask()
        return sampling.sample(sampling.probs_from_logits(logits, params, mask), rng)


def constrained_draw(
    logits: np.ndarray,
    params: SamplingParams,
    spec: PayloadSpec,
    rng: np.random.Generator,
    grammar: ConstraintState | None,
) -> tuple[int, np.ndarray | None, object]:
    """payload.draw under a grammar's state: greedy takes the masked argmax (one check when the best token is
    allowed), sampling draws from q restricted to the whole allowed set."""
    if grammar is None:
        return draw(logits, params, spec, rng)
    if params.greedy or spec.kind == "none":
        return grammar.argmax(logits), None, None
    return draw(logits, params, spec, rng, grammar.mask())
