"""Train the rejection predictor on traces, export it to ONNX, and report it beside two baselines.

    python -m tools.train.predictor [--traces build/traces] [--out models/predictors] [--cost-L 0.35]
                                    [--gamma 4] [--epochs 300] [--seed 0]

For every <draft>__<target>.jsonl in --traces (tools/train/collect_traces.py):

* splits by session (a session is one prompt), so no prompt is on both sides:
  60 % train, 20 % validation (early stopping, thresholds), 20 % held-out test;
* trains a 3-layer MLP (WISP: 6 -> 64 -> 32 -> 1, ReLU, dropout) with
  class-balanced binary cross-entropy and Adam; the feature scaling is part of
  the exported graph, so the robot feeds raw features;
* picks two thresholds on the validation split: the one with the best balanced
  accuracy, and the one that maximises simulated committed tokens per unit of
  time when drafting up to --gamma with stop-at-first-predicted-rejection under
  the round model T = 1 + k * L (what the robot ships as its default);
* reports on the test split AUC, specificity (and FPR) on the rejected class,
  recall on the accepted class and balanced accuracy, for the MLP and for two
  baselines: a threshold on the max probability (llama.cpp's draft-p-min) and a
  histogram gradient-boosted tree (scikit-learn);
* exports <out>/<draft>__<target>.onnx (input `features` [n, 6], output
  `p_accept` [n, 1]), checks onnxruntime against torch on the test rows, times a
  single-sample run, and writes report.{json,md} and roc.png.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import numpy as np

from agent.decoding.predictor import FEATURES, RejectionPredictor


def load(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(features [n, 6] float32, labels [n], session index [n], round key [n]) from a trace file."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{path} has no trace rows")
    x = np.array([[r[f] for f in FEATURES] for r in rows], np.float32)
    y = np.array([r["label"] for r in rows], np.int64)
    sessions = {s: i for i, s in enumerate(dict.fromkeys(r["session"] for r in rows))}
    sid = np.array([sessions[r["session"]] for r in rows])
    rnd = np.array([sessions[r["session"]] * 100_000 + r["round"] for r in rows])
    return x, y, sid, rnd


def split(sid: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Boolean masks (train, val, test) by session: 60/20/20."""
    order = np.random.default_rng(seed).permutation(np.unique(sid))
    n = len(order)
    val = set(order[: n // 5])
    test = set(order[n // 5 : 2 * (n // 5)])
    is_val = np.isin(sid, list(val))
    is_test = np.isin(sid, list(test))
    return ~(is_val | is_test), is_val, is_test


# ---------------------------------------------------------------------------- metrics


def auc(score: np.ndarray, y: np.ndarray) -> float:
    """Area under the ROC curve (Mann-Whitney, ties counted half)."""
    from scipy.stats import rankdata

    pos, neg = y == 1, y == 0
    if not pos.any() or not neg.any():
        return float("nan")
    ranks = rankdata(score)
    return float((ranks[pos].sum() - pos.sum() * (pos.sum() + 1) / 2) / (pos.sum() * neg.sum()))


def at_threshold(score: np.ndarray, y: np.ndarray, thr: float) -> dict:
    """Predicted accepted = score >= thr. Spec = rejected tokens caught; FPR = rejected ones let through."""
    pred = score >= thr
    rej, acc = y == 0, y == 1
    spec = float((~pred[rej]).mean()) if rej.any() else float("nan")
    rec1 = float(pred[acc].mean()) if acc.any() else float("nan")
    return {
        "threshold": float(thr),
        "accuracy": float((pred == (y == 1)).mean()),
        "spec": spec,
        "fpr": 1 - spec,
        "rec1": rec1,
        "balanced_accuracy": (spec + rec1) / 2,
    }


def best_balanced(score: np.ndarray, y: np.ndarray) -> float:
    grid = np.unique(np.quantile(score, np.linspace(0.01, 0.99, 197)))
    return float(max(grid, key=lambda t: at_threshold(score, y, t)["balanced_accuracy"]))


def simulate(
    score: np.ndarray, y: np.ndarray, x: np.ndarray, rnd: np.ndarray, thr: float, gamma: int, L: float, min_len: int = 1
) -> dict:
    """Replay traced rounds under stop-at-first-predicted-rejection, drafting at most gamma.

    A traced round holds its accepted tokens and its first rejection (if any). The
    predictor stops at the first position >= min_len scoring below thr; the round
    commits min(k, accepted) + 1 tokens for k drafted and costs 1 + k L. Past a
    first rejection the trace has no rows (the target never judged them): a
    predictor that let the rejection through is assumed to draft on to gamma.
    """
    tokens = cost = drafted = accepted = 0.0
    pos = x[:, FEATURES.index("position")].astype(int)
    order = np.lexsort((pos, rnd))
    _, starts = np.unique(rnd[order], return_index=True)
    bounds = list(starts) + [len(order)]
    for i in range(len(starts)):
        idx = order[bounds[i] : bounds[i + 1]]
        idx = idx[pos[idx] < gamma]
        labels, s = y[idx], score[idx]
        rejected = bool((labels == 0).any())
        n_acc = int(np.argmin(labels)) if rejected else len(labels)
        below = [j for j in np.flatnonzero(s < thr) if j >= min_len]
        if below:
            k = int(below[0])
        else:
            k = gamma if rejected else len(labels)
        got = min(k, n_acc)
        tokens += got + 1
        cost += 1 + k * L
        drafted += k
        accepted += got
    return {
        "tokens_per_cost": tokens / cost,
        "acceptance": accepted / max(drafted, 1),
        "draft_per_round": drafted / len(starts),
    }


def best_throughput(score, y, x, rnd, gamma, L) -> float:
    grid = np.unique(np.concatenate([[0.0], np.quantile(score, np.linspace(0.0, 0.6, 121))]))
    return float(max(grid, key=lambda t: simulate(score, y, x, rnd, t, gamma, L)["tokens_per_cost"]))


# ---------------------------------------------------------------------------- the MLP


def build_mlp(mean: np.ndarray, std: np.ndarray, hidden=(64, 32), dropout: float = 0.1):
    import torch
    from torch import nn

    class Predictor(nn.Module):
        """features [n, 6] -> p_accept [n, 1]; the scaling is inside, so the robot feeds raw features."""

        def __init__(self):
            super().__init__()
            self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32))
            self.register_buffer("std", torch.tensor(std, dtype=torch.float32))
            layers, width = [], len(FEATURES)
            for h in hidden:
                layers += [nn.Linear(width, h), nn.ReLU(), nn.Dropout(dropout)]
                width = h
            self.body = nn.Sequential(*layers, nn.Linear(width, 1))

        def forward(self, x):
            return torch.sigmoid(self.body((x - self.mean) / self.std))

        def logit(self, x):
            return self.body((x - self.mean) / self.std)

    return Predictor()


def train_mlp(x_tr, y_tr, x_val, y_val, epochs: int, seed: int, log=print):
    import torch

    torch.manual_seed(seed)
    mean, std = x_tr.mean(0), x_tr.std(0) + 1e-6
    model = build_mlp(mean, std)
    xt, yt = torch.tensor(x_tr), torch.tensor(y_tr, dtype=torch.float32)
    xv = torch.tensor(x_val)
    pos_weight = torch.tensor((y_tr == 0).sum() / max((y_tr == 1).sum(), 1), dtype=torch.float32)
    loss_fn = torch.nn.BCEWithLogitsLoss(pos_weight=pos_weight)  # balances the classes
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=1e-4)
    gen = torch.Generator().manual_seed(seed)
    best, best_state, since = -1.0, None, 0
    ran = 0
    for epoch in range(epochs):
        ran = epoch + 1  # epochs run, early stopping aside
        model.train()
        for idx in torch.randperm(len(xt), generator=gen).split(256):
            opt.zero_grad()
            loss = loss_fn(model.logit(xt[idx]).squeeze(1), yt[idx])
            loss.backward()
            opt.step()
        model.eval()
        with torch.no_grad():
            score = auc(model(xv).squeeze(1).numpy(), y_val)
        if score > best + 1e-4:
            best, since = score, 0
            best_state = {k: v.clone() for k, v in model.state_dict().items()}
        else:
            since += 1
        if since >= 30:
            break
    model.load_state_dict(best_state)
    model.eval()
    log(f"  mlp: {ran} epochs, best validation AUC {best:.4f}")
    return model


def export_onnx(model, path: Path, metadata: dict) -> None:
    import io

    import onnx
    import torch

    buf = io.BytesIO()
    with warnings.catch_warnings():  # the TorchScript exporter is deprecated; the dynamo one needs onnxscript
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(
            model,
            (torch.zeros(1, len(FEATURES)),),
            buf,
            dynamo=False,
            opset_version=17,
            input_names=["features"],
            output_names=["p_accept"],
            dynamic_axes={"features": {0: "n"}, "p_accept": {0: "n"}},
        )
    proto = onnx.load_from_string(buf.getvalue())
    for k, v in metadata.items():
        entry = proto.metadata_props.add()
        entry.key, entry.value = k, v if isinstance(v, str) else json.dumps(v)
    onnx.checker.check_model(proto)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(proto, str(path))


def single_sample_latency(path: Path, x: np.ndarray, n: int = 5000) -> dict:
    pred = RejectionPredictor(path)
    rows = x[np.random.default_rng(0).integers(0, len(x), n)]
    times = np.empty(n)
    for i in range(n):
        t0 = time.perf_counter()
        pred.p_accept(rows[i : i + 1])
        times[i] = (time.perf_counter() - t0) * 1e3
    return {
        "p50_ms": float(np.percentile(times, 50)),
        "p99_ms": float(np.percentile(times, 99)),
        "mean_ms": float(times.mean()),
        "n": n,
    }


# ---------------------------------------------------------------------------- one pair


def train_pair(path: Path, out: Path, args, log=print) -> dict:
    import torch
    from sklearn.ensemble import HistGradientBoostingClassifier

    pair = path.stem
    x, y, sid, rnd = load(path)
    tr, val, te = split(sid, args.seed)
    log(
        f"{pair}: {len(y)} rows ({(y == 0).sum()} rejected), sessions {len(np.unique(sid))}; "
        f"train {tr.sum()}, val {val.sum()}, test {te.sum()}"
    )
    model = train_mlp(x[tr], y[tr], x[val], y[val], args.epochs, args.seed, log)
    with torch.no_grad():
        mlp_score = model(torch.tensor(x)).squeeze(1).numpy()
    t_bal = best_balanced(mlp_score[val], y[val])
    t_fast = best_throughput(mlp_score[val], y[val], x[val], rnd[val], args.gamma, args.cost_L)

    maxp = x[:, FEATURES.index("max_prob")]
    t_maxp = best_balanced(maxp[val], y[val])
    tree = HistGradientBoostingClassifier(
        max_iter=200, learning_rate=0.05, class_weight="balanced", random_state=args.seed
    ).fit(x[tr], y[tr])
    tree_score = tree.predict_proba(x)[:, 1]
    t_tree = best_balanced(tree_score[val], y[val])
    t0 = time.perf_counter()
    for i in range(200):
        tree.predict_proba(x[i : i + 1])
    tree_ms = (time.perf_counter() - t0) / 200 * 1e3

    def row(name, score, thr, extra=None):
        r = {
            "model": name,
            "auc": auc(score[te], y[te]),
            **at_threshold(score[te], y[te], thr),
            **{
                f"sim_{k}": v
                for k, v in simulate(score[te], y[te], x[te], rnd[te], thr, args.gamma, args.cost_L).items()
            },
        }
        r.update(extra or {})
        return r

    never = simulate(np.ones(te.sum()), y[te], x[te], rnd[te], 0.0, args.gamma, args.cost_L)
    onnx_path = out / f"{pair}.onnx"
    test_metrics = at_threshold(mlp_score[te], y[te], t_fast)
    export_onnx(
        model,
        onnx_path,
        {
            "features": list(FEATURES),
            "threshold": f"{t_fast:.6f}",
            "threshold_balanced": f"{t_bal:.6f}",
            "pair": pair,
            "trained_on": path.name,
            "rows": int(len(y)),
            "test_auc": f"{auc(mlp_score[te], y[te]):.4f}",
            "test_spec": f"{test_metrics['spec']:.4f}",
            "cost_L": args.cost_L,
            "gamma": args.gamma,
        },
    )
    ort_score = RejectionPredictor(onnx_path).p_accept(x[te])
    max_diff = float(np.abs(ort_score - mlp_score[te]).max())
    latency = single_sample_latency(onnx_path, x)
    log(
        f"  exported {onnx_path} ({onnx_path.stat().st_size} B); onnxruntime vs torch max |diff| {max_diff:.2e}; "
        f"single-sample p50 {latency['p50_ms']:.3f} ms, p99 {latency['p99_ms']:.3f} ms"
    )
    rows = [
        row("MLP (throughput threshold, shipped)", mlp_score, t_fast, {"latency_ms_p99": latency["p99_ms"]}),
        row("MLP (balanced threshold)", mlp_score, t_bal),
        row("max probability (draft-p-min)", maxp, t_maxp),
        row("gradient-boosted tree", tree_score, t_tree, {"latency_ms_mean": tree_ms}),
    ]
    for r in rows:
        log(
            f"  {r['model']:38s} AUC {r['auc']:.3f} spec {r['spec']:.3f} FPR {r['fpr']:.3f} rec1 {r['rec1']:.3f} "
            f"balacc {r['balanced_accuracy']:.3f} thr {r['threshold']:.3f}  sim tokens/cost "
            f"{r['sim_tokens_per_cost']:.3f} (no predictor {never['tokens_per_cost']:.3f})"
        )
    return {
        "pair": pair,
        "rows": int(len(y)),
        "rejected": int((y == 0).sum()),
        "split": {"train": int(tr.sum()), "val": int(val.sum()), "test": int(te.sum())},
        "onnx": str(onnx_path),
        "onnx_vs_torch_max_abs_diff": max_diff,
        "latency": latency,
        "no_predictor": never,
        "results": rows,
        "roc": {
            name: _roc(score[te], y[te])
            for name, score in (("MLP", mlp_score), ("max probability", maxp), ("tree", tree_score))
        },
    }


def _roc(score, y) -> tuple[list, list]:
    thr = np.unique(score)[::-1]
    thr = thr[np.linspace(0, len(thr) - 1, min(len(thr), 200)).astype(int)]
    tpr = [float((score[y == 1] >= t).mean()) for t in thr]
    fpr = [float((score[y == 0] >= t).mean()) for t in thr]
    return [0.0] + fpr + [1.0], [0.0] + tpr + [1.0]


def write_report(reports: list[dict], out: Path, args) -> None:
    (out / "report.json").write_text(json.dumps({"config": vars(args), "pairs": reports}, indent=1))
    lines = [
        "# Rejection predictor",
        "",
        f"`python -m tools.train.predictor --cost-L {args.cost_L} --gamma {args.gamma}` on traces from "
        "`python -m tools.train.collect_traces` (fixed gamma 8, T 0, tools/prompts/predictor_train.jsonl). "
        "Split by prompt 60/20/20; every figure below is on the held-out test prompts. "
        "Spec: rejected tokens caught (FPR = 1 - Spec, rejected tokens let through); Rec1: accepted tokens "
        f"let through. Sim: committed tokens per unit cost replaying the test rounds with drafts of at most "
        f"{args.gamma} under T = 1 + k L, L = {args.cost_L}.",
        "",
    ]
    for r in reports:
        lines += [
            f"## {r['pair']}",
            "",
            f"{r['rows']} judged draft tokens ({r['rejected']} first rejections); ONNX vs torch max |diff| "
            f"{r['onnx_vs_torch_max_abs_diff']:.1e}; single-sample onnxruntime latency p50 "
            f"{r['latency']['p50_ms']:.3f} ms, p99 {r['latency']['p99_ms']:.3f} ms.",
            "",
            "| predictor | AUC | Spec | FPR | Rec1 | BalAcc | threshold | sim tokens/cost | sim acceptance |",
            "|---|---|---|---|---|---|---|---|---|",
            f"| none (fixed gamma {args.gamma}) | | | | | | | {r['no_predictor']['tokens_per_cost']:.3f} | "
            f"{r['no_predictor']['acceptance']:.3f} |",
        ]
        for x in r["results"]:
            lines.append(
                f"| {x['model']} | {x['auc']:.3f} | {x['spec']:.3f} | {x['fpr']:.3f} | {x['rec1']:.3f} | "
                f"{x['balanced_accuracy']:.3f} | {x['threshold']:.3f} | {x['sim_tokens_per_cost']:.3f} | "
                f"{x['sim_acceptance']:.3f} |"
            )
        lines.append("")
    lines += ["WISP's MLP (Qwen3 pairs): AUC 0.773, Spec 0.575, FPR 0.425, Rec1 0.801, BalAcc 0.688.", ""]
    (out / "report.md").write_text("\n".join(lines))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(reports), figsize=(5 * len(reports), 4.5), squeeze=False)
    for ax, r in zip(axes[0], reports, strict=True):
        for name, (fpr, tpr) in r["roc"].items():
            ax.plot(fpr, tpr, label=name)
        ax.plot([0, 1], [0, 1], "k:", lw=0.8)
        ax.set_title(r["pair"], fontsize=9)
        ax.set_xlabel("rejected let through (FPR)")
        ax.set_ylabel("accepted let through (Rec1)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "roc.png", dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", default="build/traces")
    ap.add_argument("--out", default="models/predictors")
    ap.add_argument("--gamma", type=int, default=4, help="draft cap in the throughput simulation")
    ap.add_argument(
        "--cost-L",
        type=float,
        default=0.35,
        help="relative cost of one drafted token vs a round's fixed cost, for the shipped threshold",
    )
    ap.add_argument("--epochs", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    traces = sorted(Path(args.traces).glob("*__*.jsonl"))
    if not traces:
        print(f"no traces in {args.traces}: run python -m tools.train.collect_traces first", file=sys.stderr)
        return 2
    out = Path(args.out)
    reports = [train_pair(p, out, args) for p in traces]
    write_report(reports, out, args)
    print(f"wrote {out}/report.md, report.json, roc.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
