"""The bounded session table: one entry per robot generation, evicted when idle or when full.

An evicted session loses nothing: the robot re-opens with its committed prefix (its next request
gets `unknown_session`). Who goes when room is needed (a new robot, a client over its share, an
engine with every sequence held): the least recently used session that is not in a request right
now, a detached one (its connection closed) before one whose robot is still connected. Only when
every candidate is in a request is the newcomer refused (`overloaded`, or `too_many_sessions` for a
client over its own share). An evicted session is retired at once (no later pass prepares it) and
handed to `on_release`, which frees its engine sequence in the model thread after the pass running
now, never under it.

Ownership: a session belongs to the connection that opened it. Another connection may take over a
session whose connection is still open only with the session's resume secret (`Opened.resume`);
a detached session is anyone's to re-open, as after a lost link.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from protocol.payload import PayloadSpec
from protocol.sampling import SamplingParams
from protocol.structured import ConstraintState
from protocol.wire import WireError

from .target import TargetState

log = logging.getLogger(__name__)

DETACHED = 0  # Session.conn_id of a session whose connection closed (ids count from 1)


@dataclass
class Session:
    """One robot generation's server state. Each field has one writer, so the event loop and the model thread
    never race on it:

      model thread  state (its KV, ids, cached, passes), owed, grammar, rng, superseded, handed_over: what
                    a pass reads and commits; written only inside Verifier.run_batch and release.
      event loop    conn_id, last_used, requests, detached_at, client, resume, evicted, and the SLO
                    bookkeeping alpha and t_last (`answered`, from the outcome a pass returned).
      at the open   sid, params, exits, payload, slo, t0, n0: set while the model thread builds the session,
                    before the loop sees it; read-only after (a re-open copies the old one's alpha and t_last
                    there, while that session has no request in flight: the scheduler keeps sids apart).

    The model thread returns outcomes (requests.py) the loop applies; it reads a loop field only to check
    it (`retired`: evicted by the loop, or superseded by a re-open)."""

    sid: str
    conn_id: int  # the connection that owns it; a re-open moves it
    state: TargetState
    params: SamplingParams
    rng: np.random.Generator
    last_used: float = field(default_factory=time.monotonic)
    evicted: bool = False  # the table let it go (event loop): see `retired`
    superseded: bool = False  # a re-open of its sid replaced this object (model thread): see `retired`
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
    # Ownership and shares (see SessionTable)
    client: str = ""  # who opened it (admission.client_key): max_sessions_per_client counts by it
    resume: str = ""  # the secret another connection must show to take it over while its own is open;
    # minted at its first open, kept while its robot re-opens it (Opened.resume)
    requests: int = 0  # requests of it queued or in a pass now (event loop); eviction passes it by
    handed_over: bool = False  # a re-open of its sid took over its state (model thread): freeing this
    # object must not free that state
    # Constrained decoding (protocol/structured.py): where the committed ids stand in the session's grammar;
    # None: unconstrained. Advanced with every committed token after the open's grammar.from.
    grammar: "ConstraintState | None" = None
    detached_at: float = 0.0  # monotonic time its connection closed (DETACHED); its KV waits a grace period

    @property
    def retired(self) -> bool:
        """No more work on this object: evicted or closed (event loop), or replaced by a re-open (model thread); a
        request that still names it gets unknown_session."""
        return self.evicted or self.superseded

    def answered(self, drafted: int, accepted: int, at: float) -> None:
        """A round (or, drafted 0, an ar token) of it was decided: the SLO bookkeeping, in the event loop."""
        if drafted:
            self.alpha += 0.2 * (accepted / drafted - self.alpha)
        self.t_last = at

    def generation_ended(self) -> tuple[int, float]:
        """(tokens generated, seconds from the generation's open to its last token) for the SLO metrics."""
        return len(self.state.ids) - self.n0, max(0.0, self.t_last - self.t0)


class Turns:
    """When a robot refused for room (a full table) should try again: the robots refused lately over the rate
    sessions end, so a fleet larger than the table comes back about as fast as room frees, and each retry
    mostly finds some. At 512 robots on llama.cpp's 256 sequences, retries at the scheduler's hint (1 s and
    up) were ~130 refusals a second, most of the event loop's work (docs/benchmarks/fleet_cpu/).

    Bounded: at most `most` refused sids and `most` end times are kept, each for `window_s`."""

    def __init__(self, window_s: float = 10.0, most: int = 4096):
        self.window_s = window_s
        self.most = most
        self._refused: OrderedDict[str, float] = OrderedDict()  # sid -> when it was last refused, oldest first
        self._ended: deque[float] = deque(maxlen=most)  # when sessions left the table

    def ended(self, n: int, now: float) -> None:
        self._ended.extend([now] * min(n, self.most))

    def refused(self, sid: str, now: float) -> None:
        self._refused.pop(sid, None)
        self._refused[sid] = now
        if len(self._refused) > self.most:
            self._refused.popitem(last=False)

    def admitted(self, sid: str) -> None:
        self._refused.pop(sid, None)

    def retry_after_s(self, now: float, bounds: tuple[float, float]) -> float | None:
        """How long the next refused robot should wait, within bounds: the robots refused within window_s
        (itself too) over the sessions that ended in it per second; None while none ended (no rate known)."""
        while self._refused and next(iter(self._refused.values())) < now - self.window_s:
            self._refused.popitem(last=False)
        while self._ended and self._ended[0] < now - self.window_s:
            self._ended.popleft()
        rate = len(self._ended) / self.window_s
        waiting = len(self._refused) + 1
        return min(bounds[1], max(bounds[0], waiting / rate)) if rate > 0 else None


class SessionTable:
    """sid -> Session, least recently used first. Bounded in total, per connection and per client."""

    def __init__(
        self,
        max_sessions: int,
        max_per_connection: int,
        idle_timeout_s: float,
        detached_grace_s: float | None = None,
        max_per_client: int | None = None,
        on_release: Callable[[list[Session]], None] | None = None,
        protect_active_s: float = 0.0,
    ):
        self.max_sessions = max_sessions
        self.max_per_connection = max_per_connection
        self.max_per_client = max_sessions if max_per_client is None else max_per_client
        self.idle_timeout_s = idle_timeout_s
        # a detached session (its connection closed) is kept this long for its robot to come back to,
        # then its KV is freed: with several replicas the robot may well have re-opened elsewhere
        self.detached_grace_s = idle_timeout_s if detached_grace_s is None else detached_grace_s
        # called with the sessions the table lets go (evicted or closed), already retired: the server frees
        # their engine sequences in its model thread. None: they go when collected
        self.on_release = on_release
        # a session answered this recently is not evicted for another robot's open (0: LRU goes at once):
        # with more robots than sequences, LRU would evict the robot due back soonest, every round
        self.protect_active_s = protect_active_s
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self._owned: Counter[int] = Counter()  # conn_id (DETACHED too) -> its sessions in the table
        self._clients: Counter[str] = Counter()  # client -> its sessions in the table
        self.evicted_total = 0
        self.turns = Turns()  # when a robot refused for room should come back

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

    def check_owner(self, sid: str, conn_id: int, resume: str = "") -> None:
        """Raise before any model work if conn_id may not open sid: it is held by another connection that
        is still open, and this open does not carry its resume secret. A session whose connection has
        closed is detached: any connection may re-open it with any prompt, and the KV of the prefix both
        share is kept (a robot's next step after a dropped link)."""
        s = self._sessions.get(sid)
        if s is not None and s.conn_id not in (conn_id, DETACHED) and not _same_secret(resume, s.resume):
            raise WireError(
                "session_taken",
                f"session {sid!r} belongs to another open connection; re-open it with its resume "
                "secret (from its opened), or open a new session id",
                sid,
            )

    def secret_for(self, sid: str, conn_id: int, resume: str = "") -> str:
        """The resume secret an open of sid by conn_id gets: the session's own when the opener is its
        connection or shows it, else a fresh one (a new session, or a detached one re-opened without it:
        whoever re-opened it without the secret never learns the old one)."""
        s = self._sessions.get(sid)
        if s is not None and s.resume and (s.conn_id == conn_id or _same_secret(resume, s.resume)):
            return s.resume
        return secrets.token_urlsafe(16)

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
        self._own(conn_id, -n)
        self._own(DETACHED, n)
        return n

    def _own(self, conn_id: int, n: int) -> None:
        _count(self._owned, conn_id, n)

    def _held(self, s: Session, n: int) -> None:
        """s enters (n 1) or leaves (n -1) the table: its connection's and its client's counts."""
        _count(self._owned, s.conn_id, n)
        _count(self._clients, s.client, n)

    def check_room(self, sid: str, conn_id: int) -> None:
        """Raise before any model work if conn_id may not hold one more session."""
        mine = self._sessions.get(sid)
        owned = self._owned[conn_id] - (mine is not None and mine.conn_id == conn_id)
        if owned >= self.max_per_connection:
            raise WireError(
                "too_many_sessions",
                f"a connection may hold at most {self.max_per_connection} sessions; close one first",
                sid,
            )

    def full(self, sid: str) -> str | None:
        """Why an open of sid would find no room (the table full and no session to evict for it), or None."""
        if sid in self._sessions or len(self._sessions) < self.max_sessions or self._victim(keep=sid) is not None:
            return None
        return f"all {self.max_sessions} sessions are in a request now or answered within {self.protect_active_s:g}s"

    def make_room(self, sid: str, conn_id: int, client: str) -> list[str]:
        """Before an open of sid by conn_id for client, and again as it is put: evict what must go for it to
        fit, or raise. Over the client's share (max_per_client; client "" has none of its own) its own least
        recently used idle session goes, else `too_many_sessions`; in a full table anyone's goes, else
        `overloaded`. Returns the evicted sids."""
        self.check_room(sid, conn_id)
        evicted = []
        held = self._sessions.get(sid)
        while client and self._clients[client] - (held is not None and held.client == client) >= self.max_per_client:
            mine = [s for s in self._sessions.values() if s.client == client and s.sid != sid]
            if len(mine) < self.max_per_client:
                break
            victim = _least_recently_used_idle(mine)
            if victim is None:
                raise WireError(
                    "too_many_sessions",
                    f"this client already holds {len(mine)} sessions, the most one client may "
                    "(max_sessions_per_client), and each is in a request now: close one or retry later",
                    sid,
                )
            evicted += self._evict([victim], f"client {client} at max_sessions_per_client")
        while sid not in self._sessions and len(self._sessions) >= self.max_sessions:
            victim = self._victim(keep=sid)
            if victim is None:
                raise WireError(
                    "overloaded",
                    f"all {self.max_sessions} sessions are in a request now or answered within "
                    f"{self.protect_active_s:g}s: retry later",
                    sid,
                )
            evicted += self._evict([victim], "table full")
        return evicted

    def admit(self, sid: str, conn_id: int, client: str, resume: str = "") -> str:
        """An open of sid that passed its checks, before its model work: room made for it (make_room); the
        resume secret its session will carry (secret_for)."""
        self.make_room(sid, conn_id, client)
        return self.secret_for(sid, conn_id, resume)

    def install(self, session: Session, resume: str = "") -> list[str]:
        """An open's new session into the table (put), unless another connection took its sid while it ran
        (check_owner, with the open's resume secret)."""
        self.check_owner(session.sid, session.conn_id, resume)
        return self.put(session)

    def evict_one(self, keep: str, why: str) -> str | None:
        """Evict the least recently used session not in a request (detached first), other than sid `keep`,
        to free its engine sequence; None when every one is in a request or answered within protect_active_s."""
        victim = self._victim(keep)
        return None if victim is None else self._evict([victim], why)[0]

    def _victim(self, keep: str) -> Session | None:
        """Whose room another robot's open takes: the least recently used session not in a request, other than
        sid `keep`, a detached one first, else one not answered within protect_active_s; None: nobody's.
        Stops at the first session used within the window when none is detached (the rest are newer): a
        refusal under a full fleet costs little, however many sessions there are."""
        since = time.monotonic() - self.protect_active_s
        detached = self._owned[DETACHED] > 0
        first = None
        for s in self._sessions.values():  # least recently used first
            if s.sid == keep:
                continue
            idle = not s.requests
            if idle and s.conn_id == DETACHED:
                return s
            if idle and first is None and (not self.protect_active_s or max(s.last_used, s.t_last) < since):
                first = s
            if not detached and (first is not None or s.last_used >= since):  # in a request or not: the rest are newer
                break
        return first

    def put(self, session: Session) -> list[str]:
        """Insert (or replace) a session; returns the sids evicted to make room (see make_room)."""
        evicted = self.make_room(session.sid, session.conn_id, session.client)
        old = self._sessions.pop(session.sid, None)
        if old is not None:
            self._held(old, -1)
        session.last_used = time.monotonic()  # the table's order is last use: the newest goes last
        self._sessions[session.sid] = session
        self._held(session, 1)
        self.turns.admitted(session.sid)
        return evicted

    def discard(self, sid: str, conn_id: int) -> bool:
        """Remove the session if this connection owns it; False when it was already gone."""
        s = self._sessions.get(sid)
        if s is None or s.conn_id != conn_id:
            return False
        del self._sessions[sid]
        self._held(s, -1)
        self._release([s])
        return True

    def clear(self) -> int:
        """Let every session go (the server stops); returns how many there were."""
        gone = list(self._sessions.values())
        self._sessions.clear()
        self._owned.clear()
        self._clients.clear()
        self._release(gone)
        return len(gone)

    def evict_idle(self, now: float | None = None) -> list[str]:
        """Evict sessions idle past idle_timeout_s and detached ones past detached_grace_s."""
        now = time.monotonic() if now is None else now
        idle = []
        for sid, s in self._sessions.items():  # least recently used first (get, put): the rest are newer
            if now - s.last_used <= self.idle_timeout_s:
                break
            idle.append(sid)
        gone = [
            sid
            for sid, s in (self._sessions.items() if self._owned[DETACHED] else ())
            if s.conn_id == DETACHED
            and sid not in idle
            and now - max(s.detached_at, s.last_used) > self.detached_grace_s
        ]
        return self._evict([self._sessions[sid] for sid in idle], "idle") + self._evict(
            [self._sessions[sid] for sid in gone], "detached past the grace period"
        )

    def _evict(self, victims: list[Session], why: str) -> list[str]:
        for s in victims:
            del self._sessions[s.sid]
            self._held(s, -1)
        sids = [s.sid for s in victims]
        if sids:
            self.evicted_total += len(sids)
            log.info("evicted %d session(s) (%s): %s", len(sids), why, ", ".join(sids))
        self._release(victims)
        return sids

    def _release(self, gone: list[Session]) -> None:
        self.turns.ended(len(gone), time.monotonic())
        for s in gone:
            s.evicted = True  # before anything frees its KV: no pass prepared from now on may use it
        if gone and self.on_release is not None:
            self.on_release(gone)


class in_request:  # noqa: N801 (used as a function: `with in_request(session):`)
    """Mark a session as in a request (queued or in a pass) while the block runs: eviction passes it by.
    A class, not a @contextmanager generator: it wraps every round."""

    __slots__ = ("session",)

    def __init__(self, session: Session | None):
        self.session = session

    def __enter__(self) -> None:
        if self.session is not None:
            self.session.requests += 1

    def __exit__(self, *exc: object) -> None:
        if self.session is not None:
            self.session.requests -= 1


def _least_recently_used_idle(sessions: Iterable[Session]) -> Session | None:
    """The first of sessions (least recently used first) not in a request, a detached one before others."""
    idle = [s for s in sessions if s.requests == 0]
    return next((s for s in idle if s.conn_id == DETACHED), idle[0] if idle else None)


def _count(counts: Counter, key: object, n: int) -> None:
    counts[key] += n
    if not counts[key]:
        del counts[key]  # bounded by the sessions, not by every connection or client there ever was


def _same_secret(shown: str, secret: str) -> bool:
    return bool(shown) and bool(secret) and hmac.compare_digest(shown.encode(), secret.encode())
