"""One target-only token (an `ArRequest`): the cloud-autoregressive baseline, and the robot's fallback when
speculation cannot win. Its row is sampled as a verify round's last row is: greedy, masked by the session's
grammar, or drawn at the session's temperature (on the device for the torch engine)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from protocol import sampling
from protocol.wire import WireError

from .checks import advance, check_live
from .requests import ArOutcome, ArRequest
from .sessions import Session
from .target import Extension, Target


@dataclass(frozen=True)
class ArWork:
    """An ar token that passed its checks: its one row of the pass."""

    target: Target
    session: Session
    ext: Extension
    t0: float  # perf_counter when its checks began

    def finish(self, rows: Any) -> ArOutcome:
        """rows: [1, vocab]. Samples the token and commits it."""
        token, p = sample_row(self.target, self.session, rows)
        self.target.commit(self.session.state, [token], len(self.session.state.ids))
        advance(self.session, [token])
        return ArOutcome(token, (time.perf_counter() - self.t0) * 1e3, p)


def prepare_ar(target: Target, max_context: int, req: ArRequest) -> ArWork:
    """Every check of an ar token before any model work. Raises WireError."""
    t0 = time.perf_counter()
    session = req.session
    check_live(session)
    state = session.state
    if session.owed is not None:
        raise WireError(
            "desync", "the last split round ended in a rejection: send its correction as `fix`", session.sid
        )
    if state.positions + 1 > max_context:
        raise WireError("context_full", f"session reached max_context {max_context}", session.sid)
    return ArWork(target, session, Extension(state, state.ids[state.cached :], keep=1), t0)


def sample_row(target: Target, session: Session, rows: Any) -> tuple[int, float]:
    """(token, the target's probability of it as sampled; 1.0 when greedy) from rows [1, vocab]."""
    if session.grammar is not None:  # masked like a verify row (verifier.grammar_rows)
        logits = target.to_numpy(rows)[0]
        if session.params.greedy:
            return session.grammar.argmax(logits), 1.0
        probs = sampling.probs_from_logits(logits, session.params, session.grammar.mask())
    elif session.params.greedy:
        return int(target.argmax(rows)[0]), 1.0
    elif target.on_device:
        from .engines import devmath

        dprobs = devmath.probs_from_logits(rows[0], session.params)  # [vocab] on the device
        token = devmath.sample(dprobs, session.rng)
        return token, min(1.0, float(dprobs[token]))
    else:
        probs = sampling.probs_from_logits(target.to_numpy(rows)[0], session.params)  # [vocab]
    token = sampling.sample(probs, session.rng)
    return token, min(1.0, float(probs[token]))
