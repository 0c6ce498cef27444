"""Fit the verifier's estimator (server_bridge/estimator.py) over the batches a robot fleet makes, on either engine.

    python -m tools.train.fleet_estimator --target FILE_OR_DIR --engine llamacpp|torch --out estimator.json
                                    [--device cuda] [--dtype float16] [--max-batch 32] [--gamma 4]
                                    [--cached 64,128,192] [--prompts 27,46,69,92] [--batches 160]

tools/train/profile_verifier.py fits the same model over a wide grid (caches up to 1024 tokens, batches up
to 16, 16 warm sessions per cache length); the torch engine's fixed KV slots of 2048 tokens cannot
hold that pool for a 7B target. A fleet benchmark needs the shapes its fleet makes: sessions of a few
hundred tokens, rounds of 1 to gamma + 1 new tokens, batches up to the server's max_batch, and opens
(a prompt's prefill, alone or a few together). Same pass as the server's (Target.extend, timed to the
host's copy of the greedy ids, so a GPU's queue is drained), same fit (estimator.fit, non-negative),
same file (VerifyTimeModel.save, which `server-bridge serve --estimator FILE` loads). One process
holds one engine: run it once per engine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from server_bridge.target import load_target
from tools.train.profile_verifier import Pool, fit_split, fitted_model, time_passes

SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def grid(n: int, rng: np.random.Generator, max_batch: int, gamma: int, cached: tuple, prompts: tuple) -> list[dict]:
    """n batch shapes, a quarter of them opens: {"kind", "members": [(cached, new, keep)]}."""
    sizes = [s for s in SIZES if s <= max_batch] or [max_batch]
    shapes = []
    for i in range(n):
        if i % 4 == 0:
            members = [(0, int(rng.choice(prompts)), 0) for _ in range(int(rng.choice(sizes[:4])))]
            shapes.append({"kind": "open", "members": members})
        else:
            members = [
                (int(rng.choice(cached)), int(n_new), int(n_new))
                for n_new in rng.integers(1, gamma + 2, int(rng.choice(sizes)))
            ]
            shapes.append({"kind": "round", "members": members})
    return shapes


def fit(rows: list[dict], rng: np.random.Generator) -> dict:
    """Coefficients on a random 70 %, R2 and MAPE on the rest."""
    order = rng.permutation(len(rows))
    return fit_split(rows, order[: int(0.7 * len(rows))], order[int(0.7 * len(rows)) :])[0]


def _ints(s: str) -> tuple:
    return tuple(int(x) for x in s.split(",") if x)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--engine", choices=("llamacpp", "torch"), required=True)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--cached", type=_ints, default=(64, 128, 192), help="warm sessions' cache lengths")
    ap.add_argument("--prompts", type=_ints, default=(27, 46, 69, 92), help="opens' prompt lengths")
    ap.add_argument("--batches", type=int, default=160)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True, help="the coefficients file the server loads")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    slots = min(250, len(args.cached) * args.max_batch + 8)  # llama.cpp: 256 sequences at most
    per_length = (slots - 8) // len(args.cached)
    max_len = -(-(max(max(args.cached), max(args.prompts)) + args.gamma + 16) // 64) * 64
    t0 = time.perf_counter()
    target = load_target(
        args.target,
        args.engine,
        device=args.device,
        dtype=args.dtype,
        threads=args.threads,
        max_sequences=slots,
        kv_tokens=slots * max_len,
        max_len=max_len,
    )
    pool = Pool(target, rng, args.cached, per_length)
    shapes = grid(args.batches, rng, min(args.max_batch, per_length), args.gamma, args.cached, args.prompts)
    rows = time_passes(target, pool, shapes, warm=4, to_host=True)
    report = fit(rows, rng)
    info = target.engine.info.as_dict()
    model = fitted_model(
        report["coefficients"],
        target.name,
        f"{info['engine']} on {info['device']} ({info['dtype']})",
        {
            "train": report["train"],
            "test": report["test"],
            "tool": "tools/train/fleet_estimator.py",
            "batches": len(rows),
            "max_batch": args.max_batch,
            "cached": list(args.cached),
        },
    )
    model.save(args.out)
    print(
        json.dumps(
            {
                "out": args.out,
                **report,
                "seconds": round(time.perf_counter() - t0, 1),
                "largest_pass_ms": round(max(r["ms"] for r in rows), 3),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
