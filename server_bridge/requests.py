"""The model thread's units of work: one request type per kind, each with exactly the fields it needs.

    OpenRequest    -> OpenOutcome    a session's open (its prefill) or re-open (server_bridge/opens.py)
    VerifyRequest  -> RoundOutcome   one verify round (server_bridge/verifier.py)
    ArRequest      -> ArOutcome      one target-only token (server_bridge/ar.py)

`Verifier.run_batch` takes a list of them. Each handler turns its request into a `Work` after every check
(before any model work): the work's rows of the one batched pass (`ext`) and what it makes of them
(`finish`). Closing a session and a split correction (`fix`) need no pass: the server calls
`Verifier.release` and `Verifier.fix` in the model thread directly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from protocol import sampling
from protocol.structured import Constraint
from protocol.wire import Exit, Open, Verify, WireError

from .sessions import Session
from .target import Extension


@dataclass(frozen=True)
class OpenRequest:
    """Open a session, or re-open one keeping the KV of the prefix it shares with the old one."""

    msg: Open
    conn_id: int = 0  # the connection that will own the session
    previous: Session | None = None  # the session of this sid that a re-open replaces, if any
    arrival: float = 0.0  # monotonic seconds; the first round's SLO budget counts from it (0: when prepared)
    # msg.grammar compiled ahead, off the model thread (dispatch: in a worker process first, then in the grammar
    # threads); None: compiled in the model thread if at all (a direct Verifier.open, or no grammar)
    constraint: Constraint | None = None

    @property
    def sid(self) -> str:
        return self.msg.sid


@dataclass(frozen=True)
class VerifyRequest:
    """One verify round of a session: its draft against the target."""

    session: Session
    msg: Verify
    emit: Callable[[Exit], None] | None = None  # the early-exit sink (called from inside the pass); None: no exits

    @property
    def sid(self) -> str:
        return self.msg.sid


@dataclass(frozen=True)
class ArRequest:
    """One target-only token of a session (the cloud-autoregressive baseline)."""

    session: Session

    @property
    def sid(self) -> str:
        return self.session.sid


Request = OpenRequest | VerifyRequest | ArRequest


@dataclass(frozen=True)
class OpenOutcome:
    """What an open produced, for the `opened` message and the SLO metrics."""

    session: Session  # the new session (not yet in the server's table)
    ms: float  # the open's time in the model thread, its prefill included
    ended: Session | None = None  # a previous generation of the sid that this open ended (None: none, or a
    # re-open that resumes it)
    passes: int = 0  # forward passes its prefill took (Opened.timing)


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
        timing: dict[str, Any] = {"verify_ms": self.verify_ms, "passes": 1}
        if self.exit_layer is not None:
            timing.update(exit_layer=self.exit_layer, exit_ms=self.exit_ms)
        return timing


class ArOutcome(NamedTuple):
    """One target-only token."""

    token: int
    ms: float  # its time in the model thread
    p: float  # the target's probability of it as sampled (1.0 when greedy)


Outcome = OpenOutcome | RoundOutcome | ArOutcome


class Work(Protocol):
    """A request that passed its checks: its part of the pass and what it makes of its rows."""

    @property
    def ext(self) -> Extension | None:  # its rows of the pass; None: no model work (a re-open that keeps its KV)
        ...

    def finish(self, rows: Any) -> Outcome:  # rows: its logits [ext.keep, vocab] (None without ext); commits last
        ...


class OpenNeedsRoom(WireError):
    """An open found the engine's shared room all held (every sequence, or a unified KV pool): `overloaded`
    to whoever calls the verifier directly; the server evicts an idle session and tries again."""

    def __init__(self, reason: str, sid: str):
        super().__init__("overloaded", f"{reason}: retry later", sid)
        self.reason = reason  # the engine's words: "all 64 sequences are in use"
