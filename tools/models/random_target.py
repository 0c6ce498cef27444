"""A Llama-shaped target with random weights and a planted greedy path: a GPU's cost without a 7B download.

    python -m tools.models.random_target make [--tiny] [--dtype f16|f32|q8_0|q4_0] [--seed 0] [--dir models/build]
    python -m tools.models.random_target check FILE_OR_DIR [--engine llamacpp|torch] [--device cpu|cuda] [--dtype ...]

`make` writes one model twice, from the same tensors: a GGUF for the llamacpp engine and llama.cpp's
own llama-server (through `gguf.GGUFWriter`, streamed tensor by tensor, so a 7B never sits in memory
whole) and a Hugging Face directory (config.json, per-layer safetensors shards, the tokenizer) for the
torch engine. Both carry the shipped SmolLM2 draft's vocabulary: the GGUF copies every `tokenizer.*`
field of the shipped GGUF, the directory holds that tokenizer as transformers reads it from the GGUF,
so a robot's `hello` passes the server's vocabulary check. Q and K are stored permuted in the GGUF as
llama.cpp's converter does (llama.cpp's RoPE pairs adjacent dimensions, transformers' the two halves),
so both files compute the same function. Cached by shape, dtype and seed (`paths`).

`--dtype q8_0` or `q4_0` is the GPU run's (tools/gpu_run.py): small and fast to write on the device. The GGUF's
block tensors are written directly as llama.cpp's blocks of random bytes (Q8_0: a float16 scale and 32 int8;
Q4_0: a scale and 32 nibbles; `random_blocks`), the scale set so each tensor has the standard deviation below;
no F16 file is made and no quantizer runs. The embeddings and the LM head carry the planted path, so they are
made in float32 and written in float16. A 7B shape is 4.4 GB in Q4_0, 7.7 GB in Q8_0. Its Hugging Face
directory holds no weights: config.json, the tokenizer, `successor.npy` and the recipe `random_init.json`, from
which the torch engine builds the model from its config on its device (server_bridge/engines/random_init.py). The two
files are then two models that follow the same planted path, not one function.

The weights are random Gaussians in every dense matrix, full size, so a forward pass costs exactly
what a trained model of that shape costs. With plain random weights the greedy text would be random,
and batch-dependent rounding would flip near-ties between a robot's planned draft and the server's
verdict. So a greedy path is planted, three ways at once:

  successor   a cycle over the tokenizer's normal tokens, random order (`planted_successor`); a
              special token maps to a normal one. The target's greedy token after any prefix is
              successor[last token].
  embeddings  N(0, 1) per element; the LM head's row v is the sum of the embeddings of the tokens
              whose successor is v, / sqrt(hidden): after the final norm the last token's own
              embedding dominates the residual stream, so its successor's logit wins by a wide margin
              (~30 logits at 7B shape against ~5 for the best random row).
  blocks      Q, K, V, gate and up N(0, 0.02^2); the output projections (attention out, down) at
              0.02 / sqrt(2 x layers), GPT-2's scaled init, so 32 blocks add noise of ~1.6x the
              embedding's scale rather than drowning it. Norms are ones.

`check` loads a made model through the project's engine (server_bridge.engines.load_engine), prints
its vocabulary hash and whether its greedy tokens follow the planted path, as one JSON line (the
fleet benchmark runs it in a subprocess per engine: a CUDA llama.cpp and a CUDA torch never share one).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import shutil
import sys
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from server_bridge.engines import random_init

VERSION = 1  # bump when the construction changes: cached files are keyed by it
NORMAL_TOKEN = 1  # tokenizer.ggml.token_type of an ordinary token
INIT_STD = 0.02
QUANTIZED = ("q8_0", "q4_0")  # written as llama.cpp's blocks directly (no quantizer pass)
DTYPES = ("f16", "f32", *QUANTIZED)
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18}  # per 32 weights: a float16 scale, then 32 int8 or 32 nibbles


@dataclass(frozen=True)
class Shape:
    name: str
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    context: int = 4096
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def params(self) -> int:
        h, kv = self.hidden, self.kv_heads * self.head_dim
        block = 2 * h * h + 2 * h * kv + 3 * h * self.intermediate + 2 * h
        return 2 * self.vocab * h + self.layers * block + h

    def llama_config(self, **extra: object):
        """transformers' LlamaConfig of this shape (extra: more of its fields)."""
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            max_position_embeddings=self.context,
            rms_norm_eps=self.rms_eps,
            rope_theta=self.rope_theta,
            **extra,
        )

    def weight_bytes(self, dtype: str) -> int:
        """The weights' bytes in a GGUF of `dtype` (quantized: blocks in the layers, float16 embeddings and head)."""
        if dtype in QUANTIZED:
            table = 2 * self.vocab * self.hidden
            return (self.params - table) * BLOCK_BYTES[dtype] // 32 + table * 2
        return self.params * (2 if dtype == "f16" else 4)

    def kv_bytes_per_token(self, elem_bytes: int = 2) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * elem_bytes


