"""The robot daemon's test helpers (a stub draft, a recording sd_notify, the local API on a thread), shared by
the daemon's tests. The Go2 daemon tests themselves (the API's e-stop with the robot's services hung or the
robot gone, the watchdog's pace, reset, the camera, the range finder) run against the simulated Go2 through
the real SDK over DDS: tests/agent/robot/test_go2_dds.py."""

from __future__ import annotations

import asyncio
import json
import tempfile
import threading
import time

import numpy as np

from agent.app import api as local_api
from agent.app.api import LocalApi
from agent.app.sdnotify import Notifier


class StubDrafter:
    """The daemon's draft model, for tests that never plan: tokens are characters."""

    name, vocab_size, vocab_hash, eos_ids, chat_template = "stub", 256, "stub", {0}, None

    def apply_chat_template(self, messages):
        return "\n".join(m["content"] for m in messages)

    def tokenize(self, text, chat=False):
        return [b for b in text.encode()[:200]]

    def detokenize(self, ids, skip=frozenset()):
        return bytes(i for i in ids if i not in skip).decode("utf-8", "replace")

    def next_logits(self, committed):
        return np.zeros(self.vocab_size, np.float32)


class RecordingNotifier(Notifier):
    """sd_notify without systemd: records each message and its time; a 50 ms watchdog interval."""

    def __init__(self):
        super().__init__(env={"WATCHDOG_USEC": "100000"})
        self.sent: list[tuple[float, dict]] = []

    def notify(self, **fields) -> bool:
        self.sent.append((time.monotonic(), fields))
        return True

    def times(self, key):
        return [t for t, f in list(self.sent) if key in f]

    def statuses(self):
        return [f["STATUS"] for _, f in list(self.sent) if "STATUS" in f]


RESET_TOKEN = "reset-token-of-the-tests"  # api.reset_token: a reset over the API carries it


class Api:
    """The local API on its own event loop in a thread, as `edge-agent run` serves it: on a Unix socket in a
    folder of its own (`listen` replaces that), one client connected with `token`."""

    def __init__(self, daemon, listen: str | None = None, token: str = ""):
        self.folder = tempfile.TemporaryDirectory(prefix="api-")
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-api", daemon=True)
        self.thread.start()
        listen = f"unix:{self.folder.name}/api.sock" if listen is None else listen
        self.api = asyncio.run_coroutine_threadsafe(LocalApi(daemon, listen).start(), self.loop).result(10)
        self.ws = self.connect(token)

    def connect(self, token: str = "", **kw):
        return local_api.connect(self.api.address, token, open_timeout=5, **kw).__enter__()

    def call(self, timeout=15.0, **req):
        self.ws.send(json.dumps(req))
        return json.loads(self.ws.recv(timeout=timeout))

    def close(self):
        if self.folder is None:  # closed already
            return
        self.ws.__exit__(None, None, None)
        asyncio.run_coroutine_threadsafe(self.api.close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.folder.cleanup()
        self.folder = None


def wait_for(pred, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.01)
    return False
