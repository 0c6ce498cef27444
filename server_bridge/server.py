"""server-bridge: the asyncio websocket server in front of the verifier.

One handler per connection reads frames in order; every bad frame gets an
`error` on that connection and the handler goes on (or closes, for a failed
handshake), so one robot's garbage never touches another's session. Every
model job (an open's prefill, a verify round, an ar token) goes through the
`Batcher`: the scheduler picks which waiting jobs share the next forward pass
(SLO-aware by default), the pass runs in a single model thread, and the event
loop keeps serving meanwhile. `/healthz` and `/metrics` (Prometheus text)
answer plain HTTP on the same port. With `tls_cert`/`tls_key` the port speaks
TLS only (wss:// and https:// for /healthz and /metrics).

One of many replicas (deploy/haproxy, deploy/k8s): each names itself
(`replica_id`) in welcome, opened, /healthz and /metrics. SIGTERM drains: /healthz
answers 503 so the balancer sends no new robots, an upgrade that still arrives
gets 503 (HAProxy retries it elsewhere), each connection finishes the request it
is serving and is then closed with 1012 ("service restart"), on which a robot
reconnects at once and re-opens its session, with its committed prefix, wherever
the balancer sends it. A connection's sessions outlive it for `detached_grace_s`,
so a robot back after a blip finds its KV.

Early-exit messages (FSD) are made in the model thread during a verify pass;
they reach the event loop by `call_soon_threadsafe`, wait in the connection's
bounded `Outbox` and go out from one sender task per connection, so they
overtake the pass they come from. A round's `result` goes out directly, and
its exits still pending then are purged: after the result they are useless.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import itertools
import json
import logging
import signal
import socket
import ssl
import time
from concurrent.futures import ThreadPoolExecutor
from http import HTTPStatus
from pathlib import Path

from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from protocol import images, modelfiles, wire

from .batcher import Batcher
from .config import ServerConfig
from .estimator import VerifyTimeModel, batch_memory_bytes
from .metrics import ServerMetrics
from .outbox import Outbox
from .scheduler import Scheduler, deadline
from .sessions import Session, SessionTable
from .verifier import Job, Verifier, exit_taps, slo_class

log = logging.getLogger(__name__)

# Errors after which the connection is closed: the peer is not someone we verify for.
FATAL = {"bad_token", "vocab_mismatch", "bad_version", "not_authenticated"}


def is_loopback(remote) -> bool:
    try:
        return ipaddress.ip_address(remote[0]).is_loopback
    except (TypeError, ValueError, IndexError):
        return False


def tls_context(config: ServerConfig) -> ssl.SSLContext | None:
    """The server's TLS context from tls_cert/tls_key (None: plain ws://); raises OSError or ssl.SSLError."""
    if not config.tls_cert:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(config.tls_cert, config.tls_key)
    return ctx


