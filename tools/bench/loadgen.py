"""Multi-robot load generator: SLO violations, goodput and capacity of server-bridge's scheduler.

    python -m tools.bench.loadgen [--n 2,4,8,12,16,24,32] [--policies fcfs,slo] [--pairs smollm2-q4_1,smollm2-q2_k]
                            [--window-s 20] [--warmup-s 5] [--gamma 4] [--draft-ms 8] [--tokens 48]
                            [--classes 8,2,6,4] [--out docs/loadgen]

N simulated robots (`server-bridge loadtest`'s, server_bridge/ops/loadtest.py) are real websocket clients of a
real server-bridge this tool starts (server_bridge/ops/fleet.py:LocalVerifier), one fresh server per
(pair, N, policy), started with `--scheduler POLICY` when `server-bridge serve` has
that flag. The server is pinned to one core with one torch thread, this process to
another, so robots and verifier do not compete.

A robot does not load a draft model: it replays a trace (tools/train/record_traces.py).
At T = 0 the committed text is the target's greedy continuation, so the draft a
robot would propose after i committed tokens is the recorded chain at position i;
it sleeps gamma x --draft-ms (the draft's measured cost per token on the robot),
sends that chain's first gamma tokens in a `verify`, and commits exactly what the
server's `result` says. Should its text ever leave the recorded path it sends
empty drafts (the server then answers with one target token a round). Each robot
has a speed class (SLO, tokens/s) from --classes, round-robin, and generates
--tokens tokens a generation, then closes and opens the next prompt.

An `error` `overloaded` is the server shedding the robot's request (its fallback
takes over): the generation counts as an SLO violation, the robot backs off
--backoff-s and re-opens with its committed prefix.

Measured over --window-s after --warmup-s; all robots run throughout, and on after
the window (a tail) until every generation opened in it is decided:

  violation   a generation violates its SLO when its speed, tokens / (last result -
              open), is below its class, or it was shed. It is decided when that is
              certain: at its last result, at its deadline open + tokens / class if
              unfinished by then, or when it is shed. The window's sample is the
              generations *opened* in it, each followed to its outcome, so a slow one
              counts as much as a fast one (the tail lasts at most the longest
              deadline, tokens / slowest class); a robot that opened none in the
              window (its generation outlasted it) contributes that generation.
  goodput     committed tokens (results received in the window) / window, all robots.
  capacity    per policy: the largest N of the grid such that at this N and at every
              smaller one the violation rate, overall and of every class, is <= 5 %.
              When even the largest N passes, capacity is that N and marked as a
              lower bound.

Writes loadgen.json (config, every point, capacities), loadgen.md and loadgen.png
into --out, printing a line as each point completes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

from runtime import settings
from server_bridge.config import LoadConfig
from server_bridge.ops.loadtest import (
    MAX_VIOLATION,
    Generation,
    Trace,
    capacity,
    diverged_at,
    run_robots,
    server_figures,
    summarize,
)
from tools.bench import harness

log = logging.getLogger(__name__)

TRACES = Path(__file__).resolve().parents[1] / "traces"
TARGET = "smollm2-f32"
POLICIES = ("fcfs", "slo", "fixed")
ROBOT_FLAGS = ("draft_ms", "tokens", "classes", "warmup_s", "window_s", "backoff_s", "seed")  # LoadConfig's


def trace_alpha(trace: Trace) -> float:
    """How often the draft's first token is the target's, over the trace: the planner's alpha."""
    hits = [c[0] == t for p in trace.prompts for c, t in zip(p.chains, p.target_ids, strict=True)]
    return sum(hits) / len(hits)


