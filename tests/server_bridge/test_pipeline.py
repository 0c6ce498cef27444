"""Pipelined serving (issue 51, item 3; `pipeline`, on a GPU by default): the next batch waits in the model thread's
queue behind the running one, so the target never waits on the event loop between passes while requests wait; at
most PIPELINE_DEPTH batches are in flight, and what comes after waits its turn. Over the real websocket, on the test
run's shared target."""

import asyncio
import threading
import time

import pytest
from websockets.sync.client import connect

from protocol import wire
from server_bridge.batcher import PIPELINE_DEPTH

pytestmark = pytest.mark.real

GREEDY = {"temperature": 0.0, "top_k": 0, "seed": 0}
PROMPT = [1, 504, 3287, 288]


def _connect(server, target):
    ws = connect(server.url, max_size=None, legacy=True)
    ws.send(wire.encode(wire.Hello("", "test", target.vocab_hash, target.vocab_size)))
    assert isinstance(wire.decode(ws.recv(timeout=10)), wire.Welcome)
    return ws


def _in_loop(server, fn):
    async def call():
        return fn()

    return asyncio.run_coroutine_threadsafe(call(), server.loop).result(10)


def _until(server, fn, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _in_loop(server, fn):
            return True
        time.sleep(0.005)
    return False


def test_the_next_batch_waits_in_the_model_threads_queue_and_no_more(make_server, target):
    s = make_server(exits="", batch_wait_ms=0, pipeline="on")  # auto: on a GPU only
    batcher, scheduler = s.server.batcher, s.server.scheduler
    assert batcher.depth == PIPELINE_DEPTH
    robots = [_connect(s, target) for _ in range(3)]
    unblock = threading.Event()
    try:
        for i, ws in enumerate(robots):
            ws.send(wire.encode(wire.Open(f"p{i}", PROMPT, GREEDY)))
            assert isinstance(wire.decode(ws.recv(timeout=30)), wire.Opened)
        blocker = s.server.model_thread.submit(unblock.wait, 30)  # the model thread busy: a pass running long
        for i, ws in enumerate(robots):
            ws.send(wire.encode(wire.Verify(f"p{i}", 0, len(PROMPT), [], {"kind": "none"})))
            if i < PIPELINE_DEPTH:  # handed to the model thread, behind the running pass, before it ends
                assert _until(s, lambda i=i: len(batcher._inflight) == i + 1 and not scheduler.pending), i
        time.sleep(0.3)
        assert _in_loop(s, lambda: (len(batcher._inflight), [r.sid for r in scheduler.pending])) == (2, ["p2"])
        unblock.set()
        blocker.result(10)
        for ws in robots:
            result = wire.decode(ws.recv(timeout=30))
            assert isinstance(result, wire.Result) and result.n_committed == len(PROMPT) + 1, result
        assert _until(s, lambda: not batcher._inflight and not scheduler._running)  # all answered, none left
    finally:
        unblock.set()
        for ws in robots:
            ws.close()


def test_on_the_cpu_a_batch_is_chosen_when_the_pass_returns(make_server):
    """auto: off where the engine runs on the CPU (the pass and the event loop share the cores there)."""
    assert make_server(exits="").server.batcher.depth == 1
