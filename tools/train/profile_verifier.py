"""Profile the verifier's batched forward pass and fit WISP's verification-time estimator (Eq. 19).

    python -m tools.train.profile_verifier [--target smollm2-f32] [--batches 240] [--threads 1] [--cpu 1]
                                     [--out docs/estimator] [--model-out models/estimator/<target>.json]

Times `Target.extend` (the pass the server's batcher runs) over a random
grid of batch shapes: cold members (a prompt of 16-256 tokens, nothing
cached, as an open's prefill), warm members (a draft of 1-9 tokens on a
cache of 16-1024 tokens) and mixed batches (one cold among warm), 1-16
sessions. Token ids are random: a pass's time does not depend on them. Each
shape is timed once after a warm-up, in random order; the members' caches are
built once and cropped back after every pass.

Fits T = a*N_linear + b_c*N_interactions + b_r*N_cached + c by least squares
(server_bridge.estimator.fit) on a random 70 % of the batches and reports R²,
MAPE and MAE on the other 30 %, per kind too, with 95 % bootstrap intervals of
each coefficient (1000 resamples of the training rows). Writes the
coefficients the server loads (models/estimator/<target>.json, with the
report inside) and docs/estimator.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

from protocol import modelfiles
from server_bridge import estimator
from server_bridge.target import Extension, Target, load_target

WARM_CACHED = (16, 64, 128, 256, 512, 1024)
COLD_NEW = (16, 32, 64, 128, 256)
SIZES = (1, 2, 3, 4, 6, 8, 12, 16)
MIXED_SIZES = SIZES[:6]  # a long prompt pads every warm row to its length: big mixed batches run for
# seconds and the scheduler never forms them


def grid(n: int, rng: np.random.Generator) -> list[dict]:
    """n random batch shapes: {"kind", "members": [(cached, new, keep)]}, kinds in equal thirds."""
    shapes = []
    for i in range(n):
        kind = ("cold", "warm", "mixed")[i % 3]
        size = int(rng.choice({"cold": SIZES[:5], "warm": SIZES, "mixed": MIXED_SIZES}[kind]))
        members = []
        for r in range(size):
            if kind == "cold" or (kind == "mixed" and r == 0):
                members.append((0, int(rng.choice(COLD_NEW[:4] if kind == "mixed" else COLD_NEW)), 0))
            else:
                new = int(rng.integers(1, 10))  # pending token + a draft of 0-8
                members.append((int(rng.choice(WARM_CACHED)), new, new))
        shapes.append({"kind": kind, "members": members})
    rng.shuffle(shapes)
    return shapes


class Pool:
    """Warm states by cache length, built once; a batch takes distinct ones and crops them back after."""

    def __init__(self, target: Target, rng: np.random.Generator, cached: tuple, per_length: int):
        self.target = target
        self.rng = rng
        self.states = {}
        for c in cached:
            print(f"  building {per_length} warm sessions with {c} cached tokens", flush=True)
            self.states[c] = [target.new_state(self.ids(c + 1)) for _ in range(per_length)]

    def ids(self, n: int) -> list[int]:
        return self.rng.integers(100, self.target.vocab_size, n).tolist()

    def batch(self, members: list[tuple[int, int, int]]) -> list[Extension]:
        used = dict.fromkeys(self.states, 0)
        out = []
        for cached, new, keep in members:
            if cached == 0:  # an open: nothing cached, the prompt goes through in this pass
                state = self.target.new_state(self.ids(new + 1), prefill=False)
            else:
                state = self.states[cached][used[cached]]
                used[cached] += 1
            out.append(Extension(state, self.ids(new), keep))
        return out

    def reset(self, batch: list[Extension]) -> None:
        for e in batch:
            self.target.rewind(e.state, e.state.ids)  # crop the pass's tokens off again


def _pass(target: Target, batch: list[Extension], to_host: bool) -> None:
    rows = target.extend(batch)
    if not to_host:
        return
    for r in rows:
        if len(r):
            target.argmax(r)  # the host copy: the pass has really finished
    if target.on_device:  # an open's pass returns no rows: wait for the device all the same
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()


def time_passes(target: Target, pool: Pool, shapes: list[dict], warm: int, to_host: bool = False) -> list[dict]:
    """Each shape's pass in ms (after `warm` untimed passes: allocator, kernels, thread pool).

    to_host: timed to the host's copy of the greedy ids and a drained GPU queue, not to extend's return."""
    for shape in shapes[:warm]:
        batch = pool.batch(shape["members"])
        _pass(target, batch, to_host)
        pool.reset(batch)
    rows = []
    t_start = time.perf_counter()
    for i, shape in enumerate(shapes):
        batch = pool.batch(shape["members"])
        members = [e.member for e in batch]
        t0 = time.perf_counter()
        _pass(target, batch, to_host)
        ms = (time.perf_counter() - t0) * 1e3
        pool.reset(batch)
        rows.append(
            {"kind": shape["kind"], "members": members, "features": estimator.features(members).tolist(), "ms": ms}
        )
        if (i + 1) % 20 == 0 or i + 1 == len(shapes):
            print(f"  {i + 1}/{len(shapes)} batches profiled ({time.perf_counter() - t_start:.0f} s)", flush=True)
    return rows


def fit_split(rows: list[dict], train: np.ndarray, test: np.ndarray) -> tuple[dict, np.ndarray]:
    """Coefficients fitted on the train rows, R2 / MAPE / MAE on each side; and every row's prediction."""
    x = np.array([r["features"] for r in rows])
    y = np.array([r["ms"] for r in rows])
    coef = estimator.fit(x[train], y[train])
    pred = x @ coef

    def side(idx: np.ndarray) -> dict:
        return {
            "n": len(idx),
            "r2": estimator.r2(y[idx], pred[idx]),
            "mape_pct": estimator.mape(y[idx], pred[idx]),
            "mae_ms": float(np.mean(np.abs(pred[idx] - y[idx]))),
        }

    report = {"coefficients": dict(zip(estimator.TERMS, coef.tolist(), strict=True))}
    return report | {"train": side(train), "test": side(test)}, pred


