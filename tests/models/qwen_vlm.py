"""Tiny Qwen-VL models (M-RoPE) with random weights, offline: Qwen2-VL, Qwen2.5-VL and Qwen3-VL, each as Hugging
Face and llama.cpp load it.

    python -m tests.models.make_test_vlm --family qwen2vl|qwen2.5vl|qwen3vl [--out DIR] [--seed 0] [--check]

`DIR/hf/` is a real Qwen2VLForConditionalGeneration / Qwen2_5_VLForConditionalGeneration /
Qwen3VLForConditionalGeneration (a 3-block vision tower on 8 x 8 patches merged 2 x 2, a 2-layer text
model whose rotary frequencies are split between time, row and column: M-RoPE, interleaved for Qwen3-VL)
with the shipped SmolLM2 tokenizer plus the Qwen vision tokens (`<|vision_start|>`, `<|vision_end|>`,
`<|vision_pad|>`, `<|image_pad|>`, `<|video_pad|>`), and its processor (`load_processor`: transformers
builds a Qwen-VL's AutoProcessor only with torchvision) turns an image into `pixel_values` +
`image_grid_thw`. An image is resized to multiples of 16 px (patch x merge; 8 to 4096 embeddings, the
bounds libmtmd keeps too) and takes (h/16) x (w/16) embeddings; with M-RoPE they advance the position by
max(h, w)/16 only (the text after an image sits at the previous maximum + 1), so an image's position
count differs from its token count: 64 x 64 takes 16 tokens and 4 positions, 96 x 128 takes 48 tokens and
8 positions. In a prompt an image is `<|vision_start|><|image_pad|><|vision_end|>` (IMAGE_SPAN) for the
processor; libmtmd writes the start and end tokens itself around its media marker.

From that directory llama.cpp's own converter (tests/models/llama_convert.py) writes
  target.gguf          the text model, f32        target-mmproj.gguf   the vision tower, f32
and llama.cpp's quantizer the draft:
  draft.gguf           Q8_0 of target.gguf        draft-mmproj.gguf    the vision tower, f16

Generations that mean something: the default initialisation (N(0, 0.02^2) everywhere) gives a tiny model
almost flat logits, whose greedy token then hangs on rounding (Q8_0 against f32) and barely on the image.
So the embeddings and the LM head are drawn at std EMBED_GAIN / sqrt(hidden), the other text matrices at
BLOCK_STD and the vision tower at VISION_STD: two images give different greedy ids, llama.cpp's f32 GGUF
gives transformers' greedy ids, and the Q8_0 draft agrees with the f32 target on ~95 % of greedy tokens
(on the target's path; figures: `--check`).

Made in ~20 s a family on 2 cores and cached like make_test_vlm's SmolVLM (DIR/manifest.json, keyed by
VERSION, family, seed, shape and the library versions, written last; a lock file lets two processes ask at once).
"""

from __future__ import annotations

import copy
import fcntl
import importlib.metadata
import importlib.util
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

FAMILIES = ("qwen2vl", "qwen2.5vl", "qwen3vl")
VERSION = 1  # bump when the construction changes: cached files are keyed by it
DRAFT_FTYPE = "LLAMA_FTYPE_MOSTLY_Q8_0"  # blocks of 32: every text row (128, 256) divides

