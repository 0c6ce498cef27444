"""Train early-exit adapters for the target by self-distillation (FSD, issue 3).

    python -m tools.train.exits [--layers 12,18,22,26] [--rank 64] [--steps 300] [--out models/exits]

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
Writes models/exits/<target>.{safetensors,json}, report.md and agreement.png.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from protocol import modelfiles
from server_bridge.exits import ExitConfig
from server_bridge.exits_torch import ExitHeads
from tools.plots import line_plot

PROMPTS = Path(__file__).resolve().parents[1] / "prompts"


def load_prompts(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def generate(target, prompts: list[dict], new_tokens: int, desc: str) -> list[tuple[list[int], int]]:
    """The target's greedy continuation of each prompt -> [(token ids, prompt length)]."""
    tok = target.tokenizer
    out = []
    for p in tqdm(prompts, desc=desc, unit="prompt"):
        text = (
            tok.apply_chat_template(
                [{"role": "user", "content": p["prompt"]}], tokenize=False, add_generation_prompt=True
            )
            if p["chat"]
            else p["prompt"]
        )
        ids = tok.encode(text, add_special_tokens=False)
        x = torch.tensor([ids])
        with torch.inference_mode():
            seq = target.model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=tok.eos_token_id,
            )
        out.append((seq[0].tolist(), len(ids)))
    return out


@torch.inference_mode()
def collect(target, seqs, layers: list[int], k: int):
    """Per position that predicts a generated token: hidden after each exit layer, teacher top-k."""
    hidden = {l: [] for l in layers}
    top_ids, top_p, argmax = [], [], []
    for ids, n_prompt in seqs:
        o = target.model(torch.tensor([ids]), output_hidden_states=True)
        rows = slice(n_prompt - 1, len(ids) - 1)
        for l in layers:
            hidden[l].append(o.hidden_states[l][0, rows])
        logp = torch.log_softmax(o.logits[0, rows].float(), dim=-1)
        v, i = logp.topk(k, dim=-1)
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
    vocab = model.lm_head.weight.shape[0]
    bar = tqdm(range(steps), desc=f"exit {layer:>2}", unit="step")
    for _ in bar:
        idx = torch.randint(0, h.shape[0], (batch,), generator=g)
        neg = torch.randint(0, vocab, (negatives,), generator=g)
        f = heads.features(model, layer, h[idx])  # [batch, hidden]
        pos = torch.einsum("bh,bkh->bk", f, model.lm_head.weight[ids[idx]])  # [batch, K]
        s = torch.log_softmax(torch.cat([pos, f @ model.lm_head.weight[neg].T], dim=1), dim=-1)
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
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(modelfiles.models_dir() / "exits"))
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    from server_bridge.target import load_target

    t0 = time.perf_counter()
    # the torch engine's model, run here by transformers itself (SDPA attention: no engine passes in this tool)
    target = load_target(args.target, "torch", threads=args.threads, max_sequences=1, max_len=64).engine
    target.model.config._attn_implementation = "sdpa"
    model = target.model.requires_grad_(False)
    layers = [int(x) for x in args.layers.split(",")]
    if max(layers) >= target.n_layers:
        print(f"exit layers must be below the last layer ({target.n_layers})", file=sys.stderr)
        return 2
    train = generate(target, load_prompts(PROMPTS / "exits_train.jsonl"), args.gen_tokens, "target generations (train)")
    held = generate(target, load_prompts(PROMPTS / "bench.jsonl"), args.gen_tokens, "target generations (held out)")
    h_tr, ids_tr, p_tr, _ = collect(target, train, layers, args.candidates)
    h_te, _, _, argmax_te = collect(target, held, layers, 1)
    print(f"{ids_tr.shape[0]} training positions, {argmax_te.shape[0]} held-out positions")

    heads = ExitHeads(ExitConfig(layers, int(model.config.hidden_size), args.rank, target.name))
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
        "agreement_heldout": {str(l): trained[l] for l in layers},
        "agreement_logit_lens": {str(l): lens[l] for l in layers},
        "seconds": round(time.perf_counter() - t0, 1),
    }
    out = Path(args.out)
    heads.save(out / target.name)
    rows = "\n".join(f"| {l} | {lens[l]:.3f} | {trained[l]:.3f} |" for l in layers)
    report = (
        f"Top-1 agreement with the final layer ({target.n_layers} layers) on {argmax_te.shape[0]} held-out "
        f"positions (the target's greedy generations of tools/prompts/bench.jsonl):\n\n"
        f"| exit layer | logit lens (no adapter) | trained adapter (rank {args.rank}) |\n|---|---|---|\n{rows}\n\n"
        f"`python -m tools.train.exits --layers {args.layers} --rank {args.rank} --steps {args.steps}` "
        f"took {heads.config.info['seconds']} s on {ids_tr.shape[0]} training positions.\n"
    )
    (out / "report.md").write_text(report)
    plot(layers, lens, trained, out / "agreement.png", target.n_layers)
    print("\n" + report)
    print(f"wrote {out / (target.name + '.safetensors')}, {out / 'report.md'}, {out / 'agreement.png'}")
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
