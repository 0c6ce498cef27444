"""Fleet capacity through HAProxy with 1 and 2 replicas, and what the balancer adds to a round.

    python -m tools.bench.cluster [--n 2,3,4,6,8,10] [--window-s 20] [--warmup-s 5] [--class 8]
                                  [--overhead-s 20] [--block-s 5] [--pair smollm2-q4_1] [--out docs/cluster]

1. Capacity. For 1 and then 2 replicas, one run: a fleet (server_bridge/ops/fleet.py: N
   server-bridge replicas, one engine thread each, each pinned to a core of its own,
   behind HAProxy with deploy/haproxy/haproxy.cfg) and, at each N of the grid, N
   replayed robots (tools/bench/loadgen.py's, each with its own X-Robot-Id, which HAProxy
   hashes) against the balancer's URL, all of one SLO class (--class, the tightest:
   8 tok/s). A point passes when at most 5 % of the generations opened in its window
   violate the class (loadgen's rules); capacity is the largest N with every N up to
   it passing. A replica count's grid stops after two failing points in a row. Per
   point: how many connections each replica took (HAProxy's stot over the point) and
   held mid-window (its /healthz), and whether every generation was the target's
   greedy continuation (loadgen's exactness, near-ties told apart).
2. Overhead. With the 1-replica fleet up, one robot, --overhead-s per path in blocks
   of --block-s, direct to the replica's port and through HAProxy in ABBA order
   (direct, lb, lb, direct, ...) so a slow drift of the machine hits both paths alike:
   the median and p99 round latency of each and their differences.

Cores: this process (the robots) is pinned to the first core, HAProxy inherits it;
replicas go on the cores after it while there are enough, else round-robin from the
first. On a 2-core machine: 1 replica on core 1; 2 replicas on cores 0 and 1, r0
sharing core 0 with the robots and HAProxy (both light, but not free).

Writes bench_cluster.json (config with the git commit, every point, capacities,
overhead), bench_cluster.md and bench_cluster.png into --out, printing a line per
point and per overhead block as it completes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

from runtime import settings
from server_bridge.ops.fleet import Cluster, health
from server_bridge.ops.loadtest import MAX_VIOLATION, LoadConfig, Trace, capacity, run_robots, summarize
from tools.bench import harness
from tools.bench.loadgen import TARGET, TRACES, _cap, _exactness, near_ties

PAIR = "smollm2-q4_1"
REPLICA_COUNTS = (1, 2)
AIM = 1.8  # 2 replicas should carry at least this many times 1 replica's robots
STOP_AFTER_FAILS = 2  # consecutive failing points that end a replica count's grid


# --------------------------------------------------------------------------- cores


def layout(replicas: int, cores: list[int]) -> tuple[set[int], list[set[int]], bool]:
    """(this process's cores, each replica's, whether the robots share a core with a replica).

    The robots (and HAProxy, which inherits this process's affinity) take the first core;
    replicas the ones after it while there are enough, else cores[i mod len] from the first.
    """
    client = {cores[0]}
    if len(cores) > replicas:
        per_replica = [{cores[1 + i]} for i in range(replicas)]
    else:
        per_replica = [{cores[i % len(cores)]} for i in range(replicas)]
    return client, per_replica, any(client & c for c in per_replica)


# --------------------------------------------------------------------------- one point


def _connections(port: int) -> int | None:
    """A replica's open websocket connections, from its /healthz; None when it does not answer."""
    try:
        return health(port)[1].get("connections")
    except (OSError, ValueError):
        return None


async def _observed(cluster: Cluster, trace: Trace, n: int, cfg: LoadConfig):
    """loadgen's robots against the balancer, and each replica's /healthz connections read mid-window."""

    async def mid_window() -> dict[str, int | None]:
        await asyncio.sleep(cfg.warmup_s + cfg.window_s / 2)
        return {r.name: await asyncio.to_thread(_connections, r.port) for r in cluster.replicas}

    return await asyncio.gather(run_robots(cluster.url, trace, n, cfg), mid_window())


def _stot(cluster: Cluster) -> dict[str, int]:
    """HAProxy's total connections so far per replica."""
    return {name: s["stot"] for name, s in cluster.lb_stats().items()}


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far, from /proc/PID/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cpu_all(cluster: Cluster) -> dict[str, float]:
    return {
        "robots": _cpu_s(os.getpid()),
        "haproxy": _cpu_s(cluster.lb.pid),
        **{r.name: _cpu_s(r.proc.pid) for r in cluster.replicas},
    }


def run_point(cluster: Cluster, trace: Trace, n: int, cfg: LoadConfig) -> dict:
    """N robots through the balancer: loadgen's summary, the spread over replicas, exactness, and the share of
    a core each process used over the point (robots: this process; the robots' and HAProxy's share of core 0
    is what r0 loses in the 2-replica run)."""
    before, cpu0, t0 = _stot(cluster), _cpu_all(cluster), time.monotonic()
    out, held = asyncio.run(_observed(cluster, trace, n, cfg))
    after, cpu1, wall = _stot(cluster), _cpu_all(cluster), time.monotonic() - t0
    point = {
        "replicas": len(cluster.replicas),
        "n": n,
        **summarize(out, trace, cfg.classes),
        "spread": {name: total - before.get(name, 0) for name, total in after.items()},
        "connections_mid_window": held,
        "core_share": {k: round((cpu1[k] - cpu0[k]) / wall, 3) for k in cpu0},
    }
    near_ties(point, out.generations, trace)  # a divergence: a near-tie of batched rounding, or not exact
    if out.errors:
        point["replica_log_tails"] = {r.name: r.log_tail(8) for r in cluster.replicas}
    point["generation_records"] = [r for r in point["generation_records"] if r["in_sample"] or "divergence" in r]
    return point


def describe(p: dict) -> str:
    """One progress line for a point."""
    lat = "-" if p["round_ms_mean"] is None else f"{p['round_ms_mean']:.0f}/{p['round_ms_p95']:.0f}"
    spread = " ".join(f"{k}:{v}" for k, v in p["spread"].items())
    errors = f"  errors {len(p['errors'])}" if p["errors"] else ""
    return (
        f"[{p['replicas']} replica(s)] N={p['n']:<3} violations {_pct(p['violation_rate'])} of {p['decided']}  "
        f"goodput {p['goodput_tokens_per_s']:5.1f} tok/s  round ms mean/p95 {lat}  shed {p['sheds']}  "
        f"connections {spread}  exact {_exactness(p)}  {'pass' if p['passes'] else 'FAIL'}{errors}"
    )


# --------------------------------------------------------------------------- the grid and capacity


def should_stop(passes: list[bool], after: int = STOP_AFTER_FAILS) -> bool:
    """Whether the last `after` points all failed: larger N will not pass either."""
    return len(passes) >= after and not any(passes[-after:])


def grid(cluster: Cluster, trace: Trace, ns: list[int], cfg: LoadConfig) -> list[dict]:
    """Points in increasing N until the grid ends or two in a row fail."""
    points = []
    for n in sorted(ns):
        points.append(run_point(cluster, trace, n, cfg))
        print(describe(points[-1]), flush=True)
        if should_stop([p["passes"] for p in points]):
            break
    return points


def fleet_capacity(points: list[dict]) -> dict:
    """loadgen's capacity over one replica count's points: the largest N with every N up to it passing."""
    cap, lower_bound = capacity({p["n"]: p["passes"] for p in points})
    return {"capacity": cap, "lower_bound": lower_bound, "ns_run": [p["n"] for p in points]}


def capacity_ratio(one: dict, two: dict, aim: float = AIM) -> dict:
    """2 replicas' capacity / 1 replica's, with what the grid's edge leaves open.

    bound: "" exact on the grid; ">=" when only 2 replicas passed their whole grid (the ratio
    is at least this); "<=" when only 1 replica did; "?" when both did. meets_aim: True or
    False where the bound settles it, else None.
    """
    c1, c2 = one["capacity"], two["capacity"]
    if not c1 or c2 is None:
        return {"ratio": None, "bound": "?", "meets_aim": None, "aim": aim}
    bound = {(False, False): "", (False, True): ">=", (True, False): "<=", (True, True): "?"}[
        (one["lower_bound"], two["lower_bound"])
    ]
    ratio = c2 / c1
    meets = True if ratio >= aim and bound in ("", ">=") else False if ratio < aim and bound in ("", "<=") else None
    return {"ratio": ratio, "bound": bound, "meets_aim": meets, "aim": aim}


# --------------------------------------------------------------------------- HAProxy's overhead


def block_order(total_s: float, block_s: float) -> list[str]:
    """Paths of the overhead's blocks, ABBA: direct, lb, lb, direct, ... as many of each as total_s / block_s."""
    per_path = max(1, round(total_s / block_s))
    return ["lb" if i % 4 in (1, 2) else "direct" for i in range(2 * per_path)]


def overhead_stats(direct: list[float], lb: list[float], boots: int = 2000, seed: int = 0) -> dict:
    """Median, p99 and mean round ms per path; lb minus direct of each, and a bootstrap 95 % CI of the medians'.

    The two samples are independent rounds (not pairs), so the differences are of quantiles.
    """
    d, b = np.asarray(direct, float), np.asarray(lb, float)
    if not d.size or not b.size:
        return {"direct": None, "lb": None, "added": None}
    stats = lambda a: {
        "rounds": int(a.size),
        "median": float(np.median(a)),
        "p99": float(np.percentile(a, 99)),
        "mean": float(a.mean()),
    }
    rng = np.random.default_rng(seed)
    diffs = np.median(rng.choice(b, (boots, b.size)), axis=1) - np.median(rng.choice(d, (boots, d.size)), axis=1)
    sd, sb = stats(d), stats(b)
    return {
        "direct": sd,
        "lb": sb,
        "added": {
            "median": sb["median"] - sd["median"],
            "p99": sb["p99"] - sd["p99"],
            "mean": sb["mean"] - sd["mean"],
            "median_ci95": [float(np.percentile(diffs, 2.5)), float(np.percentile(diffs, 97.5))],
        },
    }


def group_differences(blocks: list[dict]) -> list[float]:
    """Per ABBA group of four blocks (a shorter last one as it is): the mean of its lb blocks' median round ms
    minus its direct ones'. Drift between blocks shows here, which the pooled rounds' CI cannot see."""
    out = []
    for i in range(0, len(blocks), 4):
        med = {
            k: [b["median"] for b in blocks[i : i + 4] if b["path"] == k and b["median"] is not None]
            for k in ("direct", "lb")
        }
        if med["direct"] and med["lb"]:
            out.append(float(np.mean(med["lb"]) - np.mean(med["direct"])))
    return out


def measure_overhead(cluster: Cluster, trace: Trace, cfg: LoadConfig, total_s: float, block_s: float) -> dict:
    """One robot, blocks alternating between the replica's own port and the balancer; every round's latency."""
    urls = {"direct": f"ws://127.0.0.1:{cluster.replicas[0].port}", "lb": cluster.url}
    block_cfg = replace(cfg, warmup_s=1.0, window_s=block_s)  # 1 s: connect and open before rounds count
    rounds: dict[str, list[float]] = {"direct": [], "lb": []}
    errors, blocks = [], []
    order = block_order(total_s, block_s)
    for i, path in enumerate(order):
        out = asyncio.run(run_robots(urls[path], trace, 1, block_cfg))
        start, stop = out.window
        ms = [lat for t, lat, _ in out.rounds if start <= t <= stop]
        rounds[path] += ms
        errors += out.errors
        blocks.append({"path": path, "rounds": len(ms), "median": float(np.median(ms)) if ms else None})
        print(
            f"[overhead {i + 1}/{len(order)}] {path:<6} {len(ms)} rounds, median "
            f"{_num(float(np.median(ms)) if ms else None, '.1f')} ms",
            flush=True,
        )
    return {
        "blocks": blocks,
        "block_s": block_s,
        "errors": errors,
        **overhead_stats(rounds["direct"], rounds["lb"]),
        "added_median_by_group": group_differences(blocks),
        "round_ms": {k: [round(v, 3) for v in vs] for k, vs in rounds.items()},
    }


# --------------------------------------------------------------------------- the run


def git_commit() -> dict:
    """HEAD and whether tracked files differ from it (read-only git)."""

    def git(*a):
        return subprocess.run(["git", *a], capture_output=True, text=True, cwd=Path(__file__).resolve().parent)

    head = git("rev-parse", "HEAD")
    return {
        "commit": head.stdout.strip() or None,
        "dirty": bool(head.returncode == 0 and git("diff-index", "--quiet", "HEAD", "--").returncode),
    }


def run_fleet(replicas: int, cores: list[int], trace: Trace, cfg: LoadConfig, args) -> dict:
    """One replica count: pin, start the fleet, the grid (and with 1 replica the overhead), stop it."""
    client, per_replica, shared = layout(replicas, cores)
    os.sched_setaffinity(0, client)  # before the fleet starts: HAProxy inherits it
    run = {
        "replicas": replicas,
        "client_cpus": sorted(client),
        "replica_cpus": [sorted(c) for c in per_replica],
        "robots_share_a_replica_core": shared,
    }
    print(
        f"bench_cluster: {replicas} replica(s) on cores {run['replica_cpus']}, robots and HAProxy on "
        f"{sorted(client)}{' (shared with r0)' if shared else ''}",
        flush=True,
    )
    with Cluster(replicas, target=args.target, threads=1, cpus=per_replica, haproxy=args.haproxy) as cluster:
        run["haproxy"] = cluster.haproxy
        run["points"] = grid(cluster, trace, args.n, cfg)
        if replicas == 1 and args.overhead_s > 0:
            run["overhead"] = measure_overhead(cluster, trace, cfg, args.overhead_s, args.block_s)
    run.update(fleet_capacity(run["points"]))
    return run


def bench(args, cfg: LoadConfig, argv: list[str]) -> dict:
    trace = Trace.load(Path(args.traces) / f"{args.pair}__{args.target}.json")
    cores = sorted(os.sched_getaffinity(0))
    config = {
        **asdict(cfg),
        "ns": sorted(args.n),
        "pair": args.pair,
        "target": args.target,
        "server_threads": 1,
        "overhead_s": args.overhead_s,
        "block_s": args.block_s,
        "max_violation": MAX_VIOLATION,
        "stop_after_fails": STOP_AFTER_FAILS,
        "cores": cores,
        "cpu_count": os.cpu_count(),
        **git_commit(),
        "command": "python -m tools.bench.cluster " + shlex.join(argv),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    every_cpu = os.sched_getaffinity(0)
    runs = {}
    try:
        for replicas in REPLICA_COUNTS:
            runs[str(replicas)] = run_fleet(replicas, cores, trace, cfg, args)
    finally:
        os.sched_setaffinity(0, every_cpu)
    config["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    overhead = runs["1"].pop("overhead", None)
    return {"config": config, "runs": runs, "ratio": capacity_ratio(runs["1"], runs["2"]), "overhead": overhead}


# --------------------------------------------------------------------------- reports


def _pct(r: float | None) -> str:
    return "-" if r is None else f"{100 * r:.1f} %"


def _num(v: float | None, f: str) -> str:
    return "-" if v is None else format(v, f)


def _nan(v: float | None) -> float:
    return math.nan if v is None else v


def _spread(d: dict) -> str:
    return " / ".join(f"{k} {'-' if v is None else v}" for k, v in d.items()) or "-"


def _errors(p: dict) -> str:
    return f" ({len(p['errors'])} errors)" if p["errors"] else ""


def _shares(p: dict) -> str:
    share = p.get("core_share")
    if not share:
        return "-"
    replicas = " ".join(f"{k} {v:.2f}" for k, v in share.items() if k not in ("robots", "haproxy"))
    return f"{share['robots']:.2f} / {share['haproxy']:.2f} / {replicas}"


def _point_table(run: dict) -> list[str]:
    rows = [
        "| N | violations | decided | goodput tok/s | round ms mean | p95 | shed | connections per replica "
        "(point) | held mid-window | core share: robots / HAProxy / replicas | exact | passes |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in run["points"]:
        rows.append(
            f"| {p['n']} | {_pct(p['violation_rate'])} | {p['decided']} | {p['goodput_tokens_per_s']:.1f} | "
            f"{_num(p['round_ms_mean'], '.0f')} | {_num(p['round_ms_p95'], '.0f')} | {p['sheds']} | "
            f"{_spread(p['spread'])} | {_spread(p['connections_mid_window'])} | {_shares(p)} | "
            f"{_exactness(p)} | "
            f"{'yes' if p['passes'] else '**no**'}{_errors(p)} |"
        )
    return rows


def _overhead_table(o: dict | None) -> list[str]:
    if not o or not o.get("added"):
        return ["Not measured."]
    a, ci = o["added"], o["added"]["median_ci95"]
    return [
        f"One robot, {len(o['blocks']) // 2} blocks of {o['block_s']:g} s per path in ABBA order "
        "(direct, HAProxy, HAProxy, direct, ...); a round: the verify sent -> its result received.\n",
        "| path | rounds | median ms | p99 ms | mean ms |",
        "|---|---|---|---|---|",
        *(
            f"| {name} | {o[k]['rounds']} | {o[k]['median']:.1f} | {o[k]['p99']:.1f} | {o[k]['mean']:.1f} |"
            for k, name in (("direct", "direct to the replica"), ("lb", "through HAProxy"))
        ),
        f"| **added by HAProxy** | | **{a['median']:+.2f}** (95 % CI {ci[0]:+.2f} .. {ci[1]:+.2f}) | "
        f"**{a['p99']:+.2f}** | {a['mean']:+.2f} |",
        "",
        "Per ABBA group (its HAProxy blocks' median round ms minus its direct blocks'): "
        + (", ".join(f"{d:+.2f}" for d in o.get("added_median_by_group", [])) or "-")
        + " ms. The CI resamples rounds as if independent and does not see drift between blocks; the groups "
        "do: an added median within their spread is below what this machine resolves. p99 of a few hundred "
        "rounds rests on the slowest few: read it as indicative."
        + (f" Errors: {o['errors'][:3]}" if o["errors"] else ""),
    ]


def render_markdown(result: dict) -> str:
    cfg, runs, r = result["config"], result["runs"], result["ratio"]
    cls = cfg["classes"][0]
    out = [
        "# Fleet capacity through HAProxy: 1 vs 2 replicas\n",
        f"`{cfg['command']}` at commit {cfg.get('commit') or '?'}"
        f"{' (working tree differs)' if cfg.get('dirty') else ''}, "
        f"{cfg['started']} to {cfg.get('finished', '?')}.\n",
        f"Robots replay {cfg['pair']} -> {cfg['target']} traces at T = 0 (gamma {cfg['gamma']}, "
        f"{cfg['draft_ms']} ms drafting per token emulated, {cfg['tokens']} tokens a generation), all of the "
        f"tightest SLO class, {cls} tok/s, each with its own X-Robot-Id, through HAProxy "
        f"(deploy/haproxy/haproxy.cfg: consistent hash on X-Robot-Id, bounded loads). Window "
        f"{cfg['window_s']:g} s after {cfg['warmup_s']:g} s warm-up. A point passes when <= "
        f"{100 * cfg['max_violation']:.0f} % of the generations opened in its window miss {cls} tok/s (or are "
        f"shed); capacity: the largest N of the grid with every N up to it passing. A replica count's grid "
        f"stops after {cfg['stop_after_fails']} failing points in a row.\n",
        f"**Machine:** {cfg['cpu_count']} cores; each replica one engine thread pinned to one core. "
        + "; ".join(
            f"{k} replica(s) on cores {v['replica_cpus']}, robots and HAProxy on {v['client_cpus']}"
            + (" (**sharing r0's core**)" if v["robots_share_a_replica_core"] else "")
            for k, v in runs.items()
        )
        + ". 'Core share' is each process's CPU time over the point's wall time (1.00 = a whole core): "
        "the robots (this process) and HAProxy beside each replica, i.e. what they take of r0's core in "
        "the 2-replica run.\n",
    ]
    for k, run in runs.items():
        out += [f"## {k} replica(s)\n", *_point_table(run), ""]
    ns = cfg["ns"]
    ratio = (
        "-"
        if r["ratio"] is None
        else f"unknown (both grids passed to their end: {r['ratio']:.2f} of lower bounds)"
        if r["bound"] == "?"
        else f"{r['bound'] + ' ' if r['bound'] else ''}{r['ratio']:.2f}"
    )
    verdict = {True: "met", False: "**not met**", None: "not settled by this grid"}[r["meets_aim"]]
    out += [
        "## Capacity\n",
        f"| replicas | capacity (robots at {cls} tok/s) | N run |",
        "|---|---|---|",
        *(f"| {k} | {_cap(v['capacity'], v['lower_bound'], ns)} | {v['ns_run']} |" for k, v in runs.items()),
        "",
        f"Ratio 2 / 1 replicas: **{ratio}** (aim >= {r['aim']}: {verdict}). Capacities are points of the grid "
        f"{ns}, so the ratio moves in the grid's steps.\n",
        "## What HAProxy adds per round\n",
        *_overhead_table(result["overhead"]),
        "",
    ]
    return "\n".join(out) + "\n"


def plot(result: dict, path: Path) -> None:
    """Left: violation rate vs N per replica count with the 5 % line; right: round ms direct vs through HAProxy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = result["config"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for k, run in result["runs"].items():
        left.plot(
            [p["n"] for p in run["points"]],
            [_nan(p["violation_rate"]) for p in run["points"]],
            marker="o",
            label=f"{k} replica(s): capacity {_cap(run['capacity'], run['lower_bound'], cfg['ns'])}",
        )
    left.axhline(cfg["max_violation"], color="grey", linestyle=":", linewidth=0.8, label="5 % bound")
    left.set(
        xlabel="robots (N)",
        ylabel="SLO violation rate",
        ylim=(-0.02, 1.02),
        xticks=cfg["ns"],
        title=f"all robots at {cfg['classes'][0]} tok/s, through HAProxy",
    )
    o = result["overhead"]
    if o and o.get("added"):
        right.boxplot([o["round_ms"]["direct"], o["round_ms"]["lb"]], whis=(1, 99), showfliers=True)
        right.set_xticks([1, 2], ["direct", "through HAProxy"])
        right.set(
            ylabel="round latency ms (whiskers: p1-p99)",
            title=f"1 robot, 1 replica: HAProxy adds\n{o['added']['median']:+.2f} ms median, "
            f"{o['added']['p99']:+.2f} ms p99",
        )
    else:
        right.text(0.5, 0.5, "overhead not measured", ha="center", va="center", transform=right.transAxes)
    for ax in (left, right):
        ax.grid(alpha=0.3)
    left.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------- CLI


def _number(s: str) -> int | float:
    return int(s) if float(s).is_integer() else float(s)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=harness.ints, default=[2, 3, 4, 6, 8, 10], help="robot counts")
    settings.add_flags(ap, LoadConfig, only=("gamma", "draft_ms", "tokens", "warmup_s", "window_s", "seed"))
    ap.add_argument("--class", dest="slo_class", type=_number, default=8, help="every robot's SLO, tokens/s")
    ap.add_argument("--overhead-s", type=float, default=20.0, help="round latencies per path (0: skip)")
    ap.add_argument("--block-s", type=float, default=5.0, help="overhead: one path's block before switching")
    ap.add_argument("--pair", default=PAIR, help="the draft whose trace the robots replay")
    ap.add_argument("--target", default=TARGET)
    ap.add_argument("--traces", default=str(TRACES), help="folder of <draft>__<target>.json")
    ap.add_argument("--haproxy", help="the haproxy binary (default: server-bridge fleet's choice)")
    ap.add_argument("--out", default="docs/cluster")
    args = ap.parse_args(argv)
    try:
        cfg = LoadConfig(classes=(args.slo_class,), **settings.given(LoadConfig, args))
    except ValueError as e:
        ap.error(str(e))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = bench(args, cfg, argv)
    (out / "bench_cluster.json").write_text(json.dumps(result, indent=1))
    md = render_markdown(result)
    (out / "bench_cluster.md").write_text(md)
    plot(result, out / "bench_cluster.png")
    print("\n" + md)
    print(f"wrote {out / 'bench_cluster.json'}, {out / 'bench_cluster.md'}, {out / 'bench_cluster.png'}")
    points = [p for run in result["runs"].values() for p in run["points"]]
    bad = [p for p in points if not (p["exact"] or p.get("exact_up_to_near_ties")) or p["errors"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
