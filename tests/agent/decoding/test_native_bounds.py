"""A hostile verifier's replies at the worst case the robot's bounds allow (docs/guide/trust.md): a frame one
byte past websockets' max_size (2 x DEFAULT_MAX_FRAME_BYTES: a 1009 close), one of exactly that size holding
the most objects msgpack can build (8.4 M lists, decoded, then refused), and a value nested as deep as msgpack
allows. Each is a lost link that commits nothing; the robot reconnects to the honest server and finishes."""

from __future__ import annotations

import logging

import msgpack
import pytest

from protocol import wire
from tests.agent.decoding.test_hostile_verifier import PROMPT, FakeVerifier, decoder_for, on
from tests.protocol.test_native_bounds import DEPTH, nest, with_field

pytestmark = pytest.mark.real

CAP = 2 * wire.DEFAULT_MAX_FRAME_BYTES  # what the robot's link takes (agent/decoding/link.py)


def objects(cap: int, result: wire.Result) -> bytes:
    """The result as a map whose timing is arrays of empty arrays, the frame exactly `cap` bytes."""
    fields = {k: v for k, v in result.to_wire().items() if k != "timing"}
    head = with_field(fields, "timing", b"")
    room = cap - len(head) - 3
    full = b"\xdc\xff\xff" + b"\x90" * 65535
    n = room // len(full)
    last = room - n * len(full) - 3
    frame = head + b"\xdc" + (n + 1).to_bytes(2, "big") + full * n + b"\xdc" + last.to_bytes(2, "big") + b"\x90" * last
    assert len(frame) == cap
    return frame


def deep(result: wire.Result) -> bytes:
    fields = {k: v for k, v in result.to_wire().items() if k != "timing"}
    return with_field(fields, "timing", b"\x81" + msgpack.packb("verify_ms") + nest(DEPTH - 2))


BAD = {
    "past max_size": (lambda r: b"\0" * (CAP + 1), "connection lost"),
    "the most objects at the cap": (lambda r: objects(CAP, r), "undecodable"),
    "nested as deep as msgpack allows": (deep, "undecodable"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_reply_at_the_robots_bounds_is_a_lost_link_and_the_robot_finishes_on_the_honest_server(drafter, case, caplog):
    make, says = BAD[case]
    prompt = drafter.tokenize(PROMPT)
    with FakeVerifier(drafter, on(wire.Result, lambda q, r: make(r))) as fake:
        decoder = decoder_for(drafter, fake.url, "sd", attempts=2)
        try:
            with caplog.at_level(logging.WARNING, "agent.decoding.session"):
                gen = decoder.generate(prompt, mode="sd", max_tokens=6, gamma=3)
        finally:
            decoder.close()
    assert fake.opens == [prompt, prompt]  # re-opened with the prompt alone: nothing of the bad reply committed
    assert gen.token_ids[-1] == fake.eos and gen.metrics.reconnects == 1
    assert f"link lost ({says}" in caplog.text
