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
--latency-samples). Writes bench_policy.{json,md,png} into --out (the harness's flags too).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np

from agent.decoding import DecoderSettings, open_decoder
from agent.decoding.drafter import Drafter
from agent.decoding.policy import POLICIES
from agent.decoding.predictor import RejectionPredictor, feature_row, predictor_path
from server_bridge.ops.fleet import pin_cores
from tools.bench import harness
from tools.bench.link import TARGET, Served, load_prompts, served, summarize
from tools.cluster.netem import LinkProfile


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


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--rtts", type=harness.floats, default=[0.0, 20.0, 50.0, 200.0])
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--drafts", type=harness.names, default=["smollm2-q4_1", "smollm2-q2_k"])
    ap.add_argument("--policies", type=harness.names, default=list(POLICIES))
    ap.add_argument("--latency-samples", type=int, default=10000)
    ap.add_argument(
        "--latency-only",
        action="store_true",
        help="only time the predictor per drafted token (no verifier; the report holds that table alone)",
    )
    ap.add_argument("--trace", metavar="DIR", help="write predictor traces of the fixed-policy runs into DIR")


def latencies(drafters: dict[str, Drafter], samples: int) -> list[dict]:
    out = [predictor_latency(dr, samples) for dr in drafters.values()]
    for lat in out:
        print(
            f"predictor {lat['draft']}: onnx p50 {lat['onnx_p50_ms']} ms p99 {lat['onnx_p99_ms']} ms; "
            f"features p99 {lat['features_p99_ms']} ms; per token p99 {lat['per_token_p99_ms']} ms",
            flush=True,
        )
    return out


def measure(args: argparse.Namespace) -> dict:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if args.quick:  # one prompt, one RTT, a few tokens, few latency samples
        args.prompts, args.rtts, args.max_tokens, args.latency_samples = 1, args.rtts[:1], 8, 100
    prompts = load_prompts(args.prompts)
    result: dict = {"target": TARGET, "prompts": len(prompts), "max_tokens": args.max_tokens, "gamma": args.gamma}
    runs: list[dict] = []
    if args.latency_only:  # no verifier: the draft on the robot's cores alone
        agent_cpus, _ = pin_cores()
        os.sched_setaffinity(0, agent_cpus)
        drafters = {d: open_decoder(DecoderSettings(draft=d, threads=len(agent_cpus))).drafter for d in args.drafts}
        return result | {"predictor_latency": latencies(drafters, args.latency_samples)}
    with served() as s:
        result |= s.cores()
        drafters = {d: s.drafter(d) for d in args.drafts}
        result["predictor_latency"] = latencies(drafters, args.latency_samples)
        run_grid(args, s, drafters, prompts, runs)
    table = []
    for rtt in args.rtts:
        base = summarize([r for r in runs if r["rtt_ms"] == rtt and r["policy"] == "ar"])
        for d in args.drafts:
            fixed = summarize([r for r in runs if r["rtt_ms"] == rtt and r["draft"] == d and r["policy"] == "fixed"])
            for pol in args.policies:
                row = summarize([r for r in runs if r["rtt_ms"] == rtt and r["draft"] == d and r["policy"] == pol])
                row.update(
                    rtt_ms=rtt,
                    draft=d,
                    policy=pol,
                    series=f"{d}: {pol}",
                    ar_tokens_per_s=base["tokens_per_s"],
                    vs_ar=row["tokens_per_s"] / base["tokens_per_s"],
                    vs_fixed=row["tokens_per_s"] / fixed["tokens_per_s"] if fixed["runs"] else None,
                )
                table.append(row)
    return result | {"table": table, "runs": runs, "exact": all(r["exact"] for r in table)}


def run_grid(args: argparse.Namespace, s: Served, drafters: dict[str, Drafter], prompts: list, runs: list) -> None:
    """Per RTT and prompt: AR, then SD with each draft under each policy, back to back, checked against AR."""

    def trace(d: str, pol: str) -> str | None:
        return str(Path(args.trace) / f"{d}__{TARGET}.jsonl") if args.trace and pol == "fixed" else None

    decoders = {
        (d, p): open_decoder(DecoderSettings(verifier=s.link.url(), draft_policy=p, trace=trace(d, p)), dr)
        for d, dr in drafters.items()
        for p in args.policies
    }
    ar = decoders[(args.drafts[0], args.policies[0])]
    warm = drafters[args.drafts[0]].tokenize("Hello")
    for dec in decoders.values():
        dec.generate(warm, mode="sd", max_tokens=8, gamma=args.gamma)
    total, step = len(args.rtts) * len(prompts), 0
    for rtt in args.rtts:
        s.link.set_profile(LinkProfile.from_rtt(rtt))
        for i, p in enumerate(prompts):
            step += 1
            ids = drafters[args.drafts[0]].tokenize(p["prompt"], chat=p["chat"])
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


C = harness.Col
REPORT = harness.Report(
    "bench_policy",
    "# Draft policies (target {target}, T 0)",
    [
        harness.Table(
            "table",
            [
                C("draft", "pair"),
                C("rtt_ms", "RTT ms", "{:.0f}"),
                C("policy"),
                C("tokens_per_s", "tok/s", "{:.1f}"),
                C("vs_ar", "vs AR", "{:.2f}×"),
                C("vs_fixed", "vs fixed", lambda v: "–×" if v is None else f"{v:.2f}×"),
                C("acceptance_rate", "acceptance", "{:.3f}"),
                C("wasted_per_round", "wasted/round", "{:.2f}"),
                C("mean_draft_len", "draft len", "{:.2f}"),
                C("gamma_star", "gamma*", "{:.1f}"),
                C("as2_switches", "AS2 switches"),
                C("streamed_share", "streamed", lambda v: f"{100 * v:.0f} %"),
                C("exact", fmt=lambda v: "yes" if v else "NO"),
            ],
            note="Verifier on core {server_cpus}, draft on core {agent_cpus}; {prompts} prompts x {max_tokens} "
            "tokens, gamma {gamma}; started {started}.",
        ),
        harness.Table(
            "predictor_latency",
            [
                C("draft"),
                C("onnx_p50_ms", "ONNX p50", "{:.3f} ms"),
                C("onnx_p99_ms", "ONNX p99", "{:.3f} ms"),
                C("features_p99_ms", "features p99", "{:.3f} ms"),
                C("per_token_p99_ms", "total p99", "{:.3f} ms"),
            ],
            "Predictor cost per drafted token (this machine, one core):",
        ),
    ],
    harness.Plot(
        "table",
        x="rtt_ms",
        ys={"": "tokens_per_s"},
        group="series",
        xlabel="RTT (ms)",
        ylabel="committed tokens/s",
        title="Draft policies against RTT (target {target})",
    ),
)


def main(argv: list[str] | None = None) -> int:
    return harness.main(
        __doc__, REPORT, measure, add_args, argv, out="bench_results", module="tools.bench.policy", pin_cores=False
    )


if __name__ == "__main__":
    sys.exit(main())
