"""`server-bridge profile`: time the target's batched pass and fit the estimator the SLO scheduler reads.

    server-bridge profile [--target smollm2-f32] [--shapes wide|fleet] [--batches 240] [--threads 1] [--cpu 1]
                          [--out models/estimator/<target>.json] [--report docs/estimator]

Times `Target.extend` (the pass the server's batcher runs) over random batch shapes. `--shapes wide`:
cold members (a prompt of 16-256 tokens, nothing cached, as an open's prefill), warm members (a draft of
1-9 tokens on a cache of 16-1024 tokens) and mixed batches (one cold among warm), 1-16 sessions.
`--shapes fleet`: the batches a robot fleet makes (sessions of a few hundred tokens, rounds of 1 to
gamma + 1 new tokens, batches up to max_batch, and opens), for a big target on the torch engine whose
fixed KV slots cannot hold the wide pool. Token ids are random: a pass's time does not depend on them.
Each shape is timed once after a warm-up, in random order; the members' caches are built once and
cropped back after every pass.

Fits T = a*N_linear + b_c*N_interactions + b_r*N_cached + c by least squares (estimator.fit, non-negative)
on a random 70 % of the batches and reports R², MAPE and MAE on the other 30 %, per kind too, with 95 %
bootstrap intervals of each coefficient. Writes the coefficients `serve --estimator auto` loads
(models/estimator/<target>.json, with the report inside), with --report estimator.json (every pass) and
estimator.md beside it, and prints one JSON line (the fit) last on stdout. One process holds one engine.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from protocol import modelfiles

from .. import estimator
from ..config import ProfileConfig
from ..target import Extension, Target, load_target

WARM_CACHED = (16, 64, 128, 256, 512, 1024)
COLD_NEW = (16, 32, 64, 128, 256)
SIZES = (1, 2, 3, 4, 6, 8, 12, 16)
MIXED_SIZES = SIZES[:6]  # a long prompt pads every warm row to its length: big mixed batches run for
# seconds and the scheduler never forms them
FLEET_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)

Shape = dict[str, Any]  # {"kind": str, "members": [(cached, new, keep)]}


def wide_grid(n: int, rng: np.random.Generator) -> list[Shape]:
    """n random batch shapes over a wide range, kinds (cold, warm, mixed) in equal thirds."""
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


def fleet_grid(
    n: int, rng: np.random.Generator, max_batch: int, gamma: int, cached: tuple, prompts: tuple
) -> list[Shape]:
    """n batch shapes a fleet makes, a quarter of them opens (kinds "open" and "round")."""
    sizes = [s for s in FLEET_SIZES if s <= max_batch] or [max_batch]
    shapes = []
    for i in range(n):
        if i % 4 == 0:
            members = [(0, int(rng.choice(prompts)), 0) for _ in range(int(rng.choice(sizes[:4])))]
            shapes.append({"kind": "open", "members": members})
        else:
            news = rng.integers(1, gamma + 2, int(rng.choice(sizes)))
            members = [(int(rng.choice(cached)), int(k), int(k)) for k in news]
            shapes.append({"kind": "round", "members": members})
    return shapes


class Pool:
    """Warm states by cache length, built once; a batch takes distinct ones and crops them back after."""

    def __init__(self, target: Target, rng: np.random.Generator, cached: tuple, per_length: int):
        self.target = target
        self.rng = rng
        self.states = {}
        for c in cached:
            print(f"  building {per_length} warm sessions with {c} cached tokens", file=sys.stderr, flush=True)
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


def time_passes(target: Target, pool: Pool, shapes: list[Shape], warm: int, to_host: bool = False) -> list[dict]:
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
            {
                "kind": shape["kind"],
                "members": members,
                "features": estimator.features(members, target.packed).tolist(),
                "ms": ms,
            }
        )
        if (i + 1) % 20 == 0 or i + 1 == len(shapes):
            done = f"  {i + 1}/{len(shapes)} batches profiled ({time.perf_counter() - t_start:.0f} s)"
            print(done, file=sys.stderr, flush=True)
    return rows


def _errors(y: np.ndarray, pred: np.ndarray) -> dict:
    return {
        "n": len(y),
        "r2": estimator.r2(y, pred) if len(y) > 1 else float("nan"),
        "mape_pct": estimator.mape(y, pred),
        "mae_ms": float(np.mean(np.abs(pred - y))),
    }


def evaluate(rows: list[dict], rng: np.random.Generator, boot: int) -> dict:
    """Coefficients fitted on a random 70 % of the rows, their bootstrap intervals, errors on the rest (per
    kind too); each row gains its split and its prediction."""
    order = rng.permutation(len(rows))
    train, test = order[: int(round(0.7 * len(rows)))], order[int(round(0.7 * len(rows))) :]
    x = np.array([r["features"] for r in rows])  # [n, 4]
    y = np.array([r["ms"] for r in rows])  # [n]
    coef = estimator.fit(x[train], y[train])
    pred = x @ coef
    report: dict = {"coefficients": dict(zip(estimator.TERMS, coef.tolist(), strict=True))}
    if boot:
        ci = estimator.bootstrap_ci(x[train], y[train], n=boot, rng=rng)
        report["ci95"] = {t: ci[i].tolist() for i, t in enumerate(estimator.TERMS)}
    report |= {"train": _errors(y[train], pred[train]), "test": _errors(y[test], pred[test]), "test_by_kind": {}}
    for kind in sorted({r["kind"] for r in rows}):
        idx = np.array([i for i in test if rows[i]["kind"] == kind], dtype=int)
        if len(idx):
            report["test_by_kind"][kind] = _errors(y[idx], pred[idx])
    in_train = set(train.tolist())
    for i, r in enumerate(rows):
        r["split"] = "train" if i in in_train else "test"
        r["predicted_ms"] = float(pred[i])
    return report


def markdown(report: dict, meta: dict) -> str:
    """The fit as a page: coefficients with their intervals, errors per split and kind."""
    c, ci = report["coefficients"], report.get("ci95", {})
    units = {"a": "ms / new token", "b_c": "ms / query-key interaction", "b_r": "ms / cached token read"}
    lines = [
        f"# Verification-time estimator: {meta['target']} on {meta['device']}",
        "",
        f"`{meta['command']}`",
        "",
        "T = a·N_linear + b_c·N_interactions + b_r·N_cached + c (WISP Eq. 19), counted over each batch as "
        "the padded engine runs it (server_bridge/estimator.py).",
        "",
        "| term | coefficient | 95 % bootstrap interval | unit |",
        "|---|---|---|---|",
    ]
    for t in estimator.TERMS:
        interval = f"{ci[t][0]:.4g} – {ci[t][1]:.4g}" if t in ci else ""
        lines.append(f"| {t} | {c[t]:.4g} | {interval} | {units.get(t, 'ms / pass')} |")
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
    return "\n".join(lines) + "\n"


def _load(config: ProfileConfig, cached: tuple, per_length: int) -> Target:
    """The target with room for the warm pool (per_length sessions per cache length) and a batch's opens."""
    slots = per_length * len(cached) + 8
    longest = max(*cached, *config.prompts, *COLD_NEW) + config.gamma + 16
    max_len = -(-longest // 64) * 64
    kv_tokens = per_length * sum(c + 1 for c in cached) + 32768  # the pool, and room for a batch's opens
    kw = {
        "device": config.device,
        "dtype": config.dtype,
        "threads": config.threads,
        "max_len": max_len,
        "torch_compile": config.torch_compile,
    }
    return load_target(config.target, config.engine, max_sequences=min(slots, 256), kv_tokens=kv_tokens, **kw)


def _shapes(config: ProfileConfig, rng: np.random.Generator) -> tuple[tuple, int, list[Shape]]:
    """(cache lengths of the warm pool, sessions per length, the batch shapes) for config.shapes."""
    if config.shapes == "wide":
        return WARM_CACHED, max(SIZES), wide_grid(config.batches, rng)
    cached, prompts = tuple(config.cached), tuple(config.prompts)
    per_length = min(config.max_batch, (248 - 8) // len(cached))  # llama.cpp: 256 sequences at most
    return cached, per_length, fleet_grid(config.batches, rng, per_length, config.gamma, cached, prompts)


def run(config: ProfileConfig, argv: list[str]) -> int:
    """Profile, fit, save; the fit as one JSON line last on stdout."""
    if config.cpu >= 0 and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {config.cpu})
    t0 = time.perf_counter()
    rng = np.random.default_rng(config.seed)
    cached, per_length, shapes = _shapes(config, rng)
    target = _load(config, cached, per_length)
    info = target.engine.info.as_dict()
    device = f"{platform.machine()} {os.cpu_count()} cores, {info['engine']} on {info['device']} ({info['dtype']})"
    device += f", {config.threads} threads" + (f", pinned to core {config.cpu}" if config.cpu >= 0 else "")
    print(f"profiling {target.name} over {len(shapes)} {config.shapes} batch shapes ({device})", file=sys.stderr)
    rows = time_passes(target, Pool(target, rng, cached, per_length), shapes, warm=6, to_host=config.shapes == "fleet")
    report = evaluate(rows, rng, config.bootstrap)
    meta = {"target": target.name, "device": device, "shapes": config.shapes, "batches": len(rows)}
    meta["command"] = " ".join(["server-bridge", *argv])
    saved = {k: report[k] for k in ("ci95", "train", "test") if k in report} | meta
    model = estimator.VerifyTimeModel(
        **report["coefficients"], target=target.name, device=device, fitted=True, packed=target.packed
    )
    model.report = saved
    out = Path(config.out) if config.out else modelfiles.models_dir() / "estimator" / f"{target.name}.json"
    model.save(out)
    if config.report:
        folder = Path(config.report)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "estimator.json").write_text(
            json.dumps({"config": meta, "report": report, "batches": rows}, indent=1)
        )
        (folder / "estimator.md").write_text(markdown(report, meta))
    print(markdown(report, meta), file=sys.stderr)
    largest = max(r["ms"] for r in rows)
    print(
        json.dumps(
            {"out": str(out), **report, "seconds": round(time.perf_counter() - t0, 1), "largest_pass_ms": largest}
        )
    )
    return 0
