"""`server-bridge train-exits`: the target's early-exit adapters (FSD), trained by self-distillation.

    server-bridge train-exits [--target NAME|GGUF|HF_DIR] [--layers 12,18,22,26] [--rank 64] [--steps 300]
        [--out models/exits] [--images FRAME_OR_DIR ...]

Why self-distillation rather than next-token loss: an exit's only job is to
guess the *final layer's* verdict early, so that the robot pre-drafts from
the right continuation. The target's own greedy generations with the final
layer's distribution as the teacher train exactly that; next-token loss on
reference text would teach the exits to predict the text, which the final
layer itself often does not.

Steps: (1) generate the target's greedy continuations of the shipped prompts
(models/exits/train_prompts.jsonl), (2) one forward pass per sequence collects
the hidden state after each exit layer and the final layer's top-K
distribution, (3) each adapter is trained with KL(teacher top-K || exit over
the same K candidates), which needs only K rows of the LM head per position,
(4) top-1 agreement with the final layer is measured over the whole vocabulary
on held-out generations of the benchmark prompts (models/exits/heldout_prompts.jsonl),
beside the untrained "logit lens" (the same exit with a zero adapter).
Writes <out>/<target>.{safetensors,json}, report.md and (with matplotlib) agreement.png.

The target runs on the torch engine (server_bridge/engines/torch.py), through its own
passes: generation and the hidden states at the exits are what a verify pass sees.
A vision-language target (a Hugging Face directory: SmolVLM, Qwen2-VL, Qwen2.5-VL,
Qwen3-VL; the FSD paper's robot pair is Qwen2-VL) is trained on prompts with an
image, as the robot asks it: every `--image-every`-th prompt carries one of
`--images` (the robot's own camera frames; without them, random test frames,
which teach the adapters little about real scenes). The adapters read the text
decoder's residual stream and its final norm and LM head, so the same files load on
the llamacpp engine for the model's GGUF + mmproj
(`server-bridge serve --target DIR/target.gguf --mmproj DIR/target-mmproj.gguf
--exits OUT/<name>`).
"""

from __future__ import annotations

import io
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from protocol import modelfiles
from protocol.images import PromptImage

from ..config import TrainExitsConfig
from ..engines.exits_torch import ExitHeads
from ..exits import ExitConfig
from ..target import Target, load_target

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp")


MAX_PROMPT_FILE_BYTES = 64 << 20


def load_prompts(path: Path, limit: int = 0) -> list[dict]:
    """A jsonl file of {"chat": bool, "prompt": str}, the first `limit` (0: all); ValueError names a bad line."""
    if path.stat().st_size > MAX_PROMPT_FILE_BYTES:
        raise ValueError(f"{path}: over {MAX_PROMPT_FILE_BYTES >> 20} MiB, too big for a prompt file")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        try:
            row = json.loads(line) if line.strip() else None
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON: {e}") from None
        if row is None:
            continue
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not isinstance(row.get("chat"), bool):
            raise ValueError(f'{path}:{n}: expected {{"chat": true|false, "prompt": "..."}}, got {line[:200]}')
        rows.append(row)
    return rows[:limit] if limit > 0 else rows


@dataclass
class Example:
    """One prompt as the target reads it, and the target's greedy continuation of it."""

    ids: list[int]  # the prompt's token ids (one marker id per image)
    images: list[PromptImage] = field(default_factory=list)  # each on its marker (`at`)
    generated: list[int] = field(default_factory=list)  # the target's greedy ids after the prompt


def image_files(paths: list[str]) -> list[bytes]:
    """The encoded frames named (files, or directories of image files, sorted)."""
    out: list[bytes] = []
    for p in map(Path, paths):
        files = sorted(f for f in p.iterdir() if f.suffix.lower() in IMAGE_SUFFIXES) if p.is_dir() else [p]
        out.extend(f.read_bytes() for f in files)
    if paths and not out:
        raise ValueError(f"no image files in {paths}")
    return out


def random_frames(n: int) -> list[bytes]:
    """n random PNG frames of two sizes (the test models' images), for a VLM target given no --images."""
    from PIL import Image

    out = []
    for i in range(n):
        buf = io.BytesIO()
        shape = ((64, 64, 3), (96, 128, 3))[i % 2]
        Image.fromarray(np.random.default_rng(1000 + i).integers(0, 256, shape, dtype=np.uint8)).save(buf, format="PNG")
        out.append(buf.getvalue())
    return out


