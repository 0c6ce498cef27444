"""The wire under hostile input (Hypothesis): every message type, every field, any msgpack value.

`wire.decode` either returns a valid message or raises WireError, never anything else (an uncaught
error before `hello` was a close 1011 and a traceback); the WireError was raised by a check, not by the
safety net behind them; the error it becomes is one its receiver's decoder accepts (no echoed bad sid,
no MiB of echoed bytes); a message it accepts encodes again to what decodes again. Valid messages of
every type round-trip byte for byte. Derandomized, so CI sees the same examples every run.
"""

import math
import struct
import zlib
from dataclasses import fields

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol import wire
from protocol.images import PromptImage

FUZZ = settings(
    max_examples=80, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow], database=None
)
VALID = settings(max_examples=30, deadline=None, derandomize=True, database=None)
MESSAGES = list(wire.MESSAGES.values())


def _png(width: int, height: int) -> bytes:
    chunk = lambda kind, data: struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))  # noqa: E731
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 13)) + chunk(b"IEND", b"")


# --------------------------------------------------------------------------- hostile values

INTS = st.one_of(
    st.integers(-(2**63), 2**64 - 1),  # all msgpack can carry: uint64 is past int64
    st.sampled_from([0, 1, -1, 2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64 - 1]),
)
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    INTS,
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
    st.binary(max_size=40),
    st.sampled_from(["s1", "bad sid!", "", "x" * 65, "none", "full", "topk", "split", "<i4", "<f2"]),
)
DIMS = st.sampled_from([0, 1, 2, 3, 2**30, 2**31, 2**40, 2**62, 2**63 - 1, 2**64 - 1, -1])


@st.composite
def arrays(draw) -> dict:
    """Array maps as a hostile robot sends them: mostly a real dtype and a list shape of extreme dims, the
    data often exactly what the shape says (so only the shape's bounds stand between it and numpy: an
    empty 2^40 x 2^30 x 0 x 5, ...); sometimes anything at all in each key."""
    real = ("<i4", "<f2", "<f4")
    dtype = draw(st.sampled_from(real) if draw(st.integers(0, 4)) else st.one_of(st.just("<f8"), SCALARS))
    shape = draw(st.lists(st.one_of(DIMS, INTS), min_size=1, max_size=5) if draw(st.integers(0, 9)) else SCALARS)
    size = math.prod(shape) if isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape) else -1
    itemsize = np.dtype(dtype).itemsize if dtype in real else 4
    if 0 <= size * itemsize <= 4096 and draw(st.integers(0, 3)):
        data = b"\0" * (size * itemsize)
    else:
        data = draw(st.one_of(st.binary(max_size=64), SCALARS))
    return {"dtype": dtype, "shape": shape, "data": data}


ARRAYS = arrays()
QS = st.builds(
    lambda kind, parts: [kind, *parts],
    st.one_of(st.sampled_from(wire.Q_KINDS), SCALARS),
    st.lists(st.one_of(st.binary(max_size=48), SCALARS), max_size=3),
)
IMAGE_BYTES = st.sampled_from(
    [
        _png(30000, 30000),
        _png(64, 64),
        _png(4096, 4097),
        b"\xff\xd8\xff\xc0\x00\x08\x08\xff\xff\xff\xff\x00\xff\xda",  # a JPEG header: 65535 x 65535
        b"",
    ]
)
IMAGES = st.lists(
    st.dictionaries(
        st.sampled_from(["at", "data", "sha256", "pixels"]),
        st.one_of(INTS, IMAGE_BYTES, st.just("0" * 64), SCALARS),
        max_size=3,
    ),
    max_size=5,
)
LARGE = st.sampled_from(["x" * 20_000, b"\0" * 70_000, list(range(70_000)), {str(i): i for i in range(100)}])
VALUES = st.recursive(
    st.one_of(SCALARS, ARRAYS),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=10,
)
HOSTILE = st.one_of(VALUES, ARRAYS, QS, IMAGES, LARGE)


