"""Many robots on one verifier: batched passes keep every robot's tokens, overload is shed, /metrics tells."""

import threading
import urllib.request

import pytest
from websockets.sync.client import connect

from agent.decoding import DecoderSettings, open_decoder
from protocol import wire
from server_bridge.ops.loadtest import parse_metrics

pytestmark = pytest.mark.real

PROMPTS = [
    "Go to the red box.",
    "Turn left and stop.",
    "What is in front of you?",
    "Find the door.",
    "Walk forward slowly.",
    "Look for a person.",
]


def _metrics(server) -> dict[str, float]:
    """name{labels} -> value, less the replica label every sample carries."""
    return parse_metrics(urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10).read().decode())


@pytest.mark.parametrize("scheduler", ["slo", "fixed", "fcfs"])
def test_robots_sharing_batches_each_get_the_targets_tokens(make_server, drafter, scheduler):
    """Six robots at once (two SLO classes, SD with different draft lengths) against one verifier:
    every answer equals the target's greedy tokens, and the slo and fixed schedulers really batch."""
    refs_server = make_server(scheduler="fcfs")
    prompts = [drafter.tokenize(p, chat=True) for p in PROMPTS]
    solo = open_decoder(DecoderSettings(verifier=refs_server.url), drafter)
    refs = [solo.generate(ids, mode="ar", max_tokens=16).token_ids for ids in prompts]
    solo.close()

    server = make_server(scheduler=scheduler, max_batch=8, batch_wait_ms=30.0, max_wait_ms=60000.0)  # a busy CI box
    got, errors = {}, []

    drafters = [drafter.__class__(threads=1) for _ in prompts]  # a llama.cpp context per robot

    def robot(i):
        try:
            dec = open_decoder(DecoderSettings(verifier=server.url, slo_tokens_per_s=(4.0, 8.0)[i % 2]), drafters[i])
            got[i] = dec.generate(prompts[i], mode="sd", max_tokens=16, gamma=2 + i % 4).token_ids
            dec.close()
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=robot, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert [got[i] for i in range(len(prompts))] == refs
    m = _metrics(server)
    assert m["bridge_batches_total"] >= 1 and m["bridge_queue_length"] == 0
    assert m['bridge_slo_requests_total{class="4"}'] > 0 and m['bridge_slo_requests_total{class="8"}'] > 0
    assert m['bridge_slo_generations_total{class="4"}'] == m['bridge_slo_generations_total{class="8"}'] == 3
    assert m["bridge_target_forward_passes_total"] == m["bridge_batches_total"]
    mean_batch = m["bridge_batch_size_sum"] / m["bridge_batch_size_count"]
    if scheduler == "fcfs":
        assert m["bridge_batch_size_max"] == 1
    else:
        assert m["bridge_batch_size_max"] >= 2 and mean_batch > 1


def _hello(target):
    return wire.encode(
        wire.Hello(token="", client="test", draft_vocab_hash=target.vocab_hash, vocab_size=target.vocab_size)
    )


def test_overload_is_shed_with_a_clear_error_not_queued_without_bound(make_server, target, drafter):
    """A queue of 2: a burst of opens from ten robots gets `overloaded` for what does not fit, the queue
    never grows past its bound, and every robot that was shed is served when it asks again."""
    server = make_server(max_queue=2, max_wait_ms=5000.0)
    ids = drafter.tokenize("Describe the room you are in, every object, one by one.", chat=True)
    conns = [connect(server.url, max_size=None, legacy=True) for _ in range(10)]
    for ws in conns:
        ws.send(_hello(target))
        assert wire.decode(ws.recv(timeout=10)).TYPE == "welcome"
    for i, ws in enumerate(conns):
        ws.send(wire.encode(wire.Open(f"r{i}", ids + [i + 100] * 200, {"temperature": 0.0}, slo={"tokens_per_s": 8})))
    replies = [wire.decode(ws.recv(timeout=60)) for ws in conns]
    shed = [i for i, r in enumerate(replies) if isinstance(r, wire.Error)]
    assert shed and all(replies[i].code == "overloaded" and "overloaded" in replies[i].message for i in shed)
    assert all(isinstance(r, wire.Opened) for i, r in enumerate(replies) if i not in shed)
    m = _metrics(server)
    assert m['bridge_slo_shed_total{class="8"}'] == len(shed)
    assert m['bridge_errors_total{code="overloaded"}'] == len(shed)
    for i in shed:  # the shed robots come back when the burst is over
        conns[i].send(wire.encode(wire.Open(f"r{i}", ids, {"temperature": 0.0})))
        assert isinstance(wire.decode(conns[i].recv(timeout=60)), wire.Opened)
    for ws in conns:
        ws.close()
