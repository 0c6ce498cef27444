"""Behaviour tests for tools.cluster.netem: bytes, timing, ordering, injected failures.

Everything runs on 127.0.0.1 with OS-assigned ports. Timing bounds are
one-sided where physics allows it (a delay can only add time) and loose on
the other side, because CI machines are small and noisy.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import logging
import os
import signal
import socket
import socketserver
import statistics
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Callable, Iterator

import pytest

from tools.cluster.netem import LinkProfile, NetemProxy

pytestmark = pytest.mark.timeout(20)

REPO_ROOT = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------
# Loopback upstream and client helpers
# --------------------------------------------------------------------------


class _EchoHandler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        sock: socket.socket = self.request
        try:
            while data := sock.recv(65536):
                sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)  # propagate the half-close back
        except OSError:
            pass


class EchoServer(socketserver.ThreadingTCPServer):
    """Threaded echo server on 127.0.0.1, OS-assigned port."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _EchoHandler)
        self.thread = threading.Thread(target=self.serve_forever, args=(0.02,), name="echo", daemon=True)
        self.thread.start()

    @property
    def port(self) -> int:
        return self.server_address[1]

    def close(self) -> None:
        if self.thread.is_alive():
            self.shutdown()
            self.server_close()


@pytest.fixture
def echo() -> Iterator[EchoServer]:
    server = EchoServer()
    yield server
    server.close()


@pytest.fixture
def make_proxy(echo: EchoServer) -> Iterator[Callable[..., NetemProxy]]:
    proxies: list[NetemProxy] = []

    def make(**kwargs) -> NetemProxy:
        proxy = NetemProxy("127.0.0.1", echo.port, **kwargs).start()
        proxies.append(proxy)
        return proxy

    yield make
    for proxy in proxies:
        proxy.stop()