class BridgeServer:
    def __init__(self, verifier: Verifier, config: ServerConfig):
        self.verifier = verifier
        self.config = config
        self.sessions = SessionTable(
            config.max_sessions, config.max_sessions_per_connection, config.idle_timeout_s, config.detached_grace_s
        )
        self.metrics = ServerMetrics()
        self.model_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="target")
        target = verifier.target
        self.scheduler = Scheduler(
            config.scheduler,
            load_estimator(config.estimator, target.name),
            max_queue=config.max_queue,
            max_batch=config.max_batch,
            guard_ms=config.guard_ms,
            memory_budget_bytes=config.batch_memory_mb * 2**20,
            memory_of=lambda members: batch_memory_bytes(
                members, target.kv_bytes_per_token, 4 * target.vocab_size, config.max_draft_len + 1
            ),
            batch_wait_ms=config.batch_wait_ms,
            max_wait_ms=config.max_wait_ms,
        )
        self.batcher = Batcher(verifier, self.scheduler, self.model_thread, self.metrics)
        self._conn_ids = itertools.count(1)
        self._connections = 0
        self._live: dict[int, ServerConnection] = {}  # conn_id -> connection, for the drain
        self._busy: set[int] = set()  # connections serving a request now
        self._server = None
        self.port: int | None = None
        self.replica_id = config.replica_id  # "" until start() knows the port
        self.draining = False

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        tls = tls_context(self.config)
        self._server = await serve(
            self.handle,
            self.config.host,
            self.config.port,
            process_request=self.process_request,
            ssl=tls,
            # frames between the cap and twice the cap get an `error`; beyond that websockets closes (1009)
            max_size=2 * self.config.max_frame_bytes,
            max_queue=16,
            compression=None,
            ping_interval=10,
            ping_timeout=10,
        )
        self.port = self._server.sockets[0].getsockname()[1]
        self.replica_id = self.config.replica_id or f"{socket.gethostname()}:{self.port}"
        self._janitor = asyncio.create_task(self._evict_idle_forever(), name="session-janitor")
        self.batcher.start()
        model = self.scheduler.model
        log.info(
            "server-bridge replica %s listening on %s://%s:%d (target %s on %s, token %s, scheduler %s, max batch %d, "
            "estimator %s)",
            self.replica_id,
            "wss" if tls else "ws",
            self.config.host,
            self.port,
            self.verifier.target.name,
            self.verifier.target.engine.info.as_dict(),
            "required" if self.config.token else "none: loopback clients only",
            self.config.scheduler,
            self.scheduler.max_batch,
            "fitted" if model.fitted else "defaults (run tools/train/profile_verifier.py)",
        )

    async def stop(self) -> None:
        self._janitor.cancel()
        await self.batcher.stop()
        self._server.close()
        await self._server.wait_closed()
        self.model_thread.shutdown(wait=False, cancel_futures=True)

    async def serve_forever(self) -> None:
        """Serve until SIGTERM (drain, then stop) or SIGINT (stop at once)."""
        await self.start()
        loop = asyncio.get_running_loop()
        stop = loop.create_future()
        loop.add_signal_handler(signal.SIGTERM, lambda: stop.done() or stop.set_result("drain"))
        loop.add_signal_handler(signal.SIGINT, lambda: stop.done() or stop.set_result("stop"))
        if await stop == "drain":
            await self.drain()
        log.info("shutting down")
        await self.stop()

    async def drain(self, timeout_s: float | None = None) -> int:
        """Stop taking robots and hand the ones here to the other replicas without losing a round.

        /healthz turns 503 at once, and the balancer stops sending new robots (HAProxy: within one
        check interval). Every connection is closed with 1012 as soon as it is not serving a request:
        the request in flight gets its answer first. After `timeout_s` (drain_timeout_s) whatever is
        left is closed the same way; the robot re-opens its session elsewhere with its committed prefix
        either way. Returns how many connections were closed."""
        timeout_s = self.config.drain_timeout_s if timeout_s is None else timeout_s
        self.draining = True
        n = len(self._live)
        log.info("draining: %d connection(s), %d request(s) in flight, at most %.0fs", n, len(self._busy), timeout_s)
        t0 = time.monotonic()
        for conn_id, ws in list(self._live.items()):
            if conn_id not in self._busy:
                await self._close_for_drain(ws)
        while self._live and time.monotonic() - t0 < timeout_s:
            await asyncio.sleep(0.02)  # the handlers close the rest as their requests end
        late = list(self._live.values())
        for ws in late:
            await self._close_for_drain(ws)
        log.info(
            "drained %d connection(s) in %.2fs%s",
            n,
            time.monotonic() - t0,
            f" ({len(late)} still busy at the timeout)" if late else "",
        )
        return n

    @staticmethod
    async def _close_for_drain(ws: ServerConnection) -> None:
        # 1012 "service restart": the robot reconnects without backing off (agent/link.py)
        await ws.close(1012, "replica draining: reconnect")

    async def _evict_idle_forever(self) -> None:
        while True:
            await asyncio.sleep(min(5.0, self.config.idle_timeout_s / 4, max(0.25, self.config.detached_grace_s / 4)))
            self.sessions.evict_idle()

    # ------------------------------------------------------------------ plain HTTP

    def process_request(self, connection: ServerConnection, request):
        # Refused before the websocket upgrade, so the robot sees why without a half-open session.
        if not self.config.token and not is_loopback(connection.remote_address):
            self.metrics.errors["forbidden"] += 1
            return connection.respond(
                HTTPStatus.FORBIDDEN, "this verifier has no token configured and accepts loopback clients only\n"
            )
        if request.path == "/healthz":
            # 503 while draining: the balancer's check and Kubernetes' readiness take the replica out
            status = HTTPStatus.SERVICE_UNAVAILABLE if self.draining else HTTPStatus.OK
            resp = connection.respond(status, json.dumps(self.health()) + "\n")
            del resp.headers["Content-Type"]
            resp.headers["Content-Type"] = "application/json"
            return resp
        if request.path == "/metrics":
            resp = connection.respond(
                HTTPStatus.OK,
                self.metrics.render(
                    self.sessions,
                    self._connections,
                    len(self.scheduler),
                    self.verifier.target.engine,
                    replica=self.replica_id,
                    draining=self.draining,
                ),
            )
            del resp.headers["Content-Type"]  # Headers is a multidict: replace, not append
            resp.headers["Content-Type"] = "text/plain; version=0.0.4; charset=utf-8"
            return resp
        if self.draining:  # HAProxy's retry-on 503 sends it to another replica
            self.metrics.errors["draining"] += 1
            return connection.respond(HTTPStatus.SERVICE_UNAVAILABLE, "this replica is draining; reconnect\n")
        if self._connections >= self.config.max_connections:
            self.metrics.errors["busy"] += 1
            return connection.respond(HTTPStatus.SERVICE_UNAVAILABLE, "too many connections; retry later\n")
        return None  # everything else is a websocket upgrade

    def health(self) -> dict:
        """/healthz's JSON: who this replica is, what it serves and how loaded it is."""
        return {
            "status": "draining" if self.draining else "ok",
            "replica": self.replica_id,
            "target": self.verifier.target.name,
            **self.verifier.target.engine.info.as_dict(),
            "sessions": len(self.sessions),
            "connections": self._connections,
            "queue": len(self.scheduler),
            "draining": self.draining,
        }

    # ------------------------------------------------------------------ websocket

    async def handle(self, ws: ServerConnection) -> None:
        conn_id = next(self._conn_ids)
        self._connections += 1
        self._live[conn_id] = ws
        peer = ws.remote_address
        robot = ws.request.headers.get("X-Robot-Id", "") if ws.request is not None else ""
        if robot:
            log.debug("conn %d %s: robot %s", conn_id, peer, robot)
        outbox = Outbox(self.config.exit_queue, self.config.exit_policy)
        sender = asyncio.create_task(self._send_exits(ws, outbox), name=f"exits-{conn_id}")
        try:
            authed = False
            async for frame in ws:
                self.metrics.bytes_in += len(frame)
                self._busy.add(conn_id)
                try:
                    msg = wire.decode(frame, self.config.max_frame_bytes)
                    if not authed:
                        await self._handshake(ws, msg)
                        authed = True
                    else:
                        await self._dispatch(ws, conn_id, outbox, msg)
                except wire.WireError as e:
                    self.metrics.errors[e.code] += 1
                    log.info("conn %d %s: %s", conn_id, peer, e)
                    await self._send(ws, wire.Error(e.code, e.message, e.sid))
                    if e.code in FATAL:
                        return
                finally:
                    self._busy.discard(conn_id)
                if self.draining:  # its request is answered: hand the robot over
                    await self._close_for_drain(ws)
                    return
        except ConnectionClosed:
            pass
        finally:
            self._connections -= 1
            self._live.pop(conn_id, None)
            self.sessions.detach(conn_id)
            outbox.close()
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)

    async def _handshake(self, ws: ServerConnection, msg: wire.Message) -> None:
        if not isinstance(msg, wire.Hello):
            raise wire.WireError("not_authenticated", f"the first message must be hello, got {msg.TYPE}")
        if self.config.token and not hmac.compare_digest(msg.token.encode(), self.config.token.encode()):
            raise wire.WireError("bad_token", "the token in hello does not match this verifier's")
        target = self.verifier.target
        if msg.draft_vocab_hash != target.vocab_hash or msg.vocab_size != target.vocab_size:
            raise wire.WireError(
                "vocab_mismatch",
                f"the draft's vocabulary (size {msg.vocab_size}, hash "
                f"{msg.draft_vocab_hash[:12]}) differs from the target {target.name}'s (size "
                f"{target.vocab_size}, hash {target.vocab_hash[:12]}); speculative decoding "
                "needs identical tokenizers",
            )
        await self._send(
            ws,
            wire.Welcome(
                target=target.name,
                vocab_size=target.vocab_size,
                vocab_hash=target.vocab_hash,
                eos_ids=target.eos_ids,
                exits=self.verifier.exit_layers,
                limits={
                    "max_frame_bytes": self.config.max_frame_bytes,
                    "max_draft_len": self.config.max_draft_len,
                    "max_context": self.config.max_context,
                    "max_sessions": self.config.max_sessions,
                    "grammar": target.grammars_supported,
                    **self._image_limits(),
                },
                engine=target.engine.info.as_dict(),
                replica=self.replica_id,
            ),
        )

    def _image_limits(self) -> dict:
        """welcome.limits.images where the target reads images: its marker id and the wire's bounds."""
        marker = self.verifier.target.image_marker
        if marker is None:
            return {}
        return {"images": {"marker": marker, "max_images": images.MAX_IMAGES, "max_bytes": images.MAX_IMAGE_BYTES}}

    async def _dispatch(self, ws: ServerConnection, conn_id: int, outbox: Outbox, msg: wire.Message) -> None:
        if isinstance(msg, wire.Open):
            self.sessions.check_owner(msg.sid, conn_id, msg.prompt_ids)  # refused: the owner never notices
            self.metrics.exits_purged += outbox.purge(msg.sid)  # hints for the old generation
            self.sessions.check_room(msg.sid, conn_id)
            previous = self.sessions.peek(msg.sid)
            now = time.monotonic()
            job = Job("open", msg, previous, conn_id, arrival=now)
            slo = slo_class(msg.slo, self.config.default_slo, msg.sid)  # bad_field before any queueing
            fresh = previous is None  # a re-open keeps the KV of what it shares
            # worth one token, due when the first token is at the class's speed: an open is always urgent,
            # since the first round's budget counts from it
            session, ms = await self.batcher.submit(
                job, (0, len(msg.prompt_ids) - 1 if fresh else 1), 1.0, deadline(slo, now, 1.0), slo
            )
            if job.ended is not None:
                self.metrics.count_generation(job.ended.slo, *job.ended.generation_ended())
            self.sessions.put(session)
            session.acknowledge(len(msg.prompt_ids))
            self.metrics.sessions_opened += 1
            await self._send(
                ws,
                wire.Opened(
                    msg.sid, len(session.state.ids), {"prefill_ms": ms, "passes": session.state.passes}, self.replica_id
                ),
            )
            session.state.passes = 0
        elif isinstance(msg, wire.Verify):
            session = self.sessions.get(msg.sid, conn_id)
            session.acknowledge(msg.n_committed)
            emit = self._exit_sink(outbox) if session.exits else None
            try:
                outcome = await self._submit(
                    Job("verify", msg, session, emit=emit), session, len(msg.draft_ids) + (msg.fix is not None)
                )
            finally:
                # Every exit of this round is in the outbox by now (queued before the pass returned);
                # what is still pending there is useless once the result is out. No await from here
                # to the result's write, so none of them can slip out after it.
                self.metrics.exits_purged += outbox.purge(msg.sid, msg.round)
            verdict = outcome.verdict
            self.metrics.count_round(
                len(msg.draft_ids), verdict.accepted, outcome.verify_ms, outcome.exit_layer, outcome.exit_ms
            )
            if outcome.residual is not None:
                self.metrics.residuals_sent += 1
            await self._send(
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
        elif isinstance(msg, wire.Ar):
            await self._stream_ar(ws, conn_id, msg)
        elif isinstance(msg, wire.Close):
            self.metrics.exits_purged += outbox.purge(msg.sid)
            session = self.sessions.peek(msg.sid)
            if self.sessions.discard(msg.sid, conn_id):  # idempotent: closing a gone session is fine
                self.metrics.count_generation(session.slo, *session.generation_ended())
        else:
            raise wire.WireError("bad_type", f"{msg.TYPE} is not a request a robot may send")

    async def _stream_ar(self, ws: ServerConnection, conn_id: int, msg: wire.Ar) -> None:
        """The cloud-autoregressive baseline: one target token per forward pass, each sent at once."""
        stop = set(msg.stop_ids)
        session = self.sessions.get(msg.sid, conn_id)
        session.acknowledge(len(session.state.ids))  # it asks after the last open, round or stream ended
        await self._in_model_thread(self.verifier.fix, session, msg.fix)  # a split correction owed, if any
        for seq in range(msg.max_tokens):
            session = self.sessions.get(msg.sid, conn_id)  # evicted mid-stream -> unknown_session
            token, ms, p = await self._submit(Job("ar", None, session), session, 0)
            self.metrics.count_ar_token(ms)
            done = seq + 1 == msg.max_tokens or token in stop
            sent = await self._send(ws, wire.Token(msg.sid, seq, token, done, {"verify_ms": ms, "passes": 1}, p))
            if done or not sent:  # a dead link stops the stream: the robot re-opens and asks again
                return

    async def _submit(self, job: Job, session: Session, extra: int):
        """A verify or ar job of `session` through the batcher; `extra` new tokens beyond the uncached ids."""
        state = session.state
        k = len(job.msg.draft_ids) if job.kind == "verify" else 0
        value = session.alpha * k + 1  # expected committed tokens
        return await self.batcher.submit(
            job,
            (state.cached, len(state.ids) - state.cached + extra),
            value,
            deadline(session.slo, max(session.t0, session.t_last), value),
            session.slo,
        )

    def _exit_sink(self, outbox: Outbox):
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

    async def _send_exits(self, ws: ServerConnection, outbox: Outbox) -> None:
        """The connection's one exit sender: the outbox's best pending message, as the link allows."""
        while True:
            msg = await outbox.get()
            if not await self._send(ws, msg):
                return
            self.metrics.exits_sent += 1

    async def _in_model_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.model_thread, fn, *args)

    async def _send(self, ws: ServerConnection, msg: wire.Message) -> bool:
        """Send one message; False when the connection is already gone."""
        frame = wire.encode(msg)
        try:
            await ws.send(frame)
        except ConnectionClosed:
            return False
        self.metrics.bytes_out += len(frame)
        return True


