"""The wire: every message round-trips, and every kind of bad frame gets a WireError with a code."""

import json

import msgpack
import numpy as np
import pytest

from protocol import wire
from protocol.wire import WireError


@pytest.mark.parametrize("cls", [wire.Hello, wire.Welcome, wire.Open, wire.Opened, wire.Verify])
def test_dummies_round_trip(cls):
    msg = cls.make_dummy()
    assert wire.decode(wire.encode(msg)) == msg


@pytest.mark.parametrize(
    "q",
    [
        {"kind": "none"},
        {
            "kind": "topk",
            "ids": np.array([[5, 9, 1], [2, 3, 4]], np.int32),
            "probs": np.array([[0.5, 0.25, 0.25], [1, 0, 0]], np.float16),
        },
        {"kind": "split", "px": np.array([1, (1 << 23), 12345])[:2]},
    ],
)
def test_payloads_round_trip(q):
    msg = wire.Verify("s1", 2, 10, [5, 2], q, fix=7)
    back = wire.decode(wire.encode(msg))
    assert back.fix == 7 and back.q["kind"] == q["kind"]
    for key in set(q) - {"kind"}:
        np.testing.assert_array_equal(back.q[key], q[key])


def test_a_split_round_is_small():
    """DSSD's point: a split round at gamma 4 carries ids and q(x) only (packed, no key names)."""
    msg = wire.Verify(
        "a1B2c3D4", 17, 640, [48000, 123, 9, 31000], {"kind": "split", "px": np.array([1 << 23, 5, 77, 4])}, fix=4000
    )
    frame = wire.encode(msg)
    assert len(frame) <= 64
    back = wire.decode(frame)
    assert (back.sid, back.round, back.n_committed, back.draft_ids, back.fix) == (
        "a1B2c3D4",
        17,
        640,
        msg.draft_ids,
        4000,
    )
    np.testing.assert_array_equal(back.q["px"], [1 << 23, 5, 77, 4])


def test_result_residual_round_trips():
    logits = np.linspace(-3, 3, 50).astype(np.float32)
    for ids in (None, np.arange(10, 60, dtype=np.int32)):
        msg = wire.Result("s1", 3, 1, -1, 12, {"verify_ms": 1.5, "passes": 1}, {"logits": logits, "ids": ids})
        back = wire.decode(wire.encode(msg))
        np.testing.assert_array_equal(back.residual["logits"], logits)
        assert (back.residual["ids"] is None) == (ids is None)
    plain = wire.Result("s1", 3, 4, 99, 12, {"verify_ms": 1.5, "passes": 1})
    assert wire.decode(wire.encode(plain)) == plain


def test_full_q_travels_as_fp16_bytes():
    q = np.random.default_rng(0).random((3, 100)).astype(np.float16)
    msg = wire.Verify("s1", 2, 10, [1, 2, 3], {"kind": "full", "probs": q})
    back = wire.decode(wire.encode(msg))
    np.testing.assert_array_equal(back.q["probs"], q)
    assert back.q["probs"].dtype == np.float16


def _frame(**fields):
    return msgpack.packb({"v": wire.PROTOCOL_VERSION, **fields}, use_bin_type=True)


@pytest.mark.parametrize(
    "frame, code",
    [
        (b"\xc1\xff\x00garbage", "bad_frame"),
        (msgpack.packb([1, 2, 3]), "bad_frame"),
        (msgpack.packb({"type": "hello", "v": 99}), "bad_version"),
        (_frame(type="nope"), "bad_type"),
        (_frame(type="open", sid="s1", prompt_ids="abc", sampling={"temperature": 0.0}), "bad_field"),
        (_frame(type="open", sid="s1", prompt_ids=[1, -2], sampling={"temperature": 0.0}), "bad_field"),
        (_frame(type="open", sid="s1", prompt_ids=[], sampling={"temperature": 0.0}), "bad_field"),
        (_frame(type="open", sid="s1", prompt_ids=[1], sampling={"temperature": float("nan")}), "bad_field"),
        (_frame(type="open", sid="bad sid!", prompt_ids=[1], sampling={"temperature": 0.0}), "bad_field"),
        (_frame(type="verify", sid="s1", round=0, n_committed=3, draft_ids=[1, 2], q=["weird"]), "unsupported"),
        (_frame(type="verify", sid="s1", round=0, n_committed=3, draft_ids=[1, 2], q={"kind": "none"}), "bad_field"),
        (_frame(type="verify", sid="s1", round=True, n_committed=3, draft_ids=[1], q=["none"]), "bad_field"),
        (_frame(type="verify", sid="s1", round=0, n_committed=3, draft_ids=[1, 2], q=["full", b"\0" * 3]), "bad_field"),
        (_frame(type="verify", sid="s1", round=0, n_committed=3, draft_ids=[1, 2], q=["full"]), "bad_field"),
        (
            _frame(
                type="verify", sid="s1", round=0, n_committed=3, draft_ids=[1, 2], q=["topk", b"\0" * 16, b"\0" * 4]
            ),
            "bad_field",
        ),  # 2 x 2 ids but 2 probabilities
        (
            _frame(type="verify", sid="s1", round=0, n_committed=3, draft_ids=[1, 2], q=["split", b"\0" * 5]),
            "bad_field",
        ),
        (_frame(type="verify", sid="s1", round=0, n_committed=3, draft_ids=[1, 2], q=["split", "abcdef"]), "bad_field"),
        (msgpack.packb([wire.PROTOCOL_VERSION, "open", "s1"]), "bad_frame"),  # open is not packed
        (msgpack.packb([wire.PROTOCOL_VERSION, "verify", "s1", 0, 3, [1], ["none"], None, None, 7]), "bad_frame"),
        (msgpack.packb([wire.PROTOCOL_VERSION, "result", "s1", 0, 0, -1, 3, {}]), "bad_field"),  # -1 needs a residual
        (msgpack.packb([wire.PROTOCOL_VERSION, "result", "s1", 0, 0, -1, 3, {}, [b"\0" * 8, b"\0" * 3]]), "bad_field"),
        (msgpack.packb([wire.PROTOCOL_VERSION, "result", "s1", 0, 0, -1, 3, {}, [b"\0" * 8, b"\0" * 4]]), "bad_field"),
        (msgpack.packb([wire.PROTOCOL_VERSION, "result", "s1", 0, 0, 5, 3, {}, [b"\0" * 8]]), "bad_field"),
    ],
)
def test_bad_frames_get_a_code(frame, code):
    with pytest.raises(WireError) as e:
        wire.decode(frame)
    assert e.value.code == code
    assert e.value.message


