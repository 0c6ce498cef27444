"""Verification: turn sessions' drafts into verdicts, many sessions in one target forward pass.

Synchronous and free of networking, so the server runs it in its model thread and tests call it directly.
Read top to bottom, this module is the verify path:

  1. `Verifier.run_batch(requests)`: each request (server_bridge/requests.py: open, verify, ar) is checked
     by its own handler into a `Work` before any model work; one batched pass (`Target.extend`, over the
     engine interface of server_bridge/engines/__init__.py) runs every work's rows; each work then decides from its
     own rows. A request that fails its checks gets its error and leaves the others' pass alone.
  2. A verify round's checks and rows: `Verifier._prepare_verify` (desync, lengths, ids, the draft's q,
     its early exits) -> `VerifyWork`.
  3. Where a token is accepted: `VerifyWork.finish` -> `verdict` (greedy, sampled, split; under a grammar
     `grammar_rows`) -> commit -> `RoundOutcome`.
  4. Split corrections (`fix`): owed after a split rejection, checked here and committed with the next
     round (or by `Verifier.fix` before an ar stream).

Opens live in server_bridge/opens.py, ar tokens in server_bridge/ar.py, which exits run in
server_bridge/exit_setup.py. Early exits (FSD) ride along in the verify pass and report through a callback.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from protocol import payload, sampling
from protocol.grammar import GrammarError
from protocol.structured import Constraint
from protocol.wire import Exit, Open, Verify, WireError

from .ar import prepare_ar
from .checks import advance, check_ids, check_live
from .config import ServerConfig
from .engines import EngineFull, NoRoom
from .exit_setup import load_exits
from .exits import ExitPass, ExitVerdict
from .opens import Opens
from .requests import (
    ArOutcome,
    ArRequest,
    OpenNeedsRoom,
    OpenRequest,
    Outcome,
    Request,
    RoundOutcome,
    VerifyRequest,
    Work,
)
from .sessions import Session
from .target import Extension, Target

log = logging.getLogger(__name__)

Answer = Outcome | WireError  # what run_batch gives each request


class Verifier:
    """The model thread's one entry: requests in, outcomes out. Not thread-safe (one model thread)."""

    def __init__(self, target: Target, config: ServerConfig):
        self.target = target
        self.config = config
        self.exits = load_exits(config, target)
        self.opens = Opens(target, config, self.exit_layers)
        self.engine_cpu_s = 0.0  # CPU seconds of the model thread inside the engine's passes (metrics)
        self.model_cpu_s = 0.0  # ... and in run_batch in all: checks, passes, verdicts, commits

    @property
    def exit_layers(self) -> list[int]:
        """The early exits a session may ask for (Welcome.exits)."""
        return list(self.exits.layers) if self.exits is not None else []

    # ------------------------------------------------------------------ 1. a batch in one pass

    def run_batch(self, requests: list[Request]) -> tuple[list[Answer], float, list[tuple[int, int]]]:
        """Run requests through one forward pass.

        Returns per request its outcome (OpenOutcome, RoundOutcome or ArOutcome) or its WireError, the
        pass's ms, and the pass's members (L_cached, L_new) for the estimator ([] when none needed the model).
        """
        c0 = time.thread_time()
        try:
            return self._run_batch(requests)
        finally:
            self.model_cpu_s += time.thread_time() - c0

    def _run_batch(self, requests: list[Request]) -> tuple[list[Answer], float, list[tuple[int, int]]]:
        out: list[Answer | None] = [None] * len(requests)
        works = self._prepare_all(requests, out)
        exts = [w.ext for w in works.values() if w.ext is not None]
        members = [e.member for e in exts]
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            rows = iter(self.target.extend(exts) if exts else [])
        except Exception as e:  # nothing was committed: the next pass starts at state.cached
            if not isinstance(e, EngineFull):
                log.exception("a batched pass of %d sessions failed", len(exts))
            for i in works:
                out[i] = _pass_failed(e, requests[i])
            return _answers(out), (time.perf_counter() - t0) * 1e3, members
        pass_ms = (time.perf_counter() - t0) * 1e3
        self.engine_cpu_s += time.thread_time() - c0  # with the engine's threads > 1, only this thread's share
        rows_of = {i: next(rows) for i, work in works.items() if work.ext is not None}
        best: dict[int, np.ndarray | None] = dict.fromkeys(works)
        best.update(self._greedy_ids(works, rows_of))
        for i, work in works.items():
            row = rows_of.get(i)
            try:  # one session's failure is its own: the others keep their results
                out[i] = work.finish(row, best[i]) if isinstance(work, VerifyWork) else work.finish(row)
            except WireError as e:
                out[i] = e
            except GrammarError as e:  # LLGuidance's own bounds met midway (a row of 2,000 items: wide anyOfs)
                out[i] = WireError("bad_field", f"grammar: {str(e).splitlines()[0]}", requests[i].sid)
            except Exception as e:  # its state is untouched: finish commits last
                log.exception("deciding a %s of %s failed", type(requests[i]).__name__, requests[i].sid)
                out[i] = WireError(
                    "internal", f"could not decide the request ({type(e).__name__}); retry", requests[i].sid
                )
        return _answers(out), pass_ms, members

    def _greedy_ids(self, works: dict[int, Work], rows_of: dict[int, Any]) -> dict[int, np.ndarray]:
        """The argmax ids of every greedy, unconstrained verify round's rows, taken for the whole pass at once
        (one device synchronisation, not one per session); the others decide from their rows."""
        greedy = [i for i, w in works.items() if isinstance(w, VerifyWork) and w.plain_greedy and i in rows_of]
        try:
            return dict(zip(greedy, self.target.argmax_each([rows_of[i] for i in greedy]), strict=True))
        except Exception:  # each round then takes its own argmax in finish, and fails there on its own
            log.exception("the pass's argmax over %d rounds failed", len(greedy))
            return {}

    def _prepare_all(self, requests: list[Request], out: list[Answer | None]) -> dict[int, Work]:
        """Each request's work by its index; a request that fails its checks gets its error in `out`."""
        works: dict[int, Work] = {}
        states: set[int] = set()
        for i, req in enumerate(requests):
            try:
                work = self._prepare(req)
                if work.ext is not None and id(work.ext.state) in states:  # the scheduler keeps sids apart
                    raise WireError("busy", "another request of this session is in the same pass; retry", req.sid)
                works[i] = work
                if work.ext is not None:
                    states.add(id(work.ext.state))
            except WireError as e:
                out[i] = e
            except Exception as e:  # a bug in one request's checks must not take the batch down
                log.exception("preparing a %s failed", type(req).__name__)
                out[i] = WireError("internal", f"could not prepare the request ({type(e).__name__})", req.sid)
        return works

    def _prepare(self, req: Request) -> Work:
        """Every check before any model work, by the request's own handler. Raises WireError."""
        if isinstance(req, VerifyRequest):
            return self._prepare_verify(req)
        if isinstance(req, OpenRequest):
            return self.opens.prepare(req)
        return prepare_ar(self.target, self.config.max_context, req)

    # ------------------------------------------------------------------ one request at a time

    def open(self, msg: Open, conn_id: int, previous: Session | None, arrival: float = 0.0) -> tuple[Session, float]:
        """A new session, or a re-opened one that keeps the KV of the prefix it shares with the old one."""
        out = self._one(OpenRequest(msg, conn_id, previous, arrival or time.monotonic()))
        assert not isinstance(out, (RoundOutcome, ArOutcome))
        return out.session, out.ms

    def verify(self, session: Session, msg: Verify, emit: Callable[[Exit], None] | None = None) -> RoundOutcome:
        """Accept/reject msg.draft_ids against the target; commits the result to the session.

        With `emit` and a session opened with exits, the session's early exits
        score the draft during the same forward pass and `emit` gets an `exit`
        message whenever their verdict changes (called from inside the pass).
        Exits are hints only: the final layer alone decides what is committed,
        so the outcome is the same with exits on or off, and an exit that fails
        is logged and skipped without touching the verdict.
        """
        out = self._one(VerifyRequest(session, msg, emit))
        assert isinstance(out, RoundOutcome)
        return out

    def ar_step(self, session: Session) -> ArOutcome:
        """One target-only token: (token, ms, the target's probability of it as sampled; 1.0 when greedy)."""
        out = self._one(ArRequest(session))
        assert isinstance(out, ArOutcome)
        return out

    def decode_images(self, msg: Open) -> None:
        """An open's images decoded ahead, in the server's image thread (Opens.decode_images)."""
        self.opens.decode_images(msg)

    def compile_grammar(self, msg: Open, peer: str) -> Constraint | None:
        """An open's grammar compiled ahead, in the server's grammar threads (Opens.compile_grammar)."""
        return self.opens.compile_grammar(msg, peer)

    def release(self, sessions: list[Session]) -> None:
        """Give the engine sequences of sessions the server let go (evicted or closed) back now, rather than
        when they are collected. In the model thread: after the pass running now (which may still use one),
        before the next (which cannot: they are retired, so `check_live` turns their requests away). A state
        a re-open took over stays with it."""
        for session in sessions:
            if session.retired and not session.handed_over and session.state is not None:
                try:
                    self.target.free(session.state)
                except Exception:  # it goes when collected instead
                    log.exception("freeing the sequence of session %s failed", session.sid)

    def _one(self, req: Request) -> Outcome:
        (result,), _, _ = self.run_batch([req])
        if isinstance(result, WireError):
            raise result
        return result

    # ------------------------------------------------------------------ 2. a verify round's checks

    def _prepare_verify(self, req: VerifyRequest) -> VerifyWork:
        t0 = time.perf_counter()
        session, msg = req.session, req.msg
        check_live(session)
        state = session.state
        k = len(msg.draft_ids)
        self._check_fix(session, msg.fix)
        n_server = len(state.ids) + (msg.fix is not None)
        if msg.n_committed != n_server:
            raise WireError(
                "desync",
                f"robot has {msg.n_committed} committed tokens, server has "
                f"{n_server}: re-open the session with the committed prefix",
                msg.sid,
            )
        if k > self.config.max_draft_len:
            raise WireError(
                "bad_field", f"draft of {k} tokens exceeds max_draft_len {self.config.max_draft_len}", msg.sid
            )
        if state.positions + (msg.fix is not None) + k + 1 > self.config.max_context:
            raise WireError("context_full", f"session reached max_context {self.config.max_context}", msg.sid)
        check_ids(msg.draft_ids, self.target.vocab_size, "draft_ids", msg.sid)
        if msg.cands is not None and msg.cands.size and int(msg.cands.max()) >= self.target.vocab_size:
            raise WireError(
                "bad_field",
                f"cands holds token id {int(msg.cands.max())} outside the vocabulary of {self.target.vocab_size}",
                msg.sid,
            )
        # q is needed only for drafted tokens: an empty draft (the last token of a generation) has none
        q = None if session.params.greedy or not k else self._draft_q(session, msg)
        probe = self._exit_pass(session, msg, req.emit)
        # The correction a split rejection owed rides in this pass; it is committed only once the pass
        # and the verdict succeed (VerifyWork.finish), so a round that fails can be sent again as it was.
        fix = [] if msg.fix is None else [msg.fix]
        ext = Extension(
            state, state.ids[state.cached :] + fix + list(msg.draft_ids), keep=k + 1, taps=probe.taps if probe else None
        )
        return VerifyWork(self.target, session, msg, q, probe, ext, t0)

    def _draft_q(self, session: Session, msg: Verify) -> np.ndarray:
        """The draft's q, checked before any model work: [k, vocab] float64, or q(x_i) [k] for split."""
        spec = session.payload
        if spec.kind == "none":
            raise WireError(
                "bad_field",
                "temperature > 0 needs the draft distributions: open the session with payload full, topk or split",
                msg.sid,
            )
        if msg.q["kind"] != spec.kind:
            raise WireError(
                "bad_field",
                f"this session declared payload {spec.kind!r} at open, the round sent {msg.q['kind']!r}",
                msg.sid,
            )
        try:
            if spec.kind == "split":
                return payload.split_qx(msg.q, msg.draft_ids, spec)
            return payload.dense_q(msg.q, msg.draft_ids, self.target.vocab_size, spec)
        except sampling.SamplingError as e:
            raise WireError("bad_probs", str(e), msg.sid) from None

    def _exit_pass(self, session: Session, msg: Verify, emit: Callable[[Exit], None] | None) -> ExitPass | None:
        """This round's early exits, scoring the draft during the pass (None: the session asked for none)."""
        if not session.exits or emit is None or self.exits is None:
            return None

        def send(v: ExitVerdict) -> None:
            emit(Exit(msg.sid, msg.round, v.layer, v.tokens, v.confidence))

        return ExitPass(self.exits, session.exits, msg.draft_ids, msg.cands, self.config.exit_bonus_candidates, send)

    # ------------------------------------------------------------------ 4. split corrections

    def fix(self, session: Session, token: int | None) -> None:
        """Commit the correction a split rejection left owed (an `ar` request's `fix`)."""
        check_live(session)
        self._check_fix(session, token)
        if token is not None:
            self.target.commit(session.state, [token], len(session.state.ids))
            session.owed = None
            advance(session, [token])

    def _check_fix(self, session: Session, token: int | None) -> None:
        if session.owed is None:
            if token is not None:
                raise WireError(
                    "bad_field", "fix sent, but no split rejection is waiting for a correction", session.sid
                )
            return
        if token is None:
            raise WireError(
                "desync", "the last split round ended in a rejection: send its correction as `fix`", session.sid
            )
        check_ids([token], self.target.vocab_size, "fix", session.sid)
        if session.owed[token] <= 0:
            raise WireError(
                "bad_field",
                f"fix {token} has zero probability under the target: it cannot come from the residual",
                session.sid,
            )


