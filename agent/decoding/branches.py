"""Draft several continuations at once: one llama context, one sequence per branch, batched decoding.

The pre-drafter (FSD) guesses how the server will end a round and drafts the
next draft for each guess while the server verifies. Every branch shares the
committed prefix and the current draft, so the branches live as sequences of
one llama.cpp context: sequence 0 holds committed + draft, a branch copies the
part of it that it shares (`llama_memory_seq_cp` shares KV cells, it does not
copy them) and then all active branches advance one token per `llama_decode`
call, in one batch. On this CPU one step of 4 branches takes ~40 ms against
~18.5 ms for one (the weights are read once per step, not per branch);
tools/bench/predraft.py measures this against one context per worker thread
(batched is 1.3-2x faster from 2 branches on).

A vision-language draft's images are in sequence 0 as the `Drafter` lays them out:
`held` and a branch's `tokens` are indexed by position (an image's positions carry
its stand-in id), every copy and cut is by position, and a branch's first new
token sits past every position it shares (for an M-RoPE image, Qwen-VL's, the
image's cells are more than its positions: the context is sized in cells).

Not thread-safe: one BranchDrafter belongs to one thread (the pre-draft worker).
It shares the model weights of the `Drafter` it is built from.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from protocol.payload import DraftQ, PayloadSpec
from protocol.sampling import SamplingParams
from protocol.structured import ConstraintState

from .drafter import Draft, DraftContextFull, Drafter, constrained_draw, stack_candidates, top_candidates


class BranchError(RuntimeError):
    """llama.cpp refused a batch (no KV room, bad position): the round falls back to a fresh draft."""


@dataclass
class Branch:
    key: tuple[int, ...]  # the continuation of the committed prefix this branch drafts after
    seq: int  # llama sequence id (1..slots)
    gamma: int
    rng: np.random.Generator
    tokens: list[int]  # what the sequence holds, by position 0 .. len - 1 (an image's as its stand-in id)
    feed: list[int]  # tokens to decode next, at positions len(tokens), ...
    ids: list[int] = field(default_factory=list)
    rows: list[Any] = field(default_factory=list)  # the payload's q rows (T > 0), see payload.draw
    cands: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)  # top-K (ids, probs) per token
    # the generation's grammar after committed + key + ids (None: unconstrained); each token drawn under it
    grammar: ConstraintState | None = None
    t0: float = field(default_factory=time.perf_counter)

    @property
    def done(self) -> bool:
        return len(self.ids) >= self.gamma


class BranchDrafter:
    def __init__(self, drafter: Drafter, slots: int, n_ctx: int = 4096, threads: int = 1, n_cands: int = 8):
        import llama_cpp
        from llama_cpp import _internals

        if slots < 1:
            raise ValueError("slots must be >= 1")
        self.slots = slots
        self.vocab_size = drafter.vocab_size
        self.vocab_real = drafter.vocab_real  # the rows drawn from: the draft's real vocabulary
        self.n_cands = n_cands
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = params.n_ubatch = 512
        params.n_seq_max = slots + 1  # sequence 0 is the base, 1..slots the branches
        params.kv_unified = True  # branches share the prefix cells
        params.n_threads = params.n_threads_batch = threads
        params.no_perf = True
        # The model object of the drafter (weights mmapped once); a context of our own.
        self._ctx = _internals.LlamaContext(model=drafter.llm._model, params=params, verbose=False)
        self._batch = _internals.LlamaBatch(n_tokens=512, embd=0, n_seq_max=1, verbose=False)
        self.n_ctx = n_ctx
        self.drafter = drafter  # its images: sequence 0 holds drafter.expand(committed) + draft
        self.held: list[int] = []  # sequence 0 by position (an image's positions as its stand-in id)
        self.free = list(range(slots, 0, -1))  # free branch sequence ids
        self.kept: dict[tuple[int, ...], Branch] = {}  # finished branches whose KV is still held

    # ------------------------------------------------------------------ low level

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode over (token, pos, seq, want_logits) rows (at most 512)."""
        import llama_cpp

        b = self._batch.batch
        b.n_tokens = len(entries)
        for i, (tok, pos, seq, want) in enumerate(entries):
            if pos >= self.n_ctx:
                raise BranchError(f"position {pos} is past the pre-draft context of {self.n_ctx}")
            if not 0 <= tok < self.vocab_size:  # llama.cpp must never see an id outside its vocabulary
                raise ValueError(f"token id {tok} is outside the draft's vocabulary of {self.vocab_size}")
            b.token[i] = tok
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = want
        rc = llama_cpp.llama_decode(self._ctx.ctx, b)
        if rc != 0:
            raise BranchError(f"llama_decode returned {rc} for a batch of {len(entries)} rows")

    def _logits(self, row: int) -> np.ndarray:
        import llama_cpp

        ptr = llama_cpp.llama_get_logits_ith(self._ctx.ctx, row)
        logits: np.ndarray = np.ctypeslib.as_array(ptr, shape=(self.vocab_size,))[: self.vocab_real].copy()
        return logits  # [vocab_real]

    def _rm(self, seq: int, p0: int = -1) -> None:
        import llama_cpp

        llama_cpp.llama_memory_seq_rm(self._ctx.memory, seq, p0, -1)

    # ------------------------------------------------------------------ base sequence

    def base(self, committed: list[int], draft_ids: list[int], reuse: tuple[int, ...] | None = None) -> np.ndarray:
        """Sequence 0 := committed + draft; returns the logits [vocab] after the last draft token.

        Drops every branch. When `reuse` names a finished branch of the previous round
        (the one whose draft went out), its KV becomes sequence 0, so only the last
        draft token is evaluated; otherwise the KV of the prefix shared with what
        sequence 0 held is kept and the rest evaluated in one batch.
        """
        seq = self.drafter.expand(list(committed) + list(draft_ids))
        cells = self.drafter.kv_cells(len(committed) + len(draft_ids))
        if cells + 1 >= self.n_ctx:
            raise DraftContextFull(f"{cells} KV cells do not fit the pre-draft context of {self.n_ctx}")
        import llama_cpp

        promoted = self.kept.get(reuse) if reuse is not None else None
        if promoted is not None and _common_prefix(promoted.tokens, seq) > _common_prefix(self.held, seq):
            self._rm(0)
            llama_cpp.llama_memory_seq_cp(self._ctx.memory, promoted.seq, 0, -1, -1)
            self.held = list(promoted.tokens)
        for s in range(1, self.slots + 1):
            self._rm(s)
        self.free = list(range(self.slots, 0, -1))
        self.kept.clear()
        keep = self.drafter.image_start(seq, min(_common_prefix(self.held, seq), len(seq) - 1))
        self._rm(0, keep)
        self.held = self.held[:keep]
        for kind, run, at in self.drafter.image_runs(seq, keep, len(seq)):
            if kind == "image":  # a prompt's image, through the draft's projector
                vision = self.drafter.vision
                if vision is None:
                    raise BranchError("an image in a sequence of a draft without a projector (mmproj)")
                last = at + vision.positions(run) == len(seq)  # the sequence ends on it: its row
                n = vision.eval(self._ctx.ctx, 0, at, run, 512, logits_last=last)
                self.held.extend(seq[at : at + n])
                continue
            for start in range(at, at + len(run), 512):
                chunk = range(start, min(at + len(run), start + 512))
                self._decode([(seq[p], p, 0, p == len(seq) - 1) for p in chunk])
                self.held.extend(seq[p] for p in chunk)
        return self._logits(-1)  # the row after the last position

    # ------------------------------------------------------------------ branches

    def start(
        self,
        key: tuple[int, ...],
        n_committed: int,
        gamma: int,
        rng: np.random.Generator,
        grammar: ConstraintState | None = None,
    ) -> Branch:
        """A branch drafting `gamma` tokens after committed + key, under `grammar` (its state after them; the
        branch's own from then on) as Drafter.propose drafts.

        Takes a free slot, or the slot of the oldest finished branch (its draft stays
        cached; only its KV, kept for `base(reuse=...)`, is lost).
        """
        import llama_cpp

        if not self.free and self.kept:
            self.drop(self.kept.pop(next(iter(self.kept))))
        if not self.free:
            raise BranchError("no free branch slot")
        full = self.held[: self.drafter.kv_len(n_committed)] + list(key)
        shared = min(_common_prefix(self.held, full), len(full) - 1)
        if min(full[shared:]) < 0:  # an image to decode: only `base` evaluates images
            raise BranchError(f"branch {key[:4]} would start inside an image")
        seq = self.free.pop()
        llama_cpp.llama_memory_seq_cp(self._ctx.memory, 0, seq, 0, shared)
        return Branch(key, seq, gamma, rng, tokens=full[:shared], feed=full[shared:], grammar=grammar)

    def drop(self, branch: Branch) -> None:
        self._rm(branch.seq)
        self.free.append(branch.seq)

    def keep(self, branch: Branch) -> None:
        """A finished branch keeps its KV until a slot is needed or the next `base`."""
        self.kept[branch.key] = branch

    def step(self, branches: list[Branch], params: SamplingParams, payload: PayloadSpec = PayloadSpec()) -> None:
        """Advance every branch by one drafted token, in one batch."""
        entries, last = [], []
        for b in branches:
            for i, tok in enumerate(b.feed):
                entries.append((tok, len(b.tokens) + i, b.seq, i == len(b.feed) - 1))
            last.append(len(entries) - 1)
        self._decode(entries)
        for b, at in zip(branches, last, strict=True):
            logits = self._logits(at)
            b.tokens.extend(b.feed)
            token, q, row = constrained_draw(logits, params, payload.for_params(params), b.rng, b.grammar)
            if b.grammar is not None:
                b.grammar.accept(token)
            if row is not None:
                b.rows.append(row)
            b.ids.append(token)
            b.cands.append(top_candidates(logits, self.n_cands, params, q))
            b.feed = [] if b.done else [token]  # the last drafted token is fed next round

    def result(self, b: Branch, payload: PayloadSpec) -> Draft:
        """payload: as the round drafted (already `for_params`)."""
        top, top_p = stack_candidates(b.cands, self.n_cands)
        return Draft(
            list(b.ids), DraftQ.stack(payload.kind, b.ids, b.rows), (time.perf_counter() - b.t0) * 1e3, top, top_p
        )


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)
