"""A prompt's images for the torch engine, through a transformers vision-language model's own processor and tower.

    vision = vision_for(config)(model, processor)   # Idefics3 / SmolVLM; other VLMs refused or read as text
    n = vision.positions(image)                     # KV positions the image's one marker expands to
    embeds = vision.embed(image)                    # [n, hidden]: what the decoder reads at those positions
    image = vision.resolve(image)                   # its bytes from the cache when only the sha256 came
    vision.prepare(image)                           # decode and preprocess now, in this thread (not the model's)

A prompt holds one image marker per image (protocol/images.py). The model's own processor expands that
marker into the model's whole layout for the image: for SmolVLM (Idefics3) each tile is
`<fake_token_around_image><row_R_col_C>` + k `<image>`, rows end in "\n", and the overview follows as
`<fake_token_around_image><global-img>` + k `<image>` + `<fake_token_around_image>` (33 positions for a
square image on the test VLM, the layout libmtmd writes too). `embed` gives that layout's input
embeddings as the model's own forward merges them (Idefics3Model.inputs_merger): the text embeddings
of its tokens, and the vision tower + connector's features at its `<image>` tokens. The layout starts
and ends with special tokens, so the text around a marker tokenizes as it does in the whole prompt.

Decoding and preprocessing (resize, tiles, normalisation) are kept for the last CACHED images by
sha256, with their bytes, so an image sent once is known by its hash after (a re-open sends only the
hash); the vision tower runs on every `embed` (an open: rare). `positions`, `resolve` and `prepare` may be
called from any thread: the server decodes and preprocesses an open's images with `prepare` in a thread of
its own, before the open reaches the model thread, which then finds them READY and only embeds them.

Untrusted bytes: the header's width and height are checked against protocol/images.py's limits before PIL
opens the bytes, PIL's own reading of the size is checked again before it decodes a pixel, and PIL's
MAX_IMAGE_PIXELS is lowered to the same limit (it refuses twice that by itself).

Positions are 1-D: a layout's tokens take the KV positions they are written at, as in Idefics3. A
Qwen2-VL (M-RoPE) gives image tokens 3-D (time, row, column) positions, and the text after an image
positions below its KV index; such models are refused (`vision_for`) until a vision class for them
returns those position ids beside its embeddings and the engine passes them on.
"""

from __future__ import annotations

import io
import threading
from collections import OrderedDict
from dataclasses import dataclass, replace

import numpy as np
import torch

from protocol.images import MAX_IMAGE_PIXELS, PromptImage, check_header, check_size
from protocol.vision import UnknownImage

CACHED = 8  # preprocessed images kept by sha256 (tiles in the model's dtype + bytes)
READY = 8  # images preprocessed ahead by `prepare`, not yet taken by the model thread (beyond: the oldest is
# dropped, and preprocessed again when its open runs)


def pil_image():
    """PIL's Image module, its MAX_IMAGE_PIXELS lowered to protocol/images.py's limit (PIL warns above it and
    refuses twice it by itself: a second line behind check_size). Imported on first use: a text-only torch
    server needs no Pillow."""
    from PIL import Image

    if Image.MAX_IMAGE_PIXELS is None or Image.MAX_IMAGE_PIXELS > MAX_IMAGE_PIXELS:
        Image.MAX_IMAGE_PIXELS = MAX_IMAGE_PIXELS
    return Image


@dataclass(frozen=True)
class Prepared:
    """One image, decoded and preprocessed by the model's processor (on the CPU)."""

    data: bytes  # the encoded image (resolve hands it back)
    ids: torch.Tensor  # [P] long: the marker's layout; features go at its <image> ids
    pixel_values: torch.Tensor  # [tiles, 3, tile, tile] in the model's dtype (its tower casts to it anyway)
    pixel_mask: torch.Tensor  # [tiles, tile, tile] bool: real pixels, not padding


def decode(image: PromptImage) -> np.ndarray:
    """[h, w, 3] uint8 pixels of the image's bytes; ValueError naming the image if they are none
    (ImageError, before anything is decoded, for an image over protocol/images.py's limits)."""
    Image = pil_image()
    check_header(image.data)
    try:
        with Image.open(io.BytesIO(image.data), formats=("JPEG", "PNG")) as im:
            check_size(*im.size)  # PIL's own reading of the header, before it decodes a pixel
            return np.asarray(im.convert("RGB"))
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:  # PIL raises each for some bytes
        raise ValueError(
            f"image {image.sha256[:12]} ({len(image.data)} bytes, "
            f"{image.format or 'neither JPEG nor PNG'}) could not be decoded: {e}"
        ) from e


