"""What the torch engine's batch-invariant mode costs: the verify pass with and without it, side by side.

    python -m tools.bench.invariant_cost --out docs/benchmarks/batch_invariant_cpu \
        [--dtype bfloat16] [--sessions 1,2,8,16,32] [--gamma 4] [--repeats 15] [--threads 1] [--core 1]

Two engines on the same target and dtype (server_bridge/engines/invariant_torch.py), one with
`batch_invariant = "on"`, one "off". For each batch size B, B sessions (the benchmark prompts,
cycled) are prefilled, then a verify pass of B x (gamma + 1) rows is timed on each engine in
turn, alternating, `repeats` times (the median is reported: the machine is shared). The one-token
pass (1 x 1, what AR runs) is timed too: the mode changes it as well. Writes invariant_cost.json,
invariant_cost.md and invariant_cost.png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

from server_bridge.target import Extension, load_target


def _states(target, prompts: list[list[int]], n: int) -> list:
    """n sessions, each a benchmark prompt prefilled (all but its last id in the KV)."""
    return [target.new_state(prompts[i % len(prompts)]) for i in range(n)]


def _time_pass(target, states: list, rows: int) -> float:
    """Seconds of one pass of `rows` rows per session (the pending id and rows - 1 draft ids)."""
    exts = [Extension(s, s.ids[s.cached :] + [s.ids[-1]] * (rows - 1), rows) for s in states]
    t0 = time.perf_counter()
    out = target.extend(exts)
    target.argmax_each(out)  # what the verifier reads back: the rows' greedy ids
    dt = time.perf_counter() - t0
    for s in states:
        target.engine.truncate(s.seq, s.cached)  # the next repeat overwrites the same cells
    return dt


def measure(args, prompts: list[list[int]]) -> dict:
    """Median ms of each pass shape on both engines, alternating per repeat."""
    engines = {
        mode: load_target(
            args.target,
            engine="torch",
            device="cpu",
            dtype=args.dtype,
            threads=args.threads,
            max_sequences=max(args.sessions),
            max_len=1024,
            batch_invariant=mode,
        )
        for mode in ("off", "on")
    }
    shapes = [(1, 1)] + [(b, args.gamma + 1) for b in args.sessions]
    results = []
    for b, rows in shapes:
        states = {mode: _states(t, prompts, b) for mode, t in engines.items()}
        times: dict[str, list[float]] = {"off": [], "on": []}
        for _ in range(args.repeats + 1):  # the first: warm-up, dropped
            for mode, t in engines.items():
                times[mode].append(_time_pass(t, states[mode], rows))
        med = {mode: float(np.median(ts[1:])) * 1e3 for mode, ts in times.items()}
        results.append(
            {
                "sessions": b,
                "rows": rows,
                "off_ms": med["off"],
                "on_ms": med["on"],
                "cost_pct": 100.0 * (med["on"] / med["off"] - 1.0),
            }
        )
        print(f"{b} x {rows}: off {med['off']:.1f} ms, on {med['on']:.1f} ms ({results[-1]['cost_pct']:+.1f} %)")
        for mode, t in engines.items():
            for s in states[mode]:
                t.free(s)
    return {"engine": engines["on"].engine.info.as_dict(), "passes": results}


def markdown(report: dict) -> str:
    lines = [
        f"# The batch-invariant mode's cost: torch engine, {report['dtype']}, CPU ({report['machine']})",
        "",
        f"`{report['command']}`",
        "",
        f"Median of {report['repeats']} passes each, the two engines alternating; {report['threads']} thread(s). "
        "A verify pass of B sessions is B x (gamma + 1) rows; 1 x 1 is the one-token (AR) pass.",
        "",
        "| pass (sessions x rows) | mode off, ms | mode on, ms | cost |",
        "|---|---|---|---|",
    ]
    for r in report["passes"]:
        lines.append(
            f"| {r['sessions']} x {r['rows']} | {r['off_ms']:.1f} | {r['on_ms']:.1f} | {r['cost_pct']:+.1f} % |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None, help="the target (default the shipped smollm2-f32)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--sessions", default="1,2,8,16,32")
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--core", type=int, default=1, help="pin to this core (-1: no pinning)")
    ap.add_argument("--out", default="bench_results/invariant_cost")
    args = ap.parse_args(argv)
    args.sessions = [int(s) for s in args.sessions.split(",")]
    if args.core >= 0:
        os.sched_setaffinity(0, {args.core})
    from tools.bench.peer import load_prompts

    prompts = [p.prompt_ids for p in load_prompts(n=8).prompts]
    report = {
        "command": "python -m tools.bench.invariant_cost " + " ".join(argv if argv is not None else sys.argv[1:]),
        "target": args.target or "smollm2-f32",
        "dtype": args.dtype,
        "repeats": args.repeats,
        "threads": args.threads,
        "machine": platform.processor() or platform.machine(),
        **measure(args, prompts),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "invariant_cost.json").write_text(json.dumps(report, indent=1))
    (out / "invariant_cost.md").write_text(markdown(report))
    from tools.plots import bar_plot

    passes = report["passes"]
    bar_plot(
        out / "invariant_cost.png",
        [f"{r['sessions']}x{r['rows']}" for r in passes],
        {"mode off": [r["off_ms"] for r in passes], "mode on": [r["on_ms"] for r in passes]},
        ylabel="ms per pass",
        title=f"torch {args.dtype} CPU: verify pass with and without the batch-invariant mode",
    )
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
