"""Pre-draft backends: one llama context with N sequences decoded in one batch, against N contexts
in N worker threads (llama-cpp `Llama` objects are not thread-safe, so one each).

    python -m tools.bench.predraft [--branches 1,2,4,8] [--gamma 4] [--repeats 5] [--cores 0]

Both draft the same N continuations of one prompt, gamma tokens each, the way
a round's pre-drafting does; the figure is the wall time until every branch's
draft is ready (median over --repeats). Writes predraft_backends.{json,md,png}
into --out. agent/decoding/branches.py implements the batched backend, the faster one.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import threading
import time

import numpy as np

from agent.decoding import DecoderSettings, open_decoder
from agent.decoding.branches import BranchDrafter
from agent.decoding.drafter import Drafter
from protocol.sampling import SamplingParams
from tools.bench import harness

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
    threads = [threading.Thread(target=work, args=(d, k)) for d, k in zip(drafters, keys, strict=True)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return (time.perf_counter() - t0) * 1e3


REPORT = harness.Report(
    "predraft_backends",
    "# Pre-draft backends ({draft}, gamma {gamma})",
    [
        harness.Table(
            "rows",
            [
                harness.Col("branches"),
                harness.Col("batched_ms", "one context, batched (ms)", "{:.0f}"),
                harness.Col("threads_ms", "one context per thread (ms)", "{:.0f}"),
                harness.Col("batched_speedup", "batched faster by", "{:.2f}x"),
            ],
            note="{draft}, {gamma} tokens per branch, 1 llama thread per context, cores {cores}, "
            "median of {repeats}; {started}.",
        )
    ],
    harness.Plot(
        "rows",
        x="branches",
        ys={"one context, batched": "batched_ms", "one context per thread": "threads_ms"},
        xlabel="branches drafted at once",
        ylabel="ms until every draft is ready",
        title="pre-draft backends ({draft}, gamma {gamma})",
    ),
)


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--branches", type=harness.ints, default=[1, 2, 4, 8])
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--draft", default="smollm2-q4_1")


def measure(args: argparse.Namespace) -> dict:
    logging.basicConfig(level=logging.WARNING)
    sizes = args.branches[:2] if args.quick else args.branches
    main_drafter = open_decoder(DecoderSettings(draft=args.draft, threads=1)).drafter
    committed = main_drafter.tokenize(PROMPT, chat=True)
    keys = keys_for(main_drafter, committed, max(sizes))
    rows = []
    cores = sorted(os.sched_getaffinity(0))
    print(f"pre-draft backends: {args.draft}, gamma {args.gamma}, pinned to cores {cores}", flush=True)
    for n in sizes:
        bd = BranchDrafter(main_drafter, slots=n, threads=1)
        drafters = [open_decoder(DecoderSettings(draft=args.draft, threads=1)).drafter for _ in range(n)]
        for d in drafters:  # warm: the prompt's KV in every context
            d.propose(committed, 1, GREEDY, None)
        batched(bd, committed, keys[:n], args.gamma)
        b_ms = statistics.median(batched(bd, committed, keys[:n], args.gamma) for _ in range(args.repeats))
        t_ms = statistics.median(threaded(drafters, committed, keys[:n], args.gamma) for _ in range(args.repeats))
        rows.append({"branches": n, "batched_ms": b_ms, "threads_ms": t_ms, "batched_speedup": t_ms / b_ms})
        print(f"{n} branches x {args.gamma} tokens: batched {b_ms:.0f} ms, threads {t_ms:.0f} ms", flush=True)
        del drafters, bd
    return {"draft": args.draft, "gamma": args.gamma, "repeats": args.repeats, "cores": cores, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    return harness.main(
        __doc__, REPORT, measure, add_args, argv, repeats=5, cores_default="0", module="tools.bench.predraft"
    )


if __name__ == "__main__":
    sys.exit(main())
