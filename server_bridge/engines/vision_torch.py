"""A prompt's images for the torch engine, through a transformers vision-language model's own processor and tower.

    vision = vision_for(config)(model, processor)   # Idefics3 / SmolVLM, Qwen2-VL, Qwen2.5-VL, Qwen3-VL
    n = vision.positions(image)                     # positions the image's one marker advances a sequence by
    c = vision.cells(image)                         # KV cells (slot rows) it takes: its layout's tokens
    e = vision.embed(image)                         # Embedded: what the decoder reads at those cells, and where
    image = vision.resolve(image)                   # its bytes from the cache when only the sha256 came
    vision.prepare(image)                           # decode and preprocess now, in this thread (not the model's)

A prompt holds one image marker per image (protocol/images.py). The model's own processor expands that
marker into the model's layout for the image:
- SmolVLM (Idefics3): each tile is `<fake_token_around_image><row_R_col_C>` + k `<image>`, rows end in
  "\n", and the overview follows as `<fake_token_around_image><global-img>` + k `<image>` +
  `<fake_token_around_image>` (33 cells for a square image on the test VLM, the layout libmtmd writes too).
  The layout starts and ends with special tokens, so the text around a marker tokenizes as in the whole prompt.
- Qwen2-VL, Qwen2.5-VL, Qwen3-VL: the marker is `<|image_pad|>`, which the prompt already wraps in
  `<|vision_start|>` ... `<|vision_end|>` (the chat template writes them, as libmtmd expects); the processor
  repeats it once per embedding, rows x cols of them for an image resized to (rows x cols) x (patch x merge).
`embed` gives the layout's input embeddings as the model's own forward merges them: the text embeddings of
its tokens, and the vision tower's features at its image tokens.

Positions, not token counts (DESIGN invariant 5). Idefics3's positions are 1-D: a layout's tokens take the
positions they are written at, so `positions` == `cells`. An M-RoPE model (`mrope`: the Qwen-VLs) gives each
image embedding a 3-D position (time, row, column) = start + (0, r, c), where start is the marker's
position, and the text after the image sits at start + max(rows, cols) on all three axes (the previous
maximum + 1): an image takes rows x cols cells but advances the position by max(rows, cols) (16 cells and
4 positions for 64 x 64 on the test model). Those positions come from the model's own `get_rope_index`
over the layout alone, from 0 (`Embedded.rope`, [3, cells]); the engine adds the marker's position (the
index is the same wherever the layout starts). Qwen3-VL also adds its vision tower's deepstack features to
the image's cells after each of its first decoder layers (`Embedded.deepstack`), which the engine hands to
the text model's own forward.

Decoding and preprocessing (resize, tiles or patches, normalisation) are kept for the last CACHED images by
sha256, with their bytes, in runtime/vision.py's `ImageCache` (the llamacpp engine's libmtmd uses the same),
so an image sent once is known by its hash after (a re-open sends only the hash); the vision tower runs on
every `embed` (an open: rare). `positions`, `cells`, `resolve` and `prepare` may be called from any thread:
the server decodes and preprocesses an open's images with `prepare` in a thread of its own, before the open
reaches the model thread, which then finds them READY and only embeds them.

Untrusted bytes: the header's width and height are checked against protocol/images.py's limits before PIL
opens the bytes, PIL's own reading of the size is checked again before it decodes a pixel, and PIL's
MAX_IMAGE_PIXELS is lowered to the same limit (it refuses twice that by itself).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from protocol.images import MAX_IMAGE_PIXELS, PromptImage, check_header, check_size
from runtime.vision import ImageCache, image_data

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def pil_image() -> ModuleType:
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
    ids: torch.Tensor  # [cells] long: the marker's layout; features go at its image tokens
    pixels: dict  # what the model's get_image_features takes: pixel_values (in the model's dtype) and
    # pixel_attention_mask (Idefics3's tiles) or image_grid_thw (Qwen-VL's patch grid)
    rope: torch.Tensor | None  # [3, cells] long: the layout's M-RoPE positions from 0 (None: 1-D)
    positions: int  # positions the layout advances a sequence by (M-RoPE: max(rows, cols), not cells)


@dataclass(frozen=True)
class Embedded:
    """An image as the decoder reads it, at its cells."""

    embeds: torch.Tensor  # [cells, hidden] the layout's input embeddings, image features at its image tokens
    visual: torch.Tensor  # [cells] bool: the image tokens (where features, and deepstack features, go)
    rope: torch.Tensor | None  # [3, cells] long: M-RoPE positions from the marker's (None: 1-D, one a cell)
    positions: int  # positions the image advances a sequence by
    deepstack: list | None  # Qwen3-VL: per early decoder layer [image tokens, hidden], added after that layer


def decode(image: PromptImage) -> np.ndarray:
    """[h, w, 3] uint8 pixels of the image's bytes; ValueError naming the image if they are none
    (ImageError, before anything is decoded, for an image over protocol/images.py's limits)."""
    Image = pil_image()
    data = image_data(image)
    check_header(data)
    try:
        with Image.open(io.BytesIO(data), formats=("JPEG", "PNG")) as im:
            check_size(*im.size)  # PIL's own reading of the header, before it decodes a pixel
            return np.asarray(im.convert("RGB"))
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:  # PIL raises each for some bytes
        raise ValueError(
            f"image {image.sha256[:12]} ({len(data)} bytes, "
            f"{image.format or 'neither JPEG nor PNG'}) could not be decoded: {e}"
        ) from e


class Vision:
    """A VLM's images through its processor and tower: the image cache (runtime.vision.ImageCache) and the
    embedding merge.
    A family says how its processor is called (`_process`) and, for M-RoPE, where its layout sits (`_rope`)."""

    mrope = False  # 3-D positions (time, row, column); False: 1-D, one position a cell

    def __init__(self, model: Any, processor: Any):  # a transformers ...ForConditionalGeneration and its processor
        pil_image()  # PIL's own limit, from the start
        self.model = model  # the ...ForConditionalGeneration, on its device
        self.processor = processor
        self.image_token_id = int(model.config.image_token_id)
        self.marker = getattr(processor, "image_token", "<image>")
        # sha256 -> the image preprocessed (runtime/vision.py's cache, the llamacpp engine's too): positions()
        # and prepare() come from other threads. `_prepare` looked up per call (as MtmdVision's `_tokenize` is),
        # so what decodes an image is this object's method as it stands, not one bound at construction
        self.images: ImageCache[Prepared] = ImageCache(lambda image: self._prepare(image))

    def positions(self, image: PromptImage) -> int:
        """Positions the image's marker advances a sequence by (its cells for 1-D positions; fewer for M-RoPE).

        Raises ValueError for bytes that are no image, UnknownImage for a hash no longer cached."""
        return self._prepared(image).positions

    def cells(self, image: PromptImage) -> int:
        """KV cells (slot rows) the image's marker expands to: its layout's tokens, text tokens included."""
        return len(self._prepared(image).ids)

    def resolve(self, image: PromptImage) -> PromptImage:
        """The image with its bytes: as it came, or filled in from the cache; UnknownImage if not cached."""
        return self.images.resolve(image)

    def prepare(self, image: PromptImage) -> None:
        """Decode and preprocess the image now, in the calling thread, so that the model thread finds it ready.

        Raises ValueError for bytes that are no image (ImageError for an image over the limits, before
        anything is decoded). An image that came as its hash alone is left to the model thread."""
        self.images.prepare(image)

    def embed(self, image: PromptImage) -> Embedded:
        """The layout's input embeddings [cells, hidden], image features at its image tokens (model's dtype)."""
        prep = self._prepared(image)
        device = self.model.device
        ids = prep.ids.to(device)
        text = self.model.get_input_embeddings()(ids)  # [cells, hidden]
        out = self.model.get_image_features(**{k: v.to(device) for k, v in prep.pixels.items()})
        features = torch.cat(list(out.pooler_output)).to(text.dtype)  # [image tokens, hidden]
        at = ids == self.image_token_id
        if int(at.sum()) != len(features):
            raise RuntimeError(
                f"image {image.sha256[:12]}: the processor laid out {int(at.sum())} image tokens, "
                f"the vision tower made {len(features)} features"
            )
        deep = getattr(out, "deepstack_features", None)  # Qwen3-VL: per layer, split per image (one here)
        deepstack = [torch.cat(list(f)).to(text.dtype) for f in deep] if deep else None
        return Embedded(text.masked_scatter(at[:, None], features), at, prep.rope, prep.positions, deepstack)

    def _prepared(self, image: PromptImage) -> Prepared:
        return self.images.get(image)

    def _prepare(self, image: PromptImage) -> Prepared:
        pixels = decode(image)
        try:
            ids, inputs = self._process(pixels)
        except (ValueError, RuntimeError) as e:
            raise ValueError(
                f"the processor could not read image {image.sha256[:12]} ({pixels.shape[1]} x {pixels.shape[0]}): {e}"
            ) from e
        rope = self._rope(ids, inputs) if self.mrope else None
        positions = int(rope.max()) + 1 if rope is not None else len(ids)
        return Prepared(image_data(image), ids, inputs, rope, positions)

    def _process(self, pixels: np.ndarray) -> tuple[torch.Tensor, dict]:
        """([cells] the marker's layout, the get_image_features inputs) for [h, w, 3] pixels."""
        raise NotImplementedError

    def _rope(self, ids: torch.Tensor, inputs: dict) -> torch.Tensor:
        """[3, cells] the layout's M-RoPE positions from 0."""
        raise NotImplementedError


class Idefics3Vision(Vision):
    """Idefics3 and SmolVLM: the processor's tiled layout, the SigLIP tower + pixel-shuffle connector's features."""

    def _process(self, pixels: np.ndarray) -> tuple[torch.Tensor, dict]:
        out = self.processor(text=self.marker, images=[[pixels]], add_special_tokens=False, return_tensors="pt")
        values = out["pixel_values"].to(self.model.dtype)  # [1, tiles, 3, tile, tile]
        mask = out.get("pixel_attention_mask")
        mask = mask.bool() if mask is not None else torch.ones(values.shape[:2] + values.shape[3:], dtype=torch.bool)
        return out["input_ids"][0], {"pixel_values": values, "pixel_attention_mask": mask}


class QwenVLVision(Vision):
    """Qwen2-VL, Qwen2.5-VL, Qwen3-VL: the processor's patches and grid, M-RoPE positions by the model's own index."""

    mrope = True

    def _process(self, pixels: np.ndarray) -> tuple[torch.Tensor, dict]:
        out = self.processor(text=self.marker, images=[pixels], add_special_tokens=False, return_tensors="pt")
        values = out["pixel_values"].to(self.model.dtype)  # [patches, channels x time x patch x patch]
        return out["input_ids"][0], {"pixel_values": values, "image_grid_thw": out["image_grid_thw"]}  # grid [1, 3]

    def _rope(self, ids: torch.Tensor, inputs: dict) -> torch.Tensor:
        kinds = (ids == self.image_token_id).int()[None]  # mm_token_type_ids: 1 for an image token, 0 for text
        pos, _ = self.model.model.get_rope_index(ids[None], kinds, image_grid_thw=inputs["image_grid_thw"])
        return pos[:, 0]  # [3, cells] (the model keeps no state from this call: its rope_deltas stay untouched)


VISIONS = {  # model_type -> how its images are read
    "idefics3": Idefics3Vision,
    "smolvlm": Idefics3Vision,
    "qwen2_vl": QwenVLVision,
    "qwen2_5_vl": QwenVLVision,
    "qwen3_vl": QwenVLVision,
}
MROPE_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen2_5_omni", "qwen3_omni", "glm4v")


def is_vlm(config: PretrainedConfig) -> bool:
    """A vision-language model's config: it carries its vision tower's."""
    return getattr(config, "vision_config", None) is not None


def uses_mrope(config: PretrainedConfig) -> bool:
    text = getattr(config, "text_config", None) or config
    ropes = [getattr(c, a, None) for c in (config, text) for a in ("rope_scaling", "rope_parameters")]
    return config.model_type.startswith(MROPE_TYPES) or any(isinstance(r, dict) and "mrope_section" in r for r in ropes)


def vision_for(config: PretrainedConfig) -> type[Vision] | None:
    """The vision class for a VLM's config; None for a VLM whose images this engine does not read (it is
    then served as text); ValueError for an M-RoPE model other than the Qwen-VLs read here."""
    kind = config.model_type
    if kind in VISIONS:
        return VISIONS[kind]
    if uses_mrope(config):
        mrope = [k for k, v in VISIONS.items() if v.mrope]
        raise ValueError(
            f"{kind} places image tokens at M-RoPE (3-D) positions by a layout or rope index of its own "
            f"(video frames, audio, experts, other position rules): the torch engine computes them for "
            f"{', '.join(mrope)} only, and served as text this model's images would sit at wrong positions"
        )
    return None


def load_processor(model_dir: Path, config: PretrainedConfig) -> Any:
    """The model's own processor (local files only). A Qwen-VL's processor holds a video processor too, which
    transformers builds only with torchvision: without it the same processor class is loaded with its image
    processor and tokenizer alone (images never reach the video part)."""
    import importlib.util

    import transformers
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(model_dir, local_files_only=True)
    except ImportError:
        if importlib.util.find_spec("torchvision") is not None or VISIONS.get(config.model_type) is not QwenVLVision:
            raise
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    cls = getattr(transformers, PROCESSOR_MAPPING_NAMES[config.model_type])
    parts = classmethod(lambda c: ["image_processor", "tokenizer"])  # what ProcessorMixin loads and checks
    images_only: Any = type(cls.__name__, (cls,), {"get_attributes": parts})  # a processor class
    return images_only.from_pretrained(model_dir, local_files_only=True)
