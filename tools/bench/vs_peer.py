"""One robot, side by side in one run: our modes on the llamacpp engine against llama.cpp's own llama-server.

For each RTT the same prompts (the loadgen trace's chat-templated ids) go through the same network
emulator to: llama-server streaming plain AR (tools/bench/peer.py; `make llama-server` builds it), and our
verifier (server-bridge, default engine) in AR, SD, FSD and SD with predictor+optimal, for each draft
pair. Both servers run pinned to core 1 with one thread, one after the other; the robot runs on core 0.
Every one of our runs is checked against our AR's ids; the peer's against the trace's (the target's
greedy continuation).

Beside the figures it prints the per-pass costs they come from: draft ms/token (T_p), the target's ms
per AR token (T_q) and per verify round (T_v), and where SD would pull ahead: SD beats streaming AR when
(RTT + gamma*T_p + T_v) / tau < T_q, i.e. (with a verify round costing v = T_v/T_q AR tokens, as measured)
when the target/draft cost ratio T_q/T_p exceeds (gamma + RTT/T_p) / (tau - v).

    python -m tools.bench.vs_peer --out docs/peer      # ~10 min on the 2-core development machine
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from agent.spec.decoder import DecoderConfig, EdgeDecoder, FsdOptions
from agent.spec.drafter import Drafter
from agent.spec.policy import DraftPolicy
from tools.bench import peer
from tools.cluster.local_verifier import LocalVerifier
from tools.cluster.netem import LinkProfile, NetemProxy

MODES = ("ar", "sd", "fsd", "fsd without exits", "sd predictor+optimal")
LABELS = {
    "ar": "ours AR",
    "sd": "ours SD",
    "fsd": "ours FSD",
    "fsd without exits": "ours FSD without exits",
    "sd predictor+optimal": "ours SD predictor+optimal",
}


def ours(
    prompts: list[list[int]],
    rtts: list[float],
    drafts: list[str],
    n: int,
    gamma: int,
    log,
    modes: tuple[str, ...] = MODES,
) -> list[dict]:
    rows = []
    with LocalVerifier(cpus={1}, threads=1) as server, NetemProxy("127.0.0.1", server.port) as link:
        os.sched_setaffinity(0, {0})
        drafters = {d: Drafter(d, threads=1) for d in drafts}
        dec = {
            (d, m): EdgeDecoder(
                dr,
                DecoderConfig(
                    url=link.url(),
                    fsd=FsdOptions(workers=1, exits=() if "without" in m else None),
                    policy=DraftPolicy("predictor+optimal") if "predictor" in m else DraftPolicy(),
                ),
            )
            for d, dr in drafters.items()
            for m in modes
        }
        for (d, m), x in dec.items():  # warm-up
            x.generate(prompts[0][:8], mode=m.split()[0], max_tokens=4, gamma=gamma)
        for rtt in rtts:
            link.set_profile(LinkProfile.from_rtt(rtt))
            for d in drafts:
                for m in modes:
                    if m == "ar" and d != drafts[0]:
                        continue
                    gens = [dec[d, m].generate(ids, mode=m.split()[0], max_tokens=n, gamma=gamma) for ids in prompts]
                    tok = sum(len(g.token_ids) for g in gens)
                    wall = sum(g.metrics.wall_s for g in gens)
                    rounds = sum(g.metrics.rounds for g in gens)
                    row = {
                        "rtt_ms": rtt,
                        "mode": LABELS[m],
                        "draft": None if m == "ar" else d,
                        "tokens": tok,
                        "wall_s": wall,
                        "tokens_per_s": tok / wall,
                        "tau": tok / rounds if rounds else None,
                        "verify_ms_per_round": sum(g.metrics.verify_ms for g in gens) / max(rounds, 1),
                        "draft_ms_per_round": sum(g.metrics.draft_ms for g in gens) / max(rounds, 1),
                        "token_ids": [g.token_ids for g in gens],
                    }
                    rows.append(row)
                    log(
                        f"  rtt {rtt:>3.0f} ms  {row['mode']:<26} {d if m != 'ar' else '':<13} "
                        f"{row['tokens_per_s']:6.1f} tok/s"
                        + (f"  tau {row['tau']:.2f}" if row["tau"] else "")
                        + f"  ({rounds} rounds)"
                    )
        for x in dec.values():
            x.close()
    ar = {r["rtt_ms"]: r["token_ids"] for r in rows if r["mode"] == "ours AR"}
    for r in rows:
        r["exact"] = r["token_ids"] == ar[r["rtt_ms"]]
    return rows


def needed_ratio(gamma: int, tau: float, v: float, t_p: float, rtt: float) -> float | str:
    """The target/draft cost ratio T_q/T_p above which SD outruns streaming AR at this RTT."""
    return round((gamma + rtt / t_p) / (tau - v), 2) if tau > v else "never (a round costs more than tau AR tokens)"


def markdown(result: dict) -> str:
    rtts = result["rtts"]
    lines = [
        f"# One robot: our verifier (llamacpp engine) against llama-server, {result['target']}",
        "",
        f"`{result['command']}`",
        "",
        f"{result['prompts']} prompts x {result['tokens']} tokens, greedy, "
        f"gamma {result['gamma']}; servers on core 1 with 1 thread, robot on core 0.",
        "",
        "| mode | draft | " + " | ".join(f"tok/s at RTT {r:.0f} ms" for r in rtts) + " | exact |",
        "|---|---|" + "---|" * len(rtts) + "---|",
    ]
    keys = []
    for r in result["rows"]:
        if (r["mode"], r.get("draft")) not in keys:
            keys.append((r["mode"], r.get("draft")))
    for mode, draft in keys:
        cells = [
            next(
                (
                    f"{r['tokens_per_s']:.1f}"
                    for r in result["rows"]
                    if r["mode"] == mode and r.get("draft") == draft and r["rtt_ms"] == rtt
                ),
                "",
            )
            for rtt in rtts
        ]
        exact = all(r.get("exact", True) for r in result["rows"] if r["mode"] == mode and r.get("draft") == draft)
        lines.append(f"| {mode} | {draft or ''} | " + " | ".join(cells) + f" | {'yes' if exact else 'NO'} |")
    c = result["costs"]
    lines += [
        "",
        "Per-pass costs measured in this run (RTT 0): "
        f"draft T_p {c['draft_ms_per_token']:.1f} ms/token (Q4_1), target T_q {c['target_ms_per_ar_token']:.1f} "
        f"ms per AR token on our server, {c['peer_ms_per_token']:.1f} ms on llama-server, a verify round "
        f"T_v {c['verify_ms_per_round']:.1f} ms, tau {c['tau']:.2f} (Q4_1, gamma {result['gamma']}).",
        f"SD beats streaming AR when T_q/T_p > (gamma + RTT/T_p) / (tau - T_v/T_q): here T_q/T_p = "
        f"{c['ratio']:.2f}, against a needed {c['needed_ratio_rtt0']} at RTT 0 and "
        f"{c['needed_ratio_rtt50']} at 50 ms.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rtts", default="0,20,50")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--drafts", default="smollm2-q4_1,smollm2-q2_k")
    ap.add_argument("--modes", default=",".join(MODES), help=f"ours, of {', '.join(MODES)} (ar is always run)")
    ap.add_argument("--no-peer", action="store_true", help="our modes only (no llama-server needed)")
    ap.add_argument("--out", default="bench_results/vs_peer")
    args = ap.parse_args(argv)
    modes = tuple(dict.fromkeys(["ar", "sd"] + args.modes.split(",")))
    if set(modes) - set(MODES):
        ap.error(f"unknown modes {sorted(set(modes) - set(MODES))}")
    rtts = [float(x) for x in args.rtts.split(",")]
    trace = peer.load_prompts(n=args.prompts)
    prompts = [p.prompt_ids for p in trace.prompts]
    model = peer.default_model()
    if model is None or (not args.no_peer and peer.find_llama_server() is None):
        print(
            "needs models/build/SmolLM2-135M-Instruct.F32.gguf (server-bridge prepare) and llama-server "
            "(make llama-server)",
            file=sys.stderr,
        )
        return 2
    os.sched_setaffinity(0, {0})
    rows = []
    if not args.no_peer:
        print("llama-server, one slot, pinned to core 1", flush=True)
        rows = peer.one_robot(model, trace, rtts, args.tokens, core=1, threads=1)
        for r in rows:
            r["draft"] = None
            r["exact"] = r["matches_trace"] == r["runs"]
    print("ours: server-bridge (llamacpp engine), pinned to core 1", flush=True)
    rows += ours(prompts, rtts, args.drafts.split(","), args.tokens, args.gamma, lambda s: print(s, flush=True), modes)
    sd = next(r for r in rows if r["mode"] == "ours SD" and r["rtt_ms"] == rtts[0])
    ar = next(r for r in rows if r["mode"] == "ours AR" and r["rtt_ms"] == rtts[0])
    pe = next((r for r in rows if r["mode"] == "llama-server AR" and r["rtt_ms"] == rtts[0]), {})
    t_q, t_p, t_v, tau = (
        1e3 / ar["tokens_per_s"],
        sd["draft_ms_per_round"] / args.gamma,
        sd["verify_ms_per_round"],
        sd["tau"],
    )

    result = {
        "command": "python -m tools.bench.vs_peer " + " ".join(argv if argv is not None else sys.argv[1:]),
        "target": "smollm2-f32",
        "rtts": rtts,
        "prompts": len(prompts),
        "tokens": args.tokens,
        "gamma": args.gamma,
        "rows": rows,
        "costs": {
            "draft_ms_per_token": t_p,
            "target_ms_per_ar_token": t_q,
            "verify_ms_per_round": t_v,
            "peer_ms_per_token": pe.get("server_ms_per_token") or 0.0,
            "tau": tau,
            "ratio": t_q / t_p,
            "needed_ratio_rtt0": needed_ratio(args.gamma, tau, t_v / t_q, t_p, 0.0),
            "needed_ratio_rtt50": needed_ratio(args.gamma, tau, t_v / t_q, t_p, 50.0),
        },
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for r in rows:
        r.pop("token_ids", None)
    (out / "vs_peer.json").write_text(json.dumps(result, indent=1))
    (out / "vs_peer.md").write_text(markdown(result))
    from tools.plots import line_plot

    keys = []
    for r in rows:
        if (r["mode"], r.get("draft")) not in keys:
            keys.append((r["mode"], r.get("draft")))
    line_plot(
        out / "vs_peer.png",
        [
            (
                f"{m} {d or ''}".strip(),
                rtts,
                [
                    next(r["tokens_per_s"] for r in rows if r["mode"] == m and r.get("draft") == d and r["rtt_ms"] == t)
                    for t in rtts
                ],
            )
            for m, d in keys
        ],
        "RTT (ms)",
        "tokens/s, one robot",
        "ours (llamacpp engine) vs llama-server",
    )
    print(markdown(result))
    return 0 if all(r.get("exact", True) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
