"""The worst case each bound allows where a peer's bytes reach native code on the wire and in the image
decoders (docs/guide/trust.md): msgpack's C unpacker at its own nesting limit and at the frame cap, zlib,
OpenCV and Pillow on an image at the pixel limit and on one whose data is not what its header says. No model."""

from __future__ import annotations

import base64
import functools
import struct
import time
import tracemalloc
import zlib
from types import SimpleNamespace

import cv2
import msgpack
import numpy as np
import pytest

from protocol import images, wire

DEPTH = 1024  # msgpack's C unpacker: containers nested deeper than this are a StackError
SIDE = images.MAX_IMAGE_SIDE


def nest(n: int) -> bytes:
    """n msgpack arrays one inside the other around a nil: [[[...nil...]]]."""
    return b"\x91" * n + b"\xc0"


def with_field(fields: dict, name: str, value: bytes) -> bytes:
    """`fields` packed as a msgpack map with one more key, `name`, whose value is the raw msgpack `value`."""
    head = msgpack.packb(fields, use_bin_type=True)
    assert len(fields) < 15 and head[0] == 0x80 + len(fields)  # a fixmap: one more key is one more in its count
    return bytes([head[0] + 1]) + head[1:] + msgpack.packb(name) + value


OPEN = {"v": 1, "type": "open", "sid": "s1", "prompt_ids": [1, 2, 3], "sampling": {"temperature": 0.0}}
WELCOME = wire.Welcome.make_dummy().to_wire()
HELLO = wire.Hello.make_dummy().to_wire()


def deepest(inside: int) -> bytes:
    """A value nested as deep as msgpack allows, in a frame where `inside` containers already hold it."""
    return nest(DEPTH - inside)


# (frame builder given how many more levels than msgpack allows, the message or the error code it decodes to)
DEEP = {
    # a free-form map: accepted as it is (the server reads tokens_per_s from it)
    "open.slo": (
        lambda more: with_field(OPEN, "slo", b"\x81" + msgpack.packb("tokens_per_s") + nest(DEPTH - 2 + more)),
        "open",
    ),
    "open.sampling.temperature": (
        lambda more: with_field(
            {k: v for k, v in OPEN.items() if k != "sampling"},
            "sampling",
            b"\x81" + msgpack.packb("temperature") + nest(DEPTH - 2 + more),
        ),
        "bad_field",
    ),
    "open, an unknown field": (lambda more: with_field(OPEN, "later", nest(DEPTH - 1 + more)), "open"),
    "hello, an unknown field": (lambda more: with_field(HELLO, "later", nest(DEPTH - 1 + more)), "hello"),
    "welcome.engine": (
        lambda more: with_field(
            {k: v for k, v in WELCOME.items() if k != "engine"},
            "engine",
            b"\x81" + msgpack.packb("device") + nest(DEPTH - 2 + more),
        ),
        "welcome",
    ),
    "verify.q (packed)": (
        lambda more: b"\x97" + msgpack.packb([1, "verify", "s1", 0, 3, []])[1:] + nest(DEPTH - 1 + more),
        "bad_field",
    ),
    "error.message": (
        lambda more: with_field({"v": 1, "type": "error", "code": "x"}, "message", nest(DEPTH - 1 + more)),
        "bad_field",
    ),
}


@pytest.mark.parametrize("case", list(DEEP))
def test_a_frame_nested_as_deep_as_msgpack_allows_is_a_message_or_a_short_error_and_deeper_is_bad_frame(case):
    """msgpack nests 1,024 containers, Python's repr and json 1,000: a value msgpack hands over can be one that
    repr() cannot print. wire.decode either takes the message or says why in an error its receiver reads (its
    `_show` repeats two levels); one level deeper is msgpack's StackError, a bad_frame."""
    build, expect = DEEP[case]
    frame = build(0)
    assert len(frame) < wire.DEFAULT_MAX_FRAME_BYTES
    try:
        msg = wire.decode(frame)
        got = msg.TYPE
    except wire.WireError as e:
        got = e.code
        assert len(e.message) <= 200, e.message
        back = wire.decode(wire.encode(wire.Error(e.code, e.message, e.sid)))
        assert (back.code, back.message) == (e.code, e.message)
    assert got == expect
    with pytest.raises(wire.WireError) as e:
        wire.decode(build(1))
    assert e.value.code == "bad_frame" and "StackError" in e.value.message


def test_the_servers_reading_of_the_deepest_slo_is_a_short_bad_field_not_a_recursion_error():
    """server_bridge/opens.py's slo_class repeated the value with repr(): a RecursionError out of the connection's
    handler (a 1011 close and a traceback) for an slo msgpack nested past 1,000, and 4 MiB of repr in the log
    line for a long one."""
    from server_bridge.opens import slo_class

    msg = wire.decode(DEEP["open.slo"][0](0))
    with pytest.raises(wire.WireError) as e:
        slo_class(msg.slo, 0.0, msg.sid)
    assert e.value.code == "bad_field" and len(e.value.message) < 200 and e.value.sid == "s1"
    with pytest.raises(wire.WireError) as e:
        slo_class({"tokens_per_s": "x" * (wire.MAX_SCHEMA_CHARS * 4)}, 0.0, "s1")
    assert len(e.value.message) < 200


