"""The images of a prompt, as `open` carries them: encoded bytes (JPEG or PNG), or the hash of bytes sent before.

A vision-language prompt holds the model's own image marker token (SmolVLM's `<image>`, Qwen2-VL's
`<|image_pad|>`) once per image, in `prompt_ids`; `images[i]` goes with the i-th marker, and `at` is
that marker's index in `prompt_ids`. Each side builds the image's embeddings with its own vision
encoder and expands the marker to as many positions as its encoder makes; drafting, verification and
every payload stay over the text tokens after the prompt.

On the wire an image is {"at": int, "data": bytes} or, on a re-open, {"at": int, "sha256": hex} when
the server may still hold the bytes (it answers `unknown_image` when it does not, and the robot sends
them again). Bounded: at most MAX_IMAGES per prompt, MAX_IMAGE_BYTES each, JPEG or PNG by their magic
bytes; anything else is refused with `bad_image` on that session only.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

MAX_IMAGES = 4  # images in one prompt
MAX_IMAGE_BYTES = 1 << 20  # one encoded image (a 640x480 JPEG is ~50-150 KB)
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

    def to_wire(self, with_data: bool = True) -> dict:
        if with_data and self.data is not None:
            return {"at": self.at, "data": self.data}
        return {"at": self.at, "sha256": self.sha256}


def image_format(data: bytes) -> str | None:
    """ "jpeg" or "png" by the magic bytes; None for anything else."""
    return next((name for name, magic in _MAGIC.items() if data.startswith(magic)), None)


def check_bytes(data: Any) -> bytes:
    if not isinstance(data, (bytes, bytearray)):
        raise ImageError("an image must be bytes (an encoded JPEG or PNG)")
    if not data:
        raise ImageError("an image is empty")
    if len(data) > MAX_IMAGE_BYTES:
        raise ImageError(
            f"an image of {len(data)} bytes is over the limit of {MAX_IMAGE_BYTES}: "
            "send it smaller (a 640x480 JPEG is ~100 KB)"
        )
    if image_format(data) is None:
        raise ImageError("an image must be a JPEG or a PNG (its first bytes are neither)")
    return bytes(data)


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
            raise ImageError(f"images[{i}].at must index prompt_ids (0..{n_ids - 1}), got {at!r}")
        if out and at <= out[-1].at:
            raise ImageError("images must be in prompt order, one per marker (increasing at)")
        if "data" in item:
            data = check_bytes(item["data"])
            digest = hashlib.sha256(data).hexdigest()
            if "sha256" in item and item["sha256"] != digest:
                raise ImageError(f"images[{i}].sha256 does not match its data")
            out.append(PromptImage(at, digest, data))
        else:
            digest = item.get("sha256")
            if not (isinstance(digest, str) and len(digest) == 64 and all(c in "0123456789abcdef" for c in digest)):
                raise ImageError(f"images[{i}] needs data, or a sha256 of 64 lower-case hex digits")
            out.append(PromptImage(at, digest))
    return out