# ---------------------------------------------------------------------- 3. where a token is accepted


@dataclass(frozen=True)
class VerifyWork:
    """A verify round that passed its checks: its rows of the pass and what decides them."""

    target: Target
    session: Session
    msg: Verify
    q: np.ndarray | None  # the draft's q: [k, vocab], or q(x_i) [k] for split; None when greedy or k == 0
    probe: ExitPass | None  # this round's early exits
    ext: Extension  # k + 1 rows: after each draft prefix
    t0: float  # perf_counter when its checks began

    @property
    def plain_greedy(self) -> bool:
        """Greedy without a grammar: the verdict needs only its rows' argmax ids (Verifier._greedy_ids)."""
        return self.session.params.greedy and self.session.grammar is None

    def finish(self, rows: Any, best: np.ndarray | None = None) -> RoundOutcome:
        """The session's rows of the pass [k + 1, vocab] against its draft; then commit. best: their argmax ids
        when the pass took them already (plain greedy).

        Nothing of the session changes until the verdict stands: a failure here leaves its committed
        prefix as it was, and the next pass starts at state.cached whatever this one wrote.
        """
        session, msg, target = self.session, self.msg, self.target
        state = session.state
        try:
            v, p_row = verdict(target, session, msg.draft_ids, self.q, rows, msg.fix, best)
        except sampling.SamplingError as e:
            raise WireError("bad_probs", str(e), msg.sid) from None
        if msg.fix is not None:  # the owed correction, verified with this pass
            state.ids.append(msg.fix)
            session.owed = None
            advance(session, [msg.fix])
        n_before = len(state.ids)
        residual = None
        if v.token == sampling.RESIDUAL:
            # The robot draws the correction; until its `fix` comes the cache covers every committed id.
            assert p_row is not None  # a split verdict on the host or the device
            committed = msg.draft_ids[: v.accepted]
            owed = session.owed = p_row(v.accepted)  # p_j [V] on the host
            logits_j = target.to_numpy(rows[v.accepted : v.accepted + 1])[0]
            ids, values = payload.sparse_residual(logits_j, owed, session.params, masked=session.grammar is not None)
            residual = {"logits": values, "ids": ids}
        else:
            committed = msg.draft_ids[: v.accepted] + [v.token]
        target.commit(state, committed, n_before + v.accepted)
        advance(session, committed)
        outcome = RoundOutcome(v, (time.perf_counter() - self.t0) * 1e3, residual=residual)
        if self.probe is not None:
            agreed = self.probe.agreeing_layer(committed)
            outcome.exit_layer = target.n_layers if agreed is None else agreed
            outcome.exit_ms = self.probe.ms
        return outcome


