"""Verification: turn sessions' drafts into verdicts, many sessions in one target forward pass.

Synchronous and free of networking, so the server runs it in its model thread
and tests call it directly. Every request is a `Job` (open, verify or one ar
token); `run_batch` checks each job, runs one padded forward pass over all
that passed (`Target.extend`), then decides each session's verdict from
its own rows. A job that fails its checks gets its error and leaves the
others' pass alone. Where a token is accepted: `Verifier._finish_verify`.
Early exits (FSD) ride along in the same pass and report through a callback.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from protocol import modelfiles, payload, sampling
from protocol.grammar import GrammarError, GrammarState
from protocol.wire import Exit, Open, Verify, WireError
from runtime.vision import UnknownImage

from .config import ServerConfig
from .engine import EngineFull, NoRoom
from .exits import ExitConfig, ExitPass, ExitScorer, ExitVerdict, NumpyExitHeads
from .sessions import Session
from .target import Extension, Target, TargetState, shared_prefix

log = logging.getLogger(__name__)


class OpenNeedsRoom(WireError):
    """An open found the engine's shared room all held (every sequence, or a unified KV pool): `overloaded`
    to whoever calls the verifier directly; the server evicts an idle session and tries again."""

    def __init__(self, reason: str, sid: str):
        super().__init__("overloaded", f"{reason}: retry later", sid)
        self.reason = reason  # the engine's words: "all 64 sequences are in use"


@dataclass
class RoundOutcome:
    """What one verify round produced, for the `result` message and the metrics."""

    verdict: sampling.Verdict
    verify_ms: float  # the whole round, exit heads included
    exit_layer: int | None = None  # earliest enabled exit whose verdict equalled the final one, n_layers if
    # none did; None when no exits ran this round
    exit_ms: float = 0.0  # time spent in exit heads this round
    residual: dict | None = None  # split rejection: the target's p_j for the robot (Result.residual)

    def timing(self) -> dict:
        """Result.timing: verify_ms, passes; exit_layer and exit_ms when exits ran."""
        timing = {"verify_ms": self.verify_ms, "passes": 1}
        if self.exit_layer is not None:
            timing.update(exit_layer=self.exit_layer, exit_ms=self.exit_ms)
        return timing


@dataclass
class Job:
    """One request for the model thread: an open (its prefill), a verify round or one ar token."""

    kind: str  # "open" | "verify" | "ar"
    msg: Any  # wire.Open | wire.Verify | wire.Ar
    session: Session | None = None  # verify, ar: the session; open: the one a re-open replaces, if any
    conn_id: int = 0  # open: the connection that will own the session
    emit: Callable[[Exit], None] | None = None  # verify: early-exit sink
    arrival: float = 0.0  # open: monotonic time; the first round's SLO budget counts from it
    # set by Verifier._prepare
    ext: Extension | None = None  # this job's rows of the pass; None: no model work (a re-open)
    q: np.ndarray | None = None  # verify: the draft's q (see _draft_q)
    probe: ExitPass | None = None  # verify: this round's early exits
    ended: Session | None = None  # open: a previous generation of the sid that this open ends
    t0: float = field(default=0.0, repr=False)

    @property
    def sid(self) -> str:
        return self.session.sid if self.msg is None else self.msg.sid


class Verifier:
    def __init__(self, target: Target, config: ServerConfig):
        self.target = target
        self.config = config
        self.exits = load_exits(config, target)

    @property
    def exit_layers(self) -> list[int]:
        """The early exits a session may ask for (Welcome.exits)."""
        return list(self.exits.layers) if self.exits is not None else []

    # ------------------------------------------------------------------ batches

    def run_batch(self, jobs: list[Job]) -> tuple[list[Any], float, list[tuple[int, int]]]:
        """Run jobs through one forward pass.

        Returns per job its outcome or its WireError, the pass's ms, and the pass's
        members (L_cached, L_new) for the estimator ([] when no job needed the model).
        Outcomes: open -> (Session, ms); verify -> RoundOutcome; ar -> (token, ms, p).
        """
        out: list[Any] = [None] * len(jobs)
        live, states = [], set()
        for i, job in enumerate(jobs):
            try:
                self._prepare(job)
                if job.ext is not None and id(job.ext.state) in states:  # the scheduler keeps sids apart
                    raise WireError("busy", "another request of this session is in the same pass; retry", job.sid)
                live.append(job)
                if job.ext is not None:
                    states.add(id(job.ext.state))
            except WireError as e:
                out[i] = e
            except Exception as e:  # a bug in one request's checks must not take the batch down
                log.exception("preparing a %s job failed", job.kind)
                out[i] = WireError("internal", f"could not prepare the request ({type(e).__name__})", job.sid)
        exts = [job.ext for job in live if job.ext is not None]
        members = [e.member for e in exts]
        t0 = time.perf_counter()
        try:
            rows = iter(self.target.extend(exts) if exts else [])
        except Exception as e:  # nothing was committed: the next pass starts at state.cached
            full = isinstance(e, EngineFull)
            if not full:
                log.exception("a batched pass of %d sessions failed", len(exts))
            for i, job in enumerate(jobs):
                if out[i] is None:
                    if isinstance(e, NoRoom) and job.kind == "open":
                        out[i] = OpenNeedsRoom(str(e), job.sid)
                    elif full:
                        out[i] = WireError("overloaded", f"{e}: retry later", job.sid)
                    else:
                        out[i] = WireError(
                            "internal", f"the verification pass failed ({type(e).__name__}); retry the round", job.sid
                        )
            return out, (time.perf_counter() - t0) * 1e3, members
        pass_ms = (time.perf_counter() - t0) * 1e3
        for i, job in enumerate(jobs):
            if out[i] is not None:
                continue
            row = next(rows) if job.ext is not None else None
            try:  # one session's failure is its own: the others keep their results
                out[i] = self._finish(job, row)
            except WireError as e:
                out[i] = e
            except Exception as e:  # its state is untouched: _finish commits last
                log.exception("deciding a %s job of %s failed", job.kind, job.sid)
                out[i] = WireError("internal", f"could not decide the request ({type(e).__name__}); retry", job.sid)
        return out, pass_ms, members

    def _prepare(self, job: Job) -> None:
        """Every check before any model work; sets job.ext. Raises WireError."""
        job.t0 = time.perf_counter()
        if job.kind == "open":
            self._prepare_open(job)
        elif job.kind == "verify":
            self._prepare_verify(job)
        elif job.kind == "ar":
            self._prepare_ar(job)
        else:
            raise ValueError(f"unknown job kind {job.kind!r}")

    def _finish(self, job: Job, logits: np.ndarray | None) -> Any:
        if job.kind == "open":
            state = job.session.state
            if job.ext is not None:
                state.cached = len(job.ext.new_ids)
            return job.session, (time.perf_counter() - job.t0) * 1e3
        if job.kind == "verify":
            return self._finish_verify(job, logits)
        return self._finish_ar(job, logits)

    # ------------------------------------------------------------------ one job at a time

    def open(self, msg: Open, conn_id: int, previous: Session | None, arrival: float = 0.0) -> tuple[Session, float]:
        """A new session, or a re-opened one that keeps the KV of the prefix it shares with the old one."""
        return self._one(Job("open", msg, previous, conn_id, arrival=arrival or time.monotonic()))

    def verify(self, session: Session, msg: Verify, emit: Callable[[Exit], None] | None = None) -> "RoundOutcome":
        """Accept/reject msg.draft_ids against the target; commits the result to the session.

        With `emit` and a session opened with exits, the session's early exits
        score the draft during the same forward pass and `emit` gets an `exit`
        message whenever their verdict changes (called from inside the pass).
        Exits are hints only: the final layer alone decides what is committed,
        so the outcome is the same with exits on or off, and an exit that fails
        is logged and skipped without touching the verdict.
        """
        return self._one(Job("verify", msg, session, emit=emit))

    def ar_step(self, session: Session) -> tuple[int, float, float]:
        """One target-only token: (token, ms, the target's probability of it as sampled; 1.0 when greedy)."""
        return self._one(Job("ar", None, session))

    def release(self, sessions: list[Session]) -> None:
        """Give the engine sequences of sessions the server let go (evicted or closed) back now, rather than
        when they are collected. In the model thread: after the pass running now (which may still use one),
        before the next (which cannot: they are retired, so `_check_live` turns their requests away). A state
        a re-open took over stays with it."""
        for session in sessions:
            if session.retired and not session.handed_over and session.state is not None:
                try:
                    self.target.free(session.state)
                except Exception:  # it goes when collected instead
                    log.exception("freeing the sequence of session %s failed", session.sid)

    def _one(self, job: Job) -> Any:
        (result,), _, _ = self.run_batch([job])
        if isinstance(result, WireError):
            raise result
        return result

    # ------------------------------------------------------------------ opens

    def _prepare_open(self, job: Job) -> None:
        msg, previous = job.msg, job.session
        self._check_ids(msg.prompt_ids, "prompt_ids", msg.sid)
        extra = self._check_images(msg)
        if len(msg.prompt_ids) + extra >= self.config.max_context:
            raise WireError(
                "context_full",
                f"prompt of {len(msg.prompt_ids)} tokens"
                f"{f' ({extra} more positions for its images)' if extra else ''} leaves no room in the "
                f"context of {self.config.max_context}",
                msg.sid,
            )
        try:
            params = sampling.SamplingParams(**msg.sampling)
        except sampling.SamplingError as e:
            raise WireError("bad_field", str(e), msg.sid) from None
        try:
            spec = payload.PayloadSpec(msg.payload["kind"], msg.payload["k"])
        except ValueError as e:
            raise WireError("bad_field", str(e), msg.sid) from None
        if spec.k > self.target.vocab_size:
            raise WireError("bad_field", f"topk K={spec.k} exceeds the vocabulary of {self.target.vocab_size}", msg.sid)
        unknown = sorted(set(msg.exits) - set(self.exit_layers))
        if unknown:
            raise WireError(
                "bad_field",
                f"no early exit at layers {unknown}; this verifier has {self.exit_layers or 'none'}",
                msg.sid,
            )
        slo = slo_class(msg.slo, self.config.default_slo, msg.sid)
        grammar = self._grammar_state(msg)
        if previous is not None and previous.retired:  # evicted (its KV is going) or already re-opened
            previous = job.session = None
        resumes = previous is not None and previous.slo == slo and _resumes(previous.state, msg)
        if previous is not None and previous.params == params:
            state = previous.state
            previous.handed_over = True  # the state is the new session's: freeing the old one keeps it
            state.passes = 0  # passes are reported per open / round
            self.target.rewind(state, msg.prompt_ids, msg.images)  # what is not cached goes with the next round
        else:
            try:
                state = self.target.new_state(msg.prompt_ids, prefill=False, images=msg.images)
            except NoRoom as e:  # every sequence is held by a session: the server evicts an idle one
                raise OpenNeedsRoom(str(e), msg.sid) from None
            except EngineFull as e:
                raise WireError("overloaded", f"{e}: retry later", msg.sid) from None
            if len(msg.prompt_ids) > 1:  # the prefill: all but the last prompt token
                job.ext = Extension(state, list(msg.prompt_ids[:-1]), keep=0)
        if previous is not None:
            # Work still queued for the old session object (an ar stream of a dropped
            # connection) must not touch the state from now on; see _check_live.
            previous.retired = True
        # A re-opened session draws fresh randomness keyed by where it resumes,
        # so a replayed round is an independent draw, as the math requires.
        rng = np.random.default_rng([params.seed, len(msg.prompt_ids)])
        session = Session(
            msg.sid, job.conn_id, state, params, rng, exits=list(msg.exits), payload=spec, slo=slo, grammar=grammar
        )
        if resumes:
            # the same generation goes on (a re-open after a lost link): it keeps its SLO bookkeeping
            session.t0, session.n0, session.alpha, session.t_last = (
                previous.t0,
                previous.n0,
                previous.alpha,
                previous.t_last,
            )
        else:
            session.t0, session.n0 = job.arrival, len(msg.prompt_ids)
            job.ended = previous  # the previous generation on this sid ended here (SLO metrics)
        job.session = session

    def _check_images(self, msg: Open) -> int:
        """The prompt's images, checked on this session alone before anything is queued or cut (each is
        tokenized now, so no batched pass meets a bad one): the KV positions they add to the prompt."""
        if not msg.images:
            return 0
        if not self.target.sees:
            raise WireError(
                "no_vision",
                f"the target {self.target.name} reads text only: open this session "
                "without images, or serve a vision-language target",
                msg.sid,
            )
        try:
            return self.target.prepare_images(msg.prompt_ids, msg.images)[1]
        except UnknownImage as e:
            raise WireError("unknown_image", f"{e}", msg.sid) from None
        except ValueError as e:
            raise WireError("bad_image", f"{e}", msg.sid) from None

    def decode_images(self, msg: Open) -> None:
        """Decode and tile an open's images before its job reaches the model thread: the server calls this in
        its image thread, and the model thread (`_check_images`, the pass) then finds each one ready and only
        embeds it. Bytes that are no image get `bad_image` here, on this session alone; everything else
        (no vision, an image off its marker, a hash no longer held) is left to `_check_images`."""
        vision = getattr(self.target.engine, "vision", None)
        if not msg.images or not self.target.sees or not hasattr(vision, "prepare"):
            return
        for image in msg.images:
            if image.data is None or msg.prompt_ids[image.at] != self.target.image_marker:
                continue
            try:
                vision.prepare(image)
            except ValueError as e:
                raise WireError("bad_image", f"{e}", msg.sid) from None
            except Exception:  # not the bytes' fault: the model thread tries again and answers as it always did
                log.exception("decoding an image of %s ahead of its open failed", msg.sid)
                return

    def _grammar_state(self, msg: Open) -> GrammarState | None:
        """Open.grammar -> the state after the prompt's constrained part (None: unconstrained)."""
        if msg.grammar is None:
            return None
        if not self.target.grammars_supported:
            raise WireError(
                "bad_field",
                f"this verifier's target {self.target.name} cannot decode under a grammar "
                "(llama.cpp's grammar sampler needs its GGUF vocabulary)",
                msg.sid,
            )
        try:
            return self.target.grammar(msg.grammar["gbnf"]).walk(msg.prompt_ids[msg.grammar["from"] :])
        except GrammarError as e:
            raise WireError("bad_field", f"grammar: {e}", msg.sid) from None

    # ------------------------------------------------------------------ rounds

    def _prepare_verify(self, job: Job) -> None:
        session, msg = job.session, job.msg
        _check_live(session)
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
        self._check_ids(msg.draft_ids, "draft_ids", msg.sid)
        if msg.cands is not None and msg.cands.size and int(msg.cands.max()) >= self.target.vocab_size:
            raise WireError(
                "bad_field",
                f"cands holds token id {int(msg.cands.max())} outside the vocabulary of {self.target.vocab_size}",
                msg.sid,
            )
        # q is needed only for drafted tokens: an empty draft (the last token of a generation) has none
        job.q = None if session.params.greedy or not k else self._draft_q(session, msg)
        job.probe = self._exit_pass(session, msg, job.emit)
        # The correction a split rejection owed rides in this pass; it is committed only once the pass
        # and the verdict succeed (_finish_verify), so a round that fails can be sent again as it was.
        fix = [] if msg.fix is None else [msg.fix]
        job.ext = Extension(
            state,
            state.ids[state.cached :] + fix + list(msg.draft_ids),
            keep=k + 1,
            taps=job.probe.taps if job.probe else None,
        )

    def _finish_verify(self, job: Job, rows) -> "RoundOutcome":
        """Where a token is accepted: the session's rows of the pass [k + 1, vocab] against its draft.

        Nothing of the session changes until the verdict stands: a failure here leaves its committed
        prefix as it was, and the next pass starts at state.cached whatever this one wrote.
        """
        session, msg, q = job.session, job.msg, job.q
        state = session.state
        try:
            verdict, p_row = self._verdict(session, msg.draft_ids, q, rows, msg.fix)
        except sampling.SamplingError as e:
            raise WireError("bad_probs", str(e), msg.sid) from None
        if msg.fix is not None:  # the owed correction, verified with this pass
            state.ids.append(msg.fix)
            session.owed = None
            _advance(session, [msg.fix])
        n_before = len(state.ids)
        residual = None
        if verdict.token == sampling.RESIDUAL:
            # The robot draws the correction; until its `fix` comes the cache covers every committed id.
            committed = msg.draft_ids[: verdict.accepted]
            session.owed = p_row(verdict.accepted)  # p_j [V] on the host
            logits_j = self.target.to_numpy(rows[verdict.accepted : verdict.accepted + 1])[0]
            ids, values = payload.sparse_residual(
                logits_j, session.owed, session.params, masked=session.grammar is not None
            )
            residual = {"logits": values, "ids": ids}
        else:
            committed = msg.draft_ids[: verdict.accepted] + [verdict.token]
        self.target.commit(state, committed, n_before + verdict.accepted)
        _advance(session, committed)
        if msg.draft_ids:
            session.alpha += 0.2 * (verdict.accepted / len(msg.draft_ids) - session.alpha)
        session.t_last = time.monotonic()
        outcome = RoundOutcome(verdict, (time.perf_counter() - job.t0) * 1e3, residual=residual)
        if job.probe is not None:
            agreed = job.probe.agreeing_layer(committed)
            outcome.exit_layer = self.target.n_layers if agreed is None else agreed
            outcome.exit_ms = job.probe.ms
        return outcome

    def _verdict(self, session: Session, draft_ids: list[int], q: np.ndarray | None, rows, fix: int | None = None):
        """(verdict, p_row) for a round's rows [k + 1, vocab]; p_row(j) is the target's p_j on the host.

        Greedy: only the argmax ids leave the device. Sampled: on a device engine the maths runs
        there (server_bridge/devmath.py), elsewhere in numpy (protocol/sampling.py, the reference).
        Under a grammar (`_grammar_rows`) always on the host: the masks come from llama.cpp's
        sampler on the CPU.
        """
        params, rng, split = session.params, session.rng, session.payload.kind == "split" and q is not None
        mask = None
        if session.grammar is not None:
            best, mask = self._grammar_rows(session, draft_ids, self.target.to_numpy(rows), fix)
            if params.greedy:
                return sampling.verify_greedy(np.asarray(draft_ids), best), None
        elif params.greedy:
            return sampling.verify_greedy(np.asarray(draft_ids), self.target.argmax(rows)), None
        elif self.target.on_device:
            from . import devmath

            p = devmath.probs_from_logits(rows, params)  # [k + 1, vocab] on the device
            if split:
                verdict = devmath.verify_split(draft_ids, q, p, rng)
            else:
                verdict = devmath.verify_sampled(draft_ids, np.zeros((0, p.shape[1])) if q is None else q, p, rng)
            return verdict, lambda j: p[j].double().cpu().numpy()
        p = sampling.probs_from_logits(self.target.to_numpy(rows), params, mask)
        if split:  # q: q(x_i) [k]
            verdict = sampling.verify_split(np.asarray(draft_ids), q, p, rng)
        else:  # q: [k, vocab]
            verdict = sampling.verify_sampled(
                np.asarray(draft_ids), np.zeros((0, p.shape[1])) if q is None else q, p, rng
            )
        return verdict, lambda j: p[j]

    def _grammar_rows(self, session: Session, draft_ids: list[int], logits: np.ndarray, fix: int | None):
        """What the session's grammar makes of a round's rows logits [k + 1, vocab]: row i is masked by the
        grammar after ids + draft[:i]. Greedy: (the masked argmax ids [k + 1], None), walked until the first
        disagreement (protocol.grammar checks the best candidates first, so an allowed argmax costs one
        check). Sampled: (None, masks [k + 1, vocab]); a draft token the grammar forbids has p = 0 there and
        is rejected, so the rows after it are never used and stay unmasked."""
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

    def _exit_pass(self, session: Session, msg: Verify, emit: Callable[[Exit], None] | None) -> ExitPass | None:
        if not session.exits or emit is None or self.exits is None:
            return None

        def send(v: ExitVerdict) -> None:
            emit(Exit(msg.sid, msg.round, v.layer, v.tokens, v.confidence))

        return ExitPass(self.exits, session.exits, msg.draft_ids, msg.cands, self.config.exit_bonus_candidates, send)

    def _prepare_ar(self, job: Job) -> None:
        session = job.session
        _check_live(session)
        state = session.state
        if session.owed is not None:
            raise WireError(
                "desync", "the last split round ended in a rejection: send its correction as `fix`", session.sid
            )
        if state.positions + 1 > self.config.max_context:
            raise WireError("context_full", f"session reached max_context {self.config.max_context}", session.sid)
        job.ext = Extension(state, state.ids[state.cached :], keep=1)

    def _finish_ar(self, job: Job, rows) -> tuple[int, float, float]:
        session = job.session
        if session.grammar is not None:  # masked like a verify row (_grammar_rows)
            logits = self.target.to_numpy(rows)[0]
            if session.params.greedy:
                token, p = session.grammar.argmax(logits), 1.0
            else:
                probs = sampling.probs_from_logits(logits, session.params, session.grammar.mask())
                token = sampling.sample(probs, session.rng)
                p = min(1.0, float(probs[token]))
        elif session.params.greedy:
            token, p = int(self.target.argmax(rows)[0]), 1.0
        elif self.target.on_device:
            from . import devmath

            probs = devmath.probs_from_logits(rows[0], session.params)  # [vocab] on the device
            token = devmath.sample(probs, session.rng)
            p = min(1.0, float(probs[token]))
        else:
            probs = sampling.probs_from_logits(self.target.to_numpy(rows)[0], session.params)  # [vocab]
            token = sampling.sample(probs, session.rng)
            p = min(1.0, float(probs[token]))
        self.target.commit(session.state, [token], len(session.state.ids))
        _advance(session, [token])
        session.t_last = time.monotonic()
        return token, (time.perf_counter() - job.t0) * 1e3, p

    # ------------------------------------------------------------------ checks

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
                raise WireError(
                    "bad_field", "fix sent, but no split rejection is waiting for a correction", session.sid
                )
            return
        if token is None:
            raise WireError(
                "desync", "the last split round ended in a rejection: send its correction as `fix`", session.sid
            )
        self._check_ids([token], "fix", session.sid)
        if session.owed[token] <= 0:
            raise WireError(
                "bad_field",
                f"fix {token} has zero probability under the target: it cannot come from the residual",
                session.sid,
            )

    def _apply_fix(self, session: Session, token: int) -> None:
        state = session.state
        self.target.commit(state, [token], len(state.ids))
        session.owed = None
        _advance(session, [token])

    def _check_ids(self, ids: list[int], name: str, sid: str | None = None) -> None:
        if ids and max(ids) >= self.target.vocab_size:
            raise WireError(
                "bad_field", f"{name} holds token id {max(ids)} outside the vocabulary of {self.target.vocab_size}", sid
            )


def slo_class(slo: dict, default: float, sid: str) -> float:
    """Open.slo -> the session's token-speed class in tokens/s (0: best effort)."""
    value = slo.get("tokens_per_s", default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1000:
        raise WireError("bad_field", f"slo.tokens_per_s must be a number of tokens/s in [0, 1000], got {value!r}", sid)
    return float(value)


def _resumes(old: TargetState, msg: Open) -> bool:
    """Whether a re-open continues the old committed prefix (one is a prefix of the other, with the same images)."""
    n = min(len(old.ids), len(msg.prompt_ids))
    return shared_prefix(old.ids, old.images, msg.prompt_ids, {im.at: im for im in msg.images}) == n


def _advance(session: Session, committed: list[int]) -> None:
    """Walk the session's grammar over newly committed ids. Each was chosen under the grammar's mask
    (a masked argmax, or a token of p' > 0), so the walk cannot fail short of a bug, which then
    surfaces as GrammarError rather than as llama.cpp's abort."""
    if session.grammar is not None:
        for t in committed:
            session.grammar.accept(t)


def _check_live(session: Session) -> None:
    """Runs in the model thread, like `open`, so a re-open and a stale request cannot interleave."""
    if session.retired:
        raise WireError(
            "unknown_session",
            f"session {session.sid!r} was evicted or re-opened elsewhere: re-open it with the committed prefix",
            session.sid,
        )


def exit_taps(config: ServerConfig, target_name: str) -> list[int]:
    """The layers a llamacpp engine must tap for the exits the config names ([]: no eval callback).

    Only adapters named outright: with exits "auto" a llamacpp server runs none. Measured, they
    save nothing there: FSD 28.7 tok/s with exits, 28.6 without at RTT 0, 22.8 and 23.3 at 50 ms
    (docs/exits/fsd), while they add 12 ms to an accepted 65 ms pass (docs/exits).
    """
    if config.exits == "auto":
        return []
    path = modelfiles.resolve_exits(config.exits, target_name)
    return [] if path is None else ExitConfig.load(path).pick(config.exit_layers or None)


def load_exits(config: ServerConfig, target: Target) -> ExitScorer | None:
    """The early-exit heads the config names (config.exits, config.exit_layers), or None for none.

    On the torch engine the trained modules run on the model's device and dtype; on the llamacpp
    engine the same adapters run in numpy over the GGUF's own norm and LM head, fed by the
    engine's eval callback, which must tap their layers (load the engine with
    `tap_layers=exit_taps(config, name)`, as `server.target_from_config` does).
    """
    path = modelfiles.resolve_exits(config.exits, target.name)
    if path is None:
        log.info("early exits off (exits=%r, target %s)", config.exits, target.name)
        return None
    engine = target.engine
    if engine.info.engine == "torch":
        from .exits_torch import ExitHeads, TorchExitScorer

        heads = ExitHeads.load(path, config.exit_layers or None)
        heads.to(device=engine.device, dtype=engine.dtype)
        heads.n_vocab = target.vocab_size  # the agreed vocabulary: a padded head's [PAD] rows never name a token
        scorer = TorchExitScorer(heads, engine.model)
    else:
        need = ExitConfig.load(path).pick(config.exit_layers or None)
        if not set(need) <= set(engine.tapped):
            why = (
                f"the llamacpp engine taps layers {engine.tapped}, the exits need {need}: load it with "
                "tap_layers=exit_taps(config, name)"
            )
            if config.exits != "auto":
                raise ValueError(why)
            log.info("early exits off on this llamacpp engine (name them with --exits PATH to run them): %s", why)
            return None
        scorer = NumpyExitHeads.load(path, engine.path, need)
        scorer.head = scorer.head[: target.vocab_size]  # a view: a padded head's [PAD] rows never name a token
    hidden = engine.hidden_size
    if scorer.config.hidden != hidden or scorer.layers[-1] > target.n_layers:
        raise ValueError(
            f"exit adapters at {path} (hidden {scorer.config.hidden}, layers {scorer.layers}) do not "
            f"fit the target {target.name} (hidden {hidden}, {target.n_layers} layers)"
        )
    if scorer.config.target and scorer.config.target != target.name:
        log.warning(
            "exit adapters at %s were trained for %s, the target is %s", path, scorer.config.target, target.name
        )
    log.info("early exits at layers %s from %s on the %s engine", scorer.layers, path, engine.info.engine)
    return scorer
