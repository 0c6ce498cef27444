"""Train early-exit adapters for the target by self-distillation (FSD, issue 3).

    python -m tools.train.exits [--target NAME|GGUF|HF_DIR] [--layers 12,18,22,26] [--rank 64] [--steps 300]
        [--out models/exits] [--images FRAME...]

Why self-distillation rather than next-token loss: an exit's only job is to
guess the *final layer's* verdict early, so that the robot pre-drafts from
the right continuation. The target's own greedy generations with the final
layer's distribution as the teacher train exactly that; next-token loss on
reference text would teach the exits to predict the text, which the final
layer itself often does not.

Steps: (1) generate the target's greedy continuations of the shipped prompts
(tools/prompts/exits_train.jsonl), (2) one forward pass per sequence collects
the hidden state after each exit layer and the final layer's top-K
distribution, (3) each adapter is trained with KL(teacher top-K || exit over
the same K candidates), which needs only K rows of the LM head per position,
(4) top-1 agreement with the final layer is measured over the whole vocabulary
on held-out generations of the benchmark prompts (tools/prompts/bench.jsonl),
beside the untrained "logit lens" (the same exit with a zero adapter).
Writes <out>/<target>.{safetensors,json}, report.md and agreement.png.

The target runs on the torch engine (server_bridge/engine_torch.py), through its own
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

import argparse
import io
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from protocol import modelfiles
from protocol.images import PromptImage
from server_bridge.exits import ExitConfig
from server_bridge.exits_torch import ExitHeads
from tools.plots import line_plot

PROMPTS = Path(__file__).resolve().parents[1] / "prompts"
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp")


def load_prompts(path: Path, limit: int = 0) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows[:limit] if limit > 0 else rows


@dataclass
class Example:
    """One prompt as the target reads it, and the target's greedy continuation of it."""

    ids: list[int]  # the prompt's token ids (one marker id per image)
    images: list[PromptImage] = field(default_factory=list)  # each on its marker (`at`)
    generated: list[int] = field(default_factory=list)  # the target's greedy ids after the prompt


def image_files(paths: list[str]) -> list[bytes]:
    """The encoded frames named (files, or directories of image files, sorted)."""
    out = []
    for p in map(Path, paths):
        files = sorted(f for f in p.iterdir() if f.suffix.lower() in IMAGE_SUFFIXES) if p.is_dir() else [p]
        out.extend(f.read_bytes() for f in files)
    if paths and not out:
        raise ValueError(f"no image files in {paths}")
    return out


def test_frames(n: int) -> list[bytes]:
    """n random PNG frames of two sizes (the test models' images), for a VLM target given no --images."""
    from PIL import Image

    from tests.models.qwen_vlm import random_image

    out = []
    for i in range(n):
        buf = io.BytesIO()
        Image.fromarray(random_image(1000 + i, *((64, 64), (96, 128))[i % 2])).save(buf, format="PNG")
        out.append(buf.getvalue())
    return out


def examples(target, prompts: list[dict], frames: list[bytes], every: int) -> list[Example]:
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
        out.append(Example(ids, [PromptImage.of(image, at[0])] if at else []))
    return out