def connect(proxy: NetemProxy, timeout: float = 5.0) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(65536, n - len(buf)))
        if not chunk:
            raise EOFError(f"EOF after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def round_trip_s(sock: socket.socket, payload: bytes = b"ping-pong-16byte") -> float:
    start = time.perf_counter()
    sock.sendall(payload)
    assert recv_exact(sock, len(payload)) == payload
    return time.perf_counter() - start


def echo_bulk(sock: socket.socket, payload: bytes) -> bytes:
    """Send ``payload`` from a thread while reading the echo (no deadlock)."""
    sender = threading.Thread(target=sock.sendall, args=(payload,), daemon=True)
    sender.start()
    received = recv_exact(sock, len(payload))
    sender.join(5)
    return received


def wait_until_dropped(sock: socket.socket, timeout: float = 5.0) -> int:
    """Read until the connection ends; returns bytes read. Fails on timeout."""
    sock.settimeout(timeout)
    total = 0
    try:
        while chunk := sock.recv(65536):
            total += len(chunk)
    except (ConnectionResetError, BrokenPipeError):
        pass
    return total


def assert_closed_on_arrival(proxy: NetemProxy) -> None:
    """A refused connection is reset during connect() or right after it."""
    start = time.perf_counter()
    try:
        sock = connect(proxy)
    except ConnectionResetError:
        return
    with sock:
        assert wait_until_dropped(sock) == 0
    assert time.perf_counter() - start < 1.0


def wait_for(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


# --------------------------------------------------------------------------
# 1. Transparency
# --------------------------------------------------------------------------


@pytest.mark.parametrize("profile", [LinkProfile(), LinkProfile(2, 1, 400)], ids=["unshaped", "shaped"])
def test_bytes_pass_unchanged_both_directions(make_proxy, profile):
    proxy = make_proxy(profile=profile)
    payload = os.urandom(2**20)
    with connect(proxy) as sock:
        received = echo_bulk(sock, payload)
    assert hashlib.sha256(received).digest() == hashlib.sha256(payload).digest()
    stats = proxy.stats()
    assert stats["bytes_up"] == stats["bytes_down"] == len(payload)


def test_half_close_propagates_and_closes_both_sides(make_proxy):
    proxy = make_proxy(profile=LinkProfile(one_way_delay_ms=5))
    with connect(proxy) as sock:
        sock.sendall(b"last words")
        sock.shutdown(socket.SHUT_WR)  # client EOF -> server EOF -> client EOF
        assert wait_until_dropped(sock) == len(b"last words")
    wait_for(lambda: proxy.stats()["connections_open"] == 0)


# --------------------------------------------------------------------------
# 2-4. Timing: delay, bandwidth, jitter ordering
# --------------------------------------------------------------------------


def test_delay_adds_round_trip_and_set_profile_applies(make_proxy):
    proxy = make_proxy()
    with connect(proxy) as sock:
        round_trip_s(sock)  # warm-up: upstream connect
        fast = [round_trip_s(sock) for _ in range(5)]
        assert statistics.median(fast) < 0.030

        proxy.set_profile(LinkProfile(one_way_delay_ms=30))
        slow = [round_trip_s(sock) for _ in range(5)]
    assert min(slow) >= 0.0595  # 2 x 30 ms; a delay only adds
    assert statistics.median(slow) < 0.060 + 0.080


def test_bandwidth_limits_throughput(make_proxy):
    payload = os.urandom(200_000)  # 1.6 Mbit
    limited = make_proxy(profile=LinkProfile(bandwidth_mbps=8))
    unlimited = make_proxy()

    def timed_echo(proxy: NetemProxy) -> float:
        with connect(proxy) as sock:
            round_trip_s(sock)
            start = time.perf_counter()
            assert echo_bulk(sock, payload) == payload
            return time.perf_counter() - start

    slow, fast = timed_echo(limited), timed_echo(unlimited)
    assert slow >= 0.19  # 1.6 Mbit / 8 Mbit/s = 0.2 s
    assert slow < 1.5
    assert fast < slow / 3


def test_jitter_never_reorders(make_proxy):
    proxy = make_proxy(profile=LinkProfile(one_way_delay_ms=10, jitter_ms=5), seed=1)
    count, width = 500, 8
    with connect(proxy) as sock:

        def send_numbered() -> None:
            for i in range(count):
                sock.sendall(b"%07d\n" % i)
                time.sleep(0.0005)  # separate chunks, closer than the jitter

        sender = threading.Thread(target=send_numbered, daemon=True)
        sender.start()
        data = recv_exact(sock, count * width)
        sender.join(5)
    assert [int(x) for x in data.split()] == list(range(count))
    # Many chunks each drew their own jitter, so reordering would have shown.
    assert proxy.stats()["chunks_up"] >= 50


# --------------------------------------------------------------------------
# 5-7. Injected failures
# --------------------------------------------------------------------------


def test_disconnect_all_drops_open_connections_and_accepts_new(make_proxy):
    proxy = make_proxy()
    with connect(proxy) as first, connect(proxy) as second:
        round_trip_s(first)
        round_trip_s(second)
        assert proxy.disconnect_all() == 2
        assert wait_until_dropped(first) == 0
        assert wait_until_dropped(second) == 0
    assert proxy.stats()["disconnects_injected"] == 2
    with connect(proxy) as sock:
        round_trip_s(sock)


def test_refuse_new_closes_new_connections_only(make_proxy):
    proxy = make_proxy()
    with connect(proxy) as existing:
        round_trip_s(existing)
        proxy.refuse_new(True)
        assert_closed_on_arrival(proxy)
        round_trip_s(existing)  # already-open traffic is unaffected
        proxy.refuse_new(False)
        with connect(proxy) as sock:
            round_trip_s(sock)
    wait_for(lambda: proxy.stats()["connections_refused"] == 1)


def test_schedule_disconnect_after_bytes_fires_once(make_proxy):
    proxy = make_proxy()
    limit = 10_000
    proxy.schedule_disconnect(after_bytes_down=limit)
    with connect(proxy) as sock:

        def offer_40kb() -> None:
            with contextlib.suppress(OSError):
                for _ in range(10):
                    sock.sendall(b"x" * 4000)
                    time.sleep(0.002)

        sender = threading.Thread(target=offer_40kb, daemon=True)
        sender.start()
        received = wait_until_dropped(sock)
        sender.join(5)
    assert proxy.stats()["bytes_down"] == limit  # the chunk is cut at the limit
    assert limit - 4000 <= received <= limit
    assert proxy.stats()["disconnects_injected"] == 1
    with connect(proxy) as sock:  # one-shot: later traffic flows
        payload = os.urandom(3 * limit)
        assert echo_bulk(sock, payload) == payload
    assert proxy.stats()["disconnects_injected"] == 1


def test_schedule_disconnect_after_seconds(make_proxy):
    proxy = make_proxy()
    with connect(proxy) as sock:
        round_trip_s(sock)
        start = time.perf_counter()
        proxy.schedule_disconnect(after_s=0.2)
        assert wait_until_dropped(sock) == 0
        elapsed = time.perf_counter() - start
    assert 0.19 <= elapsed < 2.0
    assert proxy.stats()["disconnects_injected"] == 1


def test_drop_prob_kills_connection_on_a_chunk(make_proxy):
    proxy = make_proxy(drop_prob=1.0)
    with connect(proxy) as sock:
        sock.sendall(b"hello")
        assert wait_until_dropped(sock) == 0
    assert proxy.stats()["disconnects_injected"] == 1
    proxy.set_drop_prob(0.0)
    with connect(proxy) as sock:
        round_trip_s(sock)


def test_upstream_down_closes_client(echo):
    dead_port = echo.port
    echo.close()  # nothing listens there any more
    with NetemProxy("127.0.0.1", dead_port) as proxy:
        assert_closed_on_arrival(proxy)
        wait_for(lambda: proxy.stats()["connections_refused"] == 1)


# --------------------------------------------------------------------------
# 8. Validation
# --------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["one_way_delay_ms", "jitter_ms", "bandwidth_mbps"])
@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), "10"])
def test_link_profile_rejects_bad_values(field, bad):
    with pytest.raises(ValueError, match=field):
        LinkProfile(**{field: bad})