def evaluate(rows: list[dict], rng: np.random.Generator, boot: int) -> dict:
    order = rng.permutation(len(rows))
    n_train = int(round(0.7 * len(rows)))
    train, test = order[:n_train], order[n_train:]
    report, pred = fit_split(rows, train, test)
    x = np.array([r["features"] for r in rows])
    y = np.array([r["ms"] for r in rows])
    ci = estimator.bootstrap_ci(x[train], y[train], n=boot, rng=rng)
    report = {
        "coefficients": report["coefficients"],
        "ci95": {t: ci[i].tolist() for i, t in enumerate(estimator.TERMS)},
    } | {
        "train": report["train"],
        "test": report["test"],
        "test_by_kind": {},
    }
    for kind in ("cold", "warm", "mixed"):
        idx = np.array([i for i in test if rows[i]["kind"] == kind], dtype=int)
        if len(idx):
            report["test_by_kind"][kind] = {
                "n": len(idx),
                "mape_pct": estimator.mape(y[idx], pred[idx]),
                "mae_ms": float(np.mean(np.abs(pred[idx] - y[idx]))),
            }
    in_train = set(train.tolist())
    for i, r in enumerate(rows):
        r["split"] = "train" if i in in_train else "test"
        r["predicted_ms"] = float(pred[i])
    return report


def fitted_model(coefficients: dict, target: str, device: str, report: dict) -> estimator.VerifyTimeModel:
    """The estimator the server loads, from a fit's coefficients (a, b_c, b_r, c) and what to record of the fit."""
    c = coefficients
    return estimator.VerifyTimeModel(
        c["a"], c["b_c"], c["b_r"], c["c"], target=target, device=device, fitted=True, report=report
    )


def write_markdown(path: Path, report: dict, config: dict) -> None:
    c, ci = report["coefficients"], report["ci95"]
    units = {
        "a": "ms / new token",
        "b_c": "ms / query-key interaction",
        "b_r": "ms / cached token read",
        "c": "ms / pass",
    }
    lines = [
        f"# Verification-time estimator: {config['target']} on {config['device']}",
        "",
        f"`{config['command']}`",
        "",
        "T = a·N_linear + b_c·N_interactions + b_r·N_cached + c (WISP Eq. 19), counted over each batch as "
        "the padded engine runs it (server_bridge/estimator.py).",
        "",
        "| term | coefficient | 95 % bootstrap interval | unit |",
        "|---|---|---|---|",
    ]
    lines += [f"| {t} | {c[t]:.4g} | {ci[t][0]:.4g} – {ci[t][1]:.4g} | {units[t]} |" for t in estimator.TERMS]
    tr, te = report["train"], report["test"]
    lines += [
        "",
        "| split | batches | R² | MAPE | MAE |",
        "|---|---|---|---|---|",
        f"| train | {tr['n']} | {tr['r2']:.4f} | {tr['mape_pct']:.1f} % | |",
        f"| test (held out) | {te['n']} | {te['r2']:.4f} | {te['mape_pct']:.1f} % | {te['mae_ms']:.1f} ms |",
    ]
    lines += [
        f"| test, {k} | {v['n']} | | {v['mape_pct']:.1f} % | {v['mae_ms']:.1f} ms |"
        for k, v in report["test_by_kind"].items()
    ]
    path.write_text("\n".join(lines) + "\n")