SMOLLM2_VOCAB = 49152
LLAMA_7B = Shape("llama-7b", SMOLLM2_VOCAB, hidden=4096, layers=32, heads=32, kv_heads=32, intermediate=11008)
TINY = Shape("tiny", SMOLLM2_VOCAB, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, context=2048)
# The shipped target's shape (SmolLM2-135M): the GPU run's serve phase where the shipped draft cannot travel.
SMOLLM2_135M = Shape(
    "smollm2-135m", SMOLLM2_VOCAB, hidden=576, layers=30, heads=9, kv_heads=3, intermediate=1536, rope_theta=100000.0
)
SHAPES = {s.name: s for s in (TINY, SMOLLM2_135M, LLAMA_7B)}


@dataclass(frozen=True)
class RandomTarget:
    gguf: Path  # for the llamacpp engine and llama-server
    hf_dir: Path  # for the torch engine: the same tensors
    shape: Shape
    dtype: str  # f16 | f32
    seed: int

    def describe(self) -> dict:
        return {
            "gguf": str(self.gguf),
            "hf_dir": str(self.hf_dir),
            "shape": asdict(self.shape),
            "dtype": self.dtype,
            "seed": self.seed,
            "params": self.shape.params,
            "weight_bytes": self.shape.weight_bytes(self.dtype),
            "construction": f"random Gaussian weights, planted greedy path (tools/models/random_target.py v{VERSION})",
        }


# --------------------------------------------------------------------------- the planted path


VOCAB_ENV = "EDGESPEC_VOCAB_GGUF"  # a GGUF holding the shipped vocabulary alone (vocab_gguf), where no draft is


def vocabulary_gguf() -> Path:
    """The GGUF the vocabulary is read from: $EDGESPEC_VOCAB_GGUF, else the shipped draft."""
    from protocol import modelfiles

    return Path(os.environ[VOCAB_ENV]) if os.environ.get(VOCAB_ENV) else modelfiles.shipped_gguf()


@functools.cache
def shipped_tokenizer_fields():
    """(reader, the shipped draft GGUF's tokenizer.* fields): the vocabulary every robot drafts in. Read once a
    process (gguf's reader takes seconds over 49,152 tokens; `pair` writes two models)."""
    import gguf

    reader = gguf.GGUFReader(str(vocabulary_gguf()))
    return reader, {k: f for k, f in reader.fields.items() if k.startswith("tokenizer.")}


def vocab_gguf(out: str | Path) -> Path:
    """A GGUF of the shipped draft's metadata and no tensors (~2 MB, where the draft is 98): the vocabulary that
    travels to a GPU machine in one call (tools/gpu_pack.py), read there through $EDGESPEC_VOCAB_GGUF."""
    import gguf

    from protocol import modelfiles

    reader = gguf.GGUFReader(str(modelfiles.shipped_gguf()))
    out = Path(out)
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    w = gguf.GGUFWriter(str(tmp), str(reader.fields["general.architecture"].contents()))
    for name, field in reader.fields.items():
        if name.startswith("tokenizer.") or name == "general.name":
            kind = field.types[0]
            sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(name, field.contents(), kind, sub_type=sub)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    os.replace(tmp, out)
    return out


def token_types() -> np.ndarray:
    """[vocab] tokenizer.ggml.token_type of the shipped draft (1 = normal)."""
    _, fields = shipped_tokenizer_fields()
    return np.asarray(fields["tokenizer.ggml.token_type"].contents(), dtype=np.int64)


