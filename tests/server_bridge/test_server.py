"""The websocket server: bad input gets a clear error on its own connection; everyone else keeps going."""

import json
import urllib.request

import msgpack
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from websockets.sync.client import connect

from agent.decoding import DecoderSettings, open_decoder
from agent.decoding.link import LinkLost, ServerError, VerifierLink
from protocol import images, wire
from server_bridge.ops.loadtest import parse_metrics

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def server(target):
    from server_bridge.verifier import Verifier
    from tests.conftest import ThreadedServer

    with ThreadedServer(lambda cfg: Verifier(target, cfg), max_frame_bytes=256 * 1024) as s:
        yield s


@pytest.fixture(scope="module")
def exit_server(torch_target):
    """Early exits run on the torch engine."""
    from server_bridge.verifier import Verifier
    from tests.conftest import ThreadedServer

    with ThreadedServer(lambda cfg: Verifier(torch_target, cfg), max_frame_bytes=256 * 1024) as s:
        yield s


def _hello(target, **over):
    h = wire.Hello(token="", client="test", draft_vocab_hash=target.vocab_hash, vocab_size=target.vocab_size)
    for k, v in over.items():
        setattr(h, k, v)
    return wire.encode(h)


def _raw(server, target):
    ws = connect(server.url, max_size=None, legacy=True)  # held across many calls; closed by the test
    ws.send(_hello(target))
    assert wire.decode(ws.recv(timeout=10)).TYPE == "welcome"
    return ws


def _error(ws) -> wire.Error:
    msg = wire.decode(ws.recv(timeout=30))
    assert isinstance(msg, wire.Error), msg
    assert msg.message  # a sentence for the robot's log, not just a code
    return msg


def _open(ws, sid, ids):
    ws.send(wire.encode(wire.Open(sid, ids, {"temperature": 0.0, "top_k": 0, "seed": 0})))
    return wire.decode(ws.recv(timeout=30))


def test_bad_input_gets_errors_and_another_session_keeps_generating(server, target, drafter):
    ids = drafter.tokenize("Walk to the door and stop.", chat=True)
    good = open_decoder(DecoderSettings(verifier=server.url), drafter)
    reference = good.generate(ids, mode="sd", max_tokens=12).token_ids  # a session that must not notice

    bad = _raw(server, target)
    cases = [
        (b"\x93\x01garbage\xc1", "bad_frame"),
        (msgpack.packb({"type": "verify", "v": 1, "sid": "x", "round": "one"}), "bad_field"),
        (msgpack.packb({"type": "open", "v": 1, "sid": "x", "prompt_ids": [1, 2], "sampling": {}}), "bad_field"),
        (b"\x00" * (300 * 1024), "too_large"),
        (wire.encode(wire.Verify("nobody", 0, 3, [1, 2], {"kind": "none"})), "unknown_session"),
        (wire.encode(wire.Open("big", [target.vocab_size + 5], {"temperature": 0.0})), "bad_field"),
        (wire.encode(wire.Open("long", [5] * 2048, {"temperature": 0.0})), "context_full"),
        (
            msgpack.packb(
                {
                    "type": "open",
                    "v": 1,
                    "sid": "gif",
                    "prompt_ids": [1, 2],
                    "sampling": {"temperature": 0.0},
                    "images": [{"at": 0, "data": b"GIF89a....."}],
                }
            ),
            "bad_image",
        ),
        (
            wire.encode(
                wire.Open(
                    "seeing",
                    [1, 2],
                    {"temperature": 0.0},
                    images=[
                        images.PromptImage.of(
                            b"\xff\xd8\xff\xc0\x00\x08\x08\x00\x40\x00\x40\x00\xff\xda" + b"\0" * 64, 0
                        )
                    ],
                )
            ),
            "no_vision",
        ),
    ]
    for frame, code in cases:
        bad.send(frame)
        assert _error(bad).code == code
        # after every bad frame the good robot still gets the exact answer
    assert good.generate(ids, mode="sd", max_tokens=12).token_ids == reference

    # the bad connection itself still works for well-formed requests
    assert _open(bad, "fine", ids).TYPE == "opened"
    bad.send(wire.encode(wire.Verify("fine", 0, len(ids) + 9, [1], {"kind": "none"})))
    assert _error(bad).code == "desync"
    q = np.zeros((1, target.vocab_size), np.float16)
    q[0, 0] = np.nan
    _open(bad, "hot", ids)
    bad.send(wire.encode(wire.Open("hot", ids, {"temperature": 1.0, "top_k": 0, "seed": 0})))
    wire.decode(bad.recv(timeout=30))
    bad.send(wire.encode(wire.Verify("hot", 0, len(ids), [5], {"kind": "full", "probs": q})))
    assert _error(bad).code == "bad_probs"
    bad.send(wire.encode(wire.Verify("hot", 0, len(ids), [5], {"kind": "none"})))
    assert _error(bad).code == "bad_field"  # sampling needs q
    bad.close()
    assert good.generate(ids, mode="ar", max_tokens=12).token_ids == reference
    good.close()


