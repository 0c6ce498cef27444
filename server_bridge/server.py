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

The server's pieces: admission.py lets peers in (the strangers' caps, /healthz, /metrics), handshake.py
takes the hello and sends the welcome, dispatch.py serves each request, connections.py runs each
connection's loop and the drain; this module wires them to the batcher, the session table and the model
thread. Only a connection past hello counts toward `max_connections`; once hello passed the token, a
connection's sessions count against its robot's share of the session table (its address, X-Robot-Id and
hello's client: robots behind one NAT each have their own), never before. Log lines are budgeted per
connection, and for all strangers together.

One of many replicas (deploy/haproxy, deploy/k8s): each names itself
(`replica_id`) in welcome, opened, /healthz and /metrics. SIGTERM drains: /healthz
answers 503 so the balancer sends no new robots, an upgrade that still arrives
gets 503 (HAProxy retries it elsewhere), each connection finishes the request it
is serving and is then closed with 1012 ("service restart"), on which a robot
reconnects at once and re-opens its session, with its committed prefix, wherever
the balancer sends it. A connection's sessions outlive it for `detached_grace_s`,
so a robot back after a blip finds its KV.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
import socket
import ssl
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, cast

from websockets.asyncio.server import Server, ServerConnection, serve

from protocol import modelfiles

from .admission import Admission, Replica
from .batcher import Batcher
from .config import ServerConfig
from .connections import Connections
from .dispatch import Dispatcher, release_sessions
from .estimator import VerifyTimeModel, batch_memory_bytes
from .exit_setup import exit_taps
from .handshake import Handshake
from .metrics import ServerMetrics
from .scheduler import Scheduler
from .sessions import SessionTable
from .verifier import Verifier

if TYPE_CHECKING:
    from .target import Target

log = logging.getLogger(__name__)


def tls_context(config: ServerConfig) -> ssl.SSLContext | None:
    """The server's TLS context from tls_cert/tls_key (None: plain ws://); raises OSError or ssl.SSLError."""
    if not config.tls_cert:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(config.tls_cert, config.tls_key)
    return ctx


GRAMMAR_THREADS = 8  # opens compiling their grammars at once; each waits its turn for a worker process


class BridgeServer:
    """The verifier's websocket server: its pieces wired to one batcher, session table and model thread."""

    def __init__(self, verifier: Verifier, config: ServerConfig):
        self.verifier = verifier
        self.config = config
        self.metrics = ServerMetrics()
        self.model_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="target")
        self.image_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="images")  # opens' images, decoded
        # opens' grammars: each thread waits on a compile worker (protocol/sandbox.py bounds and shares those)
        self.grammar_threads = ThreadPoolExecutor(max_workers=GRAMMAR_THREADS, thread_name_prefix="grammar")
        # a session holds an engine sequence: a table larger than the engine's would admit opens that the model
        # thread can only refuse, each one a pass's round trip (at 512 robots on llama.cpp's 256: most of the loop)
        self.sessions = SessionTable(
            min(config.max_sessions, verifier.target.engine.max_sequences),
            config.max_sessions_per_connection,
            config.idle_timeout_s,
            config.detached_grace_s,
            max_per_client=config.max_sessions_per_client,
            on_release=functools.partial(release_sessions, self.model_thread, verifier),
            protect_active_s=config.protect_active_s,
        )
        target = verifier.target
        self.scheduler = Scheduler(
            config.scheduler,
            load_estimator(config.estimator, target.name, target.packed),
            max_queue=config.max_queue,
            max_batch=batch_limit(config, target.engine.max_sequences),
            guard_ms=config.guard_ms,
            memory_budget_bytes=config.batch_memory_mb * 2**20,
            memory_of=lambda members: batch_memory_bytes(
                members, target.kv_bytes_per_token, 4 * target.vocab_size, config.max_draft_len + 1, target.packed
            ),
            batch_wait_ms=config.batch_wait_ms,
            max_wait_ms=config.max_wait_ms,
            max_batch_ms=config.max_batch_ms,
        )
        on_gpu = verifier.target.engine.info.device not in ("cpu", "")
        pipeline = config.pipeline == "on" or (config.pipeline == "auto" and on_gpu)
        self.batcher = Batcher(verifier, self.scheduler, self.model_thread, self.metrics, pipeline)
        self.replica = Replica(config.replica_id)
        self.admission = Admission(config, self.metrics, self.replica, self.health, self._metrics_text)
        self.handshake = Handshake(config, verifier, self.admission, self.replica)
        self.dispatcher = Dispatcher(
            config,
            verifier,
            self.sessions,
            self.batcher,
            self.metrics,
            self.replica,
            self.model_thread,
            self.image_thread,
            self.grammar_threads,
        )
        self.connections = Connections(
            config, self.sessions, self.metrics, self.replica, self.admission, self.handshake, self.dispatcher
        )
        self._server: Server | None = None
        self.port: int | None = None
        self._metrics_server: Server | None = None
        self.metrics_port: int | None = None  # metrics_listen's port, once started

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        tls = tls_context(self.config)
        self._server = server = await serve(
            self.connections.handle,
            self.config.host,
            self.config.port,
            process_request=self.admission.process_request,
            ssl=tls,
            # frames between the cap and twice the cap get an `error`; beyond that websockets closes (1009)
            max_size=2 * self.config.max_frame_bytes,
            max_queue=16,
            compression=None,
            ping_interval=10,
            ping_timeout=10,
            # the TLS handshake (ssl_handshake_timeout defaults to it) and the HTTP upgrade: a peer that
            # sends nothing is gone after this; hello's own deadline then counts from the accept
            open_timeout=self.config.hello_timeout_s,
            create_connection=cast("type[ServerConnection]", self.admission.new_connection),  # a factory serve calls
        )
        self.port = server.sockets[0].getsockname()[1]
        if self.config.metrics_address is not None:
            host, port = self.config.metrics_address
            self._metrics_server = metrics_server = await serve(
                _no_websocket,
                host,
                port,
                process_request=self.admission.process_metrics_request,
                compression=None,
                open_timeout=self.config.hello_timeout_s,
            )
            self.metrics_port = metrics_server.sockets[0].getsockname()[1]
            log.info("/metrics and /healthz also on http://%s:%d, without a token", host, self.metrics_port)
        self.replica.id = self.config.replica_id or f"{socket.gethostname()}:{self.port}"
        self._janitor = asyncio.create_task(self._evict_idle_forever(), name="session-janitor")
        self.batcher.start()
        model = self.scheduler.model
        log.info(
            "server-bridge replica %s listening on %s://%s:%d (target %s on %s, token %s, scheduler %s, max batch %d, "
            "estimator %s)",
            self.replica.id,
            "wss" if tls else "ws",
            self.config.host,
            self.port,
            self.verifier.target.name,
            self.verifier.target.engine.info.as_dict(),
            "required" if self.config.token else "none: loopback clients only",
            self.config.scheduler,
            self.scheduler.max_batch,
            "fitted" if model.fitted else "defaults (run server-bridge profile)",
        )
        log.info(
            "peers: loopback clients %s; client addresses from the forwarding headers of %s; hello within %gs; at most "
            "%d unauthenticated connections, %d per address",
            "need no token" if self.config.loopback_trusted else "present the token like everyone",
            ", ".join(self.config.trusted_proxies) or "no proxy",
            self.config.hello_timeout_s,
            self.config.max_unauthenticated,
            self.config.max_unauthenticated_per_address,
        )

    async def stop(self) -> None:
        self._janitor.cancel()
        await self.batcher.stop()
        if self._metrics_server is not None:
            self._metrics_server.close()
            await self._metrics_server.wait_closed()
        assert self._server is not None, "stop() before start()"
        self._server.close()
        await self._server.wait_closed()
        if self.sessions.clear():  # their sequences go back to the engine (a target outlives its server)
            try:  # the model thread frees them after the pass in flight; this waits for that
                await asyncio.wait_for(self.dispatcher.in_model_thread(lambda: None), 10)
            except (asyncio.TimeoutError, RuntimeError):
                log.warning("stopping with sessions' sequences not yet freed (a pass is still running)")
        self.model_thread.shutdown(wait=False, cancel_futures=True)
        self.image_thread.shutdown(wait=False, cancel_futures=True)
        self.grammar_threads.shutdown(wait=False, cancel_futures=True)

    async def serve_forever(self) -> None:
        """Serve until SIGTERM (drain, then stop) or SIGINT (stop at once)."""
        await self.start()
        loop = asyncio.get_running_loop()
        stop: asyncio.Future[str] = loop.create_future()

        def stopping(how: str) -> None:
            if not stop.done():
                stop.set_result(how)

        loop.add_signal_handler(signal.SIGTERM, stopping, "drain")
        loop.add_signal_handler(signal.SIGINT, stopping, "stop")
        if await stop == "drain":
            await self.drain()
        log.info("shutting down")
        await self.stop()

    async def drain(self, timeout_s: float | None = None) -> int:
        """Hand every robot here to the other replicas (Connections.drain); how many connections were closed."""
        return await self.connections.drain(self.config.drain_timeout_s if timeout_s is None else timeout_s)

    async def _evict_idle_forever(self) -> None:
        while True:
            await asyncio.sleep(min(5.0, self.config.idle_timeout_s / 4, max(0.25, self.config.detached_grace_s / 4)))
            self.sessions.evict_idle()

    # ------------------------------------------------------------------ state

    def health(self, full: bool = True) -> dict:
        """/healthz's JSON: who this replica is, what it serves and how loaded it is; only the status when not full."""
        status = {"status": "draining" if self.replica.draining else "ok"}
        if not full:
            return status
        return {
            **status,
            "replica": self.replica.id,
            "target": self.verifier.target.name,
            **self.verifier.target.engine.info.as_dict(),
            "sessions": len(self.sessions),
            "connections": self.replica.connections,
            "unauthenticated": len(self.admission.gate),
            "queue": len(self.scheduler),
            "draining": self.replica.draining,
        }

    def _metrics_text(self) -> str:
        """/metrics' page (Prometheus text)."""
        self.metrics.engine_cpu_s = self.verifier.engine_cpu_s
        self.metrics.model_cpu_s = self.verifier.model_cpu_s
        return self.metrics.render(
            self.sessions,
            self.replica.connections,
            len(self.scheduler),
            self.verifier.target.engine,
            replica=self.replica.id,
            draining=self.replica.draining,
            unauthenticated=len(self.admission.gate),
        )