def load_estimator(spec: str, target_name: str) -> VerifyTimeModel:
    """The verification-time model: a JSON file, "auto" (the profiled one for this target, if any), or ""."""
    path = modelfiles.resolve_estimator(spec, target_name)
    if path is None:
        log.warning(
            "no profiled verification-time estimator for %s: using rough defaults; run "
            "`python -m tools.train.profile_verifier` on this machine",
            target_name,
        )
        return VerifyTimeModel()
    model = VerifyTimeModel.load(path)
    log.info(
        "verification-time estimator from %s: a %.3g ms/token, b_c %.3g ms/interaction, b_r %.3g ms/cached "
        "token, c %.3g ms",
        path,
        model.a,
        model.b_c,
        model.b_r,
        model.c,
    )
    return model


def target_from_config(config: ServerConfig):
    """The target on the engine the config names, sized by its session and context limits."""
    from .target import load_target

    # llama.cpp taps only the exits' layers, and none when exits are off: its eval callback is
    # then not installed at all
    return load_target(
        config.target,
        config.engine,
        device=config.device,
        dtype=config.dtype,
        threads=config.threads,
        max_sequences=config.max_sessions,
        kv_tokens=config.kv_budget,
        n_gpu_layers=config.n_gpu_layers,
        max_len=config.max_context,
        kv_type=config.kv_type,
        tap_layers=exit_taps(config, Path(config.target).name),
        **config.llama_options,
    )  # the torch engine ignores them


async def run(config: ServerConfig) -> None:
    t0 = time.perf_counter()
    target = target_from_config(config)
    log.info("target ready in %.1fs: %s", time.perf_counter() - t0, target.engine.info.as_dict())
    await BridgeServer(Verifier(target, config), config).serve_forever()
