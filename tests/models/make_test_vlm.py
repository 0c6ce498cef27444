"""A tiny SmolVLM (Idefics3) with random weights, offline: one model as Hugging Face and llama.cpp load it.

    python -m tests.models.make_test_vlm [--family smolvlm|qwen2vl|qwen2.5vl|qwen3vl] [--out DIR] [--seed 0] [--check]

`--family` other than smolvlm (the default) makes a tiny Qwen-VL (M-RoPE) the same way, with the same
four files: tests/models/qwen_vlm.py.

`DIR/hf/` is a real Idefics3ForConditionalGeneration (a 2-layer SigLIP-like vision tower on 64 x 64
tiles, the pixel-shuffle connector, a 2-layer Llama) with the shipped SmolLM2 tokenizer plus the image
tokens SmolVLM's processor writes (`<fake_token_around_image>`, `<image>`, `<global-img>`,
`<row_R_col_C>`, `<end_of_utterance>`), and its processor: `AutoProcessor.from_pretrained(DIR/hf)`
works. An image is resized so its longer side is 128 and cut into 64 x 64 tiles plus a 64 x 64
overview, 4 image tokens each (16 patches, pixel-shuffled by 2): a square image costs 20 tokens.

From that directory llama.cpp's own converter (convert_hf_to_gguf.py of the llama.cpp vendored in the
llama-cpp-python sdist, cached in ~/.cache/edgespec/llama-convert-<version>/; LLAMA_SDIST names a
tarball or an extracted sdist for an offline machine, else pip downloads it once) writes
  target.gguf          the text model, f32        target-mmproj.gguf   the vision tower, f32
and llama.cpp's quantizer the draft:
  draft.gguf           Q8_0 of target.gguf        draft-mmproj.gguf    the vision tower, f16
llama.cpp tiles the image the way the processor does, so both see the same token layout.

Made in ~20 s on 2 cores (the first time on a machine ~1 min more to fetch the sdist) and cached:
DIR/manifest.json holds the key (VERSION, seed, shape and the library versions) and is written last; a
second call with the same key returns at once. `--check` loads every file (transformers, llama.cpp,
libmtmd) and prints one JSON line.
"""

from __future__ import annotations

import argparse
import copy
import importlib.metadata
import importlib.util
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from tests.models import qwen_vlm
from tests.models.llama_convert import (  # noqa: F401  (this module's names since it began: kept for its callers)
    CONVERTER_FILES,
    LLAMA_CPP_VERSION,
    cache_root,
    convert,
    converter_dir,
    make_vlm,
    mtmd_prefill,
    vlm_files,
)
from tests.models.llama_convert import quiet as _quiet

