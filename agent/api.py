"""The local API other robot processes use: JSON over a websocket on 127.0.0.1 or a Unix socket.

Requests (one JSON object per message) and their answers:

    {"op": "submit", "instruction": "go to the red box", "image": "<base64 JPEG/PNG>", "max_steps": 20}
                                    -> {"ok": true, "task": 3}      (image and max_steps optional)
    {"op": "cancel"}                -> {"ok": true, "dropped": 0}   the robot halts
    {"op": "status"}                -> {"ok": true, "status": {...}}
    {"op": "estop"}                 -> {"ok": true, "latched": true, "delivered": true|false}
                                       no model in the path; latched before the reply; "delivered": the
                                       robot's own e-stop (Go2 Damp) returned within 20 ms, else it is
                                       still on its way (status "driver_calls" shows it)
    {"op": "reset"}                 -> {"ok": true}                 stands the robot up (Go2), then clears the
                                       e-stop latch; {"ok": false, ...} when the robot did not get ready
    {"op": "subscribe"}             -> {"ok": true}, then events: {"event": "observation" | "reasoning" |
                                       "action" | "mode" | "task" | "estop" | "reset", ...}

Errors are {"ok": false, "error": "..."}; a bad request never closes the connection.
A subscriber's queue holds 256 events; when it is full the oldest are dropped and
counted in the next event's "dropped" field. The e-stop is handled inline in the
connection's coroutine, never behind a queue, and nothing on this event loop
waits for a driver: the e-stop latches and hands Damp to its own thread; a reset
(seconds of standing up) runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import json
import logging

from websockets.asyncio.server import serve, unix_serve
from websockets.exceptions import ConnectionClosed

from .daemon import Busy, Daemon
from .robot.controllers.base import ControllerError

log = logging.getLogger(__name__)

SUBSCRIBER_QUEUE = 256
MAX_MESSAGE = 12_000_000  # an image of up to 8 MB, base64
ESTOP_CONFIRM_S = 0.02  # how long an e-stop reply waits to say the driver's e-stop returned


class LocalApi:
    def __init__(self, daemon: Daemon, listen: str):
        self.daemon = daemon
        self.listen = listen
        self.server = None

    async def start(self) -> "LocalApi":
        kw = dict(max_size=MAX_MESSAGE, ping_interval=5, ping_timeout=5, compression=None)
        if self.listen.startswith("unix:"):
            self.server = await unix_serve(self._handle, self.listen[5:], **kw)
        else:
            host, _, port = self.listen.rpartition(":")
            self.server = await serve(self._handle, host, int(port), **kw)
        log.info("local API on %s", self.address)
        return self

    @property
    def address(self) -> str:
        if self.listen.startswith("unix:"):
            return self.listen
        host, port = self.server.sockets[0].getsockname()[:2]
        return f"ws://{host}:{port}"

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()

    async def _handle(self, ws) -> None:
        unlisten = None
        sender = None
        try:
            async for raw in ws:
                req = None
                try:
                    req = json.loads(raw)
                    if not isinstance(req, dict):
                        raise ValueError("a request is a JSON object")
                    op = req.get("op")
                    if op == "estop":  # first, and inline
                        reply = {"ok": True, "latched": True, "delivered": await self._estop()}
                    elif op == "subscribe":
                        if unlisten is None:
                            events: asyncio.Queue = asyncio.Queue(SUBSCRIBER_QUEUE)
                            unlisten = self.daemon.listen(self._forwarder(events))
                            sender = asyncio.create_task(self._send_events(ws, events))
                        reply = {"ok": True}
                    else:
                        reply = await self._call(op, req)
                except (ValueError, TypeError, Busy, ControllerError) as e:
                    reply = {"ok": False, "error": str(e)}
                reply["op"] = req.get("op") if isinstance(req, dict) else None
                await ws.send(json.dumps(reply, default=str))
        except ConnectionClosed:
            pass
        finally:
            if unlisten is not None:
                unlisten()
            if sender is not None:
                sender.cancel()

    async def _estop(self) -> bool:
        """Latch (before the first await) and wait briefly, without blocking the loop, for the driver's e-stop."""
        delivery = asyncio.wrap_future(self.daemon.estop())
        delivery.add_done_callback(lambda f: f.cancelled() or f.exception())  # a late failure is the lane's to log
        try:
            await asyncio.wait_for(asyncio.shield(delivery), ESTOP_CONFIRM_S)  # shield: never cancel the Damp
            return True
        except asyncio.TimeoutError:
            return False
        except Exception:  # the driver's e-stop failed: logged by its lane; the latch holds anyway
            return False

    async def _call(self, op, req) -> dict:
        d = self.daemon
        if op == "submit":
            task = await asyncio.to_thread(d.submit, req.get("instruction"), req.get("image"), req.get("max_steps"))
            return {"ok": True, "task": task}
        if op == "cancel":
            return {"ok": True, "dropped": d.cancel()}
        if op == "status":
            return {"ok": True, "status": d.status()}
        if op == "reset":
            await asyncio.to_thread(d.reset)
            return {"ok": True}
        raise ValueError(f"unknown op {op!r}; use submit, cancel, status, estop, reset or subscribe")

    def _forwarder(self, events: asyncio.Queue):
        loop = asyncio.get_running_loop()
        dropped = [0]

        def put(event):
            if events.full():
                try:
                    events.get_nowait()
                    dropped[0] += 1
                except asyncio.QueueEmpty:
                    pass
            if dropped[0]:
                event = {**event, "dropped": dropped[0]}
            events.put_nowait(event)

        return lambda event: loop.call_soon_threadsafe(put, event)

    @staticmethod
    async def _send_events(ws, events: asyncio.Queue) -> None:
        try:
            while True:
                await ws.send(json.dumps(await events.get(), default=str))
        except ConnectionClosed:
            pass