def check_decode(frame: bytes) -> wire.Message | None:
    """The property: a message, or a WireError its sender can be told about."""
    try:
        msg = wire.decode(frame, max_bytes=8 * 2**20)
    except wire.WireError as e:
        assert e.__cause__ is None, f"a check missed {e.__cause__!r}: the safety net caught it"
        assert isinstance(e.code, str) and e.code and len(e.message) <= 512
        back = wire.decode(wire.encode(wire.Error(e.code, e.message, e.sid)))
        assert (back.code, back.message, back.sid) == (e.code, e.message, e.sid)
        return None
    again = wire.encode(msg)  # what was accepted is a message: it encodes, and that decodes to the same
    assert wire.encode(wire.decode(again, max_bytes=8 * 2**20)) == again
    return msg


@pytest.mark.parametrize("cls", MESSAGES, ids=lambda c: c.TYPE)
@FUZZ
@given(data=st.data())
def test_any_field_of_any_message_holding_any_value_decodes_or_gets_a_wire_error(cls, data):
    d = cls.make_dummy().to_wire()
    names = ["v", "type", *(f.name for f in fields(cls)), "unknown"]
    for name in data.draw(st.lists(st.sampled_from(names), min_size=1, max_size=3, unique=True), label="fields"):
        if data.draw(st.integers(0, 9), label="drop") == 0:
            d.pop(name, None)
        else:
            d[name] = data.draw(HOSTILE, label=name)
    if cls.PACKED and data.draw(st.booleans(), label="packed"):
        d = [d.get("v"), d.get("type"), *(d.get(f.name) for f in fields(cls))]
    check_decode(msgpack.packb(d, use_bin_type=True))


@settings(FUZZ, max_examples=300)
@given(obj=ARRAYS)
def test_any_array_map_decodes_to_its_shape_or_gets_a_wire_error(obj):
    try:
        array = wire.decode_array(obj, "a")
    except wire.WireError as e:
        assert e.code == "bad_field" and len(e.message) <= 512
        return
    assert list(array.shape) == obj["shape"] and array.nbytes == len(obj["data"])


@FUZZ
@given(frame=st.one_of(st.binary(max_size=256), VALUES.map(lambda v: msgpack.packb(v, use_bin_type=True))))
def test_any_bytes_decode_or_get_a_wire_error(frame):
    check_decode(frame)


# --------------------------------------------------------------------------- valid messages

SIDS = st.from_regex(r"[A-Za-z0-9._-]{1,64}", fullmatch=True)
U31 = st.integers(0, 2**31 - 1)
IDS = st.lists(U31, max_size=300)
TIMING = st.dictionaries(
    st.text(max_size=12), st.one_of(U31, st.floats(allow_nan=False, allow_infinity=False)), max_size=4
)
JSONISH = st.dictionaries(
    st.text(max_size=8), st.one_of(st.none(), st.booleans(), U31, st.text(max_size=8)), max_size=3
)


@st.composite
def verify_parts(draw) -> dict:
    """draft_ids and a q (and cands) whose shapes follow from k, as a robot's drafter makes them."""
    k = draw(st.integers(0, 8))
    kind = draw(st.sampled_from(wire.Q_KINDS))
    width = draw(st.integers(1, 6))

    def array(dtype, shape):
        raw = draw(st.binary(min_size=int(np.prod(shape)) * np.dtype(dtype).itemsize, max_size=4096))
        return np.frombuffer(raw[: int(np.prod(shape)) * np.dtype(dtype).itemsize], dtype).reshape(shape)

    q = {"kind": kind}
    if kind == "full":
        q["probs"] = array("<f2", (k, width))
    elif kind == "topk":
        q["ids"], q["probs"] = np.abs(array("<i4", (k, width))), array("<f2", (k, width))
    elif kind == "split":
        q["px"] = np.array(draw(st.lists(st.integers(0, 2**24 - 1), min_size=k, max_size=k)), np.int64)
    cands = draw(st.none() | st.just(np.abs(array("<i4", (k, draw(st.integers(1, wire.MAX_CANDIDATES)))))))
    return {"draft_ids": draw(st.lists(U31, min_size=k, max_size=k)), "q": q, "cands": cands}