def planned_gamma(trace: Trace, n: int, cfg: "LoadConfig", estimator: Path) -> tuple[int, dict]:
    """The draft length tools/bench/planner.py chooses for n robots like these (paper 000, Eq. 33 and its DP).

    The robots: cfg.draft_ms per draft token, alpha from the trace, the trace's mean prompt,
    cfg.tokens a generation, on loopback (no uplink time); the verifier: the fitted estimator.
    """
    from server_bridge.ops import planner

    prefix = round(sum(len(p.prompt_ids) for p in trace.prompts) / len(trace.prompts))
    alpha = min(trace_alpha(trace), 0.999)
    devices = tuple(
        planner.Device(
            draft_ms_per_token=cfg.draft_ms,
            alpha=alpha,
            uplink_bits_per_token=0.0,
            prefix_tokens=prefix,
            spectral_efficiency=1.0,
            output_tokens=cfg.tokens,
        )
        for _ in range(n)
    )
    problem = planner.Problem(
        devices,
        total_bandwidth_hz=1e6,
        verify=planner.LinearVerifyModel.load(estimator),
        gammas=tuple(range(1, trace.gamma_max + 1)),
    )
    best = planner.plan(problem)
    return int(best.gammas[0]), {
        "alpha": round(alpha, 4),
        "prefix_tokens": prefix,
        "batches": best.batches,
        "gammas": best.gammas,
        "tokens_per_s": round(best.tokens_per_s, 2),
    }


NEAR_TIE = 0.1  # logits: ~3x the llamacpp engine's rounding noise between batch shapes (tools/bench/divergence.py)
_solo_target = None


def near_ties(point: dict, gens: list[Generation], trace: Trace, bound: float = NEAR_TIE) -> None:
    """At each divergence from the trace: the target's top-2 margin there, in a one-token pass of its own.

    Under load a session's rows are computed in batches of changing shapes, which round
    differently from the solo passes that recorded the trace. A divergence is a near-tie when
    the recorded id and the robot's are the target's top two there and their logits are within
    `bound`; anything else is an exactness failure. Fills each diverged record's `divergence`
    and the point's `near_ties` (the count) and `exact_up_to_near_ties`.
    """
    global _solo_target
    from tools.logit_margin import top2

    point["near_ties"], point["exact_up_to_near_ties"] = 0, True
    for rec, g in zip(point["generation_records"], gens, strict=True):
        at = None if rec["exact"] else diverged_at(g, trace)
        if at is None:
            continue
        if _solo_target is None:
            from server_bridge.target import load_target

            _solo_target = load_target(trace.target, threads=1, max_sequences=2, kv_tokens=4096)
        p = trace.prompts[g.prompt]
        state = _solo_target.new_state(p.prompt_ids + p.target_ids[:at])
        best, second, _, margin = top2(np.asarray(_solo_target.score(state, [])[0], np.float64))
        tie = {p.target_ids[at], g.tokens[at]} == {best, second} and margin <= bound
        rec["divergence"] = {
            "at": at,
            "trace_id": p.target_ids[at],
            "robot_id": g.tokens[at],
            "margin": round(margin, 5),
            "near_tie": tie,
        }
        point["near_ties"] += tie
        point["exact_up_to_near_ties"] &= tie


# --------------------------------------------------------------------------- the sweep


