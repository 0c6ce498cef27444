"""A burst of robots starting at once against the default verifier: does every one finish, exact? (issue 51, item 4)

    python -m tools.bench.burst [--robots 8] [--gammas 2,3,4,5,6] [--max-tokens 32] [--repeats 1]
                                [--out docs/benchmarks/burst]

As a user would: `server-bridge serve` with its defaults on a free loopback port (the shipped target, smollm2-f32
on llama.cpp, every core), then --robots `edge-agent generate` processes started together, each with its
defaults (the shipped draft, SD) but its own gamma (cycling through --gammas) and prompt (tools/prompts/
bench.jsonl, cycling). Nothing is pinned: the robots' drafts and the server share the machine's cores, as they
did when 2 of 8 robots failed with `overloaded` on this 2-core machine. Each of --repeats bursts gets a fresh
server.

Per robot: whether it finished (exit 0), the sheds it retried (`overloaded`, backed off and re-opened:
agent/decoding/session.py; the `shed_retries` of its --json metrics, or its stderr's retry lines when it failed),
its tokens and wall time, and whether its token ids are its prompt's AR alone: `edge-agent generate --mode ar`
for that prompt, one robot at a time on the burst's server once the burst is over (the target's own greedy
output: tests/agent/decoding/test_end_to_end.py checks AR against the engine's greedy decoding). Exits 1 when a
robot failed or differed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from server_bridge.ops.fleet import ServerChild, free_port
from tools.bench import harness
from tools.bench.link import load_prompts

RETRY_LINE = re.compile(r"verifier overloaded .*; retry \d+/\d+")
SERVER_METRICS = {  # the server's /metrics read after the burst and after the AR references
    "sheds": "bridge_slo_shed_total",
    "passes": "bridge_batches_total",
    "pass_s": "bridge_batch_verify_seconds_total",
    "engine_cpu_s": "bridge_engine_cpu_seconds_total",
}


def server_counters(text: str) -> dict[str, float]:
    """SERVER_METRICS summed over their labels, from the Prometheus text."""
    out = {}
    for key, name in SERVER_METRICS.items():
        values = re.findall(rf"^{name}(?:\{{[^}}]*\}})? ([0-9.e+-]+)$", text, re.M)
        out[key] = sum(float(v) for v in values)
    return out


def phase(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """The server's passes between two reads: how many, their mean wall time, and the share of it the model
    thread had a core (its CPU time inside the passes over their wall time: near 1 when nothing else runs)."""
    d = {k: after[k] - before[k] for k in after}
    return {
        "passes": int(d["passes"]),
        "pass_ms": 1e3 * d["pass_s"] / d["passes"] if d["passes"] else None,
        "engine_cpu_share": d["engine_cpu_s"] / d["pass_s"] if d["pass_s"] else None,
        "sheds": int(d["sheds"]),
    }


def robot_command(url: str, prompt: dict, args: argparse.Namespace, mode: str = "sd", gamma: int = 4) -> list[str]:
    """`edge-agent generate` as a user types it: the defaults, a gamma, the prompt, --json for the ids."""
    cmd = [sys.executable, "-m", "agent.app.cli", "generate", "--verifier", url, "--mode", mode]
    cmd += ["--gamma", str(gamma), "--max-tokens", str(args.max_tokens), "--prompt", prompt["prompt"], "--json"]
    return cmd + (["--chat"] if prompt.get("chat") else [])


def last_json(stdout: str) -> dict | None:
    """The --json line: the last line of stdout that parses (the streamed text comes before it)."""
    for line in reversed(stdout.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None


def burst(url: str, prompts: list[dict], args: argparse.Namespace) -> list[dict]:
    """Start every robot at once, wait for all; a row per robot."""
    t0 = time.monotonic()
    procs = []
    for i, prompt in enumerate(prompts):
        gamma = args.gammas[i % len(args.gammas)]
        cmd = robot_command(url, prompt, args, gamma=gamma)
        procs.append((i, gamma, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
    rows = []
    for i, gamma, proc in procs:
        try:
            out, err = proc.communicate(timeout=max(1.0, args.timeout_s - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:  # counted as not finished
            proc.kill()
            out, err = proc.communicate()
            err += f"\nedge-agent: still running after {args.timeout_s:.0f} s (killed by the benchmark)"
        got = last_json(out) if proc.returncode == 0 else None
        metrics = (got or {}).get("metrics", {})
        errors = [line for line in err.splitlines() if line.startswith("edge-agent:")]
        rows.append(
            {
                "robot": i,
                "gamma": gamma,
                "finished": proc.returncode == 0 and got is not None,
                "rc": proc.returncode,
                "retries": metrics.get("shed_retries", len(RETRY_LINE.findall(err))),
                "tokens": len(got["token_ids"]) if got else None,
                "wall_s": metrics.get("wall_s"),
                "token_ids": got["token_ids"] if got else None,
                "error": errors[-1] if errors else "",
            }
        )
    return rows


def ar_alone(url: str, prompt: dict, args: argparse.Namespace) -> list[int] | None:
    """The prompt's AR ids, this robot alone on the server."""
    run = subprocess.run(robot_command(url, prompt, args, mode="ar"), capture_output=True, text=True)
    got = last_json(run.stdout) if run.returncode == 0 else None
    return got["token_ids"] if got else None


