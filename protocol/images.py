"""The images of a prompt, as `open` carries them: encoded bytes (JPEG or PNG), or the hash of bytes sent before.

A vision-language prompt holds the model's own image marker token (SmolVLM's `<image>`, Qwen2-VL's
`<|image_pad|>`) once per image, in `prompt_ids`; `images[i]` goes with the i-th marker, and `at` is
that marker's index in `prompt_ids`. Each side builds the image's embeddings with its own vision
encoder and expands the marker to as many positions as its encoder makes; drafting, verification and
every payload stay over the text tokens after the prompt.

On the wire an image is {"at": int, "data": bytes} or, on a re-open, {"at": int, "sha256": hex} when
the server may still hold the bytes (it answers `unknown_image` when it does not, and the robot sends
them again). Bounded: at most MAX_IMAGES per prompt, MAX_IMAGE_BYTES each, JPEG or PNG by their magic
bytes, at most MAX_IMAGE_SIDE pixels a side and MAX_IMAGE_PIXELS in all; anything else is refused with
`bad_image` on that session only.

Width and height are read from the header (PNG's IHDR chunk, JPEG's SOFn frame header) before any
decoder runs, and `check_bytes` refuses an image over the limits: a 48 KB PNG can declare a 1 GiB
bitmap, and a decoder allocates what the header says. Every decoder of untrusted bytes here (the wire's
`open`, the robot's local API, libmtmd in runtime/vision.py, PIL in server_bridge/engines/vision_torch.py, OpenCV
on the robot) goes through it first. Where libmtmd decodes, a PNG's image data must also inflate to no
more than its header implies (`check_png_data`: stb_image inflates all there is, whatever the header says).
"""

from __future__ import annotations

import hashlib
import re
import zlib
from dataclasses import dataclass
from typing import Any

MAX_IMAGES = 4  # images in one prompt
MAX_IMAGE_BYTES = 1 << 20  # one encoded image (a 640x480 JPEG is ~50-150 KB)
MAX_IMAGE_SIDE = 4096  # pixels, either side, as the header declares them
MAX_IMAGE_PIXELS = 1 << 24  # 16 Mpx (4096 x 4096): at most 48 MiB decoded as RGB
_MAGIC = {"jpeg": b"\xff\xd8\xff", "png": b"\x89PNG\r\n\x1a\n"}


class ImageError(ValueError):
    """An image that cannot be accepted (the wire answers it as `bad_image`)."""


@dataclass(frozen=True)
class PromptImage:
    at: int  # the index in prompt_ids of the image marker this image replaces
    sha256: str  # of the encoded bytes
    data: bytes | None = None  # None: only the hash travelled (a re-open)

    @classmethod
    def of(cls, data: bytes, at: int) -> "PromptImage":
        check_bytes(data)
        return cls(at, hashlib.sha256(data).hexdigest(), data)

    @property
    def format(self) -> str | None:
        return image_format(self.data) if self.data is not None else None

    def to_wire(self, with_data: bool = True) -> dict[str, Any]:
        if with_data and self.data is not None:
            return {"at": self.at, "data": self.data}
        return {"at": self.at, "sha256": self.sha256}


def image_format(data: bytes) -> str | None:
    """ "jpeg" or "png" by the magic bytes; None for anything else."""
    return next((name for name, magic in _MAGIC.items() if data.startswith(magic)), None)


def check_bytes(data: Any) -> bytes:
    """The bytes of an image the wire accepts: a JPEG or PNG of at most MAX_IMAGE_BYTES whose header declares
    at most MAX_IMAGE_SIDE pixels a side and MAX_IMAGE_PIXELS in all; ImageError saying what is wrong."""
    if not isinstance(data, (bytes, bytearray)):
        raise ImageError("an image must be bytes (an encoded JPEG or PNG)")
    if not data:
        raise ImageError("an image is empty")
    if len(data) > MAX_IMAGE_BYTES:
        raise ImageError(
            f"an image of {len(data)} bytes is over the limit of {MAX_IMAGE_BYTES}: "
            "send it smaller (a 640x480 JPEG is ~100 KB)"
        )
    raw = bytes(data)  # the size is bounded: the copy is cheap
    check_header(raw)
    return raw


def check_header(data: bytes) -> tuple[int, int]:
    """(width, height) of a JPEG or PNG as its header declares them, within the limits; ImageError otherwise.

    Reads the header alone (no decoder runs, whatever the size of the bytes); no cap on the byte count,
    for callers that bound it their own way (a camera's frames)."""
    kind = image_format(data)
    if kind is None:
        raise ImageError("an image must be a JPEG or a PNG (its first bytes are neither)")
    width, height = _png_size(data) if kind == "png" else _jpeg_size(data)
    check_size(width, height)
    return width, height


