"""Opening a session: an `OpenRequest` checked (ids, images, sampling, payload, exits, SLO, grammar) into a
`Session` and the prefill its first pass runs; a re-open keeps the KV of the prefix it shares with the old one and
prefills the rest.

The server decodes an open's images ahead in its image thread (`Opens.decode_images`); everything else runs
in the model thread, as part of `Verifier.run_batch`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from protocol import payload, sampling
from protocol.grammar import GrammarError
from protocol.structured import Constraint, ConstraintState
from protocol.wire import Open, WireError, _show
from runtime.vision import UnknownImage

from .checks import check_ids
from .config import ServerConfig
from .engines import EngineFull, NoRoom
from .requests import OpenNeedsRoom, OpenOutcome, OpenRequest
from .sessions import Session
from .target import Extension, Target, TargetState, shared_prefix

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OpenWork:
    """An open that passed its checks: its session, and the prefill it runs (a re-open: what its prompt adds to
    the KV it keeps; None when nothing)."""

    session: Session
    ext: Extension | None
    ended: Session | None  # a previous generation of the sid that this open ends (SLO metrics)
    t0: float  # perf_counter when its checks began

    def finish(self, rows: Any) -> OpenOutcome:
        state = self.session.state
        if self.ext is not None:
            state.cached = self.ext.start + len(self.ext.new_ids)
        passes, state.passes = state.passes, 0  # reported with this open; the next counts afresh
        return OpenOutcome(self.session, (time.perf_counter() - self.t0) * 1e3, self.ended, passes)


@dataclass(frozen=True)
class _Checked:
    """What an open's message says, checked."""

    params: sampling.SamplingParams
    spec: payload.PayloadSpec
    slo: float
    grammar: ConstraintState | None