def planted_successor(types: np.ndarray, seed: int) -> np.ndarray:
    """[vocab] the target's greedy next token after each token.

    A single cycle through every normal token in a random order, so a generation never reaches an
    end-of-text token and never repeats within vocab-many tokens; each special token leads to a
    distinct normal one (a prompt may end on one).
    """
    normal = np.flatnonzero(types == NORMAL_TOKEN)
    special = np.flatnonzero(types != NORMAL_TOKEN)
    if len(normal) < 2 or len(special) > len(normal):
        raise ValueError("the vocabulary needs two or more normal tokens, and no more special ones than normal")
    order = np.random.default_rng(seed).permutation(normal)
    succ = np.empty(len(types), dtype=np.int64)
    succ[order] = np.roll(order, -1)
    succ[special] = order[np.linspace(0, len(order) - 1, len(special), dtype=np.int64)] if len(special) else []
    return succ


def greedy_path(successor: np.ndarray, last_token: int, n: int) -> list[int]:
    """The planted continuation: n tokens after a prompt that ends with `last_token`."""
    out, t = [], int(last_token)
    for _ in range(n):
        t = int(successor[t])
        out.append(t)
    return out


# --------------------------------------------------------------------------- the weights


def _generator(seed: int, name: str):
    import torch

    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


def _normal(shape: tuple, std: float, seed: int, name: str):
    import torch

    return torch.randn(shape, generator=_generator(seed, name), dtype=torch.float32).mul_(std)


def hf_tensors(shape: Shape, seed: int, successor: np.ndarray):
    """(HF name, float32 tensor) in file order: the embeddings, then block by block, then norm and head."""
    import torch

    h, kv = shape.hidden, shape.kv_heads * shape.head_dim
    out_std = INIT_STD / math.sqrt(2 * shape.layers)
    embed = _normal((shape.vocab, h), 1.0, seed, "embed")
    yield "model.embed_tokens.weight", embed
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", torch.ones(h)
        for proj, rows, std in (
            ("q_proj", h, INIT_STD),
            ("k_proj", kv, INIT_STD),
            ("v_proj", kv, INIT_STD),
            ("o_proj", h, out_std),
        ):
            yield p + f"self_attn.{proj}.weight", _normal((rows, h), std, seed, p + proj)
        yield p + "post_attention_layernorm.weight", torch.ones(h)
        yield p + "mlp.gate_proj.weight", _normal((shape.intermediate, h), INIT_STD, seed, p + "gate")
        yield p + "mlp.up_proj.weight", _normal((shape.intermediate, h), INIT_STD, seed, p + "up")
        yield p + "mlp.down_proj.weight", _normal((h, shape.intermediate), out_std, seed, p + "down")
    yield "model.norm.weight", torch.ones(h)
    # head row v = sum of embed[u] over u with successor[u] == v (scaled): logit(v) ~ <embed[last], embed[last]>
    yield "lm_head.weight", random_init.planted_head(embed, torch.from_numpy(successor))


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter (convert_hf_to_gguf.LlamaModel.permute): rotate-half pairs -> adjacent pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf: str) -> str:
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf in names:
        return names[hf]
    _, _, i, *rest = hf.split(".")
    part = ".".join(rest)
    return (
        f"blk.{i}."
        + {
            "input_layernorm.weight": "attn_norm.weight",
            "self_attn.q_proj.weight": "attn_q.weight",
            "self_attn.k_proj.weight": "attn_k.weight",
            "self_attn.v_proj.weight": "attn_v.weight",
            "self_attn.o_proj.weight": "attn_output.weight",
            "post_attention_layernorm.weight": "ffn_norm.weight",
            "mlp.gate_proj.weight": "ffn_gate.weight",
            "mlp.up_proj.weight": "ffn_up.weight",
            "mlp.down_proj.weight": "ffn_down.weight",
        }[part]
    )


def gguf_array(hf: str, t, shape: Shape, dtype: str) -> np.ndarray:
    """The GGUF's copy of one tensor: Q and K permuted, 1-D tensors in F32 (as llama.cpp's converter writes)."""
    a = t.numpy()
    if hf.endswith("q_proj.weight"):
        a = _permute(a, shape.heads)
    elif hf.endswith("k_proj.weight"):
        a = _permute(a, shape.kv_heads)
    return np.ascontiguousarray(a, dtype=np.float32 if a.ndim == 1 or dtype == "f32" else np.float16)