VERSION = 1  # bump when the construction changes: cached files are keyed by it
DRAFT_FTYPE = "LLAMA_FTYPE_MOSTLY_Q8_0"  # blocks of 32: every row (64, 128) divides
PROMPT = "User:<image>Describe the scene.<end_of_utterance>\nAssistant:"
IMAGE_TOKEN = "<image>"
# what SmolVLM's tokenizer adds to SmolLM2's and Idefics3Processor writes around each tile
IMAGE_TOKENS = ["<fake_token_around_image>", IMAGE_TOKEN, "<end_of_utterance>", "<global-img>"] + [
    f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)
]
CHAT_TEMPLATE = (  # SmolVLM-Instruct's
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


@dataclass(frozen=True)
class Shape:
    tile: int = 64  # the vision tower's image_size: one tile
    patch: int = 16
    longest_edge: int = 128  # an image's longer side after resizing: 2 x 2 tiles for a square one
    scale_factor: int = 2  # the connector's pixel shuffle: (tile / patch)^2 / scale^2 tokens a tile
    vision_hidden: int = 32
    vision_layers: int = 2
    vision_heads: int = 2
    vision_intermediate: int = 64
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 128
    context: int = 2048

    @property
    def tokens_per_tile(self) -> int:
        return (self.tile // self.patch) ** 2 // self.scale_factor**2


TINY = Shape()


@dataclass(frozen=True)
class TinyVLM:
    directory: Path
    hf_dir: Path  # Idefics3ForConditionalGeneration + Idefics3Processor
    target: Path  # text model, f32
    target_mmproj: Path  # vision tower + connector, f32
    draft: Path  # text model, Q8_0
    draft_mmproj: Path  # vision tower + connector, f16
    vocab: int  # the shipped vocabulary + IMAGE_TOKENS
    image_token_id: int
    shape: Shape
    seed: int

    def describe(self) -> dict:
        d = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(self).items()}
        d["construction"] = (
            f"random Idefics3, converted by llama.cpp {LLAMA_CPP_VERSION} (tests/models/make_test_vlm.py v{VERSION})"
        )
        return d


def paths(directory: Path, shape: Shape = TINY, seed: int = 0, vocab: int = 0, image_token_id: int = 0) -> TinyVLM:
    return TinyVLM(*vlm_files(directory), vocab, image_token_id, shape, seed)


def cache_key(shape: Shape, seed: int) -> dict:
    versions = {p: importlib.metadata.version(p) for p in ("transformers", "torch", "llama_cpp_python")}
    return {"version": VERSION, "seed": seed, "shape": asdict(shape), "converter": LLAMA_CPP_VERSION, **versions}


def default_dir(seed: int = 0) -> Path:
    from protocol import modelfiles

    return modelfiles.build_dir() / f"test-vlm-v{VERSION}-s{seed}"


# --------------------------------------------------------------------------- the Hugging Face model


def write_hf(hf_dir: Path, shape: Shape, seed: int) -> tuple[int, int]:
    """The random Idefics3 model and its processor into hf_dir: (vocab size, <image> id)."""
    import torch
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    from tools.models import random_target

    tok = copy.deepcopy(random_target.shipped_tokenizer())  # SmolLM2's (the draft's, or the carried vocabulary)
    n_shipped = len(tok)
    tok.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS})
    if len(tok) != n_shipped + len(IMAGE_TOKENS):
        raise ValueError(f"the shipped tokenizer already holds some of {IMAGE_TOKENS}")
    image_id = tok.convert_tokens_to_ids(IMAGE_TOKEN)
    text = dict(
        model_type="llama",
        architectures=["VLlama3ForCausalLM"],  # as SmolVLM's config names it
        vocab_size=len(tok),
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.context,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )
    vision = dict(
        hidden_size=shape.vision_hidden,
        intermediate_size=shape.vision_intermediate,
        num_hidden_layers=shape.vision_layers,
        num_attention_heads=shape.vision_heads,
        image_size=shape.tile,
        patch_size=shape.patch,
        num_channels=3,
    )
    cfg = Idefics3Config(
        vision_config=vision,
        text_config=text,
        image_token_id=image_id,
        scale_factor=shape.scale_factor,
        tie_word_embeddings=False,
        pad_token_id=tok.pad_token_id,
    )
    cfg.architectures = ["Idefics3ForConditionalGeneration"]
    torch.manual_seed(seed)
    Idefics3ForConditionalGeneration(cfg).eval().save_pretrained(hf_dir)
    images = Idefics3ImageProcessorPil(
        size={"longest_edge": shape.longest_edge}, max_image_size={"longest_edge": shape.tile}, do_image_splitting=True
    )
    Idefics3Processor(
        image_processor=images, tokenizer=tok, image_seq_len=shape.tokens_per_tile, chat_template=CHAT_TEMPLATE
    ).save_pretrained(hf_dir)
    return len(tok), image_id


# --------------------------------------------------------------------------- make


def make(directory: str | Path | None = None, shape: Shape = TINY, seed: int = 0, log=print) -> TinyVLM:
    """All five outputs in `directory` (made once; found by its manifest after)."""
    directory = Path(directory) if directory else default_dir(seed)
    return make_vlm(
        directory,
        cache_key(shape, seed),
        lambda vocab, image_id: paths(directory, shape, seed, vocab, image_id),
        lambda hf_dir: write_hf(hf_dir, shape, seed),
        DRAFT_FTYPE,
        ("", "Idefics3"),
        log,
    )


# --------------------------------------------------------------------------- running it


def random_image(seed: int, size: int = 128) -> np.ndarray:
    """[size, size, 3] uint8 noise."""
    return np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)


