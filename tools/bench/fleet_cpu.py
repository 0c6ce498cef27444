"""The server's own work per robot-round, before and after issue 51: fleets of 32 to 1,024 robots on this machine.

    python -m tools.bench.fleet_cpu [--sizes 32,128,512,1024] [--before DIR | --before-commit e73bce7]
                                    [--after DIR] [--warmup-s 3] [--window-s 8] [--repeats 2]
                                    [--out docs/benchmarks/fleet_cpu]

Two servers, each `server-bridge serve` run by this interpreter from its own source tree (before: --before, or
--before-commit exported by `git archive`; after: --after, default this checkout), a fresh one a point, pinned to
--server-core: the tiny random target (tools/models/random_target.py), llamacpp, one thread, max_batch 256, the SLO
scheduler with an estimator fitted here first (`server-bridge profile --shapes fleet`, one file for both). The robots:
server-bridge loadtest's run_fleet (--robots-per-proc a process, one window) on --robots-core, replaying the Q4_1
draft's trace moved onto the target's planted path (tools/bench/gpu_fleet.py replay_trace: the server accepts what the
recorded pair accepted, and `exact` checks every verdict); 8 tok/s, 25 ms drafting a token, gamma 4, 48 tokens.

Per point, over the window (server_bridge/ops/loadtest.py server_spend):
  CPU per robot-round   the server process's CPU over the window (utime + stime from /proc/PID/stat, for both trees
                        alike) / bridge_rounds_total; the engine's share: bridge_engine_cpu_seconds_total (the model
                        thread's CPU in the passes) where the server has it, else bridge_batch_verify_seconds_total
                        (the passes' wall time: the same with one engine thread alone on its core); host = the rest.
  engine busy           the passes' wall time / the window.
  rounds/s, tokens/s    robot-rounds the server verified a second; each robot's tokens / wall time (mean, slowest).
  sheds, evictions      `overloaded` errors the server sent; sessions evicted (llama.cpp holds 256 sequences: past
                        that, opens evict idle sessions and their robots re-open).
  held                  the fleet held 8 tok/s: <= 5 % of its window's generations slower or shed (loadtest's rule).
The decision time is not on /metrics (tools/bench/sched_decision.py measures it). No FSD: the replayed robots speak
SD only, and the random target has no trained exits. The sizes alternate which server goes first, and --repeats
runs every point again, so the machine's noise falls on both.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from server_bridge.ops import loadtest
from server_bridge.ops.fleet import LocalVerifier
from server_bridge.ops.loadtest import Trace
from tools.bench import gpu_fleet, harness
from tools.models import random_target

ROOT = Path(__file__).resolve().parents[2]
BEFORE = "e73bce7"  # issue 51 filed: the server before its work
TARGET_MS = 0.3  # issue 51: the server's CPU per robot-round at 128 and 512 robots
SLO = 8.0  # tokens/s, every robot
SPENT = ("cpu_ms_per_round", "host_ms_per_round", "engine_ms_per_round", "pass_ms_per_round", "engine_busy")
SPENT += ("rounds_per_s", "batch_mean", "host_wall_ms_per_round", "counter_ms_per_round", "model_thread_ms_per_round")
SPENT += ("sheds", "evicted", "process_cpu_share", "late_s", "measured")  # loadtest.server_spend's


# --------------------------------------------------------------------------- the two servers


def source_tree(path: str, commit: str, say) -> Path:
    """The before server's tree: `path`, or `commit` exported once (git archive) into the temp folder."""
    dest = Path(path or Path(tempfile.gettempdir()) / f"fleet_cpu-{commit}").resolve()
    if not path and not (dest / "server_bridge" / "cli.py").exists():
        say(f"exporting {commit} to {dest}")
        dest.mkdir(parents=True, exist_ok=True)
        subprocess.run(f"git -C {ROOT} archive {commit} | tar -x -C {dest}", shell=True, check=True)
    return dest


def tree_commit(tree: Path) -> str:
    """The tree's commit, + if its tracked files differ from it; for an export, the commit it was exported from."""
    git = lambda *a: subprocess.run(["git", "-C", str(tree), *a], capture_output=True, text=True)  # noqa: E731
    head = git("rev-parse", "--short", "HEAD")
    dirty = "+" if git("diff", "--quiet", "HEAD").returncode else ""
    return head.stdout.strip() + dirty if head.returncode == 0 else tree.name.removeprefix("fleet_cpu-")


# --------------------------------------------------------------------------- one point


