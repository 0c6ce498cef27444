"""The bounded session table: one entry per robot generation, evicted when idle or when full.

An evicted session loses nothing: the robot re-opens with its committed prefix.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from protocol.grammar import GrammarState
from protocol.payload import PayloadSpec
from protocol.sampling import SamplingParams
from protocol.wire import WireError

from .target import TargetState

log = logging.getLogger(__name__)

DETACHED = 0  # Session.conn_id of a session whose connection closed (ids count from 1)


@dataclass
class Session:
    sid: str
    conn_id: int  # the connection that owns it; a re-open moves it
    state: TargetState
    params: SamplingParams
    rng: np.random.Generator
    last_used: float = field(default_factory=time.monotonic)
    retired: bool = False  # set (in the model thread) when a re-open takes over the state
    exits: list[int] = field(default_factory=list)  # early-exit layers the robot wants verdicts from; [] = off
    payload: PayloadSpec = field(default_factory=PayloadSpec)  # what each verify's q must be
    owed: np.ndarray | None = None  # split: the target's p_j [V] at the last rejection; the robot owes the
    # correction it draws from them (the next verify's or ar's `fix`)
    # The SLO schedule (server_bridge.scheduler): the class, and where the generation began
    slo: float = 0.0  # tokens/s the robot needs; 0 = best effort
    t0: float = 0.0  # monotonic time of the generation's first open
    n0: int = 0  # committed tokens then (the prompt)
    alpha: float = 0.7  # running acceptance rate of its drafts (expected value of a round)
    t_last: float = 0.0  # monotonic time its last round or ar token was decided
    # Ownership: another connection may re-open the session only with the committed prefix
    acked: int = 0  # committed tokens its robot has shown it holds (its open, then each request)
    # Constrained decoding (protocol/grammar.py): where the committed ids stand in the session's grammar;
    # None: unconstrained. Advanced with every committed token after the open's grammar.from.
    grammar: "GrammarState | None" = None
    detached_at: float = 0.0  # monotonic time its connection closed (DETACHED); its KV waits a grace period

    def acknowledge(self, n_robot: int) -> None:
        """The robot sent a request built on n_robot committed tokens: it holds that many of ours."""
        self.acked = max(self.acked, min(n_robot, len(self.state.ids)))

    def proves(self, prompt_ids: list[int]) -> bool:
        """Whether a re-open from another connection carries this session's committed prefix.

        The robot may be behind us (a result or ar token lost with the link was committed here, never
        seen there) or ahead (a split correction it drew and still owes): the prompt must hold at least
        the tokens it acknowledged, and agree with our ids wherever both have one."""
        ids = self.state.ids
        n = min(len(ids), len(prompt_ids))
        return n >= self.acked and list(prompt_ids[:n]) == list(ids[:n])

    def generation_ended(self) -> tuple[int, float]:
        """(tokens generated, seconds from the generation's open to its last token) for the SLO metrics."""
        return len(self.state.ids) - self.n0, max(0.0, self.t_last - self.t0)


class SessionTable:
    """sid -> Session, least recently used first. Bounded in total and per connection."""

    def __init__(
        self, max_sessions: int, max_per_connection: int, idle_timeout_s: float, detached_grace_s: float | None = None
    ):
        self.max_sessions = max_sessions
        self.max_per_connection = max_per_connection
        self.idle_timeout_s = idle_timeout_s
        # a detached session (its connection closed) is kept this long for its robot to come back to,
        # then its KV is freed: with several replicas the robot may well have re-opened elsewhere
        self.detached_grace_s = idle_timeout_s if detached_grace_s is None else detached_grace_s
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self.evicted_total = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def peek(self, sid: str) -> Session | None:
        return self._sessions.get(sid)

    def get(self, sid: str, conn_id: int) -> Session:
        s = self._sessions.get(sid)
        if s is None or s.conn_id != conn_id:
            raise WireError(
                "unknown_session",
                f"session {sid!r} is not open on this connection "
                "(evicted, closed or never opened): re-open it with the committed prefix",
                sid,
            )
        s.last_used = time.monotonic()
        self._sessions.move_to_end(sid)
        return s

    def check_owner(self, sid: str, conn_id: int, prompt_ids: list[int]) -> None:
        """Raise before any model work if conn_id may not open sid: it is held by another live connection,
        and this open does not carry its committed prefix (a robot back on a new link does). A session
        whose connection has closed is detached: any connection may re-open it with any prompt, and the
        KV of the prefix both share is kept (a robot's next step after a dropped link)."""
        s = self._sessions.get(sid)
        if s is not None and s.conn_id not in (conn_id, DETACHED) and not s.proves(prompt_ids):
            raise WireError(
                "session_taken",
                f"session {sid!r} belongs to another connection; re-open it with "
                "its committed prefix, or open a new session id",
                sid,
            )

    def detach(self, conn_id: int) -> int:
        """The connection closed: its sessions stay (until idle or evicted) for whichever connection re-opens
        them. Returns how many."""
        n = 0
        now = time.monotonic()
        for s in self._sessions.values():
            if s.conn_id == conn_id:
                s.conn_id = DETACHED
                s.detached_at = now
                n += 1
        return n

    def check_room(self, sid: str, conn_id: int) -> None:
        """Raise before any model work if conn_id may not hold one more session."""
        owned = sum(1 for s in self._sessions.values() if s.conn_id == conn_id and s.sid != sid)
        if owned >= self.max_per_connection:
            raise WireError(
                "too_many_sessions",
                f"a connection may hold at most {self.max_per_connection} sessions; close one first",
                sid,
            )

    def put(self, session: Session) -> list[str]:
        """Insert (or replace) a session; returns the sids evicted to make room."""
        self.check_room(session.sid, session.conn_id)
        self._sessions.pop(session.sid, None)
        evicted = []
        while len(self._sessions) >= self.max_sessions:
            sid, _ = self._sessions.popitem(last=False)
            evicted.append(sid)
        self._sessions[session.sid] = session
        self._count_evictions(evicted, "table full")
        return evicted

    def discard(self, sid: str, conn_id: int) -> bool:
        """Remove the session if this connection owns it; False when it was already gone."""
        s = self._sessions.get(sid)
        if s is None or s.conn_id != conn_id:
            return False
        del self._sessions[sid]
        return True

    def evict_idle(self, now: float | None = None) -> list[str]:
        """Evict sessions idle past idle_timeout_s and detached ones past detached_grace_s."""
        now = time.monotonic() if now is None else now
        idle = [sid for sid, s in self._sessions.items() if now - s.last_used > self.idle_timeout_s]
        gone = [
            sid
            for sid, s in self._sessions.items()
            if s.conn_id == DETACHED
            and sid not in idle
            and now - max(s.detached_at, s.last_used) > self.detached_grace_s
        ]
        for sid in idle + gone:
            del self._sessions[sid]
        self._count_evictions(idle, "idle")
        self._count_evictions(gone, "detached past the grace period")
        return idle + gone

    def _count_evictions(self, sids: list[str], why: str) -> None:
        if sids:
            self.evicted_total += len(sids)
            log.info("evicted %d session(s) (%s): %s", len(sids), why, ", ".join(sids))
