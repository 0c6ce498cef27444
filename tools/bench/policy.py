"""Benchmark the draft policies: fixed gamma vs the rejection predictor vs gamma* (Lambert W) + AS2.

    python -m tools.bench.policy [--rtts 0,20,50,200] [--prompts 10] [--max-tokens 64] [--gamma 4]
                                 [--drafts smollm2-q4_1,smollm2-q2_k] [--out docs]

For every RTT and prompt, target-only streaming (AR) runs first, then SD with
each draft under each policy, back to back through the emulated link, so
machine noise hits them alike; every SD run is checked against AR's tokens.
The verifier runs in its own process on its own core, the drafts here on the
other. Per pair, RTT and policy it reports committed tokens/s (and vs AR and vs
fixed), acceptance rate (accepted / drafted), wasted draft tokens per round,
the mean draft length, the optimal draft length gamma* the estimates give
(beside the fixed gamma), AS2's switches and the share of tokens the target
streamed alone. It also times the predictor per drafted token on this machine
(features from real draft logits + one onnxruntime call, p50/p99 over
--latency-samples). Writes bench_policy.{json,md,png} into --out.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np

from agent.spec.decoder import DecoderConfig, EdgeDecoder
from agent.spec.drafter import Drafter
from agent.spec.policy import POLICIES, DraftPolicy
from agent.spec.predictor import RejectionPredictor, feature_row, predictor_path
from tools.bench.decoding import load_prompts
from tools.cluster.local_verifier import LocalVerifier, pin_cores
from tools.cluster.netem import LinkProfile, NetemProxy

TARGET = "smollm2-f32"


def predictor_latency(drafter: Drafter, n: int) -> dict:
    """Per drafted token: computing the features from real logits, and one single-sample ONNX run."""
    pred = RejectionPredictor(predictor_path(drafter.name, TARGET))
    ids = drafter.tokenize("You are a robot dog. Describe how you reach the kitchen.", chat=True)
    logits = [drafter.next_logits(ids[: len(ids) - i]) for i in range(8)]
    feat, onnx = np.empty(n), np.empty(n)
    for i in range(n):
        t0 = time.perf_counter()
        row = feature_row(logits[i % 8], i % 4, 20, 2)
        t1 = time.perf_counter()
        pred.should_stop(row)
        t2 = time.perf_counter()
        feat[i], onnx[i] = (t1 - t0) * 1e3, (t2 - t1) * 1e3
    both = feat + onnx
    q = lambda a, p: round(float(np.percentile(a, p)), 4)  # noqa: E731
    return {
        "draft": drafter.name,
        "samples": n,
        "onnx_p50_ms": q(onnx, 50),
        "onnx_p99_ms": q(onnx, 99),
        "features_p50_ms": q(feat, 50),
        "features_p99_ms": q(feat, 99),
        "per_token_p50_ms": q(both, 50),
        "per_token_p99_ms": q(both, 99),
    }


def summarize(runs: list[dict]) -> dict:
    m = [r["metrics"] for r in runs]
    tokens = sum(len(r["token_ids"]) for r in runs)
    wall = sum(x["wall_s"] for x in m)
    rounds = sum(x["rounds"] for x in m)
    drafted = sum(x["drafted"] for x in m)
    stars = [x["gamma_star"] for x in m if x["gamma_star"] is not None]
    speed = [x["expected_speedup"] for x in m if x["expected_speedup"] is not None]
    return {
        "runs": len(runs),
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall if wall else 0.0,
        "acceptance_rate": sum(x["accepted"] for x in m) / drafted if drafted else None,
        "wasted_draft_tokens": sum(x["wasted_draft_tokens"] for x in m),
        "wasted_per_round": sum(x["wasted_draft_tokens"] for x in m) / rounds if rounds else None,
        "mean_draft_len": drafted / rounds if rounds else None,
        "tau": (tokens - sum(x["streamed_tokens"] for x in m)) / rounds if rounds else None,
        "gamma_star": float(np.mean(stars)) if stars else None,
        "expected_speedup": float(np.mean(speed)) if speed else None,
        "predictor_stops": sum(x["predictor_stops"] for x in m),
        "as2_switches": sum(len(x["as2_switches"]) for x in m),
        "streamed_share": sum(x["streamed_tokens"] for x in m) / tokens if tokens else 0.0,
        "verify_ms": sum(x["verify_ms"] for x in m),
        "target_forward_passes": sum(x["target_forward_passes"] for x in m),
        "exact": all(r.get("exact", True) for r in runs),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rtts", default="0,20,50,200")
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--drafts", default="smollm2-q4_1,smollm2-q2_k")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--latency-samples", type=int, default=10000)
    ap.add_argument(
        "--latency-only",
        action="store_true",
        help="only time the predictor per drafted token (writes predictor_latency.json)",
    )
    ap.add_argument("--trace", metavar="DIR", help="write predictor traces of the fixed-policy runs into DIR")
    ap.add_argument("--out", default="bench_results")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    rtts = [float(x) for x in args.rtts.split(",")]
    drafts = args.drafts.split(",")
    policies = args.policies.split(",")
    prompts = load_prompts(args.prompts)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    agent_cpus, server_cpus = pin_cores()
    if args.latency_only:
        os.sched_setaffinity(0, agent_cpus)
        latency = [predictor_latency(Drafter(d, threads=len(agent_cpus)), args.latency_samples) for d in drafts]
        (out / "predictor_latency.json").write_text(json.dumps(latency, indent=1))
        print(json.dumps(latency, indent=1))
        return 0
    config = {
        **vars(args),
        "target": TARGET,
        "temperature": 0.0,
        "agent_cpus": sorted(agent_cpus),
        "server_cpus": sorted(server_cpus),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    print(
        f"bench_policy: {len(rtts)} RTTs x {len(prompts)} prompts x drafts {drafts} x policies {policies}; "
        f"verifier on cores {sorted(server_cpus)}, drafts on {sorted(agent_cpus)}",
        flush=True,
    )
    runs: list[dict] = []
    with (
        LocalVerifier(target=TARGET, cpus=server_cpus, threads=len(server_cpus)) as server,
        NetemProxy("127.0.0.1", server.port) as link,
    ):
        os.sched_setaffinity(0, agent_cpus)
        drafters = {d: Drafter(d, threads=len(agent_cpus)) for d in drafts}
        latency = [predictor_latency(dr, args.latency_samples) for dr in drafters.values()]
        for lat in latency:
            print(
                f"predictor {lat['draft']}: onnx p50 {lat['onnx_p50_ms']} ms p99 {lat['onnx_p99_ms']} ms; "
                f"features p99 {lat['features_p99_ms']} ms; per token p99 {lat['per_token_p99_ms']} ms",
                flush=True,
            )

        def trace(d: str, pol: str) -> str | None:
            return str(Path(args.trace) / f"{d}__{TARGET}.jsonl") if args.trace and pol == "fixed" else None

        decoders = {
            (d, p): EdgeDecoder(dr, DecoderConfig(url=link.url(), policy=DraftPolicy(p), trace=trace(d, p)))
            for d, dr in drafters.items()
            for p in policies
        }
        ar = decoders[(drafts[0], policies[0])]
        warm = drafters[drafts[0]].tokenize("Hello")
        for dec in decoders.values():
            dec.generate(warm, mode="sd", max_tokens=8, gamma=args.gamma)
        total, step = len(rtts) * len(prompts), 0
        for rtt in rtts:
            link.set_profile(LinkProfile.from_rtt(rtt))
            for i, p in enumerate(prompts):
                step += 1
                ids = drafters[drafts[0]].tokenize(p["prompt"], chat=p["chat"])
                ref = ar.generate(ids, mode="ar", max_tokens=args.max_tokens).to_json()
                ref.update(rtt_ms=rtt, prompt=i, draft=None, policy="ar", exact=True)
                runs.append(ref)
                line = [f"[{step}/{total}] rtt {rtt:>4.0f} AR {ref['metrics']['tokens_per_s']:5.1f}"]
                for (d, pol), dec in decoders.items():
                    r = dec.generate(ids, mode="sd", max_tokens=args.max_tokens, gamma=args.gamma).to_json()
                    r.update(rtt_ms=rtt, prompt=i, draft=d, policy=pol, exact=r["token_ids"] == ref["token_ids"])
                    runs.append(r)
                    line.append(
                        f"{d[-4:]} {pol}: {r['metrics']['tokens_per_s']:5.1f}" + ("" if r["exact"] else " NOT EXACT")
                    )
                print(" | ".join(line), flush=True)
        for dec in decoders.values():
            dec.close()
    table = []
    for rtt in rtts:
        base = summarize([r for r in runs if r["rtt_ms"] == rtt and r["policy"] == "ar"])
        for d in drafts:
            fixed = summarize([r for r in runs if r["rtt_ms"] == rtt and r["draft"] == d and r["policy"] == "fixed"])
            for pol in policies:
                row = summarize([r for r in runs if r["rtt_ms"] == rtt and r["draft"] == d and r["policy"] == pol])
                row.update(
                    rtt_ms=rtt,
                    draft=d,
                    policy=pol,
                    ar_tokens_per_s=base["tokens_per_s"],
                    vs_ar=row["tokens_per_s"] / base["tokens_per_s"],
                    vs_fixed=row["tokens_per_s"] / fixed["tokens_per_s"] if fixed["runs"] else None,
                )
                table.append(row)
    result = {"config": config, "predictor_latency": latency, "table": table, "runs": runs}
    (out / "bench_policy.json").write_text(json.dumps(result, indent=1))
    md = render(table, latency, config)
    (out / "bench_policy.md").write_text(md)
    plot(table, drafts, policies, out / "bench_policy.png")
    print("\n" + md)
    print(f"wrote {out / 'bench_policy.json'}, {out / 'bench_policy.md'}, {out / 'bench_policy.png'}")
    return 0 if all(r["exact"] for r in table) else 1


def render(table: list[dict], latency: list[dict], config: dict) -> str:
    f = lambda v, d=2: "–" if v is None else f"{v:.{d}f}"  # noqa: E731
    lines = [
        f"`python -m tools.bench.policy --rtts {config['rtts']} --prompts {config['prompts']} "
        f"--max-tokens {config['max_tokens']} --gamma {config['gamma']}` (target {config['target']}, T 0; "
        f"verifier on core {config['server_cpus']}, draft on core {config['agent_cpus']}; "
        f"started {config['started']})",
        "",
        "| pair | RTT ms | policy | tok/s | vs AR | vs fixed | acceptance | wasted/round | draft len | "
        "gamma* | AS2 switches | streamed | exact |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in table:
        lines.append(
            f"| {r['draft']} | {r['rtt_ms']:.0f} | {r['policy']} | {f(r['tokens_per_s'], 1)} | "
            f"{f(r['vs_ar'])}× | {f(r['vs_fixed'])}× | {f(r['acceptance_rate'], 3)} | "
            f"{f(r['wasted_per_round'])} | {f(r['mean_draft_len'])} | {f(r['gamma_star'], 1)} | "
            f"{r['as2_switches']} | {100 * r['streamed_share']:.0f} % | {'yes' if r['exact'] else 'NO'} |"
        )
    lines += [
        "",
        "Predictor cost per drafted token (this machine, one core):",
        "",
        "| draft | ONNX p50 | ONNX p99 | features p99 | total p99 |",
        "|---|---|---|---|---|",
    ]
    for x in latency:
        lines.append(
            f"| {x['draft']} | {x['onnx_p50_ms']:.3f} ms | {x['onnx_p99_ms']:.3f} ms | "
            f"{x['features_p99_ms']:.3f} ms | {x['per_token_p99_ms']:.3f} ms |"
        )
    return "\n".join(lines) + "\n"


def plot(table: list[dict], drafts: list[str], policies: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(drafts), figsize=(6 * len(drafts), 7.5), squeeze=False)
    for j, d in enumerate(drafts):
        rows = [r for r in table if r["draft"] == d]
        rtts = sorted({r["rtt_ms"] for r in rows})
        ax = axes[0][j]
        ax.plot(
            rtts,
            [next(r["ar_tokens_per_s"] for r in rows if r["rtt_ms"] == t) for t in rtts],
            "k--",
            marker="s",
            label="target alone (AR)",
        )
        for pol in policies:
            ax.plot(
                rtts,
                [next(r["tokens_per_s"] for r in rows if r["rtt_ms"] == t and r["policy"] == pol) for t in rtts],
                marker="o",
                label=pol,
            )
        ax.set_title(f"{d} -> {TARGET}", fontsize=10)
        ax.set_xlabel("RTT (ms)")
        ax.set_ylabel("committed tokens/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ax = axes[1][j]
        width = 0.8 / len(policies)
        for k, pol in enumerate(policies):
            ax.bar(
                np.arange(len(rtts)) + k * width,
                [
                    next(r["acceptance_rate"] or 0 for r in rows if r["rtt_ms"] == t and r["policy"] == pol)
                    for t in rtts
                ],
                width,
                label=pol,
            )
        ax.set_xticks(np.arange(len(rtts)) + 0.4 - width / 2, [f"{t:.0f}" for t in rtts])
        ax.set_xlabel("RTT (ms)")
        ax.set_ylabel("acceptance rate (accepted / drafted)")
        ax.set_ylim(0, 1)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
