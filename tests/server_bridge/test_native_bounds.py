"""The verifier's listener at the worst case its bounds allow (docs/guide/trust.md): websockets' framing past
max_size (one frame, or a header that declares 2^62 bytes), msgpack's nesting limit in a field the server reads,
a frame at the cap of the most objects msgpack can build, and the longest id list at the cap. Each is a clear
refusal and the server serves the next robot."""

from __future__ import annotations

import os
import struct
import time

import pytest
from websockets.sync.client import connect

from protocol import wire
from tests.protocol.test_native_bounds import DEEP, objects_frame
from tests.server_bridge.test_hostile_peer import TOKEN, _close_code, _closed_how, _hello, _robot_opens, _upgrade

pytestmark = pytest.mark.real

GREEDY = {"temperature": 0.0, "top_k": 0, "seed": 0}
SMALL_CAP = 64 * 1024  # the smallest max_frame_bytes the config takes: the frames of these tests stay small


def welcomed(s, target):
    ws = connect(s.url, max_size=None, legacy=True)
    ws.send(_hello(target, TOKEN))
    assert wire.decode(ws.recv(timeout=10)).TYPE == "welcome"
    return ws


def test_an_slo_nested_as_deep_as_msgpack_allows_is_a_bad_field_and_the_connection_goes_on(make_server, target):
    """Was a RecursionError out of the handler (slo_class's repr of the value): a 1011 close and a traceback."""
    s = make_server(exits="", token=TOKEN)
    with welcomed(s, target) as ws:
        ws.send(DEEP["open.slo"][0](0))
        error = wire.decode(ws.recv(timeout=10))
        assert isinstance(error, wire.Error) and error.code == "bad_field" and error.sid == "s1"
        assert "tokens_per_s" in error.message and len(error.message) < 200
        ws.send(wire.encode(wire.Open("after", [1, 2, 3], GREEDY)))
        assert wire.decode(ws.recv(timeout=30)).TYPE == "opened"


def test_frames_past_websockets_max_size_are_closed_1009_unread_and_the_next_robot_is_served(make_server, target):
    """max_size = 2 x max_frame_bytes: a frame between the cap and that is the `too_large` error, one past it a
    1009 close; a header that declares 2^62 bytes is closed from the header alone, nothing more read."""
    s = make_server(exits="", token=TOKEN, max_frame_bytes=SMALL_CAP)
    with welcomed(s, target) as ws:
        ws.send(b"\0" * (SMALL_CAP + 1))
        assert wire.decode(ws.recv(timeout=10)).code == "too_large"
        ws.send(b"\0" * (2 * SMALL_CAP + 1))
        assert _close_code(ws) == 1009
    sock, status = _upgrade(s.port)
    assert status == 101
    mask = os.urandom(4)
    sock.sendall(b"\x82\xff" + struct.pack(">Q", 1 << 62) + mask)  # binary, masked, 2^62 bytes: no payload follows
    assert _closed_how(sock, 5.0) == "1009"
    sock.close()
    _robot_opens(s)


def test_the_longest_id_list_at_the_cap_is_refused_before_the_model_and_a_strangers_frame_of_4_m_objects_unread(
    make_server, target
):
    """65,536 ids (MAX_ID_LIST) of the vocabulary's last id: context_full, no llama_decode. A frame at the default
    cap holding 4.2 M empty arrays (msgpack's worst case for the objects it builds) before hello: too_large unread
    (a stranger's first frame is at most MAX_HELLO_BYTES), the one chance before hello spent (1008); a robot is
    served after."""
    s = make_server(exits="", token=TOKEN)
    with welcomed(s, target) as ws:
        longest = wire.encode(wire.Open("long", [target.vocab_size - 1] * wire.MAX_ID_LIST, GREEDY))
        assert len(longest) < wire.DEFAULT_MAX_FRAME_BYTES
        ws.send(longest)
        assert wire.decode(ws.recv(timeout=10)).code == "context_full"
    with connect(s.url, max_size=None) as ws:
        t0 = time.monotonic()
        ws.send(objects_frame(b"\x90", wire.DEFAULT_MAX_FRAME_BYTES))
        assert wire.decode(ws.recv(timeout=30)).code == "too_large" and time.monotonic() - t0 < 1.0
        assert _close_code(ws) == 1008
    _robot_opens(s)