def _tensor_infos(shape: Shape) -> list[tuple[str, tuple]]:
    h, kv = shape.hidden, shape.kv_heads * shape.head_dim
    infos = [("model.embed_tokens.weight", (shape.vocab, h))]
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        infos += [
            (p + "input_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (h, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, h)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "mlp.gate_proj.weight", (shape.intermediate, h)),
            (p + "mlp.up_proj.weight", (shape.intermediate, h)),
            (p + "mlp.down_proj.weight", (h, shape.intermediate)),
        ]
    return infos + [("model.norm.weight", (h,)), ("lm_head.weight", (shape.vocab, h))]


# --------------------------------------------------------------------------- the files


def _vocabulary(shape: Shape, seed: int) -> tuple[dict, np.ndarray]:
    """(the shipped vocabulary's tokenizer.* fields, the planted successor of each token), checked against `shape`."""
    _, fields = shipped_tokenizer_fields()
    types = np.asarray(fields["tokenizer.ggml.token_type"].contents(), dtype=np.int64)
    if len(types) != shape.vocab:
        raise ValueError(f"the shipped tokenizer has {len(types)} tokens, the shape {shape.vocab}")
    return fields, planted_successor(types, seed)


def paths(shape: Shape, dtype: str, seed: int, directory: Path) -> tuple[Path, Path]:
    base = f"random-{shape.name}-v{shape.vocab}-h{shape.hidden}-l{shape.layers}-{dtype}-s{seed}-planted{VERSION}"
    if dtype in QUANTIZED:  # one weightless recipe directory for every quantized GGUF of the shape
        recipe = f"random-{shape.name}-v{shape.vocab}-h{shape.hidden}-l{shape.layers}-s{seed}-planted{VERSION}-recipe"
        return directory / f"{base}.gguf", directory / recipe
    return directory / f"{base}.gguf", directory / f"{base}-hf"


def make(
    shape: Shape, dtype: str = "f16", seed: int = 0, directory: str | Path | None = None, log=print
) -> RandomTarget:
    """The GGUF and the HF directory (made once; found in the cache after)."""
    from protocol import modelfiles

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    directory = Path(directory) if directory else modelfiles.build_dir()
    gguf_path, hf_dir = paths(shape, dtype, seed, directory)
    target = RandomTarget(gguf_path, hf_dir, shape, dtype, seed)
    if gguf_path.is_file() and (hf_dir / "config.json").is_file():
        log(f"random target: cached {gguf_path.name} and {hf_dir.name}/")
        return target
    if dtype in QUANTIZED:
        return _make_quantized(target, log)
    directory.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    log(
        f"random target: writing {shape.name} ({shape.params / 1e9:.2f} B parameters, "
        f"{shape.weight_bytes(dtype) / 2**30:.2f} GiB in {dtype}) twice: {gguf_path.name} and {hf_dir.name}/"
    )
    fields, successor = _vocabulary(shape, seed)
    tmp_gguf = gguf_path.with_name(f"{gguf_path.name}.{os.getpid()}.tmp")  # this process's own
    tmp_dir = hf_dir.with_name(f"{hf_dir.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tmp_dir.mkdir(parents=True)
    _write(shape, dtype, seed, successor, fields, tmp_gguf, tmp_dir, log)
    _write_hf_config(shape, dtype, fields, tmp_dir)
    shutil.rmtree(hf_dir, ignore_errors=True)
    tmp_dir.rename(hf_dir)
    os.replace(tmp_gguf, gguf_path)  # last: a present GGUF means both are complete
    log(f"random target: made in {time.perf_counter() - t0:.1f}s")
    return target


def _write_metadata(w, shape: Shape, seed: int, fields: dict) -> None:
    """The Llama hyperparameters and every `tokenizer.*` field of the shipped draft (vocabulary, merges, ids)."""
    import gguf

    w.add_name(f"random {shape.name} (planted greedy path, seed {seed})")
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.hidden)
    w.add_block_count(shape.layers)
    w.add_feed_forward_length(shape.intermediate)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_rope_dimension_count(shape.head_dim)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_layer_norm_rms_eps(shape.rms_eps)
    w.add_vocab_size(shape.vocab)
    for name, field in fields.items():  # the shipped draft's vocabulary, merges, special ids, chat template
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, field.contents(), kind, sub_type=sub)


