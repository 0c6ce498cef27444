"""The wire: every message round-trips, and every kind of bad frame gets a WireError with a code."""
import msgpack
import numpy as np
import pytest

from server_bridge import wire
from server_bridge.wire import WireError


@pytest.mark.parametrize("cls", [wire.Hello, wire.Welcome, wire.Open, wire.Verify])
def test_dummies_round_trip(cls):
    msg = cls.make_dummy()
    assert wire.decode(wire.encode(msg)) == msg


def test_full_q_travels_as_fp16_bytes():
    q = np.random.default_rng(0).random((3, 100)).astype(np.float16)
    msg = wire.Verify("s1", 2, 10, [1, 2, 3], {"kind": "full", "probs": q})
    back = wire.decode(wire.encode(msg))
    np.testing.assert_array_equal(back.q["probs"], q)
    assert back.q["probs"].dtype == np.float16


def _frame(**fields):
    return msgpack.packb({"v": wire.PROTOCOL_VERSION, **fields}, use_bin_type=True)


@pytest.mark.parametrize("frame, code", [
    (b"\xc1\xff\x00garbage", "bad_frame"),
    (msgpack.packb([1, 2, 3]), "bad_frame"),
    (msgpack.packb({"type": "hello", "v": 99}), "bad_version"),
    (_frame(type="nope"), "bad_type"),
    (_frame(type="open", sid="s1", prompt_ids="abc", sampling={"temperature": 0.0}), "bad_field"),
    (_frame(type="open", sid="s1", prompt_ids=[1, -2], sampling={"temperature": 0.0}), "bad_field"),
    (_frame(type="open", sid="s1", prompt_ids=[], sampling={"temperature": 0.0}), "bad_field"),
    (_frame(type="open", sid="s1", prompt_ids=[1], sampling={"temperature": float("nan")}), "bad_field"),
    (_frame(type="open", sid="bad sid!", prompt_ids=[1], sampling={"temperature": 0.0}), "bad_field"),
    (_frame(type="verify", sid="s1", round=0, n_committed=3, draft_ids=[1, 2], q={"kind": "weird"}), "unsupported"),
    (_frame(type="verify", sid="s1", round=True, n_committed=3, draft_ids=[1], q={"kind": "none"}), "bad_field"),
    (_frame(type="verify", sid="s1", round=0, n_committed=3, draft_ids=[1, 2],
            q={"kind": "full", "probs": {"dtype": "<f2", "shape": [2, 4], "data": b"\0" * 3}}), "bad_field"),
    (_frame(type="verify", sid="s1", round=0, n_committed=3, draft_ids=[1, 2],
            q={"kind": "full", "probs": {"dtype": "<f8", "shape": [2, 4], "data": b"\0" * 64}}), "bad_field"),
    (_frame(type="verify", sid="s1", round=0, n_committed=3, draft_ids=[1, 2],
            q={"kind": "full", "probs": wire.encode_array(np.zeros((3, 4), np.float16))}), "bad_field"),
])
def test_bad_frames_get_a_code(frame, code):
    with pytest.raises(WireError) as e:
        wire.decode(frame)
    assert e.value.code == code
    assert e.value.message


def test_errors_name_the_session_when_they_can():
    with pytest.raises(WireError) as e:
        wire.decode(_frame(type="verify", sid="robot-7", round=-1, n_committed=3, draft_ids=[], q={"kind": "none"}))
    assert e.value.sid == "robot-7"


def test_oversized_and_text_frames():
    with pytest.raises(WireError) as e:
        wire.decode(b"\0" * 2048, max_bytes=1024)
    assert e.value.code == "too_large"
    with pytest.raises(WireError) as e:
        wire.decode('{"type": "hello"}')
    assert e.value.code == "bad_frame"


def test_streamed_token_carries_the_targets_probability():
    msg = wire.Token("s1", 0, 42, False, {"verify_ms": 1.0}, p=0.25)
    assert wire.decode(wire.encode(msg)) == msg
    assert wire.decode(wire.encode(wire.Token("s1", 0, 42, True, {}))).p is None     # optional
    for bad in (1.5, -0.1, float("nan"), "x"):
        d = msg.to_wire()
        d["p"] = bad
        with pytest.raises(WireError):
            wire.decode(msgpack.packb(d))