def test_errors_name_the_session_when_they_can():
    with pytest.raises(WireError) as e:
        wire.decode(_frame(type="verify", sid="robot-7", round=-1, n_committed=3, draft_ids=[], q=["none"]))
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
    assert wire.decode(wire.encode(wire.Token("s1", 0, 42, True, {}))).p is None  # optional
    for bad in (1.5, -0.1, float("nan"), "x"):
        d = msg.to_wire()
        d["p"] = bad
        with pytest.raises(WireError):
            wire.decode(msgpack.packb(d))


def test_resume_secrets_are_optional_on_the_wire():
    """An open without a secret is the frame it was before secrets; an older server's opened decodes to ""."""
    plain = wire.Open("s1", [1, 2, 3], {"temperature": 0.0, "top_k": 0, "seed": 0})
    assert "resume" not in msgpack.unpackb(wire.encode(plain)) and wire.decode(wire.encode(plain)).resume == ""
    older = msgpack.packb({"type": "opened", "v": 1, "sid": "s1", "n_committed": 3, "timing": {}})
    assert wire.decode(older).resume == ""
    for bad in (7, "x" * 65):
        frame = msgpack.packb({**plain.to_wire(), "resume": bad})
        with pytest.raises(WireError) as e:
            wire.decode(frame)
        assert e.value.code == "bad_field" and e.value.sid == "s1"


def test_top_p_is_optional_on_the_wire_and_checked():
    """An open without top_p is the frame it was before it (and means 1); one with it round-trips; a bad one
    is a bad_field naming sampling.top_p."""
    plain = wire.Open("s1", [1, 2, 3], {"temperature": 0.7, "top_k": 0, "seed": 0})
    assert "top_p" not in wire.decode(wire.encode(plain)).sampling
    nucleus = wire.Open("s1", [1, 2, 3], {"temperature": 0.7, "top_k": 0, "seed": 0, "top_p": 0.5})
    assert wire.decode(wire.encode(nucleus)) == nucleus
    for bad in (float("nan"), 0, 0.0, 1.5, -0.1, float("inf"), "0.5", True):
        frame = msgpack.packb({**plain.to_wire(), "sampling": {**plain.sampling, "top_p": bad}})
        with pytest.raises(WireError, match=r"sampling\.top_p must be a finite number in \(0, 1\]") as e:
            wire.decode(frame)
        assert e.value.code == "bad_field"


def _verify_with_cands(cands) -> bytes:
    return _frame(type="verify", sid="s1", round=0, n_committed=3, draft_ids=[1, 2], q=["none"], cands=cands)


@pytest.mark.parametrize(
    "cands",
    [
        {"dtype": "<i4", "shape": [2**40, 2**30, 0, 5], "data": b""},  # numpy would raise "array is too big"
        {"dtype": "<i4", "shape": [2**64 - 1, 0], "data": b""},  # past int64: numpy would overflow
        {"dtype": ["<i4"], "shape": [2, 1], "data": b"\0" * 8},  # unhashable: `in` would raise TypeError
    ],
)
def test_an_array_shape_is_bounded_before_numpy_sees_it(cands):
    with pytest.raises(WireError) as e:
        wire.decode(_verify_with_cands(cands))
    assert e.value.code == "bad_field" and e.value.sid == "s1"
    good = {"dtype": "<i4", "shape": [2, 3], "data": np.arange(6, dtype="<i4").tobytes()}
    assert wire.decode(_verify_with_cands(good)).cands.tolist() == [[0, 1, 2], [3, 4, 5]]