def objects_frame(element: bytes, cap: int, field: str = "later") -> bytes:
    """An open of exactly `cap` bytes whose `field` is arrays of `element` (one msgpack byte each): as many
    Python objects as one frame can make msgpack build (arrays of 65,535, the most wire.decode allows)."""
    head = with_field({k: v for k, v in OPEN.items() if k != field}, field, b"")
    room = cap - len(head) - 3  # the outer array's header
    full = b"\xdc\xff\xff" + element * 65535
    n_full = room // len(full)
    last = room - n_full * len(full) - 3
    body = full * n_full + b"\xdc" + last.to_bytes(2, "big") + element * last
    frame = head + b"\xdc" + (n_full + 1).to_bytes(2, "big") + body
    assert len(frame) == cap
    return frame


def test_a_frame_at_the_cap_of_the_most_objects_msgpack_can_build_decodes_and_one_byte_more_is_too_large():
    """The frame cap's worst case for msgpack's C unpacker: 4 MiB of empty arrays is 4.2 M lists (~270 MB of
    Python objects while it runs, ~2 s here, most of it the cyclic GC). It ends, and what is left of it is
    nothing (the field is unknown) or a bad_field (where ids go); one byte more is refused unread."""
    cap = wire.DEFAULT_MAX_FRAME_BYTES
    frame = objects_frame(b"\x90", cap)
    t0 = time.perf_counter()
    assert wire.decode(frame, cap).TYPE == "open"
    assert time.perf_counter() - t0 < 20.0
    with pytest.raises(wire.WireError) as e:
        wire.decode(objects_frame(b"\xc0", cap, "prompt_ids"), cap)
    assert e.value.code == "bad_field" and "prompt_ids" in e.value.message
    t0 = time.perf_counter()
    with pytest.raises(wire.WireError) as e:
        wire.decode(frame + b"\xc0", cap)
    assert e.value.code == "too_large" and time.perf_counter() - t0 < 0.1


# --------------------------------------------------------------------------- images at the limit


def png(width: int, height: int, rows: bytes) -> bytes:
    """An 8-bit RGB PNG of width x height whose image data is `rows` (filter bytes and pixels), compressed."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(rows, 9)) + chunk(b"IEND", b"")


@functools.cache
def pictures() -> SimpleNamespace:
    """The images at the pixel limit: the largest PNG (a black 4096 x 4096 image: 48 MiB of rows that compress
    to ~49 KB), one one byte over (`over`), one with half the rows its header implies (`short`), a JPEG."""
    rows = b"\0" * ((1 + 3 * SIDE) * SIDE)
    return SimpleNamespace(
        largest=png(SIDE, SIDE, rows),
        over=png(SIDE, SIDE, rows + b"\0"),
        short=png(SIDE, SIDE, rows[: len(rows) // 2]),
        jpeg=cv2.imencode(".jpg", np.zeros((SIDE, SIDE, 3), np.uint8), [cv2.IMWRITE_JPEG_QUALITY, 10])[1].tobytes(),
    )


def test_the_largest_png_the_limits_allow_is_inflated_once_in_64_kib_steps_and_a_byte_more_is_refused():
    """check_png_data (what runs before libmtmd's stb_image) inflates up to 48 MiB for an image at the pixel
    limit, holding 64 KiB at a time; data that inflates one byte past the header's size is refused."""
    p = pictures()
    assert len(p.largest) <= images.MAX_IMAGE_BYTES and images.check_bytes(p.largest)
    tracemalloc.start()
    try:
        images.check_png_data(p.largest)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20
    with pytest.raises(images.ImageError, match="inflates past"):
        images.check_png_data(p.over)
    images.check_png_data(p.short)  # less data than the header implies is the decoder's to refuse (below)


def test_opencv_decodes_the_largest_image_a_submit_takes_and_refuses_data_shorter_than_its_header():
    """The local API's submit (agent/app/daemon.py _decode_image: OpenCV's libpng and libjpeg): an image at the
    pixel limit decodes to 4096 x 4096 (48 MiB); a PNG or JPEG cut short of what its header says is refused."""
    from agent.app.daemon import _decode_image

    def b64(data: bytes) -> str:
        return base64.b64encode(data).decode()

    p = pictures()
    assert len(p.jpeg) <= images.MAX_IMAGE_BYTES
    for data in (p.largest, p.jpeg):
        assert _decode_image(b64(data)).image.shape == (SIDE, SIDE, 3)
    for data in (p.short, p.jpeg[: len(p.jpeg) // 2]):
        with pytest.raises(ValueError, match="could not be decoded"):
            _decode_image(b64(data))


def test_pillow_decodes_the_largest_image_the_torch_engine_takes_within_its_header():
    """The torch engine's decoder (server_bridge/engines/vision_torch.py decode: Pillow): an image at the pixel
    limit decodes to 4096 x 4096; a JPEG cut short is refused with the image named; a PNG with half the rows
    its header implies decodes to no more than the header's size."""
    pytest.importorskip("torch")
    from server_bridge.engines.vision_torch import decode

    p = pictures()
    for data in (p.largest, p.jpeg, p.short):
        assert decode(images.PromptImage.of(data, 0)).shape == (SIDE, SIDE, 3)
    with pytest.raises(ValueError, match="could not be decoded"):
        decode(images.PromptImage.of(p.jpeg[: len(p.jpeg) // 2], 0))