async def _no_websocket(ws: ServerConnection) -> None:  # metrics_listen answers every request in process_request
    await ws.close(1008, "no websocket here")


def batch_limit(config: ServerConfig, sequences: int) -> int:
    """The scheduler's max_batch: the configured one, or (0, the default) every sequence the engine holds."""
    return config.max_batch or max(1, min(sequences, 1024))


def load_estimator(spec: str, target_name: str, packed: bool = False) -> VerifyTimeModel:
    """The verification-time model: a JSON file, "auto" (the profiled one for this target, if any), or "".

    packed: the engine's (Engine.packed), whatever the file was fitted with: it decides how a batch runs."""
    path = modelfiles.resolve_estimator(spec, target_name)
    if path is None:
        log.warning(
            "no profiled verification-time estimator for %s: using rough defaults; run "
            "`server-bridge profile` on this machine",
            target_name,
        )
        return VerifyTimeModel(packed=packed)
    model = VerifyTimeModel.load(path)
    if model.packed != packed:
        log.info(
            "the estimator %s was fitted to %s batches and this engine runs them %s: its scale follows the "
            "difference; `server-bridge profile` refits it",
            path,
            "packed" if model.packed else "padded",
            "packed" if packed else "padded",
        )
        model.packed = packed
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


def target_from_config(config: ServerConfig) -> Target:
    """The target on the engine the config names, sized by its session and context limits."""
    from .target import load_target

    # llama.cpp taps only the exits' layers, and none when exits are off: its eval callback is
    # then not installed at all
    target = load_target(
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
        torch_compile=config.torch_compile,
        batch_invariant=config.batch_invariant,
        tap_layers=exit_taps(config, modelfiles.target_name(config.target)),
        **config.llama_options,
    )  # the torch engine ignores them
    warm = getattr(target.engine, "warm", None)  # the torch engine's compiled pass: compiled before serving
    if warm is not None:
        warm()
    return target


async def run(config: ServerConfig) -> None:
    t0 = time.perf_counter()
    target = target_from_config(config)
    log.info("target ready in %.1fs: %s", time.perf_counter() - t0, target.engine.info.as_dict())
    await BridgeServer(Verifier(target, config), config).serve_forever()