def check_size(width: int, height: int) -> None:
    """ImageError for an image of width x height pixels over MAX_IMAGE_SIDE or MAX_IMAGE_PIXELS (or empty)."""
    if not (0 < width <= MAX_IMAGE_SIDE and 0 < height <= MAX_IMAGE_SIDE and width * height <= MAX_IMAGE_PIXELS):
        raise ImageError(
            f"an image of {width} x {height} pixels is refused: at most {MAX_IMAGE_SIDE} pixels a side and "
            f"{MAX_IMAGE_PIXELS} in all (send it smaller; a camera frame is ~640 x 480)"
        )


def limits() -> dict[str, Any]:
    """The image bounds as welcome.limits.images states them (beside the target's marker id)."""
    return {
        "max_images": MAX_IMAGES,
        "max_bytes": MAX_IMAGE_BYTES,
        "max_side": MAX_IMAGE_SIDE,
        "max_pixels": MAX_IMAGE_PIXELS,
    }


def check_offered(images: list[PromptImage], offered: dict[str, Any]) -> None:
    """ImageError if a prompt's images break the bounds a verifier states in welcome.limits.images (a server
    may take less than this side's own limits; a bound an older server does not state is this side's)."""
    most = {**limits(), **{k: v for k, v in offered.items() if k in limits()}}
    if len(images) > most["max_images"]:
        raise ImageError(f"{len(images)} images in one prompt: the verifier takes at most {most['max_images']}")
    for image in images:
        if image.data is None:
            continue
        if len(image.data) > most["max_bytes"]:
            raise ImageError(f"an image of {len(image.data)} bytes: the verifier takes at most {most['max_bytes']}")
        width, height = check_header(image.data)
        if max(width, height) > most["max_side"] or width * height > most["max_pixels"]:
            raise ImageError(
                f"an image of {width} x {height} pixels: the verifier takes at most {most['max_side']} a side "
                f"and {most['max_pixels']} in all (lower perception.image_max_side)"
            )


# --------------------------------------------------------------------------- headers, read without a decoder

# PNG: the 8-byte signature, then chunks [length u32 BE][type 4][data][crc 4]; IHDR comes first and holds
# width u32 BE, height u32 BE. A second IHDR before the image data would make some decoders (PIL) read
# another size than this one: refused.
MAX_HEADER_SEGMENTS = 512  # PNG chunks or JPEG marker segments before the image data (a camera's have ~10)


def _png_size(data: bytes) -> tuple[int, int]:
    if len(data) < 33 or data[12:16] != b"IHDR" or int.from_bytes(data[8:12], "big") != 13:
        raise ImageError("a PNG must start with its IHDR header (13 bytes): these bytes are no PNG")
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    at = 33  # the chunk after IHDR's data and crc
    for _ in range(MAX_HEADER_SEGMENTS):
        kind = data[at + 4 : at + 8]
        if len(kind) < 4 or kind in (b"IDAT", b"IEND"):
            return width, height
        if kind == b"IHDR":
            raise ImageError("a PNG with two IHDR headers is refused")
        at += 12 + int.from_bytes(data[at : at + 4], "big")
    raise ImageError(f"a PNG with over {MAX_HEADER_SEGMENTS} chunks before its image data is refused")


# The bytes per pixel of each PNG colour type (grey, RGB, palette, grey + alpha, RGBA), and Adam7's passes
# (x0, y0, dx, dy): what the image data inflates to follows from IHDR alone.
_PNG_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}
_ADAM7 = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2))
_INFLATE_STEP = 1 << 16