def test_link_profile_from_rtt():
    assert LinkProfile.from_rtt(50, 5, 20) == LinkProfile(25, 5, 20)
    for bad in (-1, float("nan")):
        with pytest.raises(ValueError, match="rtt_ms"):
            LinkProfile.from_rtt(bad)


def test_proxy_rejects_bad_controls(make_proxy):
    proxy = make_proxy()
    with pytest.raises(ValueError):
        proxy.set_drop_prob(1.5)
    with pytest.raises(ValueError):
        proxy.schedule_disconnect()
    with pytest.raises(ValueError):
        proxy.schedule_disconnect(after_bytes_down=-1)
    with pytest.raises(ValueError):
        NetemProxy("127.0.0.1", 1, max_buffered_bytes=0)


# --------------------------------------------------------------------------
# 9. Stats, backpressure, lifecycle
# --------------------------------------------------------------------------


def test_stats_count_connections_and_bytes(make_proxy):
    proxy = make_proxy()
    assert proxy.address == f"127.0.0.1:{proxy.port}"
    assert proxy.url("ws") == f"ws://127.0.0.1:{proxy.port}"
    with connect(proxy) as a, connect(proxy) as b:
        echo_bulk(a, b"a" * 1000)
        echo_bulk(b, b"b" * 2345)
        stats = proxy.stats()
        assert stats["connections_total"] == 2
        assert stats["connections_open"] == 2
    wait_for(lambda: proxy.stats()["connections_open"] == 0)
    stats = proxy.stats()
    assert stats["bytes_up"] == stats["bytes_down"] == 3345
    assert stats["disconnects_injected"] == 0


def test_backpressure_bounds_buffering(make_proxy):
    """A client that writes but never reads must end up blocked by TCP, with
    the proxy holding at most ``max_buffered_bytes`` per direction. Kernel
    socket buffers (autotuned, tens of MB) absorb the rest, so the amount
    sent before the stall is not asserted, only that the stall happens."""
    cap = 256 * 1024
    proxy = make_proxy(max_buffered_bytes=cap)
    block = b"z" * 256 * 1024
    with connect(proxy, timeout=0.5) as sock:  # never reads: the echo path fills up
        with pytest.raises(socket.timeout):
            for _ in range(2048):  # offer up to 512 MB
                sock.sendall(block)
    assert cap // 2 < proxy.stats()["buffered_bytes_peak"] <= cap  # filled up, then held


def test_stop_is_clean_with_traffic_in_flight(echo, caplog):
    caplog.set_level(logging.WARNING, logger="asyncio")
    gc.collect()  # earlier tests' garbage is not this test's to report
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        proxy = NetemProxy("127.0.0.1", echo.port, LinkProfile(one_way_delay_ms=200)).start()
        socks = [connect(proxy) for _ in range(3)]
        for sock in socks:
            sock.sendall(b"still on the wire")
        time.sleep(0.05)
        proxy.stop()
        assert not any(t.name.startswith("netem-proxy") for t in threading.enumerate())
        for sock in socks:
            assert wait_until_dropped(sock) == 0
            sock.close()
        gc.collect()
    assert [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)] == []
    assert [r.getMessage() for r in caplog.records if r.name == "asyncio"] == []


def test_cli_prints_address_proxies_and_stops_on_sigint(echo):
    cmd = [
        sys.executable,
        "-m",
        "tools.cluster.netem",
        "--listen",
        "127.0.0.1:0",
        "--upstream",
        f"127.0.0.1:{echo.port}",
        "--rtt-ms",
        "20",
        "--seed",
        "3",
    ]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        host, port = proc.stdout.readline().strip().rsplit(":", 1)
        assert host == "127.0.0.1"
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            assert round_trip_s(sock) >= 0.0195
        time.sleep(0.1)  # let the close line be logged
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
    assert proc.returncode == 0
    assert "open" in err and "closed" in err


def test_websocket_session_through_proxy():
    ws_server = pytest.importorskip("websockets.sync.server")
    ws_client = pytest.importorskip("websockets.sync.client")
    ws_exceptions = pytest.importorskip("websockets.exceptions")

    def handler(conn) -> None:
        for message in conn:
            conn.send(message)

    with ws_server.serve(handler, "127.0.0.1", 0) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        ws_port = server.socket.getsockname()[1]
        with NetemProxy("127.0.0.1", ws_port, LinkProfile.from_rtt(40, jitter_ms=2)) as proxy:
            with ws_client.connect(proxy.url("ws"), proxy=None, open_timeout=5) as ws:
                start = time.perf_counter()
                ws.send("draft tokens")
                assert ws.recv(timeout=5) == "draft tokens"
                assert time.perf_counter() - start >= 0.038
            with ws_client.connect(proxy.url("ws"), proxy=None, open_timeout=5) as ws:
                proxy.disconnect_all()
                with pytest.raises(ws_exceptions.ConnectionClosed):
                    ws.recv(timeout=5)
