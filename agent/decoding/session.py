"""The robot's sessions on the verifier: the link (connect, reconnect with backoff), session names -> sids,
resume secrets, and re-opening a session with the committed prefix after a lost link or a lost session.

Two objects. `Sessions` spans generations (an EdgeDecoder holds one): the link, the sid each session name
uses now, the resume secret of each session. `Attempt` is one generation's hold on its session: the sid,
whether it is open, the failures in a row. The decoder's loop is

    attempt = sessions.begin(name, metrics)
    while not done:
        try:
            attempt.ensure_open(open_session)   # connect, (re-)open with the committed prefix
            ... one round ...
            attempt.succeeded()
        except (LinkLost, ServerError) as e:
            attempt.recover(e, len(committed))  # back off and go on, or raise e
    attempt.end(close=...)

The committed prefix is the only state that matters: a re-open sends it whole, so no token is lost or
duplicated whichever replica serves the session next.

A request the verifier sheds (`overloaded`: its queue is full, or the request waited past its limit, as a
burst of robots starting at once can make it) is retried the same way: a backoff with jitter (so a burst's
sheds do not all come back at once), then a re-open with the committed prefix, at most
`reconnect.max_attempts` times in a row, each said in a log line; the last one is raised.
"""

from __future__ import annotations

import logging
import random
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

from protocol import wire

from .link import SHED, TAKEN, LinkLost, ProtocolViolation, ServerError, VerifierLink
from .metrics import Metrics

log = logging.getLogger(__name__)

MAX_REPLICAS_SEEN = 16  # Metrics.replicas: the replicas a generation was served by, in order
MAX_SWITCHED_NAMES = 64  # session names remembered with the fresh sid they switched to (LRU)
MAX_RESUME_SECRETS = 64  # sessions whose resume secret (Opened.resume) is kept for their re-opens (LRU)


@dataclass(frozen=True)
class ReconnectPolicy:
    max_attempts: int = 8  # consecutive failures before giving up
    backoff_s: float = 0.1
    backoff_max_s: float = 2.0

    def delay(self, attempt: int) -> float:
        return min(self.backoff_max_s, self.backoff_s * 2.0**attempt)

    def jittered(self, attempt: int) -> float:
        """delay(attempt) spread over [1/2, 3/2] of itself: robots shed together come back apart."""
        return self.delay(attempt) * random.uniform(0.5, 1.5)


class Sessions:
    """The verifier link and what the robot keeps of its sessions across generations."""

    def __init__(self, make_link: Callable[[], VerifierLink], reconnect: ReconnectPolicy) -> None:
        self.make_link = make_link  # a new, unconnected link to the verifier
        self.reconnect = reconnect
        self.link: VerifierLink | None = None
        self._bytes_base = (0, 0)  # the link's byte counts already folded into a generation's metrics
        # session name -> the sid it uses now: the name itself until an open of it is refused with
        # session_taken (its old connection still holds it), then a fresh one; bounded, least recent out
        self._sids: OrderedDict[str, str] = OrderedDict()
        # sid -> the resume secret of its last `opened`: every re-open of that session sends it back, so the
        # robot back on a new link takes its session over from the old link the server may still think open
        self._resume: OrderedDict[str, str] = OrderedDict()

    # ------------------------------------------------------------------ the link

    def connect(self) -> bool:
        """Make sure the verifier link is up (the offline mode's probe); False when it cannot be."""
        if self.link is not None and self.link.ws is not None:
            return True
        try:
            self.connect_link()
            return True
        except (LinkLost, ServerError) as e:
            log.info("verifier still unreachable: %s", e)
            self.link = None
            return False

    def connect_link(self) -> VerifierLink:
        """A new connection and handshake; raises LinkLost or ServerError."""
        link = self.make_link()
        link.connect()
        self.link = link
        self._bytes_base = (0, 0)
        return link

    def drop_link(self) -> None:
        if self.link is not None:
            self.link.close()
            self.link = None

    def fold_bytes(self, m: Metrics) -> None:
        """Add the link's bytes since the last fold to m (the link outlives one generation)."""
        if self.link is not None:
            m.bytes_up += self.link.bytes_up - self._bytes_base[0]
            m.bytes_down += self.link.bytes_down - self._bytes_base[1]
            self._bytes_base = (self.link.bytes_up, self.link.bytes_down)

    # ------------------------------------------------------------------ sids and resume secrets

    def begin(self, name: str | None, m: Metrics) -> Attempt:
        """One generation's hold on session `name` (None: a fresh, unnamed session closed at its end)."""
        sid = self.sid_for(name) if name else secrets.token_urlsafe(6)  # short: it rides in every round
        return Attempt(self, name, sid, m)

    def sid_for(self, name: str) -> str:
        """The sid a named session uses now: the name, or the fresh sid it switched to."""
        sid = self._sids.get(name, name)
        if name in self._sids:
            self._sids.move_to_end(name)
        return sid

    def switch_sid(self, name: str | None, old: str) -> str:
        """A fresh sid for `name` (remembered for its later generations) or for an unnamed session."""
        self._resume.pop(old, None)  # that session is another's now
        base = (name or "s")[:48]
        sid = f"{base}.{secrets.token_urlsafe(6)}"  # 1-64 of [A-Za-z0-9-_.] as the wire wants
        if name is not None:
            self._sids[name] = sid
            self._sids.move_to_end(name)
            while len(self._sids) > MAX_SWITCHED_NAMES:
                self._sids.popitem(last=False)
        return sid

    def resume_for(self, sid: str) -> str:
        """The secret a re-open of `sid` sends back ("" for a session not opened before)."""
        return self._resume.get(sid, "")

    def keep_resume(self, sid: str, secret: str) -> None:
        """Remember the session's resume secret for its re-opens ("": the server gave none, forget any)."""
        if not secret:
            self._resume.pop(sid, None)
            return
        self._resume[sid] = secret
        self._resume.move_to_end(sid)
        while len(self._resume) > MAX_RESUME_SECRETS:
            self._resume.popitem(last=False)

    def forget(self, sid: str) -> None:
        self._resume.pop(sid, None)