def point(name: str, tree: Path, n: int, run: int, ctx: dict, say) -> dict:
    """A fresh server from `tree`, n robots against it over one window: what the server spent, what the robots got."""
    cfg, args = ctx["fleet"], ctx["args"]
    toml = Path(ctx["out"]) / f"server-{n}.toml"
    toml.write_text(gpu_fleet.server_toml(cfg, ctx["target"], "llamacpp", n + 8, ctx["context"], ctx["estimator"]))
    toml.write_text(toml.read_text() + f'kv_unified = "{args.kv_unified}"\n')
    lcfg = ctx["load"]
    procs = -(-n // args.robots_per_proc)
    srv = LocalVerifier(cpus={args.server_core}, extra_args=["--config", str(toml)], start_timeout_s=120, source=tree)
    with srv:
        t0 = time.monotonic()
        read = loadtest.server_reader(srv.port, srv.proc.pid if srv.proc else 0, timeout_s=60.0)
        out = loadtest.run_fleet(srv.url, ctx["trace"], n, lcfg, procs, read=read)
        wall = time.monotonic() - t0
    srv.log_path.unlink(missing_ok=True)
    s = loadtest.summarize(out, ctx["trace"], lcfg.classes)
    s.pop("generation_records")
    spend = loadtest.server_spend(out.metrics)
    row = {"server": name, "n": n, "run": run, "procs": procs, **{k: spend.get(k) for k in SPENT}}
    row |= {
        **loadtest.robot_speeds(out),
        **{k: s[k] for k in ("violation_rate", "tokens_per_round", "round_ms_mean", "exact")},
        "held": s["passes"],
        "robot_rounds": s["rounds"],
        "robot_sheds": s["sheds"],
        "errors": len(s["errors"]),
        "error_samples": s["errors"][:3],
        "client_cpu": round(out.client_cpu_s / max(wall, 1e-9), 3),
        "wall_s": round(wall, 1),
        "load": round(os.getloadavg()[0], 1),  # the machine's (1 min): other work on its cores
    }
    say("  " + describe(row))
    return row


def describe(r: dict) -> str:
    num = lambda v, f=".2f": "-" if v is None else format(v, f)  # noqa: E731
    return (
        f"{r['server']:<6} N={r['n']:<5} CPU/robot-round {num(r['cpu_ms_per_round'])} ms (host "
        f"{num(r['host_ms_per_round'])}, engine {num(r['engine_ms_per_round'])})  engine busy "
        f"{num(r['engine_busy'] and 100 * r['engine_busy'], '.0f')} %  {num(r['rounds_per_s'], '.0f')} rounds/s  "
        f"tok/s mean/min {num(r['speed_mean'], '.1f')}/{num(r['speed_min'], '.1f')}  sheds {r['sheds']}  "
        f"evicted {r['evicted']}  held {'yes' if r['held'] else 'no'}  exact {r['exact']}  robots' CPU "
        f"{r['client_cpu']:.2f} in {r['procs']} proc(s)" + (f"  errors {r['errors']}" if r["errors"] else "")
    )


# --------------------------------------------------------------------------- the run


def prepare(args: argparse.Namespace, out: Path, say) -> dict:
    """The target, the replayed trace, the server's config and the estimator both servers load."""
    given = {k: getattr(args, k) for k in ("gamma", "draft_ms", "tokens", "warmup_s", "window_s", "max_batch")}
    estimator = "profile" if args.fit else ""
    cfg = gpu_fleet.FleetConfig(tiny=True, device="cpu", dtype="f32", classes=(SLO,), estimator=estimator, **given)
    target = random_target.make(random_target.TINY, "f32", 0, log=say)
    recorded = Trace.load(gpu_fleet.TRACES / f"{cfg.pair}__smollm2-f32.json")
    successor = random_target.planted_successor(random_target.token_types(), 0)
    trace = gpu_fleet.replay_trace(recorded, successor, target.gguf.name)
    if args.save_trace:
        trace.save(args.save_trace)
    cpus = {"server": {args.server_core}}
    estimator, fitted = gpu_fleet.fit_estimator(cfg, target, "llamacpp", trace, out, cpus, say)
    load = dataclasses.replace(cfg.load_config((SLO,)), recv_timeout_s=args.recv_timeout_s)
    context, tau = gpu_fleet.context_tokens(trace, cfg), gpu_fleet.planned_tau(trace, cfg.gamma, cfg.tokens)
    return dict(args=args, out=out, fleet=cfg, target=target, trace=trace, context=context, tau=tau, load=load) | {
        "estimator": estimator,
        "fitted": fitted,
    }


def summary(points: list[dict], servers: list[str]) -> list[dict]:
    """A row per fleet size: each server's figures, the mean over its runs (and the runs' range of the host part)."""
    keys = SPENT[:2] + ("engine_ms_per_round", "engine_busy", "rounds_per_s", "host_wall_ms_per_round", "sheds")
    keys += ("speed_mean", "speed_min", "evicted")
    rows = []
    for n in sorted({p["n"] for p in points}):
        row: dict = {"n": n}
        for name in servers:
            runs = [p for p in points if p["n"] == n and p["server"] == name]
            if not runs:
                continue
            got = {k: statistics.mean(v) if (v := [p[k] for p in runs if p[k] is not None]) else None for k in keys}
            hosts = [p["host_ms_per_round"] for p in runs if p["host_ms_per_round"] is not None]
            got["host_range"], got["runs"] = ((min(hosts), max(hosts)) if hosts else None), (len(hosts), len(runs))
            got["held"] = all(p["held"] for p in runs)
            row[name] = got
        for key in ("host", "cpu"):
            got = [row[k][f"{key}_ms_per_round"] for k in ("before", "after") if k in row]
            row[f"{key}_ratio"] = got[0] / got[1] if len(got) == 2 and all(got) else None
        rows.append(row)
    return rows


def held_at(points: list[dict], name: str) -> dict:
    """loadtest.capacity over the sizes tried: the largest fleet that held 8 tok/s in every run, and every smaller."""
    by_n: dict[int, bool] = {}
    for p in points:
        if p["server"] == name:
            by_n[p["n"]] = by_n.get(p["n"], True) and bool(p["held"])
    cap, every = loadtest.capacity(dict(by_n))
    return {"capacity": cap, "lower_bound": every, "tried": sorted(by_n)}


def measure(args: argparse.Namespace) -> dict:
    if args.quick:  # one small fleet in two processes, the after server only, no estimator fit
        args.sizes, args.repeats, args.servers, args.fit = [4], 1, ["after"], False
        args.warmup_s, args.window_s, args.tokens, args.robots_per_proc = 0.5, 1.5, 16, 2
    out = Path(args.out).resolve()  # the servers run from other folders
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()

    def say(msg: str) -> None:
        el = int(time.monotonic() - t_start)
        print(f"[{el // 60:02d}:{el % 60:02d}] {msg}", flush=True)

    trees = {"after": Path(args.after).resolve()}
    if "before" in args.servers:
        trees = {"before": source_tree(args.before, args.before_commit, say), **trees}
    servers = [s for s in ("before", "after") if s in args.servers]
    every_cpu = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {args.robots_core})  # the robots' processes inherit it
    try:
        ctx = prepare(args, out, say)
        say(f"trees: {', '.join(f'{k} {trees[k]} ({tree_commit(trees[k])})' for k in servers)}")
        say(f"robots replay {ctx['fleet'].pair}: {ctx['tau']:.2f} tokens a round planned at gamma {args.gamma}")
        points = []
        for run in range(args.repeats):
            for i, n in enumerate(args.sizes):
                for name in servers if (i + run) % 2 == 0 else servers[::-1]:
                    points.append(point(name, trees[name], n, run, ctx, say))
    finally:
        os.sched_setaffinity(0, every_cpu)
    return {
        "trees": {k: {"path": str(trees[k]), "commit": tree_commit(trees[k])} for k in servers},
        "servers": servers,
        "target": ctx["target"].describe(),
        "estimator": ctx["fitted"]["coefficients"] if ctx["fitted"] else "defaults",
        "planned_tau": round(ctx["tau"], 3),
        "context_tokens": ctx["context"],
        "target_ms": TARGET_MS,
        "points": points,
        "summary": summary(points, servers),
        "held": {name: held_at(points, name) for name in servers},
        "exact": all(p["exact"] for p in points),
        "ok": all(p["cpu_ms_per_round"] is not None for p in points),  # robots' errors are measurements
        "wall_s": round(time.monotonic() - t_start, 1),
    }


