"""Verification: turn a session's draft into a verdict with one target forward pass.

Synchronous and free of networking, so the server runs it in its model thread
and tests call it directly. Where a token is accepted: `Verifier.verify`.
Early exits (FSD) ride along in the same pass and report through a callback.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from . import modelfiles, payload, sampling
from .config import ServerConfig
from .exits import ExitHeads, ExitPass, ExitVerdict
from .sessions import Session
from .target import TargetModel
from .wire import Exit, Open, Verify, WireError

log = logging.getLogger(__name__)


@dataclass
class RoundOutcome:
    """What one verify round produced, for the `result` message and the metrics."""
    verdict: sampling.Verdict
    verify_ms: float                # the whole round, exit heads included
    exit_layer: int | None = None   # earliest enabled exit whose verdict equalled the final one, n_layers if
                                    # none did; None when no exits ran this round
    exit_ms: float = 0.0            # time spent in exit heads this round
    residual: dict | None = None    # split rejection: the target's p_j for the robot (Result.residual)

    def timing(self) -> dict:
        """Result.timing: verify_ms, passes; exit_layer and exit_ms when exits ran."""
        timing = {"verify_ms": self.verify_ms, "passes": 1}
        if self.exit_layer is not None:
            timing.update(exit_layer=self.exit_layer, exit_ms=self.exit_ms)
        return timing


class Verifier:
    def __init__(self, target: TargetModel, config: ServerConfig):
        self.target = target
        self.config = config
        self.exits = load_exits(config, target)

    @property
    def exit_layers(self) -> list[int]:
        """The early exits a session may ask for (Welcome.exits)."""
        return list(self.exits.layers) if self.exits is not None else []

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
        try:
            spec = payload.PayloadSpec(msg.payload["kind"], msg.payload["k"])
        except ValueError as e:
            raise WireError("bad_field", str(e), msg.sid) from None
        if spec.k > self.target.vocab_size:
            raise WireError("bad_field", f"topk K={spec.k} exceeds the vocabulary of {self.target.vocab_size}",
                            msg.sid)
        unknown = sorted(set(msg.exits) - set(self.exit_layers))
        if unknown:
            raise WireError("bad_field", f"no early exit at layers {unknown}; this verifier has "
                            f"{self.exit_layers or 'none'}", msg.sid)
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
        session = Session(msg.sid, conn_id, state, params, rng, exits=list(msg.exits), payload=spec)
        return session, (time.perf_counter() - t0) * 1e3

    # ------------------------------------------------------------------ rounds

    def verify(self, session: Session, msg: Verify,
               emit: Callable[[Exit], None] | None = None) -> RoundOutcome:
        """Accept/reject msg.draft_ids against the target; commits the result to the session.

        With `emit` and a session opened with exits, the session's early exits
        score the draft during the same forward pass and `emit` gets an `exit`
        message whenever their verdict changes (called from inside the pass).
        Exits are hints only: the final layer alone decides what is committed,
        so the outcome is the same with exits on or off, and an exit that fails
        is logged and skipped without touching the verdict.
        """
        _check_live(session)
        state = session.state
        k = len(msg.draft_ids)
        self._check_fix(session, msg.fix)
        n_server = len(state.ids) + (msg.fix is not None)
        if msg.n_committed != n_server:
            raise WireError("desync", f"robot has {msg.n_committed} committed tokens, server has "
                            f"{n_server}: re-open the session with the committed prefix", msg.sid)
        if k > self.config.max_draft_len:
            raise WireError("bad_field", f"draft of {k} tokens exceeds max_draft_len "
                            f"{self.config.max_draft_len}", msg.sid)
        if len(state.ids) + k + 1 > self.config.max_context:
            raise WireError("context_full", f"session reached max_context {self.config.max_context}", msg.sid)
        self._check_ids(msg.draft_ids, "draft_ids", msg.sid)
        if msg.cands is not None and msg.cands.size and int(msg.cands.max()) >= self.target.vocab_size:
            raise WireError("bad_field", f"cands holds token id {int(msg.cands.max())} outside the vocabulary "
                            f"of {self.target.vocab_size}", msg.sid)
        # q is needed only for drafted tokens: an empty draft (the last token of a generation) has none
        q = None if session.params.greedy or not k else self._draft_q(session, msg)
        probe = self._exit_pass(session, msg, emit)
        if msg.fix is not None:                     # everything is checked: only now touch the state
            self._apply_fix(session, msg.fix)

        t0 = time.perf_counter()
        logits = self.target.score(state, msg.draft_ids, taps=probe.taps if probe else None)   # [k + 1, vocab]
        try:
            if session.params.greedy:
                verdict = sampling.verify_greedy(np.asarray(msg.draft_ids), logits.argmax(axis=-1))
            else:
                p = sampling.probs_from_logits(logits, session.params)    # [k + 1, vocab]
                if session.payload.kind == "split" and q is not None:     # q: q(x_i) [k]
                    verdict = sampling.verify_split(np.asarray(msg.draft_ids), q, p, session.rng)
                else:
                    q = np.zeros((0, p.shape[1])) if q is None else q     # [k, vocab]
                    verdict = sampling.verify_sampled(np.asarray(msg.draft_ids), q, p, session.rng)
        except sampling.SamplingError as e:
            self.target.rewind(state, state.ids)                      # drop the draft from the cache
            raise WireError("bad_probs", str(e), msg.sid) from None
        n_before = len(state.ids)
        residual = None
        if verdict.token == sampling.RESIDUAL:
            # The robot draws the correction; until its `fix` comes the cache covers every committed id.
            committed = msg.draft_ids[:verdict.accepted]
            session.owed = p[verdict.accepted]
            ids, values = payload.sparse_residual(logits[verdict.accepted], session.owed, session.params)
            residual = {"logits": values, "ids": ids}
        else:
            committed = msg.draft_ids[:verdict.accepted] + [verdict.token]
        self.target.commit(state, committed, n_before + verdict.accepted)
        outcome = RoundOutcome(verdict, (time.perf_counter() - t0) * 1e3, residual=residual)
        if probe is not None:
            agreed = probe.agreeing_layer(committed)
            outcome.exit_layer = self.target.n_layers if agreed is None else agreed
            outcome.exit_ms = probe.ms
        return outcome

    def _exit_pass(self, session: Session, msg: Verify, emit: Callable[[Exit], None] | None) -> ExitPass | None:
        if not session.exits or emit is None or self.exits is None:
            return None

        def send(v: ExitVerdict) -> None:
            emit(Exit(msg.sid, msg.round, v.layer, v.tokens, v.confidence))

        return ExitPass(self.exits, self.target.model, session.exits, msg.draft_ids, msg.cands,
                        self.config.exit_bonus_candidates, send)

    def ar_step(self, session: Session) -> tuple[int, float, float]:
        """One target-only token: (token, ms, the target's probability of it as sampled; 1.0 when greedy)."""
        _check_live(session)
        state = session.state
        if session.owed is not None:
            raise WireError("desync", "the last split round ended in a rejection: send its correction as `fix`",
                            session.sid)
        if len(state.ids) + 1 > self.config.max_context:
            raise WireError("context_full", f"session reached max_context {self.config.max_context}",
                            session.sid)
        t0 = time.perf_counter()
        logits = self.target.score(state, [])[0]                      # [vocab]
        if session.params.greedy:
            token, p = int(np.argmax(logits)), 1.0
        else:
            probs = sampling.probs_from_logits(logits, session.params)
            token = sampling.sample(probs, session.rng)
            p = min(1.0, float(probs[token]))
        self.target.commit(state, [token], len(state.ids))
        return token, (time.perf_counter() - t0) * 1e3, p

    # ------------------------------------------------------------------ checks

    def _draft_q(self, session: Session, msg: Verify) -> np.ndarray:
        """The draft's q, checked before any model work: [k, vocab] float64, or q(x_i) [k] for split."""
        spec = session.payload
        if spec.kind == "none":
            raise WireError("bad_field", "temperature > 0 needs the draft distributions: open the session with "
                            "payload full, topk or split", msg.sid)
        if msg.q["kind"] != spec.kind:
            raise WireError("bad_field", f"this session declared payload {spec.kind!r} at open, the round sent "
                            f"{msg.q['kind']!r}", msg.sid)
        try:
            if spec.kind == "split":
                return payload.split_qx(msg.q, msg.draft_ids, spec)
            return payload.dense_q(msg.q, msg.draft_ids, self.target.vocab_size, spec)
        except sampling.SamplingError as e:
            raise WireError("bad_probs", str(e), msg.sid) from None

    # ------------------------------------------------------------------ split corrections

    def fix(self, session: Session, token: int | None) -> None:
        """Commit the correction a split rejection left owed (an `ar` request's `fix`)."""
        _check_live(session)
        self._check_fix(session, token)
        if token is not None:
            self._apply_fix(session, token)

    def _check_fix(self, session: Session, token: int | None) -> None:
        if session.owed is None:
            if token is not None:
                raise WireError("bad_field", "fix sent, but no split rejection is waiting for a correction",
                                session.sid)
            return
        if token is None:
            raise WireError("desync", "the last split round ended in a rejection: send its correction as `fix`",
                            session.sid)
        self._check_ids([token], "fix", session.sid)
        if session.owed[token] <= 0:
            raise WireError("bad_field", f"fix {token} has zero probability under the target: it cannot come "
                            "from the residual", session.sid)

    def _apply_fix(self, session: Session, token: int) -> None:
        state = session.state
        self.target.commit(state, [token], len(state.ids))
        session.owed = None

    def _check_ids(self, ids: list[int], name: str, sid: str | None = None) -> None:
        if ids and max(ids) >= self.target.vocab_size:
            raise WireError("bad_field", f"{name} holds token id {max(ids)} outside the vocabulary of "
                            f"{self.target.vocab_size}", sid)


def _check_live(session: Session) -> None:
    """Runs in the model thread, like `open`, so a re-open and a stale request cannot interleave."""
    if session.retired:
        raise WireError("unknown_session", f"session {session.sid!r} was re-opened elsewhere", session.sid)


def load_exits(config: ServerConfig, target: TargetModel) -> ExitHeads | None:
    """The early-exit adapters the config names (config.exits, config.exit_layers), or None for none."""
    path = modelfiles.resolve_exits(config.exits, target.name)
    if path is None:
        log.info("early exits off (exits=%r, target %s)", config.exits, target.name)
        return None
    heads = ExitHeads.load(path, config.exit_layers or None)
    hidden = int(target.model.config.hidden_size)
    if heads.config.hidden != hidden or heads.layers[-1] > target.n_layers:
        raise ValueError(f"exit adapters at {path} (hidden {heads.config.hidden}, layers {heads.layers}) do not fit "
                         f"the target {target.name} (hidden {hidden}, {target.n_layers} layers)")
    if heads.config.target and heads.config.target != target.name:
        log.warning("exit adapters at %s were trained for %s, the target is %s", path, heads.config.target,
                    target.name)
    log.info("early exits at layers %s from %s", heads.layers, path)
    return heads
