"""Verification: turn a session's draft into a verdict with one target forward pass.

Synchronous and free of networking, so the server runs it in its model thread
and tests call it directly. Where a token is accepted: `Verifier.verify`.
"""
from __future__ import annotations

import time

import numpy as np

from . import sampling
from .config import ServerConfig
from .sessions import Session
from .target import TargetModel
from .wire import Open, Verify, WireError


class Verifier:
    def __init__(self, target: TargetModel, config: ServerConfig):
        self.target = target
        self.config = config

    # ------------------------------------------------------------------ sessions

    def open(self, msg: Open, conn_id: int, previous: Session | None) -> tuple[Session, float]:
        """A new session, or a re-opened one that keeps the KV of the prefix it shares with the old one."""
        self._check_ids(msg.prompt_ids, "prompt_ids", msg.sid)
        if len(msg.prompt_ids) >= self.config.max_context:
            raise WireError("context_full", f"prompt of {len(msg.prompt_ids)} tokens leaves no room in the "
                            f"context of {self.config.max_context}", msg.sid)
        try:
            params = sampling.SamplingParams(**msg.sampling)
        except sampling.SamplingError as e:
            raise WireError("bad_field", str(e), msg.sid) from None
        t0 = time.perf_counter()
        if previous is not None:
            # Work still queued for the old session object (an ar stream of a dropped
            # connection) must not touch the state from now on; see _check_live.
            previous.retired = True
        if previous is not None and previous.params == params:
            state = previous.state
            state.passes = 0                              # passes are reported per open / round
            self.target.rewind(state, msg.prompt_ids)
        else:
            state = self.target.new_state(msg.prompt_ids)
        # A re-opened session draws fresh randomness keyed by where it resumes,
        # so a replayed round is an independent draw, as the math requires.
        rng = np.random.default_rng([params.seed, len(msg.prompt_ids)])
        return Session(msg.sid, conn_id, state, params, rng), (time.perf_counter() - t0) * 1e3

    # ------------------------------------------------------------------ rounds

    def verify(self, session: Session, msg: Verify) -> tuple[sampling.Verdict, float]:
        """Accept/reject msg.draft_ids against the target; commits the result to the session."""
        _check_live(session)
        state = session.state
        k = len(msg.draft_ids)
        if msg.n_committed != len(state.ids):
            raise WireError("desync", f"robot has {msg.n_committed} committed tokens, server has "
                            f"{len(state.ids)}: re-open the session with the committed prefix", msg.sid)
        if k > self.config.max_draft_len:
            raise WireError("bad_field", f"draft of {k} tokens exceeds max_draft_len "
                            f"{self.config.max_draft_len}", msg.sid)
        if len(state.ids) + k + 1 > self.config.max_context:
            raise WireError("context_full", f"session reached max_context {self.config.max_context}", msg.sid)
        self._check_ids(msg.draft_ids, "draft_ids", msg.sid)
        # q is needed only for drafted tokens: an empty draft (the last token of a generation) has none
        q = None if session.params.greedy or not k else self._draft_q(msg)

        t0 = time.perf_counter()
        logits = self.target.score(state, msg.draft_ids)              # [k + 1, vocab]
        try:
            if session.params.greedy:
                verdict = sampling.verify_greedy(np.asarray(msg.draft_ids), logits.argmax(axis=-1))
            else:
                p = sampling.probs_from_logits(logits, session.params)    # [k + 1, vocab]
                q = np.zeros((0, p.shape[1])) if q is None else q         # [k, vocab]
                verdict = sampling.verify_sampled(np.asarray(msg.draft_ids), q, p, session.rng)
        except sampling.SamplingError as e:
            self.target.rewind(state, state.ids)                      # drop the draft from the cache
            raise WireError("bad_probs", str(e), msg.sid) from None
        n_before = len(state.ids)
        self.target.commit(state, msg.draft_ids[:verdict.accepted] + [verdict.token],
                           n_before + verdict.accepted)
        return verdict, (time.perf_counter() - t0) * 1e3

    def ar_step(self, session: Session) -> tuple[int, float]:
        """One target-only token (the cloud-autoregressive baseline)."""
        _check_live(session)
        state = session.state
        if len(state.ids) + 1 > self.config.max_context:
            raise WireError("context_full", f"session reached max_context {self.config.max_context}",
                            session.sid)
        t0 = time.perf_counter()
        logits = self.target.score(state, [])[0]                      # [vocab]
        if session.params.greedy:
            token = int(np.argmax(logits))
        else:
            token = sampling.sample(sampling.probs_from_logits(logits, session.params), session.rng)
        self.target.commit(state, [token], len(state.ids))
        return token, (time.perf_counter() - t0) * 1e3

    # ------------------------------------------------------------------ checks

    def _draft_q(self, msg: Verify) -> np.ndarray:
        """The draft distributions [k, vocab] as float64, checked before any model work."""
        if msg.q["kind"] != "full":
            raise WireError("bad_field", "temperature > 0 needs the draft distributions: q.kind 'full'", msg.sid)
        probs = msg.q["probs"]
        if probs.shape[1] != self.target.vocab_size:
            raise WireError("bad_field", f"q has vocabulary {probs.shape[1]}, target has "
                            f"{self.target.vocab_size}", msg.sid)
        try:
            q = sampling.dequantize_q(probs)
        except sampling.SamplingError as e:
            raise WireError("bad_probs", str(e), msg.sid) from None
        drafted = q[np.arange(len(msg.draft_ids)), msg.draft_ids]
        if np.any(drafted <= 0):
            raise WireError("bad_probs", "a drafted token has zero probability under its own q", msg.sid)
        return q

    def _check_ids(self, ids: list[int], name: str, sid: str | None = None) -> None:
        if ids and max(ids) >= self.target.vocab_size:
            raise WireError("bad_field", f"{name} holds token id {max(ids)} outside the vocabulary of "
                            f"{self.target.vocab_size}", sid)


def _check_live(session: Session) -> None:
    """Runs in the model thread, like `open`, so a re-open and a stale request cannot interleave."""
    if session.retired:
        raise WireError("unknown_session", f"session {session.sid!r} was re-opened elsewhere", session.sid)
