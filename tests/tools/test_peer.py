"""tools.bench.peer: the HTTP/SSE stream parser on canned bytes, the client against a fake llama-server, and (marked
real) a real llama-server's greedy stream against llama-cpp-python's on the same model.

The real test needs the cached llama-server binary (`make llama-server`); it never builds it.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from server_bridge.ops import loadtest
from tools.bench import peer

pytestmark = pytest.mark.timeout(120)


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def chunked(*parts: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
    b"Keep-Alive: timeout=5, max=100\r\n\r\n"
)
EVENTS = [
    {"content": "Hi", "tokens": [11], "stop": False, "tokens_predicted": 1},
    {"content": " there", "tokens": [22], "stop": False, "tokens_predicted": 2},
    {
        "content": "",
        "tokens": [],
        "stop": True,
        "stop_type": "limit",
        "tokens_predicted": 2,
        "tokens_evaluated": 5,
        "timings": {"predicted_per_token_ms": 9.5, "prompt_ms": 3.0},
    },
]
RESPONSE = HEAD + chunked(sse(EVENTS[0]), b": ping\n\n" + sse(EVENTS[1]), sse(EVENTS[2]))


def test_parser_whole_response():
    p = peer.StreamParser()
    assert p.feed(RESPONSE) == EVENTS
    assert p.done and p.status == 200 and p.keep_alive and not p.sse_done


@pytest.mark.parametrize("step", [1, 2, 3, 7, 64])
def test_parser_any_split(step):
    """Byte by byte or in odd pieces: the same events, each once, in order; done only at the end."""
    p = peer.StreamParser()
    got = []
    for i in range(0, len(RESPONSE), step):
        assert not p.done
        got += p.feed(RESPONSE[i : i + step])
    assert got == EVENTS and p.done


def test_parser_chunk_spanning_events_and_crlf_sse():
    """One chunk holding an event and a half, CRLF line ends, an event over two chunks, [DONE], trailers."""
    a, b = sse({"tokens": [1]}).replace(b"\n", b"\r\n"), sse({"tokens": [2], "stop": True})
    body = HEAD + chunked(a + b[:5], b[5:] + b"data: [DONE]\n\n").replace(b"0\r\n\r\n", b"0\r\nX-T: 1\r\n\r\n")
    p = peer.StreamParser()
    assert p.feed(body) == [{"tokens": [1]}, {"tokens": [2], "stop": True}]
    assert p.done and p.sse_done


def test_parser_content_length_and_close_delimited():
    body = sse({"tokens": [5]})
    p = peer.StreamParser()
    assert p.feed(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body) == [{"tokens": [5]}]
    assert p.done
    q = peer.StreamParser()
    assert q.feed(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + body[:-1]) == []
    assert not q.done and not q.keep_alive
    assert q.feed_eof() == [{"tokens": [5]}] and q.done


def test_parser_error_status_and_error_event():
    err = json.dumps({"error": {"code": 400, "message": "bad"}}).encode()
    p = peer.StreamParser()
    assert p.feed(b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\n\r\n" % len(err) + err) == []
    assert p.done and p.status == 400 and b"bad" in p.error_body
    q = peer.StreamParser()
    assert q.feed(HEAD + chunked(b'event: error\ndata: {"message": "x"}\n\n')) == [{"error": {"message": "x"}}]


# --------------------------------------------------------------------------- the client against a fake server


async def fake_server(responses: list[bytes], requests: list[dict], pause_s: float = 0.02):
    """Answers each request on a connection with the next canned response, a chunk at a time."""

    async def handle(reader, writer):
        for resp in responses:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int([h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")][0].split(b":")[1])
            requests.append(json.loads(await reader.readexactly(length)))
            for i in range(0, len(resp), 40):
                writer.write(resp[i : i + 40])
                await writer.drain()
                await asyncio.sleep(pause_s)
        writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


@pytest.mark.parametrize("keep_alive", [False, True])
def test_client_streams_tokens_with_monotonic_times(keep_alive):
    """Default: a connection per completion with `Connection: close`; keep_alive=True reuses one."""
    requests: list[dict] = []

    async def main():
        server = await fake_server([RESPONSE, RESPONSE] if keep_alive else [RESPONSE], requests)
        port = server.sockets[0].getsockname()[1]
        seen = []
        async with peer.PeerConnection("127.0.0.1", port, keep_alive=keep_alive) as conn:
            r1 = await peer.stream_completion("", [1, 2, 3], 2, conn=conn, on_token=lambda t, now: seen.append(t))
            writer = conn.writer
            r2 = await conn.completion([4, 5], 2)
            assert (conn.writer is writer and writer is not None) if keep_alive else conn.writer is None
        server.close()
        return r1, r2, seen

    r1, r2, seen = asyncio.run(main())
    assert seen == [11, 22]
    for r in (r1, r2):
        assert r.ids == [11, 22]
        assert r.t_tokens == sorted(r.t_tokens) and r.t_first == r.t_tokens[0] > 0
        assert r.wall_s == r.t_tokens[-1] and r.tokens_per_s == pytest.approx(2 / r.wall_s)
        assert r.n_predicted == 2 and r.n_prompt == 5 and r.stop_type == "limit"
        assert r.timings["predicted_per_token_ms"] == 9.5
    assert len(requests) == 2 and requests[0] == peer.completion_body([1, 2, 3], 2)
    assert requests[0]["stream"] and requests[0]["return_tokens"] and requests[0]["temperature"] == 0.0
    assert requests[0]["cache_prompt"] and requests[0]["n_probs"] == 0


def test_client_raises_on_error_and_on_a_cut_stream():
    err = json.dumps({"error": {"message": "no"}}).encode()
    bad = b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: %d\r\n\r\n" % len(err) + err
    cut = RESPONSE[: len(RESPONSE) // 2]

    async def main(resp):
        server = await fake_server([resp], [])
        port = server.sockets[0].getsockname()[1]
        try:
            return await peer.stream_completion(f"http://127.0.0.1:{port}", [1], 2, timeout_s=5)
        finally:
            server.close()

    with pytest.raises(peer.PeerError, match="HTTP 500"):
        asyncio.run(main(bad))
    with pytest.raises(ConnectionError):
        asyncio.run(main(cut))


def test_doubling_grid_and_server_command(tmp_path):
    tried = []
    run = lambda n: tried.append(n) or {"8": True}  # noqa: E731  every N holds: N doubles up to max_n
    caps = loadtest.capacity_search(run, ["8"], max_n=20)
    assert tried == [1, 2, 4, 8, 16, 20] and caps["8"]["capacity"] == 20 and caps["8"]["lower_bound"]
    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\necho '--no-webui --cache-ram'\n")
    fake.chmod(0o755)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"")
    peer.server_help.cache_clear()
    srv = peer.LlamaServer(model, parallel=4, threads=1, ctx_per_slot=256, core=1, binary=fake)
    cmd = srv.command()
    if cmd[0] == "taskset":
        assert cmd[:3] == ["taskset", "-c", "1"]
        cmd = cmd[3:]
    assert cmd[cmd.index("-np") + 1] == "4" and cmd[cmd.index("-c") + 1] == "1024"
    assert "-cb" in cmd and "--no-webui" in cmd and "--no-ui" not in cmd and cmd[cmd.index("--cache-ram") + 1] == "0"
    with pytest.raises(FileNotFoundError, match="make llama-server"):
        peer.LlamaServer(model, binary=tmp_path / "missing").command()


# --------------------------------------------------------------------------- a real llama-server


def _real_model():
    from protocol import modelfiles

    return peer.default_model() or modelfiles.shipped_gguf()


@pytest.mark.real
def test_real_llama_server_greedy_stream_equals_llama_cpp_python():
    binary = peer.find_llama_server()
    if binary is None:
        pytest.skip(f"llama-server {peer.VERSION} is not built (run `make llama-server`; tests never build it)")
    from llama_cpp import Llama

    model = _real_model()
    prompt = peer.load_prompts(n=1).prompts[0].prompt_ids
    llm = Llama(str(model), n_ctx=512, n_threads=1, n_batch=512, verbose=False, logits_all=False)
    llm.reset()
    want = []
    for tok in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
        want.append(int(tok))
        if len(want) == 16:
            break
    with peer.LlamaServer(model, parallel=1, threads=1, binary=binary) as srv:
        r = asyncio.run(peer.stream_completion(srv.url, prompt, 16, timeout_s=60))
    assert len(r.ids) == 16 and all(0 <= t < llm.n_vocab() for t in r.ids)
    assert r.t_tokens == sorted(r.t_tokens) and r.t_first is not None and r.t_first <= r.wall_s
    assert r.ids == want
