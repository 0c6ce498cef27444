"""One request of an authenticated connection, from its decoded message to its reply: an open (its session made
or re-made), a verify round, an ar stream, a close. Every model job goes through the `Batcher`.

Early-exit messages (FSD) are made in the model thread during a verify pass; they reach the event loop by
`call_soon_threadsafe`, wait in the connection's bounded `Outbox` and go out from one sender task per
connection (`send_exits`), so they overtake the pass they come from. A round's `result` goes out directly,
and its exits still pending then are purged: after the result they are useless.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any, TypeVar

from websockets.asyncio.server import ServerConnection

from protocol import wire
from protocol.structured import Constraint

from .admission import Replica
from .batcher import Batcher
from .config import ServerConfig
from .handshake import send
from .metrics import ServerMetrics
from .opens import slo_class
from .outbox import Outbox
from .requests import ArOutcome, ArRequest, OpenNeedsRoom, OpenOutcome, OpenRequest, RoundOutcome, VerifyRequest
from .scheduler import RETRY_AFTER_S, deadline
from .sessions import Session, SessionTable, in_request
from .verifier import Verifier

T = TypeVar("T")

# An open that finds every engine sequence held evicts at most this many idle sessions before it is refused:
# more would mean something besides this table holds them, and one robot must not empty the table.
MAX_EVICTIONS_PER_OPEN = 4


def release_sessions(model_thread: Executor, verifier: Verifier, sessions: list[Session]) -> None:
    """SessionTable.on_release: free the engine sequences of sessions let go, in the model thread after
    the pass running now (which may still use one) and before the next (they are retired: none prepares
    them)."""
    try:
        model_thread.submit(verifier.release, sessions)
    except RuntimeError:  # the model thread has stopped: they go when collected
        pass


class Dispatcher:
    """The requests of every authenticated connection of one server."""

    def __init__(
        self,
        config: ServerConfig,
        verifier: Verifier,
        sessions: SessionTable,
        batcher: Batcher,
        metrics: ServerMetrics,
        replica: Replica,
        model_thread: Executor,
        image_thread: Executor,
        grammar_threads: Executor,
    ):
        self.config = config
        self.verifier = verifier
        self.sessions = sessions
        self.batcher = batcher
        self.metrics = metrics
        self.replica = replica
        self.model_thread = model_thread
        self.image_thread = image_thread
        self.grammar_threads = grammar_threads  # opens' grammars, compiled (each waits on a worker process)

    async def dispatch(
        self, ws: ServerConnection, conn_id: int, outbox: Outbox, msg: wire.Message, client: str
    ) -> None:
        """One request; `client` is the connection's share of the session table (admission.client_key)."""
        if isinstance(msg, wire.Open):
            await self._open(ws, conn_id, outbox, msg, client)
        elif isinstance(msg, wire.Verify):
            await self._verify(ws, conn_id, outbox, msg)
        elif isinstance(msg, wire.Ar):
            await self._stream_ar(ws, conn_id, msg)
        elif isinstance(msg, wire.Close):
            self.metrics.exits_purged += outbox.purge(msg.sid)
            closing = self.sessions.peek(msg.sid)
            if self.sessions.discard(msg.sid, conn_id) and closing is not None:  # closing a gone session is fine
                self.metrics.count_generation(closing.slo, *closing.generation_ended())
        else:
            raise wire.WireError("bad_type", f"{msg.TYPE} is not a request a robot may send")

    async def _open(self, ws: ServerConnection, conn_id: int, outbox: Outbox, msg: wire.Open, client: str) -> None:
        self.sessions.check_owner(msg.sid, conn_id, msg.resume)  # refused: the owner never notices
        slo = slo_class(msg.slo, self.config.default_slo, msg.sid)  # bad_field before any queueing
        scheduler, now = self.batcher.scheduler, time.monotonic()
        if self.sessions.peek(msg.sid) is None:  # a new robot waits, cheaply: before images, grammar, model work
            if why := scheduler.saturated(now) or self.sessions.full(msg.sid):
                raise self._no_room(msg.sid, why, now)
        await self._decode_images(msg)  # bad_image before any queueing; the model thread only embeds them
        constraint = await self._compile_grammar(msg, client or f"connection {conn_id}")  # bad_field, likewise
        self.metrics.exits_purged += outbox.purge(msg.sid)  # hints for the old generation
        secret = self.sessions.admit(msg.sid, conn_id, client, msg.resume)  # idle sessions go before a refusal
        opened = await self._submit_open(msg, conn_id, slo, constraint)
        session = opened.session
        if opened.ended is not None:
            self.metrics.count_generation(opened.ended.slo, *opened.ended.generation_ended())
        session.client, session.resume = client, secret
        try:
            self.sessions.install(session, msg.resume)
        except wire.WireError:
            session.evicted = True
            release_sessions(self.model_thread, self.verifier, [session])
            raise
        self.metrics.sessions_opened += 1
        await self.send(
            ws,
            wire.Opened(
                msg.sid,
                len(session.state.ids),
                {"prefill_ms": opened.ms, "passes": opened.passes},
                self.replica.id,
                session.resume,
            ),
        )

    async def _verify(self, ws: ServerConnection, conn_id: int, outbox: Outbox, msg: wire.Verify) -> None:
        session = self.sessions.get(msg.sid, conn_id)
        emit = self._exit_sink(outbox) if session.exits else None
        try:
            outcome = await self._submit(
                VerifyRequest(session, msg, emit), len(msg.draft_ids), len(msg.draft_ids) + (msg.fix is not None)
            )
            assert isinstance(outcome, RoundOutcome)
        finally:
            # Every exit of this round is in the outbox by now (queued before the pass returned);
            # what is still pending there is useless once the result is out. No await from here
            # to the result's write, so none of them can slip out after it.
            self.metrics.exits_purged += outbox.purge(msg.sid, msg.round)
        verdict = outcome.verdict
        session.answered(len(msg.draft_ids), verdict.accepted, time.monotonic())
        self.metrics.count_round(
            len(msg.draft_ids), verdict.accepted, outcome.verify_ms, outcome.exit_layer, outcome.exit_ms
        )
        if outcome.residual is not None:
            self.metrics.residuals_sent += 1
        await self.send(
            ws,
            wire.Result(
                msg.sid,
                msg.round,
                verdict.accepted,
                verdict.token,
                len(session.state.ids),
                outcome.timing(),
                outcome.residual,
            ),
        )

    async def _stream_ar(self, ws: ServerConnection, conn_id: int, msg: wire.Ar) -> None:
        """The cloud-autoregressive baseline: one target token per forward pass, each sent at once."""
        stop = set(msg.stop_ids)
        session = self.sessions.get(msg.sid, conn_id)
        await self.in_model_thread(self.verifier.fix, session, msg.fix)  # a split correction owed, if any
        for seq in range(msg.max_tokens):
            session = self.sessions.get(msg.sid, conn_id)  # evicted mid-stream -> unknown_session
            out = await self._submit(ArRequest(session), 0, 0)
            assert isinstance(out, ArOutcome)
            token, ms, p = out
            session.answered(0, 0, time.monotonic())
            self.metrics.count_ar_token(ms)
            done = seq + 1 == msg.max_tokens or token in stop
            sent = await self.send(ws, wire.Token(msg.sid, seq, token, done, {"verify_ms": ms, "passes": 1}, p))
            if done or not sent:  # a dead link stops the stream: the robot re-opens and asks again
                return

    async def _decode_images(self, msg: wire.Open) -> None:
        """An open's images decoded and tiled in the image thread (one: one image at a time, bounded in pixels
        by protocol/images.py), never in the model thread, which every robot waits on."""
        if msg.images:
            await asyncio.get_running_loop().run_in_executor(self.image_thread, self.verifier.decode_images, msg)

    async def _compile_grammar(self, msg: wire.Open, peer: str) -> Constraint | None:
        """An open's grammar compiled in the grammar threads (a worker process first: protocol/sandbox.py), never in
        the model thread; `peer` (the connection's client key) takes turns with other peers' compile work."""
        if msg.grammar is None:
            return None
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.grammar_threads, self.verifier.compile_grammar, msg, peer)

    async def _submit_open(
        self, msg: wire.Open, conn_id: int, slo: float, constraint: Constraint | None = None
    ) -> OpenOutcome:
        """An open through the batcher. While the engine's shared room is all held
        (every sequence; a unified KV pool's cells), the least recently used session not in a request
        (detached first) is evicted and the open tried again: `overloaded` only when every session is in
        a request (or MAX_EVICTIONS_PER_OPEN went and still no room)."""
        now = time.monotonic()
        evictions = 0
        while True:
            previous = self.sessions.peek(msg.sid)  # a re-open keeps the KV of what it shares
            try:
                with in_request(previous):
                    # worth one token, due when the first token is at the class's speed: an open is always
                    # urgent, since the first round's budget counts from it
                    return await self.batcher.submit(
                        OpenRequest(msg, conn_id, previous, now, constraint),
                        (0, len(msg.prompt_ids) - 1 if previous is None else 1),
                        1.0,
                        deadline(slo, now, 1.0),
                        slo,
                    )
            except OpenNeedsRoom as e:
                if evictions == MAX_EVICTIONS_PER_OPEN:
                    raise
                if self.sessions.evict_one(msg.sid, e.reason) is None:
                    why = f"{e.reason}, each by a session in a request now or answered within "
                    raise self._no_room(msg.sid, f"{why}{self.sessions.protect_active_s:g}s", now) from None
                evictions += 1

    def _no_room(self, sid: str, why: str, now: float) -> wire.WireError:
        """`overloaded` for a new robot's open: no room in the table, or the verifier saturated. Its retry_after:
        its turn (sessions.Turns: the robots refused lately over the rate sessions end, once some have ended),
        and never sooner than the scheduler's hint (twice the oldest request's wait) or protect_active_s."""
        turns = self.sessions.turns
        turns.refused(sid, now)
        after = max(turns.retry_after_s(now, RETRY_AFTER_S) or 0.0, self.sessions.protect_active_s)
        after_ms = max(round(1e3 * after), self.batcher.scheduler.retry_after_ms(now))
        return wire.WireError("overloaded", f"{why}: draft locally and retry later", sid, after_ms)

    async def _submit(self, req: VerifyRequest | ArRequest, k: int, extra: int) -> RoundOutcome | ArOutcome:
        """A verify round (k drafted tokens) or an ar token (k 0) through the batcher; `extra` new tokens beyond
        the session's uncached ids."""
        session = req.session
        state = session.state
        value = session.alpha * k + 1  # expected committed tokens
        with in_request(session):  # not evicted while it waits or runs
            return await self.batcher.submit(
                req,
                (state.cached, len(state.ids) - state.cached + extra),
                value,
                deadline(session.slo, max(session.t0, session.t_last), value),
                session.slo,
            )

    def _exit_sink(self, outbox: Outbox) -> Callable[[wire.Exit], None]:
        """A callback for the model thread that queues an exit message into this connection's outbox."""
        loop = asyncio.get_running_loop()

        def queue(msg: wire.Exit) -> None:  # in the event loop
            self.metrics.exits_dropped += outbox.put(msg)

        def emit(msg: wire.Exit) -> None:  # in the model thread
            try:
                loop.call_soon_threadsafe(queue, msg)
            except RuntimeError:  # the loop is closed: the server is stopping
                pass

        return emit

    async def send_exits(self, ws: ServerConnection, outbox: Outbox) -> None:
        """The connection's one exit sender: the outbox's best pending message, as the link allows."""
        while True:
            msg = await outbox.get()
            if not await self.send(ws, msg):
                return
            self.metrics.exits_sent += 1

    async def in_model_thread(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.model_thread, fn, *args)

    async def send(self, ws: ServerConnection, msg: wire.Message) -> bool:
        return await send(ws, msg, self.metrics)