def plot(path: Path, rows: list[dict], report: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
    colours = {"cold": "tab:blue", "warm": "tab:orange", "mixed": "tab:green"}
    for kind, colour in colours.items():
        for split, marker in (("train", "o"), ("test", "x")):
            pts = [r for r in rows if r["kind"] == kind and r["split"] == split]
            if pts:
                ax.scatter(
                    [r["ms"] for r in pts],
                    [r["predicted_ms"] for r in pts],
                    s=14,
                    c=colour,
                    marker=marker,
                    label=f"{kind} ({split})",
                    alpha=0.7,
                )
                ax2.scatter(
                    [r["ms"] for r in pts],
                    [100 * (r["predicted_ms"] - r["ms"]) / r["ms"] for r in pts],
                    s=14,
                    c=colour,
                    marker=marker,
                    alpha=0.7,
                )
    top = max(r["ms"] for r in rows) * 1.05
    ax.plot([0, top], [0, top], "k--", lw=0.8)
    ax.set(
        xlabel="measured pass (ms)",
        ylabel="estimated (ms)",
        title=f"held-out R² {report['test']['r2']:.3f}, MAPE {report['test']['mape_pct']:.1f} %",
    )
    ax.legend(fontsize=7)
    ax2.axhline(0, c="k", lw=0.8)
    ax2.set(xlabel="measured pass (ms)", ylabel="error (%)", title="relative error")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=modelfiles.DEFAULT_TARGET)
    ap.add_argument("--batches", type=int, default=240)
    ap.add_argument("--threads", type=int, default=1, help="engine threads (as the server will run)")
    ap.add_argument("--engine", default="auto", help="llamacpp (default for the GGUF target) or torch")
    ap.add_argument("--cpu", type=int, default=1, help="pin to this core (-1: no pinning)")
    ap.add_argument("--bootstrap", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="docs/estimator", help="folder for estimator.{json,md,png}")
    ap.add_argument("--model-out", default=None, help="coefficients file (default models/estimator/<target>.json)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if args.cpu >= 0 and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {args.cpu})
    rng = np.random.default_rng(args.seed)
    # room for every warm session of the pool, and the cold ones a batch adds: llama.cpp shares one
    # KV pool among its sequences; torch gives each session a slot of max_len (f32 135M: ~5 GiB here)
    slots = max(SIZES) * (len(WARM_CACHED) + 1)
    target = (
        load_target(
            args.target,
            args.engine,
            threads=args.threads,
            max_sequences=slots,
            kv_tokens=max(SIZES) * sum(c + 1 for c in WARM_CACHED) + 32768,
            max_len=2048,
        )
        if args.engine != "torch"
        else load_target(args.target, "torch", threads=args.threads, max_sequences=slots, max_len=max(WARM_CACHED) + 16)
    )
    device = (
        f"{platform.machine()} {os.cpu_count()} cores, {target.engine.info.engine} engine, {args.threads} threads"
        + (f", pinned to core {args.cpu}" if args.cpu >= 0 else "")
    )
    config = {
        "target": target.name,
        "device": device,
        "batches": args.batches,
        "seed": args.seed,
        "command": "python -m tools.train.profile_verifier " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    print(f"profiling {target.name} over {args.batches} batch shapes ({device})", flush=True)
    pool = Pool(target, rng, WARM_CACHED, per_length=max(SIZES))
    rows = time_passes(target, pool, grid(args.batches, rng), warm=6)
    report = evaluate(rows, rng, args.bootstrap)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "estimator.json").write_text(json.dumps({"config": config, "report": report, "batches": rows}, indent=1))
    write_markdown(out / "estimator.md", report, config)
    plot(out / "estimator.png", rows, report)
    model = fitted_model(report["coefficients"], target.name, device, {k: report[k] for k in ("ci95", "train", "test")})
    model_out = (
        Path(args.model_out) if args.model_out else modelfiles.models_dir() / "estimator" / f"{target.name}.json"
    )
    model.save(model_out)
    print((out / "estimator.md").read_text())
    print(f"wrote {model_out} and {out}/estimator.{{json,md,png}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
