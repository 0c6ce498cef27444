"""The robot's draft model: a GGUF through llama-cpp-python, proposing k tokens with their q.

Per-token logits come from `llama_get_logits_ith(ctx, -1)` after each decode
(no `logits_all`, which would hold an [n_ctx, vocab] float32 table). The KV
cache follows the committed prefix: a rejection rolls it back by setting
`n_tokens` (llama-cpp's `eval` drops every KV entry past it first).

Not thread-safe: one `Drafter` (one llama context) per thread.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from protocol import modelfiles, sampling
from protocol.grammar import GrammarCache, GrammarState
from protocol.payload import DraftQ, PayloadSpec, draw
from protocol.sampling import SamplingParams

log = logging.getLogger(__name__)


class DraftContextFull(RuntimeError):
    pass


@dataclass
class Draft:
    ids: list[int]                  # [k] proposed token ids; k can be zero
    q: DraftQ | None                # the draft distributions as the payload mode sends them; None when greedy
    ms: float                       # wall time spent drafting (gamma * T_p)
    cands: np.ndarray | None = None  # [k, K] int32: the draft's top-K ids per position (for early exits)
    cand_p: np.ndarray | None = None  # [k, K] the draft's probabilities of those ids (for pre-draft guesses)

    def head(self, k: int) -> "Draft":
        """The first k tokens of this draft (a prefix of a draft is a valid draft)."""
        cut = (lambda a: None if a is None else a[:k])
        return Draft(self.ids[:k], None if self.q is None else self.q.head(k), self.ms, cut(self.cands),
                     cut(self.cand_p))

    def wire_q(self) -> dict:
        """Verify.q for this draft."""
        return {"kind": "none"} if self.q is None else self.q.to_wire()


def top_candidates(logits: np.ndarray, k: int, params: SamplingParams,
                   q: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
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
def _model_params(use_extra_bufts: bool):
    """llama-cpp-python's `Llama` exposes no `use_extra_bufts`; set it on the default params while
    one model loads. Off by default: a llama.cpp 0.3.36 built with -march=native on a CPU with AMX
    crashes in llama_decode on multi-token batches when they are on, and on the portable AVX2 build
    the Makefile makes they measured no faster here (19.0 vs 21.8 ms/token, 2 threads)."""
    import llama_cpp
    import llama_cpp.llama as llama_module

    with _params_lock:
        original = llama_cpp.llama_model_default_params

        def patched():
            p = original()
            p.use_extra_bufts = use_extra_bufts
            return p

        llama_module.llama_cpp.llama_model_default_params = patched
        try:
            yield
        finally:
            llama_module.llama_cpp.llama_model_default_params = original


def stack_candidates(rows: list[tuple[np.ndarray, np.ndarray]], n_cands: int):
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
    def __init__(self, model: str = modelfiles.DEFAULT_DRAFT, n_ctx: int = 4096, threads: int = 2,
                 extra_buffers: bool = False, n_gpu_layers: int = -1):
        from llama_cpp import Llama, llama_model_get_vocab, llama_supports_gpu_offload, llama_vocab_get_text

        self.path: Path = modelfiles.resolve_draft(model)
        self.name = model if model in modelfiles.DRAFTS else self.path.name
        # llama.cpp's own answer: a CUDA build on the Orin says yes, the CPU wheel no (then -1 would be ignored
        # silently; saying 0 and logging why is what an operator can read)
        supported = bool(llama_supports_gpu_offload())
        layers = gpu_layers(n_gpu_layers, supported)
        self.offload = {"device": "gpu" if layers else "cpu", "n_gpu_layers": layers,
                        "llama_supports_gpu_offload": supported}
        if n_gpu_layers and not supported:
            log.warning("draft on the CPU: this llama.cpp build has no GPU offload (on a Jetson: make setup-robot "
                        "builds it with CUDA when nvcc is present)")
        t0 = time.perf_counter()
        with _model_params(extra_buffers):
            self.llm = Llama(str(self.path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                             n_batch=512, logits_all=False, verbose=False, n_gpu_layers=layers)
        self.vocab_size = int(self.llm.n_vocab())
        vocab = llama_model_get_vocab(self.llm.model)
        self.vocab_hash = modelfiles.vocab_hash(llama_vocab_get_text(vocab, i) for i in range(self.vocab_size))
        self.eos_ids = {int(self.llm.token_eos())}
        self.grammars = GrammarCache(vocab, self.vocab_size, owner=self.llm)   # compiled answer grammars
        self.chat_template = self.llm.metadata.get("tokenizer.chat_template")
        log.info("draft %s loaded from %s in %.2fs (vocab %d, %d threads, %s)", self.name, self.path,
                 time.perf_counter() - t0, self.vocab_size, threads,
                 f"GPU: {'all' if layers < 0 else layers} layers" if layers else "CPU")

    # ------------------------------------------------------------------ text

    def tokenize(self, text: str, chat: bool = False) -> list[int]:
        """Text -> ids. With chat=True the text becomes one user turn in the model's chat template."""
        if chat:
            text = self.apply_chat_template([{"role": "user", "content": text}])
        return self.llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)

    def apply_chat_template(self, messages: list[dict]) -> str:
        if not self.chat_template:
            raise ValueError(f"draft {self.name} has no chat template; call without --chat")
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        fmt = Jinja2ChatFormatter(self.chat_template, eos_token="", bos_token="")
        return fmt(messages=messages).prompt

    def detokenize(self, ids: list[int], skip: set[int] | frozenset = frozenset()) -> str:
        return self.llm.detokenize([t for t in ids if t not in skip], special=True).decode("utf-8", "replace")

    # ------------------------------------------------------------------ drafting

    def _logits_after(self, committed: list[int]) -> np.ndarray:
        """Point the KV cache at `committed` and return the logits [vocab] after its last token.

        Reuses the KV of the prefix shared with what the context holds; always
        re-evaluates at least the last token so its logits are fresh, and always in a
        batch of its own: llama.cpp's logits depend on the batch they come from (Q2_K:
        up to 0.5 apart between a prompt's last row and the same token alone), so this
        keeps the draft, and a seeded generation, the same whatever the KV held before.
        """
        if len(committed) >= self.llm.n_ctx():
            raise DraftContextFull(f"{len(committed)} tokens do not fit the draft context of {self.llm.n_ctx()}")
        held = self.llm.input_ids[: self.llm.n_tokens]
        n = min(len(held), len(committed) - 1)
        mismatch = np.flatnonzero(held[:n] != np.asarray(committed[:n]))
        keep = int(mismatch[0]) if mismatch.size else n
        self.llm.n_tokens = keep                      # KV rollback: eval() drops positions >= keep
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
        return np.ctypeslib.as_array(ptr, shape=(self.vocab_size,)).copy()

    def propose(self, committed: list[int], k: int, params: SamplingParams,
                rng: np.random.Generator, n_cands: int = 0,
                watch: Callable[[int, np.ndarray], bool] | None = None,
                payload: PayloadSpec = PayloadSpec(), grammar: GrammarState | None = None) -> Draft:
        """Draft up to k tokens after `committed`; at T > 0 each is drawn from the q it is sent with.

        `payload` says what that q is (protocol/payload.py): the fp16 table (full), the
        renormalized top-K (topk) or the fixed-point table whose q(x) alone is sent (split).

        n_cands > 0 also returns the top-n_cands ids at each position (the early exits' candidates).
        watch(position, logits [vocab]) is asked before each token is drawn; False ends the draft
        there (the rejection predictor's stop), so the draft may be shorter than k.
        grammar: the state after `committed` (left as it is): each token is drawn from q restricted to
        what the grammar allows next (protocol/grammar.py), as the target's p will be.
        """
        t0 = time.perf_counter()
        if len(committed) + k >= self.llm.n_ctx():
            raise DraftContextFull(f"drafting {k} after {len(committed)} tokens exceeds the draft context")
        ids: list[int] = []
        rows: list = []
        cands: list[tuple[np.ndarray, np.ndarray]] = []
        payload = payload.for_params(params)
        logits = self._logits_after(committed) if k else None
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
            if i + 1 < k:                              # the last draft token is fed next round
                self.llm.eval([token])
                logits = self._last_logits()
        top, top_p = stack_candidates(cands, n_cands)
        return Draft(ids, DraftQ.stack(payload.kind, ids, rows), (time.perf_counter() - t0) * 1e3, top, top_p)

    def next_token(self, committed: list[int], params: SamplingParams, rng: np.random.Generator,
                   grammar: GrammarState | None = None) -> int:
        """One token from the draft alone (offline generation), under `grammar` (its state after committed)."""
        logits = self._logits_after(committed)
        if params.greedy:
            return int(np.argmax(logits)) if grammar is None else grammar.argmax(logits)
        mask = None if grammar is None else grammar.mask()
        return sampling.sample(sampling.probs_from_logits(logits, params, mask), rng)


def constrained_draw(logits: np.ndarray, params: SamplingParams, spec: PayloadSpec, rng: np.random.Generator,
                     grammar: GrammarState | None):
    """payload.draw under a grammar's state: greedy takes the masked argmax (one check when the best token is
    allowed), sampling draws from q restricted to the whole allowed set."""
    if grammar is None:
        return draw(logits, params, spec, rng)
    if params.greedy or spec.kind == "none":
        return grammar.argmax(logits), None, None
    return draw(logits, params, spec, rng, grammar.mask())
