"""Benchmark: cloud AR vs edge-cloud SD through the emulated link, for both model pairs.

    python -m tools.bench [--rtts 0,20,50,100] [--gamma 4] [--max-tokens 64] [--prompts 10]

The verifier runs in its own process pinned to its own core(s); the drafts run
here on the other core(s). For every RTT and prompt the modes run back to
back (AR, SD with each draft), so machine noise hits them alike. Writes
bench.json (every run, plus the config in use), bench.md (the table) and
bench.png (tokens/s against RTT) into --out, and prints beside each
measurement what the latency model predicts:

    cloud AR = 2*T_c + n*T_q            SD = n/tau * (2*T_c + gamma*T_p + T_v)

with T_c the one-way delay, T_q the target's time per AR token, T_p the
draft's time per token and T_v the target's time per verification round
(T_q for gamma+1 positions), all measured in the same run.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

from agent.decoder import EdgeDecoder
from agent.drafter import Drafter
from tools.local_verifier import LocalVerifier, pin_cores
from tools.netem import LinkProfile, NetemProxy
from tools.plots import line_plot

PROMPTS = Path(__file__).parent / "prompts" / "bench.jsonl"
PAIRS = {"smollm2-q4_1": "near-identical (Q4_1 draft)", "smollm2-q2_k": "weaker (Q2_K requantized draft)"}
TARGET = "smollm2-f32"


def load_prompts(n: int) -> list[dict]:
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    return rows[:n]


def predict(run: dict, rtt_ms: float, t_q: float) -> float:
    """Seconds the latency model predicts for this run."""
    n, m = len(run["token_ids"]), run["metrics"]
    t_c = rtt_ms / 2 / 1e3
    if run["mode"] == "ar":
        return 2 * t_c + n * t_q
    t_p = m["draft_ms"] / 1e3 / max(m["drafted"], 1)
    t_v = m["verify_ms"] / 1e3 / m["rounds"]
    return n / m["tau"] * (2 * t_c + run["gamma"] * t_p + t_v)


def summarize(runs: list[dict]) -> dict:
    tok = sum(len(r["token_ids"]) for r in runs)
    wall = sum(r["metrics"]["wall_s"] for r in runs)
    rounds = sum(r["metrics"]["rounds"] for r in runs)
    drafted = sum(r["metrics"]["drafted"] for r in runs)
    return {
        "runs": len(runs), "tokens": tok, "wall_s": wall, "tokens_per_s": tok / wall,
        "tau": tok / rounds if rounds else None,
        "acceptance_rate": sum(r["metrics"]["accepted"] for r in runs) / drafted if drafted else None,
        "predicted_s": sum(r["predicted_s"] for r in runs),
        "target_forward_passes": sum(r["metrics"]["target_forward_passes"] for r in runs),
        "bytes_up": sum(r["metrics"]["bytes_up"] for r in runs),
        "bytes_down": sum(r["metrics"]["bytes_down"] for r in runs),
        "exact": all(r.get("exact", True) for r in runs),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rtts", default="0,20,50,100", help="round-trip times in ms")
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--drafts", default=",".join(PAIRS))
    ap.add_argument("--out", default="bench_results")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    rtts = [float(x) for x in args.rtts.split(",")]
    drafts = args.drafts.split(",")
    prompts = load_prompts(args.prompts)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    agent_cpus, server_cpus = pin_cores()
    config = {"rtts_ms": rtts, "gamma": args.gamma, "max_tokens": args.max_tokens, "prompts": len(prompts),
              "drafts": drafts, "target": TARGET, "temperature": 0.0, "agent_cpus": sorted(agent_cpus),
              "server_cpus": sorted(server_cpus), "cpu_count": os.cpu_count(),
              "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    print(f"bench: {len(rtts)} RTTs x {len(prompts)} prompts x (AR + SD with {len(drafts)} drafts), "
          f"gamma {args.gamma}, {args.max_tokens} tokens; verifier on cores {sorted(server_cpus)}, drafts on "
          f"{sorted(agent_cpus)}", flush=True)
    runs: list[dict] = []
    with LocalVerifier(target=TARGET, cpus=server_cpus, threads=len(server_cpus)) as server, \
            NetemProxy("127.0.0.1", server.port) as link:
        os.sched_setaffinity(0, agent_cpus)
        drafters = {d: Drafter(d, threads=len(agent_cpus)) for d in drafts}
        decoders = {d: EdgeDecoder(dr, link.url()) for d, dr in drafters.items()}
        first = drafters[drafts[0]]
        # warm-up: first forward passes allocate caches; keep them out of the figures
        for dec in decoders.values():
            dec.generate(first.tokenize("Hello"), mode="sd", max_tokens=4, gamma=args.gamma)
        decoders[drafts[0]].generate(first.tokenize("Hello"), mode="ar", max_tokens=4)
        total = len(rtts) * len(prompts)
        step = 0
        for rtt in rtts:
            link.set_profile(LinkProfile.from_rtt(rtt))
            for i, p in enumerate(prompts):
                step += 1
                ids = first.tokenize(p["prompt"], chat=p["chat"])
                ar = decoders[drafts[0]].generate(ids, mode="ar", max_tokens=args.max_tokens).to_json()
                t_q = ar["metrics"]["verify_ms"] / 1e3 / max(ar["metrics"]["rounds"], 1)
                batch = [("AR", "ar", None, ar)]
                for d in drafts:
                    sd = decoders[d].generate(ids, mode="sd", max_tokens=args.max_tokens, gamma=args.gamma).to_json()
                    sd["exact"] = sd["token_ids"] == ar["token_ids"]
                    batch.append((f"SD {d}", "sd", d, sd))
                line = [f"[{step}/{total}] rtt {rtt:>5.0f} ms  {p['category']:<13}"]
                for label, mode, draft, r in batch:
                    r.update(rtt_ms=rtt, prompt=i, category=p["category"], draft=draft, gamma=args.gamma)
                    r["predicted_s"] = predict(r, rtt, t_q)
                    runs.append(r)
                    m = r["metrics"]
                    tau = f" tau {m['tau']:.2f}" if mode == "sd" else ""
                    flag = "" if r.get("exact", True) else " NOT EXACT"
                    line.append(f"{label}: {m['tokens_per_s']:5.1f} tok/s ({m['wall_s']:.2f}s, model "
                                f"{r['predicted_s']:.2f}s){tau}{flag}")
                print("  |  ".join(line), flush=True)
        for dec in decoders.values():
            dec.close()
        config["server_metrics_tail"] = server.metrics().splitlines()[-6:]

    table = []
    for rtt in rtts:
        ar = summarize([r for r in runs if r["rtt_ms"] == rtt and r["mode"] == "ar"])
        table.append({"rtt_ms": rtt, "mode": "AR", "pair": "target only", **ar, "speedup": 1.0})
        for d in drafts:
            sd = summarize([r for r in runs if r["rtt_ms"] == rtt and r["draft"] == d])
            table.append({"rtt_ms": rtt, "mode": "SD", "pair": f"{d} -> {TARGET}", **sd,
                          "speedup": sd["tokens_per_s"] / ar["tokens_per_s"]})
    result = {"config": config, "table": table, "runs": runs}
    (out / "bench.json").write_text(json.dumps(result, indent=1))
    md = render_markdown(table, config)
    (out / "bench.md").write_text(md)
    plot(table, drafts, out / "bench.png")
    print("\n" + md)
    print(f"wrote {out / 'bench.json'}, {out / 'bench.md'}, {out / 'bench.png'}")
    return 0 if all(r["exact"] for r in table) else 1


def render_markdown(table: list[dict], config: dict) -> str:
    head = ("| RTT ms | mode | pair | tokens/s | speedup vs AR | tau | acceptance | wall s | model s | "
            "target passes | bytes up | bytes down | exact |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    rows = []
    for r in table:
        tau = "-" if r["tau"] is None or r["mode"] == "AR" else f"{r['tau']:.2f}"
        acc = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.3f}"
        rows.append(f"| {r['rtt_ms']:.0f} | {r['mode']} | {r['pair']} | {r['tokens_per_s']:.2f} | "
                    f"{r['speedup']:.2f}x | {tau} | {acc} | {r['wall_s']:.1f} | {r['predicted_s']:.1f} | "
                    f"{r['target_forward_passes']} | {r['bytes_up']} | {r['bytes_down']} | "
                    f"{'yes' if r['exact'] else 'NO'} |")
    note = (f"\n{config['prompts']} prompts x {config['max_tokens']} tokens, gamma {config['gamma']}, temperature 0; "
            f"verifier on cores {config['server_cpus']}, drafts on {config['agent_cpus']}; started "
            f"{config['started']}. 'model s' is the latency model's prediction from times measured in the same run.\n")
    return head + "\n".join(rows) + "\n" + note


def plot(table: list[dict], drafts: list[str], path: Path) -> None:
    ar = [r for r in table if r["mode"] == "AR"]
    series = [("target only (cloud AR)", [r["rtt_ms"] for r in ar], [r["tokens_per_s"] for r in ar])]
    notes = []
    for d in drafts:
        rows = [r for r in table if r["pair"].startswith(d)]
        series.append((f"SD, draft {d}", [r["rtt_ms"] for r in rows], [r["tokens_per_s"] for r in rows]))
        notes += [(r["rtt_ms"], r["tokens_per_s"], f"tau {r['tau']:.1f}") for r in rows]
    line_plot(path, series, "round-trip time (ms)", "committed tokens / s",
              f"AR vs SD through the emulated link (target {TARGET}, CPU)", notes=notes)


if __name__ == "__main__":
    sys.exit(main())