def _write(
    shape: Shape, dtype: str, seed: int, successor: np.ndarray, fields: dict, gguf_path: Path, hf_dir: Path, log
) -> None:
    """One pass over the tensors: each is made once, streamed into the GGUF and into its layer's shard."""
    import gguf
    import torch
    from safetensors.torch import save_file

    w = gguf.GGUFWriter(str(gguf_path), "llama")
    _write_metadata(w, shape, seed, fields)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if dtype == "f16" else gguf.LlamaFileType.ALL_F32)
    infos = _tensor_infos(shape)
    for hf, dims in infos:
        elem = 4 if len(dims) == 1 or dtype == "f32" else 2
        w.add_tensor_info(
            gguf_name(hf), dims, np.dtype(np.float32 if elem == 4 else np.float16), math.prod(dims) * elem
        )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    hf_dtype = torch.float16 if dtype == "f16" else torch.float32
    shards = ["embed"] + [f"layer{i}" for i in range(shape.layers)] + ["head"]
    files = {s: f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k, s in enumerate(shards)}
    weight_map, total, shard, current = {}, 0, {}, "embed"
    expected = iter(infos)
    for hf, t in hf_tensors(shape, seed, successor):
        assert (hf, tuple(t.shape)) == next(expected), hf
        w.write_tensor_data(gguf_array(hf, t, shape, dtype))
        key = f"layer{hf.split('.')[2]}" if hf.startswith("model.layers.") else "embed" if "embed" in hf else "head"
        if key != current:
            save_file(shard, str(hf_dir / files[current]), metadata={"format": "pt"})
            if shape.layers > 4:  # a 7B takes minutes: show it moving
                log(f"  {current} written")
            shard, current = {}, key
        shard[hf] = t.to(hf_dtype).contiguous()
        weight_map[hf] = files[key]
        total += shard[hf].numel() * shard[hf].element_size()
    save_file(shard, str(hf_dir / files[current]), metadata={"format": "pt"})
    w.close()
    (hf_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
    )


def _write_hf_config(shape: Shape, dtype: str, fields: dict, hf_dir: Path) -> None:
    """config.json, generation_config.json and the tokenizer (transformers reads it from the shipped GGUF)."""
    from transformers import GenerationConfig

    bos = int(fields["tokenizer.ggml.bos_token_id"].contents())
    eos = int(fields["tokenizer.ggml.eos_token_id"].contents())
    cfg = shape.llama_config(
        tie_word_embeddings=False,
        bos_token_id=bos,
        eos_token_id=eos,
        torch_dtype="float16" if dtype == "f16" else "float32",
    )
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(hf_dir)
    GenerationConfig(bos_token_id=bos, eos_token_id=eos).save_pretrained(hf_dir)
    shipped_tokenizer().save_pretrained(hf_dir)