IMAGE_TOKEN = "<|image_pad|>"  # what the processor repeats once per image embedding
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
IMAGE_SPAN = VISION_START + IMAGE_TOKEN + VISION_END  # one image in a Hugging Face prompt (libmtmd writes the same)
# what Qwen's tokenizer has beyond ChatML (SmolLM2 has <|im_start|> and <|im_end|> already)
IMAGE_TOKENS = [VISION_START, VISION_END, "<|vision_pad|>", IMAGE_TOKEN, "<|video_pad|>"]
PROMPT = f"<|im_start|>user\n{IMAGE_SPAN}Describe the scene.<|im_end|>\n<|im_start|>assistant\n"
CHAT_TEMPLATE = (  # Qwen2-VL-Instruct's, without the default system message
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}{% if content['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class QwenShape:
    patch: int = 8
    merge: int = 2  # spatial merge: 2 x 2 patches make one embedding
    min_tokens: int = 8  # libmtmd's bounds on an image's embeddings for these projectors (clip.cpp); the
    max_tokens: int = 4096  # processor is given the same ones, so both resize an image alike
    vision_hidden: int = 64
    vision_layers: int = 3  # at least 3: the converter maps merger.mlp.{0,2} as if they were blocks
    vision_heads: int = 2
    vision_intermediate: int = 128
    hidden: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 256
    context: int = 4096
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def factor(self) -> int:
        """An image's sides are resized to multiples of this (pixels)."""
        return self.patch * self.merge

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """(rows, cols) of embeddings for an image of that size, as both processors resize it."""
        f, lo, hi = self.factor, self.min_tokens * self.factor**2, self.max_tokens * self.factor**2
        h, w = max(f, round(height / f) * f), max(f, round(width / f) * f)
        if h * w > hi:
            beta = math.sqrt(height * width / hi)
            h, w = max(f, math.floor(height / beta / f) * f), max(f, math.floor(width / beta / f) * f)
        elif h * w < lo:
            beta = math.sqrt(lo / (height * width))
            h, w = math.ceil(height * beta / f) * f, math.ceil(width * beta / f) * f
        return h // f, w // f


TINY = QwenShape()
EMBED_GAIN = 4.0  # embeddings and LM head at std EMBED_GAIN / sqrt(hidden): clear margins between logits
BLOCK_STD = 0.08  # every other matrix of the text model (HF's default is 0.02)
VISION_STD = 0.1  # the vision tower and merger: features of the embeddings' scale


@dataclass(frozen=True)
class QwenVLM:
    """The files of one tiny Qwen-VL; the same fields as make_test_vlm.TinyVLM (and `family`)."""

    directory: Path
    hf_dir: Path  # the *ForConditionalGeneration + its processor (Qwen2VLProcessor / Qwen3VLProcessor)
    target: Path  # text model, f32
    target_mmproj: Path  # vision tower + merger, f32
    draft: Path  # text model, Q8_0
    draft_mmproj: Path  # vision tower + merger, f16
    vocab: int  # the shipped vocabulary + IMAGE_TOKENS
    image_token_id: int  # <|image_pad|>
    shape: QwenShape
    seed: int
    family: str

    def describe(self) -> dict:
        d = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(self).items()}
        d["construction"] = f"random {self.family}, converted by llama.cpp (tests/models/qwen_vlm.py v{VERSION})"
        return d


def paths(
    family: str, directory: Path, shape: QwenShape = TINY, seed: int = 0, vocab: int = 0, image_token_id: int = 0
) -> QwenVLM:
    from tests.models import llama_convert

    return QwenVLM(*llama_convert.vlm_files(directory), vocab, image_token_id, shape, seed, family)


def check_family(family: str) -> str:
    if family not in FAMILIES:
        raise ValueError(f"unknown Qwen-VL family {family!r}: one of {', '.join(FAMILIES)}")
    return family


def default_dir(family: str, seed: int = 0) -> Path:
    from protocol import modelfiles

    return modelfiles.build_dir() / f"test-vlm-{check_family(family).replace('.', '')}-v{VERSION}-s{seed}"


# --------------------------------------------------------------------------- the Hugging Face model


def _text_config(family: str, shape: QwenShape, tok) -> dict:
    half = shape.head_dim // 2  # rotary frequencies a head has: split between time, row and column
    if family == "qwen3vl":  # interleaved (llama.cpp: IMROPE), 24:20:20 as Qwen3-VL's 64
        third = half * 5 // 16
        section = [half - 2 * third, third, third]
    else:  # contiguous (MROPE), 16:24:24 as Qwen2-VL's 64
        section = [half // 4, (half - half // 4) // 2, half - half // 4 - (half - half // 4) // 2]
    rope = {"rope_type": "default", "rope_theta": shape.rope_theta, "mrope_section": section}
    if family == "qwen3vl":
        rope["mrope_interleaved"] = True
    text = dict(
        vocab_size=len(tok),
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.context,
        rms_norm_eps=1e-6,
        rope_parameters=rope,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )
    if family == "qwen3vl":
        text["head_dim"] = shape.head_dim
    return text


def _vision_config(family: str, shape: QwenShape) -> dict:
    common = dict(
        depth=shape.vision_layers,
        num_heads=shape.vision_heads,
        in_channels=3,
        patch_size=shape.patch,
        spatial_merge_size=shape.merge,
        temporal_patch_size=2,  # llama.cpp's converter splits the Conv3D into two Conv2Ds: 2 only
    )
    if family == "qwen2vl":
        return dict(common, embed_dim=shape.vision_hidden, hidden_size=shape.hidden, mlp_ratio=2)
    if family == "qwen2.5vl":
        return dict(
            common,
            hidden_size=shape.vision_hidden,
            intermediate_size=shape.vision_intermediate,
            out_hidden_size=shape.hidden,
            # llama.cpp's clip.cpp fixes the window at 112 px (Qwen2.5-VL's): 7 x 7 embeddings here, so a 64 x 64
            # image is one window and a 96 x 128 one (6 x 8 embeddings) two
            window_size=112,
            fullatt_block_indexes=[shape.vision_layers - 1],  # the last block full, the others windowed
        )
    return dict(  # qwen3vl
        common,
        hidden_size=shape.vision_hidden,
        intermediate_size=shape.vision_intermediate,
        out_hidden_size=shape.hidden,
        num_position_embeddings=64,  # an 8 x 8 table, interpolated to each image's grid
        deepstack_visual_indexes=[0],  # block 0's features go to the text model's first layer as well
    )


def _classes(family: str):
    import transformers as T

    return {
        "qwen2vl": (T.Qwen2VLConfig, T.Qwen2VLForConditionalGeneration, T.Qwen2VLProcessor),
        "qwen2.5vl": (T.Qwen2_5_VLConfig, T.Qwen2_5_VLForConditionalGeneration, T.Qwen2_5_VLProcessor),
        "qwen3vl": (T.Qwen3VLConfig, T.Qwen3VLForConditionalGeneration, T.Qwen3VLProcessor),
    }[family]


def _reinit(model, shape: QwenShape, seed: int) -> None:
    """The gains of the module docstring, drawn from `seed`: text matrices, embeddings and LM head, vision."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim < 2:
                continue  # norms stay ones, biases zeros
            if name.endswith("embed_tokens.weight") or name.startswith("lm_head."):
                std = EMBED_GAIN / math.sqrt(shape.hidden)
            elif "visual" in name:
                std = VISION_STD
            else:
                std = BLOCK_STD
            p.copy_(torch.randn(p.shape, generator=gen) * std)


def load_processor(hf_dir: str | Path):
    """The model's processor (Qwen2VLProcessor, Qwen2_5_VLProcessor or Qwen3VLProcessor) for images and text.

    AutoProcessor loads a video processor too, which transformers only has with torchvision; without it the
    same processor class is built from the image processor and the tokenizer alone (every image path is the
    processor's own: `processor(text=..., images=[image])` gives input_ids, pixel_values, image_grid_thw)."""
    import transformers
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    try:
        return AutoProcessor.from_pretrained(hf_dir)
    except (ImportError, AttributeError, ValueError, OSError):
        pass  # no torchvision: no video processor
    name = json.loads((Path(hf_dir) / "processor_config.json").read_text())["processor_class"]
    cls = getattr(transformers, name)
    images_only = type(name, (cls,), {"get_attributes": classmethod(lambda c: ["image_processor", "tokenizer"])})
    template = Path(hf_dir) / "chat_template.jinja"
    return images_only(
        AutoImageProcessor.from_pretrained(hf_dir),
        AutoTokenizer.from_pretrained(hf_dir),
        chat_template=template.read_text() if template.is_file() else None,
    )


def write_hf(family: str, hf_dir: Path, shape: QwenShape, seed: int) -> tuple[int, int]:
    """The random model and its processor into hf_dir: (vocab size, <|image_pad|> id)."""
    import torch
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from tools.models import random_target

    config_cls, model_cls, processor_cls = _classes(family)
    tok = copy.deepcopy(random_target.shipped_tokenizer())  # SmolLM2's (the draft's, or the carried vocabulary)
    n_shipped = len(tok)
    tok.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS})
    if len(tok) != n_shipped + len(IMAGE_TOKENS):
        raise ValueError(f"the shipped tokenizer already holds some of {IMAGE_TOKENS}")
    ids = {t: tok.convert_tokens_to_ids(t) for t in IMAGE_TOKENS}
    cfg = config_cls(
        text_config=_text_config(family, shape, tok),
        vision_config=_vision_config(family, shape),
        image_token_id=ids[IMAGE_TOKEN],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids[VISION_START],
        vision_end_token_id=ids[VISION_END],
        tie_word_embeddings=False,
    )
    cfg.architectures = [model_cls.__name__]
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    _reinit(model, shape, seed)
    model.save_pretrained(hf_dir)
    mean, std = ([0.5] * 3, [0.5] * 3) if family == "qwen3vl" else (None, None)  # Qwen3-VL's; others CLIP's
    images = Qwen2VLImageProcessorPil(
        size={
            "shortest_edge": shape.min_tokens * shape.factor**2,
            "longest_edge": shape.max_tokens * shape.factor**2,
        },
        patch_size=shape.patch,
        merge_size=shape.merge,
        temporal_patch_size=2,
        **({"image_mean": mean, "image_std": std} if mean else {}),
    )
    # The processor's own save_pretrained needs a video processor, and transformers has none without torchvision:
    # its parts are saved one by one instead, with the processor_config.json the processor would write.
    tok.save_pretrained(hf_dir)
    images.save_pretrained(hf_dir)  # preprocessor_config.json: llama.cpp's converter reads image_mean / image_std
    (hf_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (hf_dir / "processor_config.json").write_text(json.dumps({"processor_class": processor_cls.__name__}, indent=1))
    return len(tok), ids[IMAGE_TOKEN]


# --------------------------------------------------------------------------- make


def make(
    family: str, directory: str | Path | None = None, shape: QwenShape = TINY, seed: int = 0, log=print
) -> QwenVLM:
    """All five outputs in `directory` (made once; found by its manifest after)."""
    check_family(family)
    directory = Path(directory) if directory else default_dir(family, seed)
    directory.mkdir(parents=True, exist_ok=True)
    # models/build is shared: a second process asking for the same model waits for the first, then finds it
    with open(directory / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _make_locked(family, directory, shape, seed, log)


def _make_locked(family: str, directory: Path, shape: QwenShape, seed: int, log) -> QwenVLM:
    from tests.models import llama_convert

    key = {
        "version": VERSION,
        "family": family,
        "seed": seed,
        "shape": asdict(shape),
        "vision": _vision_config(family, shape),
        "gains": [EMBED_GAIN, BLOCK_STD, VISION_STD],
        "converter": llama_convert.LLAMA_CPP_VERSION,
        **{p: importlib.metadata.version(p) for p in ("transformers", "torch", "llama_cpp_python")},
    }
    return llama_convert.make_vlm(
        directory,
        key,
        lambda vocab, image_id: paths(family, directory, shape, seed, vocab, image_id),
        lambda hf_dir: write_hf(family, hf_dir, shape, seed),
        DRAFT_FTYPE,
        (f"{family} ", family),
        log,
    )


# --------------------------------------------------------------------------- running it


def random_image(seed: int, height: int = 64, width: int = 64):
    """[height, width, 3] uint8 noise."""
    import numpy as np

    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


@dataclass
class HfRun:
    logits: object  # [vocab] np.ndarray: next-token logits after the prompt
    input_ids: list  # the processor's ids: the prompt with <|image_pad|> repeated once per embedding
    grid: tuple  # image_grid_thw: (1, rows x merge, cols x merge) patches
    greedy: list  # the model's greedy ids after the prompt


def hf_run(hf_dir: str | Path, image, prompt: str = PROMPT, n: int = 16) -> HfRun:
    """transformers on `prompt` with `image` at its <|image_pad|>: logits, ids and n greedy tokens."""
    import torch
    from transformers import AutoModelForImageTextToText

    _check_image(image)
    processor = load_processor(hf_dir)
    model = AutoModelForImageTextToText.from_pretrained(hf_dir, dtype=torch.float32).eval()
    inputs = processor(text=prompt, images=[image], return_tensors="pt")
    with torch.no_grad():
        logits = model(**inputs).logits[0, -1].numpy()
        out = model.generate(**inputs, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    ids = inputs["input_ids"][0].tolist()
    return HfRun(logits, ids, tuple(inputs["image_grid_thw"][0].tolist()), out[0, len(ids) :].tolist())


@dataclass
class LlamaRun:
    logits: object  # [vocab] np.ndarray: next-token logits after the prompt
    n_past: int  # the position after the prompt: text tokens + every image's n_pos
    chunks: list  # ("text", [ids]) and ("image", n_tokens, n_pos), in order
    rope_type: int  # llama_model_rope_type: LLAMA_ROPE_TYPE_MROPE (8) / IMROPE (40)
    greedy: list  # greedy ids after the prompt, each at n_past + i


def llama_run(
    gguf: str | Path,
    mmproj: str | Path,
    image,
    prompt: str = PROMPT,
    n: int = 16,
    n_threads: int = 1,
    follow: list[int] | None = None,
) -> LlamaRun:
    """llama.cpp with libmtmd on `prompt` with `image` at its IMAGE_SPAN (libmtmd writes <|vision_start|> and
    <|vision_end|> around the image itself): the image chunk's token and position counts, the logits, and n
    greedy tokens decoded one a batch at positions n_past, n_past + 1, ... (one position a token: llama.cpp
    copies it to the M-RoPE planes). With `follow`, those ids are decoded instead of its own picks and
    `greedy` holds its argmax after each (teacher forcing: a draft's agreement with a target's path). One
    thread: see llama_convert.mtmd_prefill."""
    import llama_cpp
    import numpy as np

    from tests.models import llama_convert

    _check_image(image)
    with llama_convert.mtmd_prefill(gguf, mmproj, image, prompt, IMAGE_SPAN, n_ctx=1024, n_threads=n_threads) as p:
        batch = llama_cpp.llama_batch_init(1, 0, 1)
        try:
            steps = len(follow) if follow is not None else n
            greedy, row = [], p.logits
            for i in range(steps):
                greedy.append(int(row.argmax()))
                token = follow[i] if follow is not None else greedy[-1]
                if i == steps - 1:
                    break
                batch.n_tokens = 1
                batch.token[0], batch.pos[0], batch.n_seq_id[0], batch.logits[0] = token, p.n_past + i, 1, True
                batch.seq_id[0][0] = 0
                if llama_cpp.llama_decode(p.ctx, batch) != 0:
                    raise RuntimeError("llama_decode failed")
                row = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(p.ctx, -1), shape=(p.n_vocab,))
            return LlamaRun(p.logits, p.n_past, p.chunks, llama_cpp.llama_model_rope_type(p.model), greedy)
        finally:
            llama_cpp.llama_batch_free(batch)


def _check_image(image) -> None:
    if image.dtype != "uint8" or image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f"an image is [height, width, 3] uint8, got {image.shape} {image.dtype}")


def check(vlm: QwenVLM, sizes=((64, 64), (96, 128))) -> dict:
    """Every file loaded by what reads it, two images through each: the figures as a dict."""
    import numpy as np

    out = {"family": vlm.family, "vocab": vlm.vocab}
    for h, w in sizes:
        a, b = random_image(0, h, w), random_image(1, h, w)
        hf_a, hf_b = hf_run(vlm.hf_dir, a), hf_run(vlm.hf_dir, b)
        fig = {
            "hf": {
                "grid_thw": hf_a.grid,
                "image_tokens": hf_a.input_ids.count(vlm.image_token_id),
                "greedy_differs_by_image": hf_a.greedy != hf_b.greedy,
                "greedy": hf_a.greedy,
            }
        }
        runs = {}
        for name, gguf, mmproj in (("target", vlm.target, vlm.target_mmproj), ("draft", vlm.draft, vlm.draft_mmproj)):
            pa, pb = llama_run(gguf, mmproj, a), llama_run(gguf, mmproj, b)
            runs[name] = pa
            image = [c for c in pa.chunks if c[0] == "image"][0]
            fig[name] = {
                "rope_type": pa.rope_type,
                "image_n_tokens": image[1],
                "image_n_pos": image[2],
                "n_past": pa.n_past,
                "greedy_differs_by_image": pa.greedy != pb.greedy,
                "max_diff_vs_hf": float(np.abs(pa.logits - hf_a.logits).max()),
                "greedy_agrees_with_hf": sum(x == y for x, y in zip(pa.greedy, hf_a.greedy, strict=False)),
                "greedy": pa.greedy,
            }
        agree = sum(x == y for x, y in zip(runs["draft"].greedy, runs["target"].greedy, strict=False))
        fig["draft"]["greedy_agrees_with_target"] = f"{agree}/{len(runs['target'].greedy)}"
        out[f"{h}x{w}"] = fig
    return out
