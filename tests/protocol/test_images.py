"""A prompt's images on the wire: bytes or their hash, bounded, JPEG or PNG only, errors on the session."""

import ctypes
import hashlib
import io
import struct
import threading
import time
import tracemalloc
import zlib
from types import SimpleNamespace

import cv2
import msgpack
import numpy as np
import pytest
from PIL import Image

from protocol import images, wire
from protocol.wire import WireError
from runtime.vision import READY


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


# --------------------------------------------------------------------------- sizes, read from the header alone


def png_header(width: int, height: int, chunks: tuple = ()) -> bytes:
    """A PNG that declares width x height (its image data a few zero rows): what a decoder would allocate for."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    rows = zlib.compress(b"\0" * (1 + 3 * min(width, 64)) * 4)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + b"".join(chunk(k, d) for k, d in chunks)
        + chunk(b"IDAT", rows)
        + chunk(b"IEND", b"")
    )


def with_sof(data: bytes, width: int, height: int, marker: int = 0xC0) -> bytes:
    """A real JPEG whose frame header (SOFn) is made to declare width x height."""
    at = data.index(bytes([0xFF, marker])) + 5  # FF Cn, length (2), precision (1), then height, width
    return data[:at] + struct.pack(">HH", height, width) + data[at + 4 :]


def test_a_png_bomb_is_refused_from_its_header_in_milliseconds_without_decoding():
    bomb = png_header(30000, 30000)  # ~100 bytes that a decoder would make a 2.5 GiB bitmap of
    assert len(bomb) < 200
    tracemalloc.start()
    t0 = time.perf_counter()
    with pytest.raises(images.ImageError, match="30000 x 30000 pixels"):
        images.check_bytes(bomb)
    with pytest.raises(images.ImageError):
        images.PromptImage.of(bomb, 1)
    with pytest.raises(WireError) as e:
        wire.decode(open_frame([{"at": 1, "data": bomb}]))
    elapsed, (_, peak) = time.perf_counter() - t0, tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert e.value.code == "bad_image" and e.value.sid == "robot-3" and "30000 x 30000" in e.value.message
    assert elapsed < 0.5 and peak < 1 << 20  # nothing was decoded


@pytest.mark.parametrize(
    "width, height, ok",
    [(640, 480, True), (4096, 4096, True), (4097, 1, False), (1, 4097, False), (0, 10, False), (2**31, 2**31, False)],
)
def test_the_limits_are_a_side_and_a_pixel_count(width, height, ok):
    if ok:
        assert images.check_header(png_header(width, height)) == (width, height)
    else:
        with pytest.raises(images.ImageError, match="refused"):
            images.check_header(png_header(width, height))
    assert images.MAX_IMAGE_SIDE**2 <= images.MAX_IMAGE_PIXELS  # a 4096 square is the largest image


def test_a_jpeg_bomb_is_refused_whichever_frame_header_declares_it():
    real = jpeg(size=64)
    assert images.check_header(real) == (64, 64)
    assert images.check_header(with_sof(real, 640, 480)) == (640, 480)
    with pytest.raises(images.ImageError, match="65000 x 65000"):
        images.check_bytes(with_sof(real, 65000, 65000))
    progressive = io.BytesIO()
    Image.fromarray(np.zeros((48, 64, 3), np.uint8)).save(progressive, format="JPEG", progressive=True)
    assert images.check_header(progressive.getvalue()) == (64, 48)
    with pytest.raises(images.ImageError, match="refused"):
        images.check_bytes(with_sof(progressive.getvalue(), 20000, 20000, marker=0xC2))
    # a small frame header first and a huge second one: PIL would take the last
    sof = real[real.index(b"\xff\xc0") :][: 2 + int.from_bytes(real[real.index(b"\xff\xc0") + 2 :][:2], "big")]
    huge = with_sof(sof, 30000, 30000)
    with pytest.raises(images.ImageError, match="30000 x 30000"):
        images.check_bytes(real.replace(sof, sof + huge, 1))
    dhp = b"\xff\xde" + huge[2:]  # a hierarchical JPEG's DHP: PIL reads a size from it as from a SOF
    with pytest.raises(images.ImageError, match="30000 x 30000"):
        images.check_bytes(real.replace(sof, sof + dhp, 1))


@pytest.mark.parametrize(
    "data, says",
    [
        (b"\xff\xd8\xff\xe0\x00\x10JFIF\0\x01\x01\0\0\x01\0\x01\0\0\xff\xda\x00\x02", "without a frame header"),
        (b"\xff\xd8\xff\xe0" + b"not a jpeg" * 40, "corrupt or truncated"),  # a segment longer than the bytes
        (b"\xff\xd8\xff\xfe\x00\x02junk\xff\xc0\x00\x08\x08\x00\x40\x00\x40\x00\xff\xda", "no marker at byte 6"),
        (b"\xff\xd8\xff\xc0\x00\x08\x08\x00\x40\x00\x40\x00", "corrupt or truncated"),  # no scan follows
        (b"\xff\xd8" + b"\xff\xfe\x00\x02" * 600 + b"\xff\xda", "over 512 segments"),
        (b"\xff\xd8\xff\xd9", "without a frame header"),
        (b"\x89PNG\r\n\x1a\n" + b"\0" * 64, "IHDR"),
        (png_header(64, 64, ((b"IHDR", struct.pack(">IIBBBBB", 30000, 30000, 8, 2, 0, 0, 0)),)), "two IHDR"),
        (png_header(64, 64, ((b"tEXt", b"k\0v"),) * 600), "over 512 chunks"),
    ],
)
def test_a_header_no_decoder_reads_the_same_way_is_refused(data, says):
    with pytest.raises(images.ImageError, match=says):
        images.check_header(data)


def test_headers_of_real_encoders_pass():
    pixels = np.random.default_rng(0).integers(0, 255, (480, 640, 3), dtype=np.uint8)
    for fmt, options in [("JPEG", {}), ("JPEG", {"progressive": True, "icc_profile": b"p" * 70000}), ("PNG", {})]:
        out = io.BytesIO()
        Image.fromarray(pixels).save(out, format=fmt, **options)
        assert images.check_header(out.getvalue()) == (640, 480)
    fill = b"\xff\xd8\xff\xff\xff\xc0\x00\x08\x08\x00\x40\x00\x30\x03\xff\xda"  # fill bytes before a marker
    assert images.check_header(fill) == (48, 64)
    assert images.limits() == {"max_images": 4, "max_bytes": 1 << 20, "max_side": 4096, "max_pixels": 1 << 24}


def test_a_welcome_states_the_image_limits_and_the_robot_checks_them():
    welcome = wire.Welcome.make_dummy()
    welcome.limits["images"] = {"marker": 49190, **images.limits()}
    assert wire.decode(wire.encode(welcome)).limits["images"]["max_pixels"] == images.MAX_IMAGE_PIXELS
    del welcome.limits["images"]["max_side"]  # an older server's
    assert wire.decode(wire.encode(welcome)).limits["images"]["max_bytes"] == images.MAX_IMAGE_BYTES
    for bad in ({"marker": -1}, {"max_pixels": "all"}, {"max_bytes": 0}):
        welcome.limits["images"] = {"marker": 49190, **images.limits(), **bad}
        with pytest.raises(WireError):
            wire.decode(wire.encode(welcome))


def test_the_robot_holds_its_images_to_the_bounds_the_verifier_states():
    shown = [images.PromptImage.of(png_header(640, 480), 1)]
    images.check_offered(shown, {"marker": 7, **images.limits()})
    images.check_offered(shown, {"marker": 7, "max_images": 4, "max_bytes": 1 << 20})  # an older server's
    images.check_offered([images.PromptImage(1, "0" * 64)], {"max_side": 16})  # a hash: the server has it
    for offered, says in [
        ({"max_side": 512}, "640 x 480 pixels"),
        ({"max_pixels": 640 * 479}, "640 x 480 pixels"),
        ({"max_bytes": 10}, "bytes"),
        ({"max_images": 0}, "at most 0"),
    ]:
        with pytest.raises(images.ImageError, match=says):
            images.check_offered(shown, offered)


# --------------------------------------------------------------------------- image data, inflated in bounded steps


def png_with_data(width: int, height: int, raw: bytes, interlace: int = 0) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, interlace)
    idat = zlib.compress(raw, 9)
    halves = [idat[: len(idat) // 2], idat[len(idat) // 2 :]]  # image data may come in several chunks
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + b"".join(chunk(b"IDAT", h) for h in halves) + chunk(b"IEND", b"")
    )


def test_a_png_whose_image_data_inflates_past_its_header_is_refused_in_bounded_memory():
    bomb = png_with_data(64, 64, b"\0" * (16 << 20))  # 16 KB that stb_image would inflate to 16 MiB (1 MiB: 1 GiB)
    assert len(bomb) < 32_000 and images.check_bytes(bomb)  # its header is fine: the wire lets it through
    tracemalloc.start()
    with pytest.raises(images.ImageError, match="inflates past the 12352 bytes"):
        images.check_png_data(bomb)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 1 << 20
    vision = fake_vision()
    with pytest.raises(images.ImageError, match="inflates past"):
        vision.prepare(images.PromptImage.of(bomb, 1))
    assert vision.mtmd.decoded == 0


def test_the_image_data_a_header_implies_is_what_decoders_read():
    pixels = np.random.default_rng(0).integers(0, 255, (37, 53, 3), dtype=np.uint8)
    rows = b"".join(b"\0" + row.tobytes() for row in pixels)
    adam7 = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2))
    passes = b"".join(  # Adam7: seven sub-images (x0, y0, dx, dy), each row with its filter byte
        b"\0" + row.tobytes() for x, y, dx, dy in adam7 for row in pixels[y::dy, x::dx]
    )
    for raw, interlace in ((rows, 0), (passes, 1)):
        png = png_with_data(53, 37, raw, interlace)
        images.check_png_data(png)
        assert (np.asarray(Image.open(io.BytesIO(png)).convert("RGB")) == pixels).all()
        with pytest.raises(images.ImageError, match="inflates past"):
            images.check_png_data(png_with_data(53, 37, raw + b"\0", interlace))
    for mode in ("RGB", "RGBA", "L", "LA", "P", "1", "I;16"):
        out = io.BytesIO()
        Image.fromarray(pixels).convert(mode).save(out, format="PNG")
        images.check_png_data(out.getvalue())


# --------------------------------------------------------------------------- libmtmd's decode (runtime/vision.py)


class FakeMtmd:
    """Just enough of llama_cpp.mtmd_cpp to count what MtmdVision decodes (no model, no llama.cpp)."""

    mtmd_bitmap_p_ctypes = ctypes.c_void_p

    def __init__(self, size: tuple[int, int]):
        self.size, self.decoded, self.threads, self.freed, self.opt = size, 0, [], 0, None

    def mtmd_helper_init_opt_default(self):
        return SimpleNamespace(video_params=SimpleNamespace(ffmpeg_bin_dir=None))

    def mtmd_helper_bitmap_init_from_buf(self, ctx, buf, n, placeholder, opt):
        self.decoded += 1
        self.threads.append(threading.current_thread().name)
        self.opt = opt
        return 1

    def mtmd_bitmap_get_nx(self, bitmap):
        return self.size[0]

    def mtmd_bitmap_get_ny(self, bitmap):
        return self.size[1]

    def mtmd_input_text(self, *args):
        return ctypes.c_int(0)

    def mtmd_tokenize(self, *args):
        return 0

    def mtmd_input_chunks_size(self, chunks):
        return 1  # one chunk of 33 positions, 33 tokens

    def mtmd_input_chunks_get(self, chunks, i):
        return chunks

    def mtmd_input_chunk_get_n_pos(self, chunk):
        return 33

    mtmd_input_chunk_get_n_tokens = mtmd_input_chunk_get_n_pos

    def mtmd_input_chunks_free(self, chunks):
        self.freed += 1

    mtmd_bitmap_free = mtmd_bitmap_set_id = lambda self, *args: None  # noqa: E731
    mtmd_input_chunks_init = lambda self: object()  # noqa: E731


def fake_vision(size=(64, 64)):
    from runtime.vision import ImageCache, MtmdVision

    vision = object.__new__(MtmdVision)  # no projector: the decode path alone
    vision.mtmd, vision.mctx, vision.marker = FakeMtmd(size), 1, b"<__media__>"
    vision.images = ImageCache(vision._entry, vision._free)
    return vision


def test_libmtmd_never_sees_an_image_over_the_limits_or_decodes_it_as_a_video():
    vision = fake_vision()
    bomb = images.PromptImage(1, "0" * 64, png_header(30000, 30000))  # made without check_bytes
    with pytest.raises(images.ImageError, match="30000 x 30000"):
        vision.positions(bomb)
    with pytest.raises(images.ImageError):
        vision.prepare(bomb)
    assert vision.mtmd.decoded == 0
    assert vision.positions(images.PromptImage.of(png_header(64, 64), 1)) == 33
    assert vision.mtmd.opt.video_params.ffmpeg_bin_dir == b"/dev/null"  # no ffmpeg for bytes stb refuses
    liar = fake_vision(size=(64, 65))  # the decoder made another size than the header said
    with pytest.raises(images.ImageError, match="its header says 64 x 64"):
        liar.positions(images.PromptImage.of(png_header(64, 64), 1))


def test_an_image_prepared_in_another_thread_is_only_taken_by_the_model_thread():
    vision = fake_vision()
    image = images.PromptImage.of(png_header(64, 64), 1)
    worker = threading.Thread(target=vision.prepare, args=(image,), name="images_0")
    worker.start()
    worker.join()
    assert vision.positions(image) == 33 and vision.positions(image) == 33
    vision.prepare(image)  # cached now: nothing to do
    assert vision.mtmd.threads == ["images_0"] and not vision.images._ready  # decoded once, off this thread
    for seed in range(READY + 2):  # ready ones nobody took are dropped beyond READY, and freed
        vision.prepare(images.PromptImage.of(png_header(64, 64, ((b"tEXt", b"seed\0%d" % seed),)), 1))
    assert len(vision.images._ready) == READY and vision.mtmd.freed == 2