# --------------------------------------------------------------------------- the report

POINT_COLS = [  # (key, header, format) of the table of every point
    *[("server", "", "{}"), ("n", "robots", "{}"), ("run", "", "{}"), ("host_ms_per_round", "host ms", "{:.2f}")],
    *[("host_wall_ms_per_round", "host ms by pass wall", "{:.2f}"), ("engine_ms_per_round", "engine ms", "{:.2f}")],
    *[("pass_ms_per_round", "pass wall ms", "{:.2f}"), ("model_thread_ms_per_round", "model thread ms", "{:.2f}")],
    ("cpu_ms_per_round", "total ms", "{:.2f}"),
    *[("counter_ms_per_round", "total ms (its counter)", "{:.2f}"), ("engine_busy", "engine busy", harness.pct)],
    *[("process_cpu_share", "server CPU", harness.pct), ("rounds_per_s", "rounds/s", "{:.0f}")],
    *[("batch_mean", "batch", "{:.1f}"), ("speed_mean", "tok/s mean", "{:.1f}"), ("speed_min", "min", "{:.1f}")],
    *[("violation_rate", "missed 8 tok/s", harness.pct), ("sheds", "sheds", "{}"), ("evicted", "evicted", "{}")],
    *[("client_cpu", "robots' CPU", "{:.2f}"), ("procs", "procs", "{}"), ("late_s", "pages late s", "{:.1f}")],
    ("errors", "robots' errors", "{}"),
    ("load", "load", "{}"),
]


