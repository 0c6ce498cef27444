"""The planner's report: paper 000's plan against its baselines, as a table, a figure and JSON.

    python -m tools.bench.planner [server-bridge plan's flags] [--fixed-gamma 4] [--out docs/planner]

The plan itself is `server-bridge plan` (server_bridge/ops/planner.py, which says how the paper maps onto
this system); this benchmark sets it beside the paper's search space, its Algorithm 1, an equal
bandwidth split, no pipelining, one batch and one robot per batch, and writes <out>.json, <out>.md
and <out>.png.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from runtime import settings
from server_bridge.config import PlanConfig
from server_bridge.ops.planner import (
    SUBSET_LIMIT,
    Plan,
    Problem,
    evaluate,
    paper_algorithm1,
    paper_order,
    plan,
    plan_consecutive,
    plan_subsets,
    problem_from,
    upload_ms,
)


def baselines(problem: Problem, fixed_gamma: int = 4) -> list[Plan]:
    """The DP plan first, then the paper's search space and its benchmarks (Sec. IV) on the same devices."""
    n = len(problem.devices)
    dp = plan(problem)
    out = [dp]
    if dp.label != "dp (consecutive)":
        out.append(plan(problem, search="consecutive"))
    out.append(plan(problem, per_batch_gamma=True))
    alg1 = min((paper_algorithm1(problem, g) for g in problem.gammas), key=lambda s: s.t_inf_ms)
    out.append(evaluate(problem, alg1.batches, alg1.gammas, label="paper Algorithm 1"))
    uniform = np.full(n, problem.total_bandwidth_hz / n)
    out.append(evaluate(problem, dp.batches, dp.gammas, bandwidth_hz=uniform, label="dp, equal bandwidth"))
    out.append(evaluate(problem, dp.batches, dp.gammas, pipelined=False, label="dp, no pipeline"))
    if problem.feasible(range(n)):
        out.append(evaluate(problem, [tuple(range(n))], [fixed_gamma], label=f"one batch, gamma={fixed_gamma}"))
        out.append(evaluate(problem, [tuple(range(n))], [0], label="one batch, AR (target only)"))
    solo = [(k,) for k in paper_order(problem.devices)]
    out.append(
        min(
            (evaluate(problem, solo, [g] * n, label="one device per batch") for g in problem.gammas),
            key=lambda p: p.total_ms,
        )
    )
    return out


def _fmt_batches(p: Plan) -> str:
    return " ".join("{" + ",".join(map(str, b)) + "}" for b in p.batches)


def _fmt_gammas(p: Plan) -> str:
    return str(p.gammas[0]) if len(set(p.gammas)) == 1 else ",".join(map(str, p.gammas))