def _topk_q(ids, probs):
    return {"kind": "topk", "ids": np.array(ids, np.int32), "probs": np.array(probs, np.float16)}


def test_malformed_payloads_are_refused_and_the_session_survives(server, target, drafter):
    """Each bad payload gets a clear error; the same session then verifies a good round as if nothing happened."""
    ids = drafter.tokenize("Walk to the door and stop.", chat=True)
    sampled = {"temperature": 1.0, "top_k": 0, "seed": 4}
    ws = _raw(server, target)
    ws.send(wire.encode(wire.Open("tk", ids, sampled, payload={"kind": "topk", "k": 2})))
    assert wire.decode(ws.recv(timeout=30)).TYPE == "opened"
    vocab = target.vocab_size
    cases = [
        (_topk_q([[5, 6, 7]], [[0.5, 0.25, 0.25]]), "bad_probs", "K=3"),  # wrong K
        (_topk_q([[5, vocab + 3]], [[0.5, 0.5]]), "bad_probs", "vocabulary"),  # id outside V
        (_topk_q([[5, 6]], [[1.5, -0.5]]), "bad_probs", "negative"),
        (_topk_q([[5, 6]], [[np.nan, 0.5]]), "bad_probs", "NaN"),
        (_topk_q([[5, 6]], [[0.75, 0.75]]), "bad_probs", "sums to 1.5"),
        (_topk_q([[6, 7]], [[0.5, 0.5]]), "bad_probs", "zero probability"),  # 5 is not among its K
        ({"kind": "full", "probs": np.full((1, vocab), 1 / vocab, np.float16)}, "bad_field", "declared"),
        ({"kind": "split", "px": np.array([9])}, "bad_field", "declared"),
    ]
    for q, code, words in cases:
        ws.send(wire.encode(wire.Verify("tk", 0, len(ids), [5], q)))
        err = _error(ws)
        assert (err.code, err.sid) == (code, "tk") and words in err.message, err
    ws.send(wire.encode(wire.Verify("tk", 0, len(ids), [5], _topk_q([[5, 6]], [[0.5, 0.5]]))))
    ok = wire.decode(ws.recv(timeout=30))
    assert isinstance(ok, wire.Result) and ok.n_committed == len(ids) + ok.accepted + 1

    # split: q(x) out of range, and the correction after a rejection is owed before anything else
    ws.send(wire.encode(wire.Open("sp", ids, sampled, payload={"kind": "split", "k": 0})))
    assert wire.decode(ws.recv(timeout=30)).TYPE == "opened"
    ws.send(wire.encode(wire.Verify("sp", 0, len(ids), [5], {"kind": "split", "px": np.array([0])})))
    assert _error(ws).code == "bad_probs"
    ws.send(wire.encode(wire.Verify("sp", 0, len(ids), [5], {"kind": "split", "px": np.array([1])}, fix=3)))
    assert "no split rejection" in _error(ws).message
    # q(x) = 1.0 for a token the target finds unlikely: rejected (p/q < 1), so p_j comes down
    unlikely = int(np.argsort(target.score(target.new_state(ids), [])[0])[vocab // 2])
    ws.send(wire.encode(wire.Verify("sp", 0, len(ids), [unlikely], {"kind": "split", "px": np.array([1 << 23])})))
    res = wire.decode(ws.recv(timeout=30))
    assert (res.accepted, res.token, res.n_committed) == (0, -1, len(ids))
    assert res.residual["ids"] is None and len(res.residual["logits"]) == vocab  # no top_k: dense p_j
    ws.send(wire.encode(wire.Verify("sp", 1, len(ids) + 1, [], {"kind": "split", "px": np.zeros(0)})))
    assert "correction" in _error(ws).message  # fix missing
    ws.send(wire.encode(wire.Verify("sp", 1, len(ids) + 1, [], {"kind": "split", "px": np.zeros(0)}, fix=vocab + 1)))
    assert _error(ws).code == "bad_field"
    ws.send(wire.encode(wire.Verify("sp", 1, len(ids) + 1, [], {"kind": "split", "px": np.zeros(0)}, fix=7)))
    done = wire.decode(ws.recv(timeout=30))
    assert isinstance(done, wire.Result) and done.n_committed == len(ids) + 2  # the fix, then one token
    ws.close()


def test_vocabulary_mismatch_is_refused_at_the_handshake(server, target):
    link = VerifierLink(server.url, vocab_hash="f" * 64, vocab_size=target.vocab_size)
    with pytest.raises(ServerError) as e:
        link.connect()
    assert e.value.code == "vocab_mismatch" and "identical tokenizers" in e.value.message
    link = VerifierLink(server.url, vocab_hash=target.vocab_hash, vocab_size=32000)
    with pytest.raises(ServerError) as e:
        link.connect()
    assert e.value.code == "vocab_mismatch"


def test_first_message_must_be_hello(server, target):
    with connect(server.url) as ws:
        ws.send(wire.encode(wire.Open.make_dummy()))
        assert _error(ws).code == "not_authenticated"


def test_token_is_checked(make_server, target):
    s = make_server(token="s3cret")
    for token, ok in (("wrong", False), ("", False), ("s3cret", True)):
        link = VerifierLink(s.url, token=token, vocab_hash=target.vocab_hash, vocab_size=target.vocab_size)
        if ok:
            assert link.connect().target == target.name
        else:
            with pytest.raises(ServerError) as e:
                link.connect()
            assert e.value.code == "bad_token"
        link.close()


def test_healthz_and_metrics(server, target, drafter):
    health = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{server.port}/healthz", timeout=5).read())
    assert health["status"] == "ok" and health["target"] == target.name
    assert (health["engine"], health["device"], health["dtype"]) == ("llamacpp", "cpu", "float32")
    dec = open_decoder(DecoderSettings(verifier=server.url), drafter)
    dec.generate(drafter.tokenize("Say hi."), mode="sd", max_tokens=6)
    dec.close()
    resp = urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5)
    assert resp.headers.get_all("Content-Type") == ["text/plain; version=0.0.4; charset=utf-8"]
    text = resp.read().decode()
    values = parse_metrics(text)  # name{labels} -> value, less the replica label
    assert values["bridge_rounds_total"] >= 1
    assert values["bridge_committed_tokens_total"] >= 6
    assert 0 <= values["bridge_acceptance_rate"] <= 1
    assert "# TYPE bridge_rounds_total counter" in text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    [info] = families["bridge_engine_info"].samples
    assert (info.labels["engine"], info.labels["device"], info.labels["dtype"]) == ("llamacpp", "cpu", "float32")
    assert 0 < values["bridge_kv_tokens_used"] <= values["bridge_kv_tokens_capacity"]
    # every sample names the replica (HOST:PORT without --replica-id), as /healthz does
    samples = [s for f in families.values() for s in f.samples]
    assert samples and {s.labels["replica"] for s in samples} == {health["replica"]}
    assert values["bridge_draining"] == 0


def test_reopen_keeps_the_kv_of_the_shared_prefix(server, target, drafter):
    """A re-open with a longer committed prefix forwards only the new tokens, in its own pass (the robot's draft
    prefills its copy meanwhile); a re-open that adds nothing forwards nothing."""
    ids = drafter.tokenize("Turn right and walk forward.", chat=True)
    ws = _raw(server, target)
    first = _open(ws, "re", ids)
    assert first.timing["passes"] == 1  # prefill
    again = _open(ws, "re", ids + [260, 9902])
    assert again.timing["passes"] == 1 and again.n_committed == len(ids) + 2  # the two new tokens' prefill
    same = _open(ws, "re", ids + [260, 9902])
    assert same.timing["passes"] == 0 and same.n_committed == len(ids) + 2
    ws.send(wire.encode(wire.Verify("re", 0, len(ids) + 2, [], {"kind": "none"})))
    assert wire.decode(ws.recv(timeout=30)).n_committed == len(ids) + 3
    ws.close()


def test_a_late_error_for_another_session_is_not_taken_as_the_reply(server, target, drafter):
    link = VerifierLink(server.url, vocab_hash=target.vocab_hash, vocab_size=target.vocab_size)
    link.connect()
    link.send(wire.Verify("finished", 0, 3, [1], {"kind": "none"}))  # answered by error{unknown_session}
    ids = drafter.tokenize("Stop.")
    reply, _ = link.request(wire.Open("current", ids, {"temperature": 0.0, "top_k": 0, "seed": 0}))
    assert isinstance(reply, wire.Opened) and reply.sid == "current"
    assert link.stale == 1
    link.send(wire.Close("current"))
    link.send(wire.Close("current"))  # closing twice draws no error
    reply, _ = link.request(wire.Open("next", ids, {"temperature": 0.0, "top_k": 0, "seed": 0}))
    assert reply.sid == "next" and link.stale == 1
    link.close()


def test_connection_limit_and_draft_length_limit(make_server, target, drafter):
    s = make_server(max_connections=1, max_draft_len=2)
    first = VerifierLink(s.url, vocab_hash=target.vocab_hash, vocab_size=target.vocab_size)
    first.connect()
    second = VerifierLink(s.url, vocab_hash=target.vocab_hash, vocab_size=target.vocab_size)
    with pytest.raises(LinkLost, match="503 too many connections"):  # transient: back off and retry
        second.connect()
    first.close()
    # the robot clamps its draft to the server's advertised max_draft_len instead of failing
    dec = open_decoder(DecoderSettings(verifier=s.url), drafter)
    gen = dec.generate(drafter.tokenize("Turn left."), mode="sd", gamma=6, max_tokens=8)
    dec.close()
    assert gen.metrics.drafted <= 2 * gen.metrics.rounds and len(gen.token_ids) >= 1


def test_without_a_token_only_loopback_peers_get_the_upgrade(server):
    """The gate in process_request, driven with a stand-in for websockets' connection object."""
    from http import HTTPStatus
    from types import SimpleNamespace

    class Peer:
        def __init__(self, addr):
            self.remote_address = addr

        def respond(self, status, text):
            return SimpleNamespace(status=status, text=text)

    request = SimpleNamespace(path="/")
    far = server.server.admission.process_request(Peer(("10.1.2.3", 5555)), request)
    assert far.status == HTTPStatus.FORBIDDEN and "loopback clients only" in far.text
    assert server.server.admission.process_request(Peer(("127.0.0.1", 5555)), request) is None  # upgrade goes on


GREEDY = {"temperature": 0.0, "top_k": 0, "seed": 0}


def _until_result(ws) -> list[wire.Message]:
    got = []
    while not got or not isinstance(got[-1], (wire.Result, wire.Error)):
        got.append(wire.decode(ws.recv(timeout=30)))
    return got


def test_welcome_lists_the_exits_and_an_unknown_exit_is_refused_without_harm(exit_server, torch_target):
    with connect(exit_server.url, max_size=None) as ws:
        ws.send(_hello(torch_target))
        assert wire.decode(ws.recv(timeout=10)).exits == [12, 18, 22, 26]
        ids = torch_target.tokenizer.encode("Walk to the door.")
        ws.send(wire.encode(wire.Open("e", ids, GREEDY, exits=[12, 99])))
        error = _error(ws)
        assert error.code == "bad_field" and "99" in error.message
        assert _open(ws, "e", ids).TYPE == "opened"  # the connection keeps working


def test_exit_messages_stream_before_their_result(exit_server, torch_target):
    """The torch_target's own continuation as drafts (fetched with `ar`), its true tokens among the candidates."""
    ws = _raw(exit_server, torch_target)
    ids = torch_target.tokenizer.encode("The robot walked to the kitchen door, stopped, and")
    _open(ws, "ref", ids)
    ws.send(wire.encode(wire.Ar("ref", 16)))
    ref = [wire.decode(ws.recv(timeout=30)).token for _ in range(16)]
    rng = np.random.default_rng(0)

    ws.send(wire.encode(wire.Open("fsd", ids, GREEDY, exits=[12, 18, 22, 26])))
    assert wire.decode(ws.recv(timeout=30)).TYPE == "opened"
    committed = list(ids)
    for r in range(3):
        done = len(committed) - len(ids)
        draft = ref[done : done + 4]
        if r == 1:
            draft[2] = 5  # a rejection in the middle
        cands = rng.integers(0, torch_target.vocab_size, (4, 8)).astype(np.int32)
        cands[:, 3] = ref[done : done + 4]
        ws.send(wire.encode(wire.Verify("fsd", r, len(committed), draft, {"kind": "none"}, cands=cands)))
        *exits, result = _until_result(ws)
        assert isinstance(result, wire.Result), result
        assert exits, "no exit overtook the pass"
        assert all(isinstance(m, wire.Exit) and (m.sid, m.round) == ("fsd", r) for m in exits)
        assert sorted(m.layer for m in exits) == sorted({m.layer for m in exits})
        assert result.timing["exit_layer"] in (12, 18, 22, 26, 30) and result.timing["exit_ms"] > 0
        committed += draft[: result.accepted] + [result.token]
        assert committed == ids + ref[: len(committed) - len(ids)]  # exact, exits or not
    # the same connection without exits: the result is the only answer
    _open(ws, "plain", ids)
    ws.send(wire.encode(wire.Verify("plain", 0, len(ids), ref[:4], {"kind": "none"}, cands=cands)))
    [result] = _until_result(ws)
    assert result.accepted == 4 and "exit_layer" not in result.timing
    ws.close()
    text = urllib.request.urlopen(f"http://127.0.0.1:{exit_server.port}/metrics", timeout=5).read().decode()
    values = parse_metrics(text)
    assert values["bridge_exits_sent_total"] >= 3 and values["bridge_exit_seconds_total"] > 0
    assert "bridge_exits_dropped_total" in values and 12 <= values["bridge_avg_exit_layer"] <= 30


def test_a_server_without_exits_says_so(make_server, target):
    s = make_server(exits="")
    link = VerifierLink(s.url, vocab_hash=target.vocab_hash, vocab_size=target.vocab_size)
    assert link.connect().exits == []
    with pytest.raises(ServerError) as e:
        link.request(wire.Open("x", [1, 2, 3], GREEDY, exits=[26]))
    assert e.value.code == "bad_field"
    link.close()


def _round(ws, sid, rnd, committed):
    """One empty-draft greedy round: commits the target's next token; returns the prefix with it."""
    ws.send(wire.encode(wire.Verify(sid, rnd, len(committed), [], {"kind": "none"})))
    result = wire.decode(ws.recv(timeout=30))
    assert isinstance(result, wire.Result) and result.n_committed == len(committed) + 1, result
    return committed + [result.token]


def test_a_session_is_reopened_only_by_its_connection_or_with_its_resume_secret(server, target, drafter):
    ids = drafter.tokenize("Go to the kitchen.", chat=True)
    owner, other = _raw(server, target), _raw(server, target)
    opened = _open(owner, "mine", ids)
    assert opened.n_committed == len(ids) and opened.resume
    committed = _round(owner, "mine", 0, _round(owner, "mine", 0, ids))
    # someone else who knows the sid: another prompt, the prompt, even the whole committed prefix
    for prompt in (drafter.tokenize("Go to the garage.", chat=True), ids, committed):
        other.send(wire.encode(wire.Open("mine", prompt, GREEDY)))
        assert _error(other).code == "session_taken"
    committed = _round(owner, "mine", 1, committed)  # the owner goes on as if nothing happened
    # the owner's robot back on a new link, its last result lost with the old one (one round short): its
    # resume secret moves the session, and the secret stays the same
    back = _raw(server, target)
    back.send(wire.encode(wire.Open("mine", committed[:-1], GREEDY, resume=opened.resume)))
    reopened = wire.decode(back.recv(timeout=30))
    assert reopened.n_committed == len(committed) - 1 and reopened.resume == opened.resume
    owner.send(wire.encode(wire.Verify("mine", 2, len(committed), [], {"kind": "none"})))
    assert _error(owner).code == "unknown_session"  # the session moved with its robot
    # with the secret a longer prefix re-opens it too (a split correction still owed)
    other.send(wire.encode(wire.Open("mine", committed, GREEDY, resume=opened.resume)))
    assert wire.decode(other.recv(timeout=30)).n_committed == len(committed)
    for ws in (owner, other, back):
        ws.close()