def hf_logits(hf_dir: str | Path, image: np.ndarray, prompt: str = PROMPT) -> tuple[np.ndarray, list[int]]:
    """([vocab] transformers' next-token logits after `prompt` with `image` at its <image>, the input ids)."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    _check_image(image)
    processor = AutoProcessor.from_pretrained(hf_dir)
    model = AutoModelForImageTextToText.from_pretrained(hf_dir, dtype=torch.float32).eval()
    inputs = processor(text=prompt, images=[[image]], return_tensors="pt")
    with torch.no_grad():
        logits = model(**inputs).logits[0, -1]
    return logits.numpy(), inputs["input_ids"][0].tolist()


@dataclass
class Prefill:
    logits: np.ndarray  # [vocab] after the last position
    n_pos: int  # positions the prompt took in the KV cache
    chunks: list  # ("text", [ids]) and ("image", n_tokens), in order


def llama_logits(
    gguf: str | Path, mmproj: str | Path, image: np.ndarray, prompt: str = PROMPT, n_threads: int = 1
) -> Prefill:
    """llama.cpp's next-token logits after `prompt` with `image` at its <image> (llama_convert.mtmd_prefill:
    libmtmd tiles the image as the processor does)."""
    _check_image(image)
    with mtmd_prefill(gguf, mmproj, image, prompt, IMAGE_TOKEN, n_ctx=512, n_threads=n_threads) as p:
        return Prefill(p.logits, p.n_past, [c[:2] for c in p.chunks])


def llama_vocab(gguf: str | Path) -> list[bytes]:
    """[vocab] the token texts llama.cpp reads from a GGUF (vocab_only: no weights loaded)."""
    import llama_cpp

    _quiet()
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(str(gguf).encode(), params)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {gguf}")
    try:
        vocab = llama_cpp.llama_model_get_vocab(model)
        return [llama_cpp.llama_vocab_get_text(vocab, i) for i in range(llama_cpp.llama_vocab_n_tokens(vocab))]
    finally:
        llama_cpp.llama_model_free(model)


def _check_image(image: np.ndarray) -> None:
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f"an image is [height, width, 3] uint8, got {image.shape} {image.dtype}")


def check(vlm: TinyVLM) -> dict:
    """Every file loaded by what reads it, two images through each: the figures as a dict."""
    a, b = random_image(0), random_image(1)
    out = {"vocab": vlm.vocab}
    hf_a, ids = hf_logits(vlm.hf_dir, a)
    hf_b, _ = hf_logits(vlm.hf_dir, b)
    out["hf"] = {
        "image_tokens": ids.count(vlm.image_token_id),
        "prompt_tokens": len(ids),
        "image_effect": float(np.abs(hf_a - hf_b).max()),
    }
    for name, gguf, mmproj in (("target", vlm.target, vlm.target_mmproj), ("draft", vlm.draft, vlm.draft_mmproj)):
        pa, pb = llama_logits(gguf, mmproj, a), llama_logits(gguf, mmproj, b)
        out[name] = {
            "vocab": len(pa.logits),
            "n_pos": pa.n_pos,
            "image_tokens": sum(n for kind, n in pa.chunks if kind == "image"),
            "image_effect": float(np.abs(pa.logits - pb.logits).max()),
            "max_diff_vs_hf": float(np.abs(pa.logits - hf_a).max()),
        }
    return out


FAMILIES = ("smolvlm",) + qwen_vlm.FAMILIES


def make_family(family: str = "smolvlm", directory: str | Path | None = None, seed: int = 0, log=print):
    """One family's test VLM: `make` for smolvlm (a TinyVLM), qwen_vlm.make for the Qwen-VLs (a QwenVLM, the
    same fields and `family`)."""
    if family == "smolvlm":
        return make(directory, TINY, seed, log)
    return qwen_vlm.make(family, directory, seed=seed, log=log)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--family", choices=FAMILIES, default="smolvlm", help="which model (default smolvlm)")
    ap.add_argument(
        "--out", type=Path, default=None, help="output folder (default models/build/test-vlm[-<family>]-v<N>-s<seed>)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check", action="store_true", help="load every file and print what each computes, as JSON")
    args = ap.parse_args(argv)
    vlm = make_family(args.family, args.out, args.seed, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(json.dumps(vlm.describe()))
    if args.check:
        print(json.dumps(check(vlm) if args.family == "smolvlm" else qwen_vlm.check(vlm)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