def generate(target, exs: list[Example], new_tokens: int, desc: str) -> list[Example]:
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
def collect(target, exs: list[Example], layers: list[int], k: int):
    """Per position that predicts a generated token: hidden after each exit layer, teacher top-k.

    One verify pass per sequence (the prompt prefilled with its images, the generated ids as its
    draft), its exit layers tapped as the server taps them."""
    hidden = {l: [] for l in layers}
    top_ids, top_p, argmax = [], [], []
    for ex in exs:
        state = target.new_state(ex.ids, images=ex.images)
        rows = {}
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
    heads: ExitHeads, model, layer: int, h, ids, p, steps: int, batch: int, lr: float, seed: int, negatives: int
):
    """KL(teacher || exit) over each position's teacher top-K plus `negatives` random vocabulary rows
    shared by the batch (a sampled softmax): without them the rows outside every top-K stay untrained
    and win the full-vocabulary argmax."""
    adapter = heads.adapters[str(layer)]
    adapter.requires_grad_(True)
    opt = torch.optim.AdamW(adapter.parameters(), lr=lr, weight_decay=0.0)
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
def agreement(heads: ExitHeads, model, layer: int, h, argmax) -> float:
    """Top-1 agreement of the exit's full-vocabulary argmax with the final layer's."""
    hits = 0
    for i in range(0, h.shape[0], 256):
        hits += (heads.logits(model, layer, h[i : i + 256]).argmax(-1) == argmax[i : i + 256]).sum().item()
    return hits / h.shape[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=modelfiles.DEFAULT_TARGET)
    ap.add_argument("--layers", default="12,18,22,26", help="decoder blocks after which exits sit (1-based)")
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--candidates", type=int, default=128, help="teacher top-K used for the distillation loss")
    ap.add_argument("--negatives", type=int, default=1024, help="random vocabulary rows per batch (sampled softmax)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--max-len", type=int, default=2048, help="KV slot length: prompt, its images' cells, generation")
    ap.add_argument("--prompts", default=str(PROMPTS / "exits_train.jsonl"), help="training prompts (jsonl)")
    ap.add_argument("--heldout", default=str(PROMPTS / "bench.jsonl"), help="held-out prompts (jsonl)")
    ap.add_argument("--max-prompts", type=int, default=0, help="use only the first N of each prompt file (0 = all)")
    ap.add_argument(
        "--images", nargs="*", default=[], help="a VLM target's frames (files or directories; default: random frames)"
    )
    ap.add_argument("--image-every", type=int, default=2, help="a VLM target: every N-th prompt carries an image")
    ap.add_argument("--name", default="", help="the adapters' file name and target (default: the target's name)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(modelfiles.models_dir() / "exits"))
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    from server_bridge.target import load_target

    t0 = time.perf_counter()
    # the torch engine's own passes: what the server's verify passes compute, images included (on the CPU in
    # float32: the adapters train beside the model's final norm and LM head there)
    target = load_target(
        args.target,
        "torch",
        device="cpu",
        dtype="float32",
        threads=args.threads,
        max_sequences=1,
        max_len=args.max_len,
    )
    engine = target.engine
    model = engine.model.requires_grad_(False)
    name = args.name or engine.name
    layers = [int(x) for x in args.layers.split(",")]
    if max(layers) >= engine.n_layers:
        print(f"exit layers must be below the last layer ({engine.n_layers})", file=sys.stderr)
        return 2
    frames = []
    if target.sees and args.image_every > 0:
        frames = image_files(args.images) or test_frames(4)
        if not args.images:
            print("a vision-language target and no --images: training on random frames", file=sys.stderr)
    train_set = examples(target, load_prompts(Path(args.prompts), args.max_prompts), frames, args.image_every)
    held_set = examples(target, load_prompts(Path(args.heldout), args.max_prompts), frames, args.image_every)
    train = generate(target, train_set, args.gen_tokens, "target generations (train)")
    held = generate(target, held_set, args.gen_tokens, "target generations (held out)")
    h_tr, ids_tr, p_tr, _ = collect(target, train, layers, args.candidates)
    h_te, _, _, argmax_te = collect(target, held, layers, 1)
    print(f"{ids_tr.shape[0]} training positions, {argmax_te.shape[0]} held-out positions")

    heads = ExitHeads(ExitConfig(layers, engine.hidden_size, args.rank, name))
    lens = {l: agreement(heads, model, l, h_te[l], argmax_te) for l in layers}  # zero adapters
    for l in layers:
        train_one(
            heads, model, l, h_tr[l], ids_tr, p_tr, args.steps, args.batch, args.lr, args.seed + l, args.negatives
        )
    trained = {l: agreement(heads, model, l, h_te[l], argmax_te) for l in layers}

    heads.config.info = {
        "method": "self-distillation: KL over the teacher's top-K plus shared random negatives",
        "candidates": args.candidates,
        "negatives": args.negatives,
        "steps": args.steps,
        "batch": args.batch,
        "lr": args.lr,
        "train_positions": int(ids_tr.shape[0]),
        "heldout_positions": int(argmax_te.shape[0]),
        "prompts_with_an_image": sum(bool(ex.images) for ex in train + held),
        "agreement_heldout": {str(l): trained[l] for l in layers},
        "agreement_logit_lens": {str(l): lens[l] for l in layers},
        "seconds": round(time.perf_counter() - t0, 1),
    }
    out = Path(args.out)
    heads.save(out / name)
    rows = "\n".join(f"| {l} | {lens[l]:.3f} | {trained[l]:.3f} |" for l in layers)
    report = (
        f"Top-1 agreement with the final layer ({engine.n_layers} layers) on {argmax_te.shape[0]} held-out "
        f"positions (the target's greedy generations of {Path(args.heldout).name}):\n\n"
        f"| exit layer | logit lens (no adapter) | trained adapter (rank {args.rank}) |\n|---|---|---|\n{rows}\n\n"
        f"`python -m tools.train.exits --layers {args.layers} --rank {args.rank} --steps {args.steps}` "
        f"took {heads.config.info['seconds']} s on {ids_tr.shape[0]} training positions.\n"
    )
    (out / "report.md").write_text(report)
    plot(layers, lens, trained, out / "agreement.png", engine.n_layers)
    print("\n" + report)
    print(f"wrote {out / (name + '.safetensors')}, {out / 'report.md'}, {out / 'agreement.png'}")
    return 0


def plot(layers, lens, trained, path: Path, n_layers: int) -> None:
    line_plot(
        path,
        [
            ("logit lens (no adapter)", layers, [lens[l] for l in layers]),
            ("trained adapter", layers, [trained[l] for l in layers]),
        ],
        f"exit after layer (of {n_layers})",
        "top-1 agreement with final layer",
        ylim=(0, 1),
    )


if __name__ == "__main__":
    sys.exit(main())
