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
import sys

from agent.decoding import DecoderSettings, open_decoder
from server_bridge.ops.fleet import LocalVerifier
from tools.bench import harness, peer
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
        harness.pin({0})
        drafters = {d: open_decoder(DecoderSettings(draft=d, threads=1)).drafter for d in drafts}
        dec = {
            (d, m): open_decoder(
                DecoderSettings(
                    verifier=link.url(),
                    predraft_workers=1,
                    exits="" if "without" in m else "all",
                    draft_policy="predictor+optimal" if "predictor" in m else "fixed",
                ),
                dr,
            )
            for d, dr in drafters.items()
            for m in modes
        }
        for (_, m), x in dec.items():  # warm-up
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


def costs_note(result: dict) -> list[str]:
    c = result["costs"]
    return [
        "Per-pass costs measured in this run (RTT 0): "
        f"draft T_p {c['draft_ms_per_token']:.1f} ms/token (Q4_1), target T_q {c['target_ms_per_ar_token']:.1f} "
        f"ms per AR token on our server, {c['peer_ms_per_token']:.1f} ms on llama-server, a verify round "
        f"T_v {c['verify_ms_per_round']:.1f} ms, tau {c['tau']:.2f} (Q4_1, gamma {result['gamma']}).",
        f"SD beats streaming AR when T_q/T_p > (gamma + RTT/T_p) / (tau - T_v/T_q): here T_q/T_p = "
        f"{c['ratio']:.2f}, against a needed {c['needed_ratio_rtt0']} at RTT 0 and "
        f"{c['needed_ratio_rtt50']} at 50 ms.",
    ]


def _columns(result: dict) -> list[harness.Col]:
    return [
        harness.Col("mode"),
        harness.Col("draft"),
        *[harness.Col(f"tokens_per_s@{r}", f"tok/s at RTT {r:.0f} ms", "{:.1f}") for r in result["rtts"]],
        harness.Col("exact", fmt=lambda x: "yes" if x else "NO"),
    ]


REPORT = harness.Report(
    "vs_peer",
    "# One robot: our verifier (llamacpp engine) against llama-server, {target}",
    [
        harness.Table(
            "table",
            _columns,
            "{prompts} prompts x {tokens} tokens, greedy, gamma {gamma}; servers on core 1 with 1 thread, "
            "robot on core 0.",
        )
    ],
    harness.Plot(
        "rows",
        x="rtt_ms",
        ys={"": "tokens_per_s"},
        group="series",
        xlabel="RTT (ms)",
        ylabel="tokens/s, one robot",
        title="ours (llamacpp engine) vs llama-server",
    ),
    extra=costs_note,
)


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--rtts", type=harness.floats, default=[0.0, 20.0, 50.0])
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--drafts", type=harness.names, default=["smollm2-q4_1", "smollm2-q2_k"])
    ap.add_argument("--modes", default=",".join(MODES), help=f"ours, of {', '.join(MODES)} (ar is always run)")
    ap.add_argument("--no-peer", action="store_true", help="our modes only (no llama-server needed)")


def measure(args: argparse.Namespace) -> dict:
    modes = tuple(dict.fromkeys(["ar", "sd"] + args.modes.split(",")))
    if set(modes) - set(MODES):
        raise SystemExit(f"unknown modes {sorted(set(modes) - set(MODES))}")
    rtts = args.rtts
    trace = peer.load_prompts(n=args.prompts)
    prompts = [p.prompt_ids for p in trace.prompts]
    model = peer.default_model()
    if model is None or (not args.no_peer and peer.find_llama_server() is None):
        raise SystemExit(
            "needs models/build/SmolLM2-135M-Instruct.F32.gguf (server-bridge prepare) and llama-server "
            "(make llama-server)"
        )
    rows = []
    if not args.no_peer:
        print("llama-server, one slot, pinned to core 1", flush=True)
        rows = peer.one_robot(model, trace, rtts, args.tokens, core=1, threads=1)
        for r in rows:
            r["draft"] = None
            r["exact"] = r["matches_trace"] == r["runs"]
    print("ours: server-bridge (llamacpp engine), pinned to core 1", flush=True)
    rows += ours(prompts, rtts, args.drafts, args.tokens, args.gamma, lambda s: print(s, flush=True), modes)
    if not all(r.get("exact", True) for r in rows):
        raise SystemExit(
            "a run's ids differ from our AR's (or the trace's): " + str([r for r in rows if not r.get("exact", True)])
        )
    sd = next(r for r in rows if r["mode"] == "ours SD" and r["rtt_ms"] == rtts[0])
    ar = next(r for r in rows if r["mode"] == "ours AR" and r["rtt_ms"] == rtts[0])
    pe = next((r for r in rows if r["mode"] == "llama-server AR" and r["rtt_ms"] == rtts[0]), {})
    t_q, t_p, t_v, tau = (
        1e3 / ar["tokens_per_s"],
        sd["draft_ms_per_round"] / args.gamma,
        sd["verify_ms_per_round"],
        sd["tau"],
    )
    for r in rows:
        r.pop("token_ids", None)
        r["series"] = f"{r['mode']} {r.get('draft') or ''}".strip()
    table = harness.pivot(rows, ("mode", "draft", "exact"), "rtt_ms", "tokens_per_s")
    return {
        "target": "smollm2-f32",
        "rtts": rtts,
        "prompts": len(prompts),
        "tokens": args.tokens,
        "gamma": args.gamma,
        "rows": rows,
        "table": table,
        "exact": all(r.get("exact", True) for r in rows),  # harness.main exits 1 where not
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


def main(argv: list[str] | None = None) -> int:
    # the robot (this process) on core 0; both servers pin themselves to core 1
    return harness.main(__doc__, REPORT, measure, add_args, argv, out="bench_results/vs_peer", cores_default="0")


if __name__ == "__main__":
    sys.exit(main())