def scheduler_flag_available() -> bool:
    """Whether `server-bridge serve` takes --scheduler (it is new; older servers run their one policy)."""
    try:
        r = subprocess.run(
            [sys.executable, "-m", "server_bridge.cli", "serve", "--help"], capture_output=True, text=True, timeout=120
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "--scheduler" in r.stdout


def server_config(log_text: str) -> dict | None:
    """The config the server logged at start ("config in use: {json}"), saved beside its figures."""
    for line in log_text.splitlines():
        _, sep, rest = line.partition("config in use: ")
        if sep:
            try:
                return json.loads(rest)
            except ValueError:
                return None
    return None


def run_point(
    trace: Trace,
    n: int,
    policy: str,
    cfg: LoadConfig,
    server_cpus: set[int] | None,
    server_threads: int,
    server_args: list[str],
    use_flag: bool,
    keep_tokens: bool = False,
) -> dict:
    """A fresh server-bridge with `policy`, N robots against it; the point's summary."""
    from server_bridge.ops.fleet import LocalVerifier

    extra = (["--scheduler", policy] if use_flag else []) + server_args
    t0 = time.perf_counter()
    with LocalVerifier(target=trace.target, cpus=server_cpus, threads=server_threads, extra_args=extra) as server:
        started = time.perf_counter() - t0
        out = asyncio.run(run_robots(server.url, trace, n, cfg, metrics_port=server.port))
        tail = server.log_tail(8) if out.errors else None
    log_text = server.log_path.read_text(errors="replace")
    server.log_path.unlink(missing_ok=True)
    point = {
        "pair": trace.draft,
        "target": trace.target,
        "policy": policy,
        "n": n,
        "scheduler_flag": use_flag,
        "server_start_s": round(started, 2),
        **summarize(out, trace, cfg.classes),
        "server_metrics": server_figures(out.metrics),
        "server_config": server_config(log_text),
    }
    near_ties(point, out.generations, trace)
    if tail:
        point["server_log_tail"] = tail
    if keep_tokens:  # every generation, with its ids
        for rec, g in zip(point["generation_records"], out.generations, strict=True):
            rec["token_ids"] = g.tokens
    else:  # the window's sample only: the JSON stays small
        point["generation_records"] = [r for r in point["generation_records"] if r["in_sample"] or "divergence" in r]
    return point


def describe(p: dict, classes: tuple) -> str:
    pct = lambda r: "  -  " if r is None else f"{100 * r:4.0f}%"  # noqa: E731
    by = " ".join(f"{c}:{pct(p['violation_rate_by_class'][str(c)]).strip()}" for c in sorted(classes))
    lat = "-" if p["round_ms_mean"] is None else f"{p['round_ms_mean']:.0f}/{p['round_ms_p95']:.0f}"
    flags = (
        ""
        if p["exact"]
        else f"  near-ties only ({p['near_ties']})"
        if p.get("exact_up_to_near_ties")
        else "  NOT EXACT"
    ) + (f"  errors {len(p['errors'])}" if p["errors"] else "")
    if p["decided"] < p["n"]:
        flags += "  (fewer decided generations than robots: raise --window-s)"
    return (
        f"{p['pair']} {p['policy']:<5} N={p['n']:<3} violations {pct(p['violation_rate'])} ({by}) of "
        f"{p['decided']}  goodput {p['goodput_tokens_per_s']:5.1f} tok/s  rounds {p['rounds']}  "
        f"shed {p['sheds']}  round ms mean/p95 {lat}{flags}"
    )


def capacities(points: list[dict], classes: tuple) -> dict:
    """pair -> policy -> capacity overall and per class; pair -> slo/fcfs ratios."""
    out: dict = {}
    for pair in dict.fromkeys(p["pair"] for p in points):
        out[pair] = {"policies": {}, "ratio_slo_over_fcfs": {}}
        for policy in dict.fromkeys(p["policy"] for p in points if p["pair"] == pair):
            sel = {p["n"]: p for p in points if p["pair"] == pair and p["policy"] == policy}
            cap, capped = capacity({n: p["passes"] for n, p in sel.items()})
            by_class = {}
            for c in classes:
                rates = {n: p["violation_rate_by_class"][str(c)] for n, p in sel.items()}
                by_class[str(c)] = capacity({n: None if r is None else r <= MAX_VIOLATION for n, r in rates.items()})
            out[pair]["policies"][policy] = {
                "capacity": cap,
                "lower_bound": capped,
                "by_class": {c: v[0] for c, v in by_class.items()},
                "by_class_lower_bound": {c: v[1] for c, v in by_class.items()},
            }
        pol = out[pair]["policies"]
        if "slo" in pol and "fcfs" in pol:
            out[pair]["ratio_slo_over_fcfs"] = {
                "overall": _ratio(pol["slo"]["capacity"], pol["fcfs"]["capacity"]),
                **{
                    f"class_{c}": _ratio(pol["slo"]["by_class"][str(c)], pol["fcfs"]["by_class"][str(c)])
                    for c in classes
                },
            }
    return out


def _ratio(a: int | None, b: int | None) -> float | None:
    """a / b; None where either has no data or b is 0 (fcfs fails at the smallest N)."""
    return None if a is None or not b else a / b


def sweep(args, cfg: LoadConfig) -> dict:
    traces = {pair: Trace.load(Path(args.traces) / f"{pair}__{args.target}.json") for pair in args.pairs}
    for t in traces.values():
        if args.gamma != "plan" and cfg.gamma > t.gamma_max:
            raise SystemExit(f"--gamma {cfg.gamma} exceeds the trace's recorded chains of {t.gamma_max}")
    use_flag = scheduler_flag_available() if args.scheduler_flag == "auto" else args.scheduler_flag == "yes"
    cpus = sorted(os.sched_getaffinity(0))
    client_cpus = {args.client_cpu} if args.client_cpu in cpus else set(cpus)
    server_cpus = {args.server_cpu} if args.server_cpu in cpus and args.server_cpu != args.client_cpu else None
    config = {
        **asdict(cfg),
        "gamma": args.gamma,
        "ns": args.n,
        "policies": args.policies,
        "pairs": args.pairs,
        "target": args.target,
        "scheduler_flag": use_flag,
        "server_args": args.server_args,
        "server_cpus": sorted(server_cpus or []),
        "server_threads": args.server_threads,
        "client_cpus": sorted(client_cpus),
        "cpu_count": os.cpu_count(),
        "max_violation": MAX_VIOLATION,
        "traces": {p: str(Path(args.traces) / f"{p}__{args.target}.json") for p in args.pairs},
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    print(
        f"loadgen: pairs {args.pairs} x N {args.n} x policies {args.policies}; window {cfg.window_s}s after "
        f"{cfg.warmup_s}s warm-up, gamma {cfg.gamma}, {cfg.draft_ms} ms/draft token, {cfg.tokens} tokens a "
        f"generation, classes {list(cfg.classes)} tok/s; server on cores {config['server_cpus'] or 'any'} "
        f"({args.server_threads} thread), robots on {sorted(client_cpus)}",
        flush=True,
    )
    if not use_flag:
        print(
            "loadgen: `server-bridge serve` has no --scheduler flag here: every policy runs the server's one "
            "scheduler (the points are labelled by policy all the same)",
            flush=True,
        )
    points = []
    total, step = len(args.pairs) * len(args.n) * len(args.policies), 0
    every_cpu = os.sched_getaffinity(0)
    os.sched_setaffinity(0, client_cpus)
    try:
        for pair in args.pairs:
            for n in args.n:
                point_cfg, plan = cfg, None
                if args.gamma == "plan":
                    gamma, plan = planned_gamma(traces[pair], n, cfg, Path(args.estimator))
                    point_cfg = replace(cfg, gamma=gamma)
                    print(f"  planner: gamma {gamma} for {n} robots of {pair} ({plan})", flush=True)
                for policy in args.policies:
                    step += 1
                    p = run_point(
                        traces[pair],
                        n,
                        policy,
                        point_cfg,
                        server_cpus,
                        args.server_threads,
                        shlex.split(args.server_args),
                        use_flag,
                        args.keep_tokens,
                    )
                    p["gamma"], p["plan"] = point_cfg.gamma, plan
                    points.append(p)
                    print(f"[{step}/{total}] {describe(p, cfg.classes)}", flush=True)
    finally:
        os.sched_setaffinity(0, every_cpu)
    config["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    return {"config": config, "points": points, "capacities": capacities(points, cfg.classes)}


# --------------------------------------------------------------------------- report and CLI


def _cap(c: int | None, lower_bound: bool, ns: list[int]) -> str:
    if c is None:
        return "-"
    if c == 0:
        return f"< {min(ns)}"
    return f">= {c}" if lower_bound else str(c)


def capacity_rows(result: dict) -> list[dict]:
    """The capacity table: per pair and policy, the capacity overall and per class as written."""
    cfg = result["config"]
    return [
        {
            "pair": pair,
            "policy": policy,
            "all": _cap(c["capacity"], c["lower_bound"], cfg["ns"]),
            **{
                str(k): _cap(c["by_class"][str(k)], c["by_class_lower_bound"][str(k)], cfg["ns"])
                for k in cfg["classes"]
            },
        }
        for pair, caps in result["capacities"].items()
        for policy, c in caps["policies"].items()
    ]


def _intro(result: dict) -> str:
    cfg = result["config"]
    return (
        f"{len(cfg['pairs'])} pair(s) x N in {cfg['ns']} x policies {cfg['policies']}; target {cfg['target']}. "
        f"Each robot replays a recorded trace at T = 0 (gamma {cfg['gamma']}, {cfg['draft_ms']} ms drafting per "
        f"token emulated, {cfg['tokens']} tokens a generation) with SLO class "
        f"{', '.join(str(c) for c in cfg['classes'])} tok/s round-robin. Window {cfg['window_s']} s after "
        f"{cfg['warmup_s']} s warm-up; a fresh server per point on cores {cfg['server_cpus'] or 'any'} "
        f"({cfg['server_threads']} torch thread), robots on {cfg['client_cpus']}. "
        + (
            ""
            if cfg["scheduler_flag"]
            else "**The server had no --scheduler flag: every policy ran the same scheduler.** "
        )
        + f"Started {cfg['started']}.\n\n"
        "A generation violates its SLO when tokens / (last result - open) < its class, or it was shed; the "
        "sample is the generations opened in the window, each followed to its outcome. Goodput: tokens "
        "committed in the window / window (all robots); SLO-met: the tokens of the sample's generations that "
        "met their class / window. "
        f"Capacity: the largest N with every N up to it at <= {100 * cfg['max_violation']:.0f} % violations, "
        "overall and per class; '-' where no robot of a class ran, or no generation opened in the window "
        "(a point without any fails)."
    )


def _ratios(result: dict) -> list[str]:
    """A line per pair: slo's capacity against fcfs's, overall and for the tightest class."""
    cfg, out = result["config"], []
    tight = str(max(cfg["classes"]))
    for pair, caps in result["capacities"].items():
        r, pol = caps["ratio_slo_over_fcfs"], caps["policies"]
        if r:

            def cap(p: str, c: str | None = None, pol: dict = pol) -> str:
                key = "" if c is None else "by_class_"
                got = pol[p]["capacity"] if c is None else pol[p]["by_class"][c]
                return _cap(
                    got, pol[p][key + "lower_bound"] if c is None else pol[p][key + "lower_bound"][c], cfg["ns"]
                )

            ratio = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
            out.append(
                f"- {pair}: capacity slo {cap('slo')} vs fcfs {cap('fcfs')} robots, ratio {ratio(r['overall'])}; "
                f"tightest class ({tight} tok/s): slo {cap('slo', tight)} vs fcfs {cap('fcfs', tight)}, ratio "
                f"{ratio(r[f'class_{tight}'])}"
            )
    return out


def _exactness(p: dict) -> str:
    if p["exact"]:
        return "yes"
    return f"near-ties only ({p['near_ties']})" if p.get("exact_up_to_near_ties") else "**no**"


def _point_cols(result: dict) -> list[harness.Col]:
    cfg = result["config"]
    classes = sorted(cfg["classes"])
    means = lambda m: ", ".join(f"{k.removeprefix('bridge_')} {v:.2f}" for k, v in m.items()) or "-"  # noqa: E731
    return [
        harness.Col("n", "N"),
        harness.Col("policy"),
        *([harness.Col("gamma")] if cfg["gamma"] == "plan" else []),
        harness.Col("violation_rate", "violations", harness.pct),
        *[harness.Col(f"violation_rate_by_class.{c}", f"{c} tok/s", harness.pct) for c in classes],
        harness.Col("decided"),
        harness.Col("goodput_tokens_per_s", "goodput tok/s", "{:.1f}"),
        harness.Col("slo_met_tokens_per_s", "SLO-met tok/s", "{:.1f}"),
        harness.Col("tokens_per_round", "tokens/round", "{:.2f}"),
        harness.Col("round_ms_mean", "round ms mean", "{:.0f}"),
        harness.Col("round_ms_p95", "p95", "{:.0f}"),
        harness.Col("sheds", "shed"),
        harness.Col("server_metrics.means", "server means", means),
        harness.Col("exactness", "exact"),
    ]


REPORT = harness.Report(
    "loadgen",
    "# Multi-robot load: SLO violations, goodput and capacity",
    [
        harness.Table("points", _point_cols, "## {pair} -> {target}", facet="pair"),
        harness.Table(
            "capacity",
            lambda result: [
                harness.Col("pair"),
                harness.Col("policy"),
                harness.Col("all", "capacity (all classes)"),
                *[harness.Col(str(c), f"{c} tok/s") for c in sorted(result["config"]["classes"])],
            ],
            "## Capacity",
        ),
    ],
    [
        harness.Plot(
            "points",
            x="n",
            ys=lambda r: {
                "all": "violation_rate",
                f"{max(r['config']['classes'])} tok/s": f"violation_rate_by_class.{max(r['config']['classes'])}",
            },
            group="policy",
            facet="pair",
            xlabel="robots (N)",
            ylabel="SLO violation rate",
            title="{pair}: violations",
            ylim=(-0.02, 1.02),
            hline=MAX_VIOLATION,
        ),
        harness.Plot(
            "points",
            x="n",
            ys={"": "goodput_tokens_per_s"},
            group="policy",
            facet="pair",
            xlabel="robots (N)",
            ylabel="committed tokens / s (all robots)",
            title="{pair}: goodput",
        ),
    ],
    intro=_intro,
    extra=_ratios,
)


def _gamma(s: str) -> int | str:
    return s if s == "plan" else int(s)


def _policies(s: str) -> list[str]:
    names = harness.names(s)
    if not names or any(x not in POLICIES for x in names):
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(POLICIES)}")
    return names


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--n", type=harness.ints, default=[2, 4, 8, 12, 16, 24, 32], help="robot counts")
    ap.add_argument("--policies", type=_policies, default=["fcfs", "slo"])
    ap.add_argument("--pairs", type=harness.names, default=["smollm2-q4_1", "smollm2-q2_k"], help="drafts (traces)")
    ap.add_argument("--target", default=TARGET)
    ap.add_argument("--traces", default=str(TRACES), help="folder of <draft>__<target>.json")
    settings.add_flags(ap, LoadConfig, only=ROBOT_FLAGS)  # --window-s, --draft-ms, ... as `server-bridge loadtest`
    ap.add_argument(
        "--gamma",
        type=_gamma,
        default=4,
        help="draft tokens per round, or 'plan': tools/bench/planner.py's choice for each N",
    )
    ap.add_argument(
        "--estimator",
        default="models/estimator/smollm2-f32.json",
        help="with --gamma plan: the verifier's fitted estimator (`server-bridge profile`)",
    )
    ap.add_argument("--server-cpu", type=int, default=1)
    ap.add_argument("--client-cpu", type=int, default=0)
    ap.add_argument("--server-threads", type=int, default=1)
    ap.add_argument("--server-args", default="", help="more `server-bridge serve` flags, e.g. \"--exits ''\"")
    ap.add_argument(
        "--scheduler-flag",
        choices=("auto", "yes", "no"),
        default="auto",
        help="pass --scheduler POLICY to the server (auto: if its serve --help lists it)",
    )
    ap.add_argument(
        "--keep-tokens",
        action="store_true",
        help="store every generation (not only the window's sample) with its token ids in the JSON",
    )


def measure(args: argparse.Namespace) -> dict:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if args.quick:  # one short point
        args.n, args.policies, args.pairs = args.n[:1], args.policies[:1], args.pairs[:1]
        args.window_s, args.warmup_s, args.tokens = min(args.window_s, 3.0), min(args.warmup_s, 1.0), 16
    try:
        cfg = LoadConfig(**settings.given(LoadConfig, args) | {"gamma": 4 if args.gamma == "plan" else args.gamma})
    except ValueError as e:
        raise SystemExit(f"loadgen: {e}") from None
    result = sweep(args, cfg)
    for p in result["points"]:
        p["exactness"] = _exactness(p)
    result["target"], result["capacity"] = args.target, capacity_rows(result)
    result["ok"] = all((p["exact"] or p.get("exact_up_to_near_ties")) and not p["errors"] for p in result["points"])
    return result


def main(argv: list[str] | None = None) -> int:
    return harness.main(__doc__, REPORT, measure, add_args, argv, out="docs/loadgen", pin_cores=False)


if __name__ == "__main__":
    sys.exit(main())