def check_png_data(data: bytes) -> None:
    """ImageError if a PNG's image data (its IDAT chunks) inflates to more than its header implies.

    stb_image (libmtmd's decoder) inflates the whole stream whatever the header says, so 1 MiB of IDAT
    declared as 64 x 64 pixels becomes a 1 GiB buffer. This inflates it _INFLATE_STEP at a time and throws
    each step away, so it holds no more than that, and stops at the first byte past the header's size; it
    costs the time to inflate what the header implies (~2 ms for a 640 x 480 frame, ~0.3 s at the limits),
    so it runs where images are decoded (the server's image thread), not in check_bytes."""
    width, height = check_header(data)
    depth, color, interlace = data[24], data[25], data[28]
    if color not in _PNG_CHANNELS or depth not in (1, 2, 4, 8, 16):
        raise ImageError(f"a PNG of colour type {color} and bit depth {depth} is no PNG")
    bits = depth * _PNG_CHANNELS[color]

    def raw(w: int, h: int) -> int:  # filter byte + packed pixels per row
        return h * (1 + (w * bits + 7) // 8) if w and h else 0

    if interlace:
        expected = sum(raw((width - x + dx - 1) // dx, (height - y + dy - 1) // dy) for x, y, dx, dy in _ADAM7)
    else:
        expected = raw(width, height)
    inflate, total, at = zlib.decompressobj(), 0, 8
    while at + 8 <= len(data):
        length, kind = int.from_bytes(data[at : at + 4], "big"), data[at + 4 : at + 8]
        if kind == b"IDAT":
            chunk = data[at + 8 : at + 8 + length]
            while chunk and not inflate.eof:
                try:
                    total += len(inflate.decompress(chunk, _INFLATE_STEP))
                except zlib.error as e:
                    raise ImageError(f"a PNG whose image data is corrupt ({e})") from None
                if total > expected:
                    raise ImageError(
                        f"a PNG of {width} x {height} pixels whose image data inflates past the {expected} bytes "
                        "its header implies is refused"
                    )
                chunk = inflate.unconsumed_tail
        elif kind == b"IEND":
            break
        at += 12 + length


# JPEG: SOI (FF D8), then marker segments [FF, marker, length u16 BE counting itself, data] up to the first
# scan (SOS, FF DA), after which entropy-coded data follows. The frame header is a SOFn segment (C0-CF less
# DHT C4, JPG C8 and DAC CC): precision u8, height u16 BE, width u16 BE, components; a hierarchical JPEG's
# DHP (DE) has the same layout, and PIL reads a size from it too. Any number of FF fill bytes may precede
# a marker; TEM and RST0-7 stand alone. Every frame header before the first scan is checked (PIL takes the
# last, stb and libjpeg refuse a second); anything that is not a well-formed segment is refused rather than
# skipped, so no decoder finds a frame header this walk did not.
_JPEG_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC} | {0xDE}
_JPEG_STANDALONE = frozenset([0x01, *range(0xD0, 0xD8)])
_JPEG_SOS, _JPEG_EOI = 0xDA, 0xD9
_FILL = re.compile(rb"\xff+")


def _jpeg_size(data: bytes) -> tuple[int, int]:
    size: tuple[int, int] | None = None
    at, n = 2, len(data)
    for _ in range(MAX_HEADER_SEGMENTS):
        fill = _FILL.match(data, at)
        if fill is None or fill.end() >= n:
            raise ImageError(f"a JPEG whose header is corrupt or truncated (no marker at byte {at})")
        marker, at = data[fill.end()], fill.end() + 1
        if marker in _JPEG_STANDALONE:
            continue
        if marker == _JPEG_SOS and size is not None:
            return size
        if marker in (_JPEG_EOI, _JPEG_SOS):
            raise ImageError("a JPEG without a frame header (SOF) before its image data is refused")
        length = int.from_bytes(data[at : at + 2], "big")
        if marker in (0x00, 0xD8) or length < 2 or at + length > n:
            raise ImageError(f"a JPEG whose header is corrupt or truncated (marker {marker:02X} at byte {at - 1})")
        if marker in _JPEG_SOF:
            if length < 8:
                raise ImageError("a JPEG whose frame header is too short")
            height, width = int.from_bytes(data[at + 3 : at + 5], "big"), int.from_bytes(data[at + 5 : at + 7], "big")
            check_size(width, height)
            size = (width, height)
        at += length
    raise ImageError(f"a JPEG with over {MAX_HEADER_SEGMENTS} segments before its image data is refused")


def from_wire(v: Any, n_ids: int) -> list[PromptImage]:
    """Validate `open.images` against a prompt of n_ids ids; raises ImageError with what is wrong."""
    if v is None:
        return []
    if not isinstance(v, list):
        raise ImageError("images must be a list")
    if len(v) > MAX_IMAGES:
        raise ImageError(f"{len(v)} images in one prompt: at most {MAX_IMAGES}")
    out: list[PromptImage] = []
    for i, item in enumerate(v):
        if not isinstance(item, dict) or "at" not in item or not set(item) <= {"at", "data", "sha256"}:
            raise ImageError(f"images[{i}] must be a map of at and data (or sha256)")
        at = item["at"]
        if not isinstance(at, int) or isinstance(at, bool) or not 0 <= at < n_ids:
            shown = at if isinstance(at, int) else type(at).__name__  # never a MiB of echoed bytes
            raise ImageError(f"images[{i}].at must index prompt_ids (0..{n_ids - 1}), got {shown}")
        if out and at <= out[-1].at:
            raise ImageError("images must be in prompt order, one per marker (increasing at)")
        if "data" in item:
            data = check_bytes(item["data"])
            digest = hashlib.sha256(data).hexdigest()
            if "sha256" in item and item["sha256"] != digest:
                raise ImageError(f"images[{i}].sha256 does not match its data")
            out.append(PromptImage(at, digest, data))
        else:
            named = item.get("sha256")
            if not (isinstance(named, str) and len(named) == 64 and all(c in "0123456789abcdef" for c in named)):
                raise ImageError(f"images[{i}] needs data, or a sha256 of 64 lower-case hex digits")
            out.append(PromptImage(at, named))
    return out