@st.composite
def result_parts(draw) -> dict:
    if not draw(st.booleans()):
        return {"token": draw(U31), "residual": None}
    n = draw(st.integers(1, 16))
    logits = np.array(draw(st.lists(st.floats(-1e6, 1e6, width=32), min_size=n, max_size=n)), np.float32)
    ids = draw(st.none() | st.just(np.array(draw(st.lists(U31, min_size=n, max_size=n)), np.int32)))
    return {"token": -1, "residual": {"logits": logits, "ids": ids}}


@st.composite
def open_parts(draw) -> dict:
    ids = draw(st.lists(U31, min_size=1, max_size=300))
    at = sorted(draw(st.sets(st.integers(0, len(ids) - 1), max_size=2)))
    return {
        "prompt_ids": ids,
        "sampling": {
            "temperature": draw(st.floats(0.0, 100.0)),
            "top_k": draw(st.integers(0, 1 << 24)),
            "seed": draw(st.integers(0, 2**63 - 1)),
        },
        "exits": sorted(draw(st.sets(U31, max_size=4))),
        "payload": {"kind": draw(st.text(max_size=16)), "k": draw(st.integers(0, 1 << 20))},
        "grammar": draw(st.none() | st.just({"gbnf": draw(st.text(max_size=64)), "from": len(ids)})),
        "images": [PromptImage.of(_png(1 + i, draw(st.integers(1, 4096))), i) for i in at],
    }


FIELDS = {  # per message type: a strategy for each field it validates (others keep the dummy's value)
    wire.Hello: st.fixed_dictionaries(
        {
            "token": st.text(max_size=256),
            "client": st.text(max_size=256),
            "draft_vocab_hash": st.text(max_size=128),
            "vocab_size": st.integers(1, 1 << 24),
        }
    ),
    wire.Welcome: st.fixed_dictionaries(
        {
            "target": st.text(max_size=64),
            "vocab_hash": st.text(max_size=128),
            "eos_ids": st.lists(U31, max_size=64),
            "exits": st.lists(U31, max_size=16),
            "engine": JSONISH,
            "replica": st.text(max_size=64),
        }
    ),
    wire.Error: st.fixed_dictionaries(
        {"code": st.text(max_size=64), "message": st.text(max_size=300), "sid": st.none() | SIDS}
    ),
    wire.Open: open_parts(),
    wire.Opened: st.fixed_dictionaries({"n_committed": U31, "timing": TIMING, "replica": st.text(max_size=64)}),
    wire.Verify: verify_parts(),
    wire.Exit: st.fixed_dictionaries(
        {
            "layer": st.integers(1, 1 << 12),
            "tokens": st.lists(U31, min_size=1, max_size=257),
            "confidence": st.floats(0.0, 1.0),
        }
    ),
    wire.Result: result_parts(),
    wire.Ar: st.fixed_dictionaries(
        {"max_tokens": st.integers(1, wire.MAX_ID_LIST), "stop_ids": st.lists(U31, max_size=64), "fix": st.none() | U31}
    ),
    wire.Token: st.fixed_dictionaries(
        {"seq": U31, "token": U31, "done": st.booleans(), "timing": TIMING, "p": st.none() | st.floats(0.0, 1.0)}
    ),
    wire.Close: st.just({}),
}


def test_every_message_type_is_fuzzed():
    assert set(FIELDS) == set(MESSAGES)


@pytest.mark.parametrize("cls", MESSAGES, ids=lambda c: c.TYPE)
@VALID
@given(data=st.data())
def test_valid_messages_round_trip_byte_for_byte(cls, data):
    values = {f.name: getattr(cls.make_dummy(), f.name) for f in fields(cls)}
    if "sid" in values and cls is not wire.Error:
        values["sid"] = data.draw(SIDS, label="sid")
    values.update(data.draw(FIELDS[cls], label="fields"))
    if "round" in values:
        values["round"] = data.draw(U31, label="round")
    msg = cls(**values)
    frame = wire.encode(msg)
    back = wire.decode(frame, max_bytes=8 * 2**20)
    assert type(back) is cls and wire.encode(back) == frame