def test_an_error_never_echoes_what_its_own_decoder_would_refuse():
    cases = [
        _frame(type="open", sid="bad sid!", prompt_ids=[1], sampling={"temperature": 0.0}),
        _frame(type="open", sid="x" * 65, prompt_ids=[1], sampling={"temperature": 0.0}),
        _frame(type="open", sid=b"s1", prompt_ids=[1], sampling={"temperature": b"\0" * 2**20}),
        _frame(type="verify", sid="s1", round="r" * 4000, n_committed=3, draft_ids=[], q=["none"]),
        _frame(type="verify", sid="s1", round=0, n_committed=3, draft_ids=[1, 2], q=["k" * 4000]),
        _frame(type=["open"] * 1000),  # unhashable: a TypeError before
        _frame(type="x" * 16000),
        msgpack.packb({"type": "hello", "v": "v" * 16000}),
    ]
    for frame in cases:
        with pytest.raises(WireError) as e:
            wire.decode(frame, max_bytes=8 * 2**20)
        assert e.value.sid in (None, "s1") and len(e.value.message) < 300
        back = wire.decode(wire.encode(wire.Error(e.value.code, e.value.message, e.value.sid)))
        assert (back.code, back.message, back.sid) == (e.value.code, e.value.message, e.value.sid)
    # whatever an error is given, it goes out as an error its receiver can read
    back = wire.decode(wire.encode(wire.Error("c" * 100, "m" * 10_000, "bad sid!")))
    assert back.sid is None and len(back.code) == 64 and len(back.message) == wire.MAX_STR


def test_replies_the_robot_adds_up_carry_numbers_only():
    for timing in ({"verify_ms": "fast"}, {"verify_ms": float("nan")}, {"passes": [1]}, {"verify_ms": None}):
        frame = msgpack.packb([wire.PROTOCOL_VERSION, "result", "s1", 0, 1, 5, 3, timing])
        with pytest.raises(WireError):
            wire.decode(frame)
    for logits in ([np.nan, 0.0], [np.inf, 0.0], [-np.inf, -np.inf]):
        residual = {"logits": np.array(logits, np.float32), "ids": None}
        with pytest.raises(WireError, match="residual logits"):
            wire.decode(wire.encode(wire.Result("s1", 0, 0, -1, 3, {}, residual)))
    masked = {"logits": np.array([-np.inf, 1.5], np.float32), "ids": np.array([4, 9], np.int32)}
    assert wire.decode(wire.encode(wire.Result("s1", 0, 0, -1, 3, {"verify_ms": 2.0}, masked))).residual["ids"][1] == 9
    negative = {"logits": np.array([0.5], np.float32), "ids": np.array([-4], np.int32)}
    with pytest.raises(WireError, match="negative"):
        wire.decode(wire.encode(wire.Result("s1", 0, 0, -1, 3, {}, negative)))


def test_a_json_schema_up_to_its_cap_travels_in_an_open():
    """A schema's text is a msgpack string far longer than the wire's other strings (Kubernetes schemas: 20-900
    KB): it decodes whole up to MAX_SCHEMA_CHARS (msgpack's own string bound was 16 KiB, so every open with a
    larger schema was a bad_frame), and past it is the open's bad_field."""
    greedy = {"temperature": 0.0, "top_k": 0, "seed": 0}
    schema = json.dumps({"type": "object", "properties": {f"p{i:06d}": {"type": "integer"} for i in range(12_000)}})
    assert 16 * 1024 < len(schema) <= wire.MAX_SCHEMA_CHARS
    msg = wire.decode(wire.encode(wire.Open("s", [1, 2, 3], greedy, grammar={"json_schema": schema, "from": 3})))
    assert msg.grammar["json_schema"] == schema
    over = "x" * (wire.MAX_SCHEMA_CHARS + 1)
    with pytest.raises(wire.WireError) as e:
        wire.decode(wire.encode(wire.Open("s", [1, 2, 3], greedy, grammar={"json_schema": over, "from": 3})))
    assert e.value.code == "bad_field"


def test_an_overloaded_error_may_say_when_to_come_back():
    back = wire.decode(wire.encode(wire.Error("overloaded", "saturated", "s1", 4000)))
    assert back.retry_after_ms == 4000
    plain = wire.Error("overloaded", "saturated", "s1").to_wire()
    assert "retry_after_ms" not in plain  # what an earlier robot got, and still gets
    long = wire.Error("overloaded", "x", None, 10**12)
    assert wire.decode(wire.encode(long)).retry_after_ms == wire.MAX_RETRY_AFTER_MS
    for bad in (-1, 1.5, "soon", wire.MAX_RETRY_AFTER_MS + 1):
        frame = {"type": "error", "v": wire.PROTOCOL_VERSION, "code": "x", "message": "m", "retry_after_ms": bad}
        with pytest.raises(WireError, match="retry_after_ms"):
            wire.decode(msgpack.packb(frame))