PRow = Callable[[int], np.ndarray]  # j -> the target's p_j [vocab] on the host


def verdict(
    target: Target,
    session: Session,
    draft_ids: list[int],
    q: np.ndarray | None,
    rows: Any,
    fix: int | None = None,
    best: np.ndarray | None = None,
) -> tuple[sampling.Verdict, PRow | None]:
    """(verdict, p_row) for a round's rows [k + 1, vocab]; p_row(j) is the target's p_j on the host.

    Greedy: only the argmax ids leave the device. Sampled: on a device engine the maths runs
    there (server_bridge/engines/devmath.py), elsewhere in numpy (protocol/sampling.py, the reference).
    Under a grammar (`grammar_rows`) always on the host: the masks come from LLGuidance
    (protocol/structured.py) on the CPU.
    """
    params, rng = session.params, session.rng
    split = session.payload.kind == "split"
    mask = None
    if session.grammar is not None:
        best, mask = grammar_rows(session, draft_ids, target.to_numpy(rows), fix)
        if best is not None:  # greedy
            return sampling.verify_greedy(np.asarray(draft_ids), best), None
    elif params.greedy:
        return sampling.verify_greedy(np.asarray(draft_ids), target.argmax(rows) if best is None else best), None
    elif target.on_device:
        from .engines import devmath

        dp = devmath.probs_from_logits(rows, params)  # [k + 1, vocab] on the device
        if split and q is not None:  # q: q(x_i) [k]
            v = devmath.verify_split(draft_ids, q, dp, rng)
        else:  # q: [k, vocab]
            v = devmath.verify_sampled(draft_ids, np.zeros((0, dp.shape[1])) if q is None else q, dp, rng)
        return v, lambda j: dp[j].double().cpu().numpy()
    p = sampling.probs_from_logits(target.to_numpy(rows), params, mask)  # [k + 1, vocab]
    if split and q is not None:  # q: q(x_i) [k]
        v = sampling.verify_split(np.asarray(draft_ids), q, p, rng)
    else:  # q: [k, vocab]
        v = sampling.verify_sampled(np.asarray(draft_ids), np.zeros((0, p.shape[1])) if q is None else q, p, rng)
    return v, lambda j: p[j]