def examples(target: Target, prompts: list[dict], frames: list[bytes], every: int) -> list[Example]:
    """The prompts tokenized for the target; with frames (a VLM target), every `every`-th leads with one
    (chat prompts as the chat template lays an image out, plain ones behind the marker's placeholder)."""
    from runtime.vision import placeholder

    tok, marker = target.engine.tokenizer, target.image_marker
    out = []
    for i, p in enumerate(prompts):
        image = frames[(i // every) % len(frames)] if frames and i % every == 0 else None
        if p["chat"]:
            content = p["prompt"] if image is None else [{"type": "image"}, {"type": "text", "text": p["prompt"]}]
            text = tok.apply_chat_template(
                [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
            )
        else:
            text = p["prompt"] if image is None else placeholder(tok.convert_ids_to_tokens(marker)) + p["prompt"]
        ids = tok.encode(text, add_special_tokens=False)
        at = [j for j, t in enumerate(ids) if t == marker] if image is not None else []
        if len(at) != (image is not None) or (at and at[0] == len(ids) - 1):
            raise ValueError(f"prompt {i}: {len(at)} image markers in {text!r}")
        out.append(Example(ids, [PromptImage.of(image, at[0])] if at and image is not None else []))
    return out


def generate(target: Target, exs: list[Example], new_tokens: int, desc: str) -> list[Example]:
    """The target's greedy continuation of each prompt, one engine pass a token (stops at an EOS)."""
    eos = set(target.engine.eos_ids)
    for ex in tqdm(exs, desc=desc, unit="prompt"):
        state, ex.generated = target.new_state(ex.ids, images=ex.images), []
        try:
            while len(ex.generated) < new_tokens:
                token = int(target.score(state, [])[0].argmax())  # [1, vocab]: the row after the ids
                target.commit(state, [token], len(state.ids))
                ex.generated.append(token)
                if token in eos:
                    break
        finally:
            target.free(state)
    return [ex for ex in exs if ex.generated]


@torch.inference_mode()
def collect(target: Target, exs: list[Example], layers: list[int], k: int) -> tuple[dict, Any, Any, Any]:
    """Per position that predicts a generated token: hidden after each exit layer, teacher top-k.

    One verify pass per sequence (the prompt prefilled with its images, the generated ids as its
    draft), its exit layers tapped as the server taps them."""
    hidden: dict[int, list[torch.Tensor]] = {l: [] for l in layers}
    top_ids, top_p, argmax = [], [], []
    for ex in exs:
        state = target.new_state(ex.ids, images=ex.images)
        rows: dict[int, torch.Tensor] = {}
        taps = {
            l: (lambda h, l=l, rows=rows: rows.__setitem__(l, torch.as_tensor(h).float().cpu().clone())) for l in layers
        }
        try:
            logits = torch.from_numpy(target.score(state, ex.generated[:-1], taps=taps))  # [len(generated), vocab]
        finally:
            target.free(state)
        for l in layers:
            hidden[l].append(rows[l])
        v, i = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
        top_ids.append(i)
        top_p.append(v.exp())
        argmax.append(i[:, 0])
    return ({l: torch.cat(h) for l, h in hidden.items()}, torch.cat(top_ids), torch.cat(top_p), torch.cat(argmax))


def train_one(
    heads: ExitHeads,
    model: Any,
    layer: int,
    h: torch.Tensor,
    ids: torch.Tensor,
    p: torch.Tensor,
    config: TrainExitsConfig,
    seed: int,
) -> None:
    """KL(teacher || exit) over each position's teacher top-K plus `negatives` random vocabulary rows
    shared by the batch (a sampled softmax): without them the rows outside every top-K stay untrained
    and win the full-vocabulary argmax."""
    adapter = heads.adapters[str(layer)]
    adapter.requires_grad_(True)
    steps, batch, negatives = config.steps, config.batch, config.negatives
    opt = torch.optim.AdamW(adapter.parameters(), lr=config.lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)
    teacher = p / p.sum(-1, keepdim=True)  # [n, K] renormalized top-K
    weight = model.get_output_embeddings().weight  # [vocab, hidden]: the LM head (a VLM's too)
    vocab = weight.shape[0]
    bar = tqdm(range(steps), desc=f"exit {layer:>2}", unit="step")
    for _ in bar:
        idx = torch.randint(0, h.shape[0], (batch,), generator=g)
        neg = torch.randint(0, vocab, (negatives,), generator=g)
        f = heads.features(model, layer, h[idx])  # [batch, hidden]
        pos = torch.einsum("bh,bkh->bk", f, weight[ids[idx]])  # [batch, K]
        s = torch.log_softmax(torch.cat([pos, f @ weight[neg].T], dim=1), dim=-1)
        t = torch.cat([teacher[idx], torch.zeros(batch, negatives)], dim=1)  # negatives: teacher mass ~0
        loss = (t * (t.clamp_min(1e-12).log() - s)).sum(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        bar.set_postfix(kl=f"{loss.item():.3f}")
    adapter.requires_grad_(False)


@torch.inference_mode()
def agreement(heads: ExitHeads, model: torch.nn.Module, layer: int, h: torch.Tensor, argmax: torch.Tensor) -> float:
    """Top-1 agreement of the exit's full-vocabulary argmax with the final layer's."""
    hits: float = 0
    for i in range(0, h.shape[0], 256):
        hits += (heads.logits(model, layer, h[i : i + 256]).argmax(-1) == argmax[i : i + 256]).sum().item()
    return hits / h.shape[0]


def prompt_sets(config: TrainExitsConfig) -> list[list[dict]]:
    """The training and the held-out prompts (the shipped ones where none are named), read before any model."""
    shipped = modelfiles.models_dir() / "exits"
    named = ((config.prompts, "train_prompts.jsonl"), (config.heldout, "heldout_prompts.jsonl"))
    return [load_prompts(Path(path) if path else shipped / default, config.max_prompts) for path, default in named]


def _data(target: Target, config: TrainExitsConfig, sets: list[list[dict]]) -> tuple[list[Example], list[Example]]:
    """The target's greedy generations of the training and the held-out prompts (a VLM's with frames)."""
    frames: list[bytes] = []
    if target.sees and config.image_every > 0:
        frames = image_files(config.images) or random_frames(4)
        if not config.images:
            print("a vision-language target and no --images: training on random frames", file=sys.stderr)
    train_set, held_set = (examples(target, prompts, frames, config.image_every) for prompts in sets)
    train = generate(target, train_set, config.gen_tokens, "target generations (train)")
    return train, generate(target, held_set, config.gen_tokens, "target generations (held out)")


def run(config: TrainExitsConfig) -> int:
    """Train the adapters, measure their agreement, write them and the report."""
    sets = prompt_sets(config)  # a bad prompt file fails here, before the model loads
    torch.manual_seed(config.seed)
    t0 = time.perf_counter()
    # the torch engine's own passes: what the server's verify passes compute, images included (on the CPU in
    # float32: the adapters train beside the model's final norm and LM head there)
    kw = {"device": "cpu", "dtype": "float32", "threads": config.threads, "max_len": config.max_len}
    target = load_target(config.target, "torch", max_sequences=1, **kw)
    engine: Any = target.engine  # the torch engine: its model, its tokenizer
    model = engine.model.requires_grad_(False)
    name, layers = config.name or engine.name, config.layers
    if max(layers) >= engine.n_layers:
        print(
            f"server-bridge train-exits: exit layers must be below the last layer ({engine.n_layers})", file=sys.stderr
        )
        return 2
    train, held = _data(target, config, sets)
    h_tr, ids_tr, p_tr, _ = collect(target, train, layers, config.candidates)
    h_te, _, _, argmax_te = collect(target, held, layers, 1)
    print(f"{ids_tr.shape[0]} training positions, {argmax_te.shape[0]} held-out positions")

    heads = ExitHeads(ExitConfig(layers, engine.hidden_size, config.rank, name))
    lens = {l: agreement(heads, model, l, h_te[l], argmax_te) for l in layers}  # zero adapters
    for l in layers:
        train_one(heads, model, l, h_tr[l], ids_tr, p_tr, config, config.seed + l)
    trained = {l: agreement(heads, model, l, h_te[l], argmax_te) for l in layers}
    heads.config.info = {
        "method": "self-distillation: KL over the teacher's top-K plus shared random negatives",
        **{k: getattr(config, k) for k in ("candidates", "negatives", "steps", "batch", "lr")},
        "train_positions": int(ids_tr.shape[0]),
        "heldout_positions": int(argmax_te.shape[0]),
        "prompts_with_an_image": sum(bool(ex.images) for ex in train + held),
        "agreement_heldout": {str(l): trained[l] for l in layers},
        "agreement_logit_lens": {str(l): lens[l] for l in layers},
        "seconds": round(time.perf_counter() - t0, 1),
    }
    out = Path(config.out) if config.out else modelfiles.models_dir() / "exits"
    heads.save(out / name)
    rows = "\n".join(f"| {l} | {lens[l]:.3f} | {trained[l]:.3f} |" for l in layers)
    report = (
        f"Top-1 agreement with the final layer ({engine.n_layers} layers) on {argmax_te.shape[0]} held-out "
        f"positions (the target's greedy generations of the held-out prompts):\n\n"
        f"| exit layer | logit lens (no adapter) | trained adapter (rank {config.rank}) |\n|---|---|---|\n{rows}\n\n"
        f"`server-bridge train-exits --layers {','.join(map(str, layers))} --rank {config.rank} --steps "
        f"{config.steps}` took {heads.config.info['seconds']} s on {ids_tr.shape[0]} training positions.\n"
    )
    (out / "report.md").write_text(report)
    plot(layers, lens, trained, out / "agreement.png", engine.n_layers)
    print("\n" + report)
    print(f"wrote {out / (name + '.safetensors')} and {out / 'report.md'}")
    return 0


def plot(layers: list[int], lens: dict, trained: dict, path: Path, n_layers: int) -> None:
    """Agreement against the exit's layer, with and without its adapter (skipped without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no matplotlib: agreement.png not drawn", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(layers, [lens[l] for l in layers], marker="o", label="logit lens (no adapter)")
    ax.plot(layers, [trained[l] for l in layers], marker="o", label="trained adapter")
    ax.set(xlabel=f"exit after layer (of {n_layers})", ylabel="top-1 agreement with final layer", ylim=(0, 1))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