def _cell(key: str, fmt: str):
    return lambda v: "–" if v.get(key) is None else format(v[key], fmt)


def _host(v: dict) -> str:
    (lo, hi), (measured, runs) = v["host_range"] or (0, 0), v["runs"]
    spread = f" ({lo:.2f}–{hi:.2f})" if hi - lo > 0.005 else f" ({measured} of {runs} runs)" if measured < runs else ""
    return "–" if v["host_ms_per_round"] is None else f"{v['host_ms_per_round']:.2f}{spread}"


def side_cols(result: dict) -> list[harness.Col]:
    cols = [harness.Col("n", "robots")]
    for name in result["servers"]:
        cols += [
            harness.Col(name, f"{name}: host ms", _host),
            harness.Col(name, "engine ms", _cell("engine_ms_per_round", ".2f")),
            harness.Col(name, "total ms", _cell("cpu_ms_per_round", ".2f")),
            harness.Col(
                name, "engine busy", lambda v: "–" if v["engine_busy"] is None else harness.pct(v["engine_busy"])
            ),
            harness.Col(name, "rounds/s", _cell("rounds_per_s", ".0f")),
            harness.Col(name, "tok/s mean/min", lambda v: f"{v['speed_mean'] or 0:.1f} / {v['speed_min'] or 0:.1f}"),
            harness.Col(name, "sheds", _cell("sheds", ".0f")),
            harness.Col(name, "8 tok/s held", lambda v: "yes" if v["held"] else "no"),
        ]
    if len(result["servers"]) == 2:
        cols += [
            harness.Col("host_ratio", "host: before / after", "{:.1f}x"),
            harness.Col("cpu_ratio", "total", "{:.1f}x"),
        ]
    return cols


def measured_by(result: dict) -> list[str]:
    lines = ["## How each figure was measured", ""]
    for name in result["servers"]:
        for way in sorted(
            {json.dumps(p["measured"]) for p in result["points"] if p["server"] == name and p["measured"]}
        ):
            m = json.loads(way)
            lines.append(
                f"- {name} ({result['trees'][name]['commit']}): process `{m['process']}`, engine `{m['engine']}`."
            )
    held = ", ".join(f"{k} {'>= ' if v['lower_bound'] else ''}{v['capacity']}" for k, v in result["held"].items())
    return lines + [
        "",
        "proc_cpu_seconds_total: utime + stime of /proc/PID/stat, the same for both. bridge_engine_cpu_seconds_total: "
        "the model thread's CPU inside the passes (the server's counter). The busiest thread but the main one: that "
        "thread's whole CPU (/proc/PID/task), the engine's and the host's work the model thread does around each pass, "
        "so the before server's host is a lower bound. host by pass wall (every point): total - the passes' wall time, "
        "too low wherever other work takes the server's core during a pass (server CPU under 100 %).",
        "",
        f"Largest fleet held at 8 tok/s (every run, and every smaller fleet): {held} robots.",
        "",
    ]