def grammar_rows(
    session: Session, draft_ids: list[int], logits: np.ndarray, fix: int | None
) -> tuple[np.ndarray | None, np.ndarray | None]:
    """What the session's grammar makes of a round's rows logits [k + 1, vocab]: row i is masked by the
    grammar after ids + draft[:i]. Greedy: (the masked argmax ids [k + 1], None), walked until the first
    disagreement (protocol.structured reads the argmax's bit first, so an allowed argmax costs one
    check). Sampled: (None, masks [k + 1, vocab]); a draft token the grammar forbids has p = 0 there and
    is rejected, so the rows after it are never used and stay unmasked."""
    assert session.grammar is not None
    walk = session.grammar.clone()
    if fix is not None:  # committed before this draft
        walk.accept(fix)
    k = len(draft_ids)
    if session.params.greedy:
        best = np.zeros(k + 1, dtype=np.int64)
        for i in range(k + 1):
            best[i:] = walk.argmax(logits[i])
            if i == k or draft_ids[i] != best[i]:
                break
            walk.accept(draft_ids[i])
        return best, None
    masks = np.ones(logits.shape, dtype=bool)
    for i in range(k + 1):
        masks[i] = walk.mask()
        if i == k or not masks[i, draft_ids[i]]:
            break
        walk.accept(draft_ids[i])
    return None, masks


def _pass_failed(e: Exception, req: Request) -> WireError:
    """A request's answer when the batched pass itself failed (nothing was committed)."""
    if isinstance(e, NoRoom) and isinstance(req, OpenRequest):
        return OpenNeedsRoom(str(e), req.sid)
    if isinstance(e, EngineFull):
        return WireError("overloaded", f"{e}: retry later", req.sid)
    return WireError("internal", f"the verification pass failed ({type(e).__name__}); retry the round", req.sid)


def _answers(out: list[Answer | None]) -> list[Answer]:
    """Every slot filled: each request was prepared and failed, or finished, or failed with the pass."""
    assert all(a is not None for a in out)
    return [a for a in out if a is not None]