def report_tables(problem: Problem, plans: list[Plan]) -> tuple[list[str], list[str], list[str]]:
    """Markdown rows: the devices, the DP plan's batches, the schemes side by side."""
    dp = plans[0]
    bw = dp.bandwidth_hz
    up = upload_ms([d.uplink_bits for d in problem.devices], [d.spectral_efficiency for d in problem.devices], bw)
    dev = [
        "| device | prompt I_k | alpha | draft ms/tok | s_k bit/s/Hz | uplink kbit | MHz (Eq. 27) | upload ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for k, d in enumerate(problem.devices):
        dev.append(
            f"| {k} | {d.prefix_tokens} | {d.alpha:.2f} | {d.draft_ms_per_token:.1f} | "
            f"{d.spectral_efficiency:.2f} | {d.uplink_bits / 1e3:.0f} | {bw[k] / 1e6:.2f} | {up[k]:.1f} |"
        )
    horizon = problem.horizon(dp.gammas)
    bat = [
        "| batch | devices | gamma | rows | I_m | steps n_m | draft ms (step 2) | verify ms (step 2) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for m, (b, g) in enumerate(zip(dp.batches, dp.gammas, strict=True)):
        t_draft, t_verify = problem.stages(b, g, horizon)
        i_m = max(problem.devices[k].prefix_tokens for k in b)
        n_m = int((t_verify > 0).sum())
        bat.append(
            f"| {m} | {','.join(map(str, b))} | {g} | {len(b)} | {i_m} | {n_m} | "
            f"{t_draft[min(1, horizon - 1)]:.1f} | {t_verify[min(1, horizon - 1)]:.1f} |"
        )
    cmp = [
        "| scheme | batches | gamma | T_com ms | T_inf ms | total ms | tok/s | ms/token | vs dp |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in plans:
        cmp.append(
            f"| {p.label} | {_fmt_batches(p)} | {_fmt_gammas(p)} | {p.t_com_ms:.1f} | {p.t_inf_ms:.1f} | "
            f"{p.total_ms:.1f} | {p.tokens_per_s:.1f} | {p.ms_per_token:.2f} | "
            f"{p.total_ms / dp.total_ms:.2f}x |"
        )
    return dev, bat, cmp


def write_png(path: Path, problem: Problem, plans: list[Plan]) -> None:
    """Three panels: total latency per scheme, T_inf against gamma, the DP plan's pipeline in step 2."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(16, 4.8))
    names = [p.label for p in plans]
    y = np.arange(len(plans))
    ax[0].barh(y, [p.t_com_ms for p in plans], color="tab:orange", label="T_com (uplink, Eq. 16)")
    ax[0].barh(
        y,
        [p.t_inf_ms for p in plans],
        left=[p.t_com_ms for p in plans],
        color="tab:blue",
        label="T_inf (pipeline, Eq. 22)",
    )
    ax[0].set_yticks(y, names, fontsize=8)
    ax[0].invert_yaxis()
    ax[0].set_xlabel("total latency, ms (Eq. 23)")
    ax[0].legend(fontsize=8)
    ax[0].set_title("schemes")

    gs = list(problem.gammas)
    n = len(problem.devices)
    search = "subsets" if n <= SUBSET_LIMIT[0] else "consecutive"
    solve = plan_subsets if search == "subsets" else plan_consecutive
    ax[1].plot(
        gs,
        [solve(problem, [g]).t_inf_ms for g in gs],
        marker="o",
        label="dp (all partitions)" if search == "subsets" else "dp (consecutive)",
    )
    if search == "subsets":
        ax[1].plot(gs, [plan_consecutive(problem, [g]).t_inf_ms for g in gs], marker="s", label="dp (consecutive)")
    ax[1].plot(
        gs, [paper_algorithm1(problem, g).t_inf_ms for g in gs], marker="x", linestyle="--", label="paper Algorithm 1"
    )
    if problem.feasible(range(n)):
        ax[1].plot(gs, [evaluate(problem, [tuple(range(n))], [g]).t_inf_ms for g in gs], marker=".", label="one batch")
    solo = [(k,) for k in paper_order(problem.devices)]
    ax[1].plot(gs, [evaluate(problem, solo, [g] * n).t_inf_ms for g in gs], marker=".", label="one device per batch")
    ax[1].set_xlabel("speculation length gamma (Eq. 33)")
    ax[1].set_ylabel("T_inf, ms")
    ax[1].grid(alpha=0.3)
    ax[1].legend(fontsize=8)
    ax[1].set_title("inference latency vs gamma")

    # Eq. 20 drawn for the DP plan in step 2 (warm caches; step 1 carries the prefills)
    dp = plans[0]
    horizon = problem.horizon(dp.gammas)
    step = min(1, horizon - 1)
    shared = problem.drafting.shared
    ready, done = 0.0, 0.0
    for m, (b, g) in enumerate(zip(dp.batches, dp.gammas, strict=True)):
        t_draft, t_verify = (x[step] for x in problem.stages(b, g, horizon))
        d0 = ready if shared else 0.0  # a shared drafter works batch after batch
        ready = d0 + t_draft
        v0 = max(ready, done)
        done = v0 + t_verify
        row = 1 if shared else 1 + m  # own drafters: one row per batch, all from 0
        ax[2].barh(row, t_draft, left=d0, color=f"C{m % 10}", edgecolor="k", height=0.7)
        ax[2].barh(0, t_verify, left=v0, color=f"C{m % 10}", edgecolor="k", height=0.7)
        ax[2].text(v0 + t_verify / 2, 0, f"b{m}", ha="center", va="center", fontsize=8)
    rows = 1 if shared else len(dp.batches)
    ax[2].set_yticks(
        range(rows + 1),
        ["verify (server)"] + (["draft (SBS)"] if shared else [f"draft b{m} (robots)" for m in range(rows)]),
    )
    ax[2].set_xlabel("ms into decoding step 2 (Eq. 20)")
    ax[2].set_title(f"dp plan, step 2: {len(dp.batches)} batches, makespan {done:.0f} ms")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


REPORT_NOTES = [
    "How to read it (paper 000, `server-bridge plan`, `tools/bench/planner.py`):",
    "",
    "- total = T_com + T_inf (Eq. 23). T_com is the last prompt's arrival on the uplink with the "
    "closed-form split of Eq. 27 (every robot finishes uploading at once); `dp, equal bandwidth` splits evenly.",
    "- T_inf = sum over decoding steps of the pipeline makespan (Eqs. 20-22): batch m's drafts are verified "
    "after its robots finish drafting and the server finishes batch m-1; each step waits for the last batch.",
    "- Expected-value model: L = (1 - alpha^(gamma+1)) / (1 - alpha) tokens per round (Eq. 7), "
    "ceil(O / L) rounds (Eq. 8); a batch runs until its slowest member is done.",
    "- `dp (all partitions)` is exact over every grouping and order of the robots; `dp (consecutive)` is exact "
    "over the paper's space (consecutive batches in prompt-length order); `paper Algorithm 1` is the "
    "published one-label DP (Eq. 29's misplaced T^d corrected), which can miss the optimum.",
    "- `one batch, AR` is the target alone (gamma = 0), outside the paper's l >= 1 unless --allow-ar.",
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    settings.add_flags(ap, PlanConfig)  # the same flags as `server-bridge plan`
    ap.add_argument("--fixed-gamma", type=int, default=4, help="gamma of the one-batch baseline")
    ap.add_argument("--out", default="docs/planner", help="writes <out>.json, <out>.md, <out>.png")
    args = ap.parse_args(argv)
    try:
        config = PlanConfig(**settings.given(PlanConfig, args))
        problem = problem_from(config)
    except (ValueError, OSError) as e:
        raise SystemExit(f"planner: {e}") from None
    t0 = time.perf_counter()
    plans = baselines(problem, args.fixed_gamma)
    solve_s = time.perf_counter() - t0
    dev, bat, cmp = report_tables(problem, plans)
    command = " ".join(["python -m tools.bench.planner", *(sys.argv[1:] if argv is None else argv)])
    verify = problem.verify
    print(
        f"{command.strip()}\nverify model: {getattr(verify, 'source', verify)}; drafting: {config.drafting}; "
        f"padded: {config.pad}; planned in {solve_s:.2f} s"
    )
    print("\n".join(bat))
    print()
    print("\n".join(cmp))

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    meta = {**asdict(config), "fixed_gamma": args.fixed_gamma, "verify_model": asdict(verify), "started": started}
    json_path, md_path, png_path = (out.with_name(out.name + ext) for ext in (".json", ".md", ".png"))
    robots = [asdict(d) for d in problem.devices]
    plans_json = [p.to_json() for p in plans]
    json_path.write_text(
        json.dumps({"config": meta, "devices": robots, "plans": plans_json}, indent=1, default=float) + "\n"
    )
    md = [
        f"`{command}` ({started}; planned in {solve_s:.2f} s)",
        "",
        f"Verify model: {getattr(verify, 'source', '') or asdict(verify)}. Drafting: {config.drafting}. "
        f"Prompts padded to the batch's longest: {config.pad}. Bandwidth {config.bandwidth_mhz} MHz. "
        f"gamma in {min(problem.gammas)}..{config.gamma_max}, O = {config.output_tokens} tokens per robot. "
        + ("Robots from " + config.fleet if config.fleet else "Robots are seeded EXAMPLES, not measurements")
        + ".",
        "",
        "## Devices",
        "",
        *dev,
        "",
        f"## The plan: {plans[0].label}",
        "",
        *bat,
        "",
        "## Against the baselines",
        "",
        *cmp,
        "",
        *REPORT_NOTES,
        "",
        f"![planner]({png_path.name})",
        "",
    ]
    md_path.write_text("\n".join(md))
    write_png(png_path, problem, plans)
    print(f"wrote {json_path}, {md_path}, {png_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