class Attempt:
    """One generation's session: opened (again) when needed, recovered after a lost link or session."""

    def __init__(self, sessions: Sessions, name: str | None, sid: str, m: Metrics) -> None:
        self.sessions = sessions
        self.name = name
        self.sid = sid
        self.m = m
        self.is_open = False
        self.switched = False  # this open already moved to a fresh sid (at most once)
        self.failures = 0  # in a row
        self.lost_at: float | None = None  # when the link was lost, until the session is re-opened

    def ensure_open(self, open_session: Callable[[str, str], wire.Opened]) -> None:
        """Connect if the link is down, and open the session if it is not open on it:
        `open_session(sid, resume)` sends the open (with the committed prefix) and returns the checked reply."""
        link = self.sessions.link
        if link is None:
            link = self.sessions.connect_link()
        if self.is_open:
            return
        opened = open_session(self.sid, self.sessions.resume_for(self.sid))
        self.sessions.keep_resume(self.sid, opened.resume)
        replica, replicas = opened.replica or (link.welcome.replica if link.welcome else ""), self.m.replicas
        if replica and (not replicas or replicas[-1] != replica) and len(replicas) < MAX_REPLICAS_SEEN:
            replicas.append(replica)
        self.is_open, self.switched = True, False
        if self.lost_at is not None:
            self.m.reconnect_ms += (time.perf_counter() - self.lost_at) * 1e3
            self.lost_at = None

    def succeeded(self) -> None:
        """A round went through: failures are counted afresh."""
        self.failures = 0

    def recover(self, e: LinkLost | ServerError, n_committed: int) -> None:
        """Get ready to go on after `e` (the next ensure_open re-opens), or raise it when that cannot help."""
        if isinstance(e, LinkLost):
            self._lost(e, n_committed)
        elif e.code == SHED:
            self._shed(e, n_committed)
        else:
            self._refused(e, n_committed)

    def _lost(self, e: LinkLost, n_committed: int) -> None:
        """The link dropped: close it, back off (not when a replica drained: another one serves now)."""
        m, policy = self.m, self.sessions.reconnect
        self.failures += 1
        self.lost_at = time.perf_counter() if self.lost_at is None else self.lost_at
        if isinstance(e, ProtocolViolation):  # a lost link like any other, and said as such
            m.protocol_violations += 1
            log.error("the verifier broke the protocol: %s; dropping the link, nothing of it committed", e)
        if self.failures > policy.max_attempts:
            raise e
        delay = 0.0 if e.restart else policy.delay(self.failures - 1)
        m.restarts += e.restart
        log.warning(
            "link lost (%s); reconnect %d/%d in %.2fs with %d committed tokens",
            e,
            self.failures,
            policy.max_attempts,
            delay,
            n_committed,
        )
        self.sessions.fold_bytes(m)
        self.sessions.drop_link()
        self.is_open = False
        m.reconnects += 1
        time.sleep(delay)

    def _shed(self, e: ServerError, n_committed: int) -> None:
        """The verifier shed the open or a round (`overloaded`): nothing of it ran there. Back off with jitter and
        re-open with the committed prefix, as the fleet's robots do (server_bridge/ops/loadtest.py); raise e after
        reconnect.max_attempts sheds or other failures in a row."""
        policy = self.sessions.reconnect
        self.failures += 1
        if self.failures > policy.max_attempts:
            raise e
        # the longer of its own backoff and the server's hint, jittered as its own is
        delay = max(policy.jittered(self.failures - 1), (e.retry_after_ms or 0) / 1e3 * random.uniform(1.0, 1.5))
        log.warning(
            "verifier overloaded (%s); retry %d/%d in %.2fs with %d committed tokens",
            e.message,
            self.failures,
            policy.max_attempts,
            delay,
            n_committed,
        )
        self.is_open = False  # the re-open sends the committed prefix: the server keeps the KV it shares
        self.m.shed_retries += 1
        time.sleep(delay)

    def _refused(self, e: ServerError, n_committed: int) -> None:
        """The server answered with an error: a fresh sid for a session held by another connection, a
        re-open for a session the server lost; any other error is raised."""
        if e.code == TAKEN and not self.is_open and not self.switched:
            # another connection holds sid (ours, before the link dropped, most likely) and
            # this prompt is not its prefix: nothing to wait for, a fresh sid costs one prefill
            self.switched = True
            old, self.sid = self.sid, self.sessions.switch_sid(self.name, self.sid)
            log.info(
                "session %s is held by another connection (%s); re-opening as %s with %d committed tokens",
                old,
                e.code,
                self.sid,
                n_committed,
            )
            self.m.session_switches += 1
            return
        self.failures += 1
        if not e.recoverable or self.failures > self.sessions.reconnect.max_attempts:
            raise e
        log.info("server lost our session (%s); re-opening with %d committed tokens", e.code, n_committed)
        self.is_open = False
        self.m.reopens += 1

    def end(self, close: bool) -> None:
        """The generation is over: close the session on the server when `close` (and forget its secret)."""
        link = self.sessions.link
        if link is not None and self.is_open and close:
            try:
                link.send(wire.Close(self.sid))
            except LinkLost:
                pass
        if close:  # an unnamed session is never opened again
            self.sessions.forget(self.sid)
        self.sessions.fold_bytes(self.m)