@functools.cache
def shipped_tokenizer():
    """transformers' fast tokenizer of the shipped vocabulary (vocabulary_gguf()'s byte-level BPE), built once a
    process from the GGUF's fields with `tokenizers` itself. transformers' own GGUF loader is not used: its
    version 5.17 (the GPU machine's) turns this vocabulary into a byte-fallback tokenizer with <|im_start|> as eos,
    which llama.cpp's converter then writes as a SentencePiece vocabulary that aborts on the first unknown byte."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    _, fields = shipped_tokenizer_fields()
    tokens = [str(t) for t in fields["tokenizer.ggml.tokens"].contents()]
    types = fields["tokenizer.ggml.token_type"].contents()
    merges = [tuple(str(m).split(" ", 1)) for m in fields["tokenizer.ggml.merges"].contents()]
    bpe = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False, byte_fallback=False))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    bpe.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
    bpe.add_special_tokens(
        [AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, types, strict=True) if k == 3]
    )

    def named(key: str) -> str | None:
        return tokens[int(fields[key].contents())] if key in fields else None

    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token=named("tokenizer.ggml.bos_token_id"),
        eos_token=named("tokenizer.ggml.eos_token_id"),
        unk_token=named("tokenizer.ggml.unknown_token_id"),
        pad_token=named("tokenizer.ggml.padding_token_id"),
        chat_template=str(fields["tokenizer.chat_template"].contents())
        if "tokenizer.chat_template" in fields
        else None,
    )


# --------------------------------------------------------------------------- quantized, for the GPU run


def _make_quantized(target: RandomTarget, log) -> RandomTarget:
    """The quantized GGUF (blocks written directly) and the weightless recipe directory for the torch engine."""
    shape, dtype, seed = target.shape, target.dtype, target.seed
    target.gguf.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    log(
        f"random target: writing {shape.name} ({shape.params / 1e9:.2f} B parameters) as {target.gguf.name} "
        f"({shape.weight_bytes(dtype) / 2**30:.2f} GiB of {dtype} blocks) and the recipe {target.hf_dir.name}/"
    )
    fields, successor = _vocabulary(shape, seed)
    if not (target.hf_dir / "config.json").is_file():
        tmp_dir = target.hf_dir.with_name(f"{target.hf_dir.name}.{os.getpid()}.tmp")
        shutil.rmtree(tmp_dir, ignore_errors=True)
        tmp_dir.mkdir(parents=True)
        _write_hf_config(shape, "f32", fields, tmp_dir)
        np.save(tmp_dir / "successor.npy", successor)
        recipe = {"seed": seed, "init_std": INIT_STD, "successor": "successor.npy", "version": VERSION}
        (tmp_dir / random_init.RECIPE).write_text(json.dumps(recipe, indent=1))
        shutil.rmtree(target.hf_dir, ignore_errors=True)
        tmp_dir.rename(target.hf_dir)
    tmp_gguf = target.gguf.with_name(f"{target.gguf.name}.{os.getpid()}.tmp")
    _write_quantized(shape, dtype, seed, successor, fields, tmp_gguf, log)
    os.replace(tmp_gguf, target.gguf)
    log(f"random target: made in {time.perf_counter() - t0:.1f}s")
    return target


def random_blocks(rows: int, cols: int, dtype: str, std: float, rng: np.random.Generator) -> np.ndarray:
    """[rows, cols / 32 x block bytes] uint8: llama.cpp's Q8_0 or Q4_0 blocks of uniform random values whose
    dequantized standard deviation is `std`. Raw random bytes (GB/s: a 7B shape's in seconds): a nibble stands for
    -8..7 and a byte for -128..127, so each block leans by half a step; the scales alternate in sign along a row,
    so a row's blocks cancel that lean and no bias enters."""
    blocks = rows * cols // 32
    quant = 16 if dtype == "q4_0" else 32  # the bytes after each block's float16 scale
    out = np.empty((blocks, 2 + quant), dtype=np.uint8)
    out[:, 2:] = np.frombuffer(rng.bytes(blocks * quant), dtype=np.uint8).reshape(blocks, quant)
    levels = 16 if dtype == "q4_0" else 256
    step = std / math.sqrt((levels**2 - 1) / 12)  # the standard deviation of a uniform over `levels` steps
    scale = np.full(blocks, step, dtype=np.float16)
    scale[1::2] *= -1
    out[:, :2] = scale.view(np.uint8).reshape(blocks, 2)
    return out.reshape(rows, -1)


def _write_quantized(shape: Shape, dtype: str, seed: int, successor: np.ndarray, fields: dict, path: Path, log) -> None:
    import gguf
    import torch

    qtype = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}[dtype]
    w = gguf.GGUFWriter(str(path), "llama")
    _write_metadata(w, shape, seed, fields)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if dtype == "q8_0" else gguf.LlamaFileType.MOSTLY_Q4_0)
    out_std = INIT_STD / math.sqrt(2 * shape.layers)
    plan = []  # (gguf name, dims, kind, std): kind f32 (ones), table (float16), blocks (random blocks)
    for hf, dims in _tensor_infos(shape):
        if len(dims) == 1:
            plan.append((gguf_name(hf), dims, "f32", 1.0))
        elif hf in ("model.embed_tokens.weight", "lm_head.weight"):
            plan.append((gguf_name(hf), dims, "table", 1.0))
        else:
            std = out_std if hf.endswith(("o_proj.weight", "down_proj.weight")) else INIT_STD
            plan.append((gguf_name(hf), dims, "blocks", std))
    for name, dims, kind, _ in plan:
        if kind == "blocks":
            per_row = dims[1] // 32 * BLOCK_BYTES[dtype]
            w.add_tensor_info(name, (dims[0], per_row), np.dtype(np.uint8), dims[0] * per_row, raw_dtype=qtype)
        else:
            elem = np.dtype(np.float32 if kind == "f32" else np.float16)
            w.add_tensor_info(name, dims, elem, math.prod(dims) * elem.itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    # the planted path: embeddings N(0, 1); head row v = the sum of the embeddings of v's predecessors / sqrt(h)
    embed = _normal((shape.vocab, shape.hidden), 1.0, seed, "embed")
    head = random_init.planted_head(embed, torch.from_numpy(successor))
    tables = {"token_embd.weight": embed, "output.weight": head}
    for i, (name, dims, kind, std) in enumerate(plan):
        if kind == "f32":
            w.write_tensor_data(np.ones(dims, dtype=np.float32))
        elif kind == "table":
            w.write_tensor_data(tables.pop(name).numpy().astype(np.float16))
        else:
            rng = np.random.default_rng(seed * 1_000_003 + zlib.crc32(name.encode()))
            w.write_tensor_data(random_blocks(dims[0], dims[1], dtype, std, rng))
        if shape.layers > 4 and name.endswith("ffn_down.weight"):
            log(f"  {name.split('.')[1]} of {shape.layers} layers written ({i + 1} of {len(plan)} tensors)")
    w.close()


def gguf_vocab_hash(path: str | Path) -> str:
    """protocol.modelfiles.vocab_hash over a GGUF's tokenizer.ggml.tokens (what llama.cpp hashes)."""
    import gguf

    from protocol import modelfiles

    tokens = gguf.GGUFReader(str(path)).fields["tokenizer.ggml.tokens"].contents()
    return modelfiles.vocab_hash(t.encode("utf-8") for t in tokens)


# --------------------------------------------------------------------------- check


def check(
    path: str | Path, engine: str, device: str = "cpu", dtype: str = "auto", seed: int = 0, steps: int = 8
) -> dict:
    """Load through the project's engine; greedy-decode `steps` tokens after a prompt; compare with the path."""
    from server_bridge.engines import Pass, load_engine

    t0 = time.perf_counter()
    eng = load_engine(str(path), engine=engine, device=device, dtype=dtype, max_sequences=2, kv_tokens=512, max_len=256)
    load_s = time.perf_counter() - t0
    succ = planted_successor(token_types(), seed)
    prompt = [1, 9690, 198, 1, 4093, 198]  # any ids; the path depends on the last one only
    seq = eng.new_sequence()
    got, new, start = [], prompt, 0
    t1 = time.perf_counter()
    for _ in range(steps):
        row = eng.to_numpy(eng.forward([Pass(seq, start, new, 1)])[0])[-1]  # [vocab]
        start += len(new)
        new = [int(np.argmax(row))]
        got.append(new[0])
    ms = 1e3 * (time.perf_counter() - t1) / steps
    want = greedy_path(succ, prompt[-1], steps)
    return {
        "engine": engine,
        "info": eng.info.as_dict(),
        "vocab_size": eng.vocab_size,
        "vocab_hash": eng.vocab_hash,
        "n_layers": eng.n_layers,
        "hidden": eng.hidden_size,
        "load_s": round(load_s, 2),
        "ms_per_token_one_session": round(ms, 3),
        "greedy": got,
        "planted": want,
        "follows_path": got == want,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("--tiny", action="store_true", help="2 layers, hidden 64 (vocab still 49152)")
    m.add_argument("--dtype", choices=DTYPES, default="f16")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--dir", default=None, help="default models/build")
    p = sub.add_parser("pair", help="a random pair in the shipped vocabulary: a target, its recipe and a toy draft")
    p.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    p.add_argument("--dtype", choices=QUANTIZED, default="q8_0")
    p.add_argument("--dir", default=None, help="default models/build")
    v = sub.add_parser("vocab", help="the shipped vocabulary alone, as a GGUF without tensors")
    v.add_argument("out")
    c = sub.add_parser("check")
    c.add_argument("path")
    c.add_argument("--engine", choices=("llamacpp", "torch"), default="llamacpp")
    c.add_argument("--device", default="cpu")
    c.add_argument("--dtype", default="auto", help="torch engine: auto, float32, float16, bfloat16")
    c.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.cmd == "make":
        t = make(TINY if args.tiny else LLAMA_7B, args.dtype, args.seed, args.dir)
        print(json.dumps(t.describe()))
        return 0
    if args.cmd == "vocab":
        print(json.dumps({"vocab": str(vocab_gguf(args.out))}))
        return 0
    if args.cmd == "pair":  # the target and the draft share the planted path (seed 0): the draft is mostly right
        target = make(SHAPES[args.shape], args.dtype, 0, args.dir)
        draft = make(TINY, args.dtype, 0, args.dir)
        print(json.dumps({"target": str(target.gguf), "recipe": str(target.hf_dir), "draft": str(draft.gguf)}))
        return 0
    result = check(args.path, args.engine, args.device, args.dtype, args.seed)
    print(json.dumps(result))
    return 0 if result["follows_path"] else 1


if __name__ == "__main__":
    sys.exit(main())