def one_burst(n: int, prompts: list[dict], args: argparse.Namespace) -> dict:
    log = Path(tempfile.mkstemp(prefix="burst-server-", suffix=".log")[1])
    server = ServerChild("burst", free_port(), [], None, log)  # `serve` with its defaults
    server.threads = os.environ.get("OMP_NUM_THREADS", str(os.cpu_count() or 1))  # as the user's shell has it
    server.start()
    try:
        server.wait_ready(300)
        print(f"burst {n}: {len(prompts)} robots against {server.url}", flush=True)
        start = server_counters(server.metrics())
        rows = burst(server.url, prompts, args)
        after_burst = server_counters(server.metrics())
        refs: dict[str, list[int] | None] = {}  # prompt -> its AR ids
        for row in rows:
            prompt = prompts[row["robot"]]
            if prompt["prompt"] not in refs:
                refs[prompt["prompt"]] = ar_alone(server.url, prompt, args)
            ref = refs[prompt["prompt"]]
            row["burst"] = n
            row["same_as_ar"] = row["token_ids"] is not None and ref is not None and row["token_ids"] == ref
            print(
                f"  robot {row['robot']} gamma {row['gamma']}: finished {row['finished']}, retries "
                f"{row['retries']}, tokens {row['tokens']}, ids == AR {row['same_as_ar']} {row['error']}",
                flush=True,
            )
        alone = phase(after_burst, server_counters(server.metrics()))
        return {"burst": n, "during": phase(start, after_burst), "alone": alone, "rows": rows}
    finally:
        server.stop()
        log.unlink(missing_ok=True)


def measure(args: argparse.Namespace) -> dict:
    if args.quick:
        args.robots, args.max_tokens = min(args.robots, 2), min(args.max_tokens, 8)
    pool = load_prompts(10)
    prompts = [pool[i % len(pool)] for i in range(args.robots)]
    bursts = [one_burst(n, prompts, args) for n in range(args.repeats)]
    rows = [r for b in bursts for r in b["rows"]]
    for r in rows:
        r.pop("token_ids")
    finished = sum(r["finished"] for r in rows)
    exact = sum(r["same_as_ar"] for r in rows)
    return {
        "robots": args.robots,
        "bursts": [{k: v for k, v in b.items() if k != "rows"} for b in bursts],
        "rows": rows,
        "finished": finished,
        "same_as_ar": exact,
        "retried": sum(r["retries"] for r in rows),
        "total": len(rows),
        "ok": finished == len(rows),
        "exact": exact == len(rows),
    }


def server_rows(r: dict) -> list[dict]:
    return [
        {"burst": b["burst"], "phase": name, **b[key]}
        for b in r["bursts"]
        for key, name in (("during", "the burst"), ("alone", "AR alone, after"))
    ]


def summary(r: dict) -> list[str]:
    return [
        f"{r['finished']} of {r['total']} robots finished, {r['same_as_ar']} with their AR ids; the robots retried "
        f"{r['retried']} sheds (`overloaded`).",
        "",
    ]


REPORT = harness.Report(
    "burst",
    "# A burst of {robots} robots starting at once against the default verifier",
    [
        harness.Table(
            "rows",
            [
                harness.Col("burst"),
                harness.Col("robot"),
                harness.Col("gamma"),
                harness.Col("finished", "finished", lambda v: "yes" if v else "**no**"),
                harness.Col("retries", "shed retries"),
                harness.Col("tokens"),
                harness.Col("wall_s", "wall (s)", "{:.1f}"),
                harness.Col("same_as_ar", "ids == AR", lambda v: "yes" if v else "**no**"),
                harness.Col("error"),
            ],
        ),
        harness.Table(
            server_rows,
            [
                harness.Col("burst"),
                harness.Col("phase"),
                harness.Col("passes"),
                harness.Col("pass_ms", "mean pass (ms)", "{:.0f}"),
                harness.Col("engine_cpu_share", "model thread's CPU share", "{:.2f}"),
                harness.Col("sheds", "requests shed"),
            ],
            title="## The server's passes",
            note="During each burst, and while the AR references ran one robot at a time after it (the server's "
            "/metrics: `bridge_batches_total`, `bridge_batch_verify_seconds_total`, `bridge_engine_cpu_seconds_total`, "
            "`bridge_slo_shed_total`). The CPU share is the model thread's CPU time inside the passes over their wall "
            "time: well below 1, a pass waited for a core that the robots' drafts held.",
        ),
    ],
    intro=lambda r: (
        f"`{r['command']}` ({r['machine']}, {r['started']}): `server-bridge serve` with its defaults, the robots "
        "`edge-agent generate` with theirs (SD, the shipped pair), all on the same cores, nothing pinned."
    ),
    extra=summary,
)


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--robots", type=int, default=8, help="robots started at once")
    ap.add_argument("--gammas", type=harness.ints, default=[2, 3, 4, 5, 6], help="their gammas, cycled")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens each generates at most")
    ap.add_argument("--timeout-s", type=float, default=1800.0, help="a robot still running after this fails the run")


def main(argv: list[str] | None = None) -> int:
    return harness.main(__doc__, REPORT, measure, add_args, argv, out="bench_results/burst", repeats=1, pin_cores=False)


if __name__ == "__main__":
    sys.exit(main())
