"""A robot the verifier sheds (`overloaded`) backs off and re-opens, and its generation is still the target's own
(issue 51, item 4: a burst of robots starting at once, none fails)."""

from __future__ import annotations

import itertools
import logging
import threading
import time

import pytest

from agent.decoding import DecoderSettings, open_decoder
from agent.decoding.link import ServerError, VerifierLink
from protocol import wire

pytestmark = pytest.mark.real

PROMPT = "Go to the kitchen, then turn left and stop next to the red chair."
MAX_TOKENS = 12
_HOGS = itertools.count()  # each hog a fresh session: its prompt is prefilled, not found in the KV


def _hogs(server_url: str, drafter: object, started: threading.Event) -> threading.Thread:
    """Two other robots opening sessions on long prompts: each prefill holds the target for a pass of about half
    a second. One request a pass in arrival order (fcfs): an open that comes during the first waits, the second
    hog goes before it, and once that pass is over it has waited past the server's max_wait_ms and is shed."""
    ids = drafter.tokenize("The robot walks down the long hall, past the doors, and looks around. " * 8)  # type: ignore[attr-defined]
    sampling = {"temperature": 0.0, "top_k": 0, "seed": 0}
    links = []
    for _ in range(2):  # a connection each: one connection's opens are taken one after the other
        link = VerifierLink(server_url, vocab_hash=drafter.vocab_hash, vocab_size=drafter.vocab_size)  # type: ignore[attr-defined]
        link.connect()
        links.append((link, wire.Open(f"hog-{next(_HOGS)}", ids, sampling, payload={"kind": "none", "k": 0})))

    def run() -> None:
        try:
            for link, msg in links:
                link.send(msg)
                time.sleep(0.05)  # in this order
            started.set()
            for link, msg in links:
                link.recv(msg.sid, timeout_s=120)
        finally:
            for link, _ in links:
                link.close()

    return threading.Thread(target=run, name="hogs", daemon=True)


@pytest.fixture(scope="module")
def shedding_server(target):
    """A real verifier, one request a pass in arrival order, that sheds a request a batch was chosen without
    once it waited more than 100 ms (the default waits 3 s)."""
    from server_bridge.verifier import Verifier
    from tests.conftest import ThreadedServer

    with ThreadedServer(lambda cfg: Verifier(target, cfg), scheduler="fcfs", max_wait_ms=100.0) as server:
        yield server


def _generate_behind_hogs(server: object, drafter: object, settings: DecoderSettings, mode: str = "sd") -> object:
    """generate PROMPT while another robot's long prefills hold the target: its open waits and is shed."""
    dec = open_decoder(settings, drafter)
    try:
        assert dec.connect()  # the handshake is done before the hogs' passes start
        started = threading.Event()
        hogs = _hogs(server.url, drafter, started)  # type: ignore[attr-defined]
        hogs.start()
        started.wait(10)
        time.sleep(0.1)  # both hogs' opens are queued: this open comes after them
        try:
            return dec.generate(drafter.tokenize(PROMPT), mode=mode, max_tokens=MAX_TOKENS)  # type: ignore[attr-defined]
        finally:
            hogs.join(120)
    finally:
        dec.close()


def test_a_shed_open_is_retried_and_the_ids_stay_the_targets(drafter, shedding_server, caplog):
    with caplog.at_level(logging.WARNING, logger="agent.decoding.session"):
        gen = _generate_behind_hogs(shedding_server, drafter, DecoderSettings(verifier=shedding_server.url))
    dec = open_decoder(DecoderSettings(verifier=shedding_server.url), drafter)
    try:  # alone now: the target's own greedy ids
        ar = dec.generate(drafter.tokenize(PROMPT), mode="ar", max_tokens=MAX_TOKENS)
    finally:
        dec.close()
    assert gen.metrics.shed_retries >= 1, "the open was not shed: the hogs' prefills did not hold the target"
    assert "verifier overloaded" in caplog.text and "retry 1/8" in caplog.text
    assert gen.token_ids == ar.token_ids and len(ar.token_ids) == MAX_TOKENS


def test_the_retries_are_bounded_then_the_robot_falls_back(drafter, shedding_server):
    """Past reconnect_attempts sheds in a row (0 here) the generation fails with `overloaded` and hands back what
    was committed: the robot's fallback (the navigator's offline policy) takes over."""
    settings = DecoderSettings(verifier=shedding_server.url, reconnect_attempts=0)
    started = time.perf_counter()
    with pytest.raises(ServerError) as e:
        _generate_behind_hogs(shedding_server, drafter, settings)
    assert e.value.code == "overloaded" and not e.value.recoverable and e.value.token_ids == []
    assert time.perf_counter() - started < 30


def test_a_shed_robot_waits_at_least_the_servers_hint(monkeypatch):
    from agent.decoding.metrics import Metrics
    from agent.decoding.session import Attempt, ReconnectPolicy, Sessions

    waits: list[float] = []
    monkeypatch.setattr("agent.decoding.session.time.sleep", waits.append)
    attempt = Attempt(Sessions(lambda: None, ReconnectPolicy(max_attempts=4)), None, "s1", Metrics())  # type: ignore[arg-type, return-value]
    attempt.recover(ServerError("overloaded", "saturated", "s1"), 0)  # its own backoff: 0.1 s, jittered
    attempt.recover(ServerError("overloaded", "saturated", "s1", retry_after_ms=3000), 0)  # the server's: 3 s
    assert 0.05 <= waits[0] <= 0.15 and 3.0 <= waits[1] <= 4.5
    assert attempt.m.shed_retries == 2