class Opens:
    """The open handler: every check of an `Open` against this target and config, then its session."""

    def __init__(self, target: Target, config: ServerConfig, exit_layers: list[int]):
        self.target = target
        self.config = config
        self.exit_layers = exit_layers

    def prepare(self, req: OpenRequest) -> OpenWork:
        """Every check before any model work, then the session (its state new, or the old one's re-pointed).
        Raises WireError; nothing of the previous session changes unless every check passed."""
        t0 = time.perf_counter()
        msg, previous = req.msg, req.previous
        checked = self._check(msg, req.constraint)
        if previous is not None and previous.retired:  # evicted (its KV is going) or already re-opened
            previous = None
        resumes = previous is not None and previous.slo == checked.slo and _resumes(previous.state, msg)
        state, ext = self._state(msg, previous, checked.params)
        if previous is not None:
            # Work still queued for the old session object (an ar stream of a dropped
            # connection) must not touch the state from now on; see checks.check_live.
            previous.superseded = True
        # A re-opened session draws fresh randomness keyed by where it resumes,
        # so a replayed round is an independent draw, as the math requires.
        rng = np.random.default_rng([checked.params.seed, len(msg.prompt_ids)])
        session = Session(
            msg.sid,
            req.conn_id,
            state,
            checked.params,
            rng,
            exits=list(msg.exits),
            payload=checked.spec,
            slo=checked.slo,
            grammar=checked.grammar,
        )
        if resumes and previous is not None:
            # the same generation goes on (a re-open after a lost link): it keeps its SLO bookkeeping
            session.t0, session.n0, session.alpha, session.t_last = (
                previous.t0,
                previous.n0,
                previous.alpha,
                previous.t_last,
            )
            return OpenWork(session, ext, None, t0)
        session.t0, session.n0 = req.arrival or time.monotonic(), len(msg.prompt_ids)
        return OpenWork(session, ext, previous, t0)  # the previous generation on this sid ended here

    def _check(self, msg: Open, constraint: Constraint | None = None) -> _Checked:
        check_ids(msg.prompt_ids, self.target.vocab_size, "prompt_ids", msg.sid)
        extra = self.check_images(msg)
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
        return _Checked(params, spec, slo, self._grammar_state(msg, constraint))

    def _state(
        self, msg: Open, previous: Session | None, params: sampling.SamplingParams
    ) -> tuple[TargetState, Extension | None]:
        """The session's target state and its prefill: the previous session's state re-pointed at the new
        prompt (same sampling: its KV of the shared prefix stays), or a new one."""
        if previous is not None and previous.params == params:
            state = previous.state
            previous.handed_over = True  # the state is the new session's: freeing the old one keeps it
            state.passes = 0  # passes are reported per open / round
            self.target.rewind(state, msg.prompt_ids, msg.images)
            # what the new prompt adds is prefilled now, in the open's pass, not with the first round: the robot's
            # draft prefills its own copy while this one runs (agent/decoding/decoder.py, _prefill_draft), so a
            # navigation step's two prefills overlap instead of following each other
            pending = msg.prompt_ids[state.cached : -1]
            return state, (Extension(state, pending, keep=0) if pending else None)
        try:
            state = self.target.new_state(msg.prompt_ids, prefill=False, images=msg.images)
        except NoRoom as e:  # every sequence is held by a session: the server evicts an idle one
            raise OpenNeedsRoom(str(e), msg.sid) from None
        except EngineFull as e:
            raise WireError("overloaded", f"{e}: retry later", msg.sid) from None
        if len(msg.prompt_ids) > 1:  # the prefill: all but the last prompt token
            return state, Extension(state, list(msg.prompt_ids[:-1]), keep=0)
        return state, None

    def check_images(self, msg: Open) -> int:
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
        """Decode and tile an open's images before its request reaches the model thread: the server calls this
        in its image thread, and the model thread (`check_images`, the pass) then finds each one ready and only
        embeds it. Bytes that are no image get `bad_image` here, on this session alone; everything else
        (no vision, an image off its marker, a hash no longer held) is left to `check_images`."""
        vision = getattr(self.target.engine, "vision", None)
        if not msg.images or not self.target.sees or vision is None or not hasattr(vision, "prepare"):
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

    def compile_grammar(self, msg: Open, peer: str) -> Constraint | None:
        """An open's grammar compiled ahead of its queueing, in the server's grammar threads (never the model
        thread, which every robot waits on): in a worker process first, where a crash or a runaway is this open's
        bad_field alone, and `peer`'s compile work takes turns with other peers' (protocol/sandbox.py). None
        without a grammar; WireError when it cannot be compiled."""
        if msg.grammar is None:
            return None
        self._check_grammars_supported(msg)
        try:
            return self.target.grammar(msg.grammar, peer)
        except GrammarError as e:
            raise WireError("bad_field", f"grammar: {e}", msg.sid) from None

    def _grammar_state(self, msg: Open, constraint: Constraint | None) -> ConstraintState | None:
        """Open.grammar -> the state after the prompt's constrained part (None: unconstrained)."""
        if msg.grammar is None:
            return None
        self._check_grammars_supported(msg)
        try:
            if constraint is None:
                constraint = self.target.grammar(msg.grammar)
            return constraint.walk(msg.prompt_ids[msg.grammar["from"] :])
        except GrammarError as e:
            raise WireError("bad_field", f"grammar: {e}", msg.sid) from None

    def _check_grammars_supported(self, msg: Open) -> None:
        if not self.target.grammars_supported:
            raise WireError(
                "bad_field",
                f"this verifier's target {self.target.name} cannot decode under a grammar "
                "(LLGuidance needs its GGUF vocabulary)",
                msg.sid,
            )


def slo_class(slo: dict, default: float, sid: str) -> float:
    """Open.slo -> the session's token-speed class in tokens/s (0: best effort)."""
    value = slo.get("tokens_per_s", default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1000:
        # _show: at most MAX_SHOWN characters, and no repr of a value msgpack nested 1,000 deep (a RecursionError)
        raise WireError(
            "bad_field", f"slo.tokens_per_s must be a number of tokens/s in [0, 1000], got {_show(value)}", sid
        )
    return float(value)


def _resumes(old: TargetState, msg: Open) -> bool:
    """Whether a re-open continues the old committed prefix (one is a prefix of the other, with the same images)."""
    n = min(len(old.ids), len(msg.prompt_ids))
    return shared_prefix(old.ids, old.images, msg.prompt_ids, {im.at: im for im in msg.images}) == n