class Idefics3Vision:
    """Idefics3 and SmolVLM: the processor's layout, the SigLIP tower + pixel-shuffle connector's features."""

    def __init__(self, model, processor):
        pil_image()  # PIL's own limit, from the start
        self.model = model  # the ...ForConditionalGeneration, on its device
        self.processor = processor
        self.image_token_id = int(model.config.image_token_id)
        self.marker = getattr(processor, "image_token", "<image>")
        self._cache: OrderedDict[str, Prepared] = OrderedDict()
        self._ready: OrderedDict[str, Prepared] = OrderedDict()  # made by `prepare`, not yet in the cache
        self._lock = threading.Lock()  # the cache and READY: positions() and prepare() come from other threads

    def positions(self, image: PromptImage) -> int:
        """KV positions the image's marker expands to (the layout's text tokens included).

        Raises ValueError for bytes that are no image, UnknownImage for a hash no longer cached."""
        return len(self._prepared(image).ids)

    def resolve(self, image: PromptImage) -> PromptImage:
        """The image with its bytes: as it came, or filled in from the cache; UnknownImage if not cached."""
        if image.data is not None:
            return image
        return replace(image, data=self._prepared(image).data)

    def prepare(self, image: PromptImage) -> None:
        """Decode and preprocess the image now, in the calling thread, so that the model thread finds it ready.

        Raises ValueError for bytes that are no image (ImageError for an image over the limits, before
        anything is decoded). An image that came as its hash alone is left to the model thread."""
        with self._lock:
            if image.data is None or image.sha256 in self._cache or image.sha256 in self._ready:
                return
        prep = self._prepare(image)
        with self._lock:
            self._ready[image.sha256] = prep
            while len(self._ready) > READY:
                self._ready.popitem(last=False)

    def embed(self, image: PromptImage) -> torch.Tensor:
        """[P, hidden] the layout's input embeddings, image features at its <image> tokens (model's dtype)."""
        prep = self._prepared(image)
        device = self.model.device
        ids = prep.ids.to(device)
        text = self.model.get_input_embeddings()(ids)  # [P, hidden]
        out = self.model.get_image_features(
            pixel_values=prep.pixel_values[None].to(device), pixel_attention_mask=prep.pixel_mask[None].to(device)
        )
        features = torch.cat(list(out.pooler_output)).to(text.dtype)  # [image tokens, hidden]
        at = ids == self.image_token_id
        if int(at.sum()) != len(features):
            raise RuntimeError(
                f"image {image.sha256[:12]}: the processor laid out {int(at.sum())} image tokens, "
                f"the vision tower made {len(features)} features"
            )
        return text.masked_scatter(at[:, None], features)

    def _prepared(self, image: PromptImage) -> Prepared:
        with self._lock:
            hit = self._cache.get(image.sha256)
            if hit is not None:
                self._cache.move_to_end(image.sha256)
                return hit
            prep = self._ready.pop(image.sha256, None)
        if prep is None:
            if image.data is None:
                raise UnknownImage(
                    f"image {image.sha256[:12]} came as its sha256 alone and is not cached: send its bytes again"
                )
            prep = self._prepare(image)  # not prepared ahead (a direct caller), or dropped from READY
        with self._lock:
            self._cache[image.sha256] = prep
            while len(self._cache) > CACHED:
                self._cache.popitem(last=False)
        return prep

    def _prepare(self, image: PromptImage) -> Prepared:
        pixels = decode(image)
        try:
            out = self.processor(text=self.marker, images=[[pixels]], add_special_tokens=False, return_tensors="pt")
        except (ValueError, RuntimeError) as e:
            raise ValueError(
                f"the processor could not tile image {image.sha256[:12]} ({pixels.shape[1]} x {pixels.shape[0]}): {e}"
            ) from e
        values = out["pixel_values"][0].to(self.model.dtype)  # [tiles, 3, tile, tile]
        mask = out.get("pixel_attention_mask")
        mask = mask[0].bool() if mask is not None else torch.ones(values.shape[:1] + values.shape[2:], dtype=torch.bool)
        return Prepared(bytes(image.data), out["input_ids"][0], values, mask)


VISIONS = {"idefics3": Idefics3Vision, "smolvlm": Idefics3Vision}  # model_type -> how its images are read
MROPE_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen2_5_omni", "qwen3_omni", "glm4v")


def is_vlm(config) -> bool:
    """A vision-language model's config: it carries its vision tower's."""
    return getattr(config, "vision_config", None) is not None


def uses_mrope(config) -> bool:
    text = getattr(config, "text_config", None) or config
    ropes = [getattr(c, a, None) for c in (config, text) for a in ("rope_scaling", "rope_parameters")]
    return config.model_type.startswith(MROPE_TYPES) or any(isinstance(r, dict) and "mrope_section" in r for r in ropes)


def vision_for(config):
    """The vision class for a VLM's config; None for a VLM whose images this engine does not read (it is
    then served as text); ValueError for an M-RoPE model (Qwen2-VL), which would need 3-D positions."""
    kind = config.model_type
    if kind in VISIONS:
        return VISIONS[kind]
    if uses_mrope(config):
        raise ValueError(
            f"{kind} places image tokens at M-RoPE (3-D) positions: the torch engine writes 1-D "
            f"positions and reads images of {', '.join(VISIONS)} models only"
        )
    return None
