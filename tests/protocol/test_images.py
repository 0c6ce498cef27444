"""A prompt's images on the wire: bytes or their hash, bounded, JPEG or PNG only, errors on the session."""

import hashlib

import cv2
import msgpack
import numpy as np
import pytest

from protocol import images, wire
from protocol.wire import WireError


def jpeg(seed: int = 0, size: int = 64) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, (size, size, 3), dtype=np.uint8)
    return cv2.imencode(".jpg", pixels)[1].tobytes()


def png() -> bytes:
    return cv2.imencode(".png", np.zeros((8, 8, 3), np.uint8))[1].tobytes()


def open_frame(images_field, ids=(1, 7, 2, 7, 3)):
    return msgpack.packb(
        {
            "v": wire.PROTOCOL_VERSION,
            "type": "open",
            "sid": "robot-3",
            "prompt_ids": list(ids),
            "sampling": {"temperature": 0.0},
            "images": images_field,
        },
        use_bin_type=True,
    )


def test_an_open_carries_its_images_and_a_reopen_only_their_hashes():
    a, b = images.PromptImage.of(jpeg(1), 1), images.PromptImage.of(png(), 3)
    msg = wire.Open("s1", [1, 7, 2, 7, 3], {"temperature": 0.0, "top_k": 0, "seed": 0}, images=[a, b])
    back = wire.decode(wire.encode(msg))
    assert back.images == [a, b] and back.images[0].format == "jpeg" and back.images[1].format == "png"
    assert back.images[0].sha256 == hashlib.sha256(a.data).hexdigest()
    reopen = wire.decode(open_frame([a.to_wire(with_data=False), b.to_wire(with_data=False)]))
    assert [(i.at, i.sha256, i.data) for i in reopen.images] == [(1, a.sha256, None), (3, b.sha256, None)]


def test_a_text_open_is_the_frame_it_was_before_images():
    frame = wire.Open.make_dummy().to_wire()
    assert "images" not in frame and wire.decode(wire.encode(wire.Open.make_dummy())).images == []


@pytest.mark.parametrize(
    "field, says",
    [
        ("not a list", "must be a list"),
        ([{"at": 1, "data": jpeg()}] * (images.MAX_IMAGES + 1), "at most"),
        ([{"at": 1, "data": b"GIF89a" + b"\0" * 20}], "JPEG or a PNG"),
        ([{"at": 1, "data": b""}], "empty"),
        ([{"at": 1, "data": b"\xff\xd8\xff" + b"\0" * images.MAX_IMAGE_BYTES}], "over the limit"),
        ([{"at": 9, "data": jpeg()}], "must index prompt_ids"),
        ([{"at": 3, "data": jpeg()}, {"at": 1, "data": jpeg(2)}], "prompt order"),
        ([{"at": 1, "sha256": "abc"}], "64 lower-case hex"),
        ([{"at": 1, "data": jpeg(), "sha256": "0" * 64}], "does not match"),
        ([{"at": 1, "pixels": b"x"}], "map of at and data"),
    ],
)
def test_a_bad_image_is_refused_with_a_clear_error_naming_the_session(field, says):
    with pytest.raises(WireError) as e:
        wire.decode(open_frame(field), max_bytes=8 * 2**20)
    assert e.value.code == "bad_image" and says in e.value.message and e.value.sid == "robot-3"