def intro(r: dict) -> str:
    c, trees = r["config"], ", ".join(f"{k} `{v['commit']}`" for k, v in r["trees"].items())
    return (
        f"`{r['command']}` ({r['machine']}, {r['started']}, {r['wall_s']:.0f} s). Tiny random target, llamacpp, 1 "
        f"thread, max_batch {c['max_batch']}, kv_unified {c['kv_unified']}, SLO scheduler, estimator "
        f"{json.dumps(r['estimator'])}; a fresh server a point on core {c['server_core']}, the robots on core "
        f"{c['robots_core']}: 8 tok/s, {c['draft_ms']} ms drafting a token, gamma {c['gamma']}, {c['tokens']} tokens a "
        f"generation ({r['planned_tau']} planned a round). Window {c['window_s']} s after {c['warmup_s']} s, "
        f"{c['repeats']} runs a point, the order alternating. Trees: {trees}. Columns: tools/bench/fleet_cpu.py."
    )


REPORT = harness.Report(
    "fleet_cpu",
    "# The server's CPU per robot-round, before and after issue 51",
    [
        harness.Table(
            "summary",
            side_cols,
            "## Side by side (mean of the runs with figures; host: their range, or how many had figures)",
            "ms: the server's CPU per robot-round (host: its own work; engine: the passes; total: both). Target: "
            "host <= {target_ms} ms at 128 and 512 robots. How each was measured: below.",
        ),
        harness.Table(
            "points",
            [harness.Col(k, h, f) for k, h, f in POINT_COLS]
            + [harness.Col("exact", fmt=lambda e: "yes" if e else "**no**")],
            "## Every point",
            "server CPU: the server process's CPU over the window / the window (it has one core). robots' CPU: "
            "the robots' processes' CPU over the point / its wall time (their core). evicted: llama.cpp holds 256 "
            "sequences; past that, opens evict idle sessions. pages late: how long after its edge of the window the "
            "later /metrics page came (a server whose event loop is blocked answers late; the figures are then over "
            "the span between the two answers). robots' errors: replies that never came (--recv-timeout-s) or "
            "connections refused. load: the machine's 1-minute load average after the point (2 cores).",
        ),
    ],
    [
        harness.Plot(
            "summary",
            x="n",
            ys=lambda r: (
                {f"{k}, host": f"{k}.host_ms_per_round" for k in r["servers"]}
                | {f"{k}, engine": f"{k}.engine_ms_per_round" for k in r["servers"]}
            ),
            xlabel="robots",
            ylabel="server CPU ms per robot-round",
            title="The server's CPU per robot-round",
            hline=TARGET_MS,
            xscale="log",
            yscale="log",
        ),
        harness.Plot(
            "summary",
            x="n",
            ys=lambda r: {k: f"{k}.rounds_per_s" for k in r["servers"]},
            xlabel="robots",
            ylabel="robot-rounds verified per second",
            title="Rounds per second",
            xscale="log",
        ),
    ],
    intro=intro,
    extra=measured_by,
)


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--sizes", type=harness.ints, default=[32, 128, 512, 1024], help="fleet sizes (robots)")
    ap.add_argument("--servers", type=harness.names, default=["before", "after"], help="before, after or both")
    ap.add_argument("--before", default="", help="the before server's tree ('' = --before-commit, exported)")
    ap.add_argument("--before-commit", default=BEFORE, help="the commit the before tree is exported from")
    ap.add_argument("--after", default=str(ROOT), help="the after server's tree (default: this checkout)")
    for flag, kind, default in [("--warmup-s", float, 3.0), ("--window-s", float, 8.0), ("--tokens", int, 48)]:
        ap.add_argument(flag, type=kind, default=default)
    for flag, kind, default in [("--draft-ms", float, 25.0), ("--gamma", int, 4), ("--max-batch", int, 256)]:
        ap.add_argument(flag, type=kind, default=default)
    ap.add_argument("--recv-timeout-s", type=float, default=15.0, help="a robot's wait for a reply")
    ap.add_argument("--robots-per-proc", type=int, default=256, help="robots a process (run_fleet)")
    ap.add_argument("--kv-unified", default="auto", choices=("auto", "on", "off"), help="the server's kv_unified")
    ap.add_argument("--server-core", type=int, default=0)
    ap.add_argument("--robots-core", type=int, default=1)
    ap.add_argument("--no-fit", dest="fit", action="store_false", help="the estimator's defaults, not fitted here")
    ap.add_argument(
        "--save-trace", default="", help="also write the replayed trace here (server-bridge loadtest --trace)"
    )


def main(argv: list[str] | None = None) -> int:
    return harness.main(
        __doc__, REPORT, measure, add_args, argv, out="bench_results/fleet_cpu", repeats=2, pin_cores=False
    )


if __name__ == "__main__":
    sys.exit(main())
