"""Pre-draft backends: one llama context with N sequences decoded in one batch, against N contexts
in N worker threads (llama-cpp `Llama` objects are not thread-safe, so one each).

    python -m tools.bench.predraft [--branches 1,2,4,8] [--gamma 4] [--repeats 5] [--cores 0]

Both draft the same N continuations of one prompt, gamma tokens each, the way
a round's pre-drafting does; the figure is the wall time until every branch's
draft is ready (median over --repeats). Writes predraft_backends.{json,md,png}
into --out. agent/spec/branches.py implements the batched backend, the faster one.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

from agent.spec.branches import BranchDrafter
from agent.spec.drafter import Drafter
from protocol.sampling import SamplingParams
from tools.plots import line_plot

PROMPT = "Walk to the charging dock, avoid the boxes on the left, and report what you see."
GREEDY = SamplingParams()


def keys_for(drafter: Drafter, committed: list[int], n: int) -> list[tuple[int, ...]]:
    """n plausible continuations: the draft's top-n first tokens."""
    logits = drafter._logits_after(committed)
    return [(int(t),) for t in np.argsort(logits)[::-1][:n]]


def batched(bd: BranchDrafter, committed: list[int], keys, gamma: int) -> float:
    t0 = time.perf_counter()
    bd.base(committed, [])
    branches = [bd.start(k, len(committed), gamma, np.random.default_rng(0)) for k in keys]
    while not all(b.done for b in branches):
        bd.step([b for b in branches if not b.done], GREEDY)
    return (time.perf_counter() - t0) * 1e3


def threaded(drafters: list[Drafter], committed: list[int], keys, gamma: int) -> float:
    def work(d: Drafter, key) -> None:
        d.propose(committed + list(key), gamma, GREEDY, None)

    # each context already holds the prompt (warm), as the batched base sequence does
    threads = [threading.Thread(target=work, args=(d, k)) for d, k in zip(drafters, keys)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return (time.perf_counter() - t0) * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--branches", default="1,2,4,8")
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cores", default="0", help="cores to pin to (the robot's share of this machine)")
    ap.add_argument("--draft", default="smollm2-q4_1")
    ap.add_argument("--out", default="bench_results")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    cores = {int(c) for c in args.cores.split(",")}
    os.sched_setaffinity(0, cores)
    sizes = [int(x) for x in args.branches.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    main_drafter = Drafter(args.draft, threads=1)
    committed = main_drafter.tokenize(PROMPT, chat=True)
    keys = keys_for(main_drafter, committed, max(sizes))
    rows = []
    print(f"pre-draft backends: {args.draft}, gamma {args.gamma}, pinned to cores {sorted(cores)}", flush=True)
    for n in sizes:
        bd = BranchDrafter(main_drafter, slots=n, threads=1)
        drafters = [Drafter(args.draft, threads=1) for _ in range(n)]
        for d in drafters:  # warm: the prompt's KV in every context
            d.propose(committed, 1, GREEDY, None)
        batched(bd, committed, keys[:n], args.gamma)
        b_ms = statistics.median(batched(bd, committed, keys[:n], args.gamma) for _ in range(args.repeats))
        t_ms = statistics.median(threaded(drafters, committed, keys[:n], args.gamma) for _ in range(args.repeats))
        rows.append({"branches": n, "batched_ms": b_ms, "threads_ms": t_ms, "batched_speedup": t_ms / b_ms})
        print(
            f"{n} branches x {args.gamma} tokens: one context batched {b_ms:.0f} ms, {n} contexts in threads "
            f"{t_ms:.0f} ms ({t_ms / b_ms:.2f}x)",
            flush=True,
        )
        del drafters, bd
    config = {
        "draft": args.draft,
        "gamma": args.gamma,
        "repeats": args.repeats,
        "cores": sorted(cores),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    (out / "predraft_backends.json").write_text(json.dumps({"config": config, "rows": rows}, indent=1))
    md = (
        "| branches | one context, batched (ms) | one context per thread (ms) | batched faster by |\n"
        "|---|---|---|---|\n"
        + "\n".join(
            f"| {r['branches']} | {r['batched_ms']:.0f} | {r['threads_ms']:.0f} | {r['batched_speedup']:.2f}x |"
            for r in rows
        )
        + f"\n\n{args.draft}, {args.gamma} tokens per branch, 1 llama thread per context, cores {sorted(cores)}, "
        f"median of {args.repeats}; {config['started']}.\n"
    )
    (out / "predraft_backends.md").write_text(md)
    line_plot(
        out / "predraft_backends.png",
        [
            ("one context, batched", sizes, [r["batched_ms"] for r in rows]),
            ("one context per thread", sizes, [r["threads_ms"] for r in rows]),
        ],
        "branches drafted at once",
        "ms until every draft is ready",
        f"pre-draft backends ({args.draft}, gamma {args.gamma})",
    )
    print("\n" + md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
