"""Benchmark: cloud AR vs edge-cloud SD vs FSD through the emulated link, for both model pairs.

    python -m tools.bench.decoding [--rtts 0,20,50,100] [--gamma 4] [--max-tokens 64] [--prompts 10]
                          [--ablations] [--ablation-rtt 20] [--ablation-prompts 3]

FSD is SD with early-exit verdicts streamed by the verifier and pre-drafting
on the robot while it waits (agent/spec/predraft.py). With --ablations it also runs
the FSD paper's ablations on the near-identical pair at one RTT: pre-draft
workers 1..8, gamma 1..8 (SD and FSD) and the early-verdict queue policy on the
robot x on the server (the server policy needs one verifier per policy).

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

from agent.spec.decoder import DecoderConfig, EdgeDecoder, FsdOptions
from agent.spec.drafter import Drafter
from tools.cluster.local_verifier import LocalVerifier, pin_cores
from tools.cluster.netem import LinkProfile, NetemProxy
from tools.plots import line_plot

PROMPTS = Path(__file__).resolve().parents[1] / "prompts" / "bench.jsonl"
POLICIES = ("priority", "fifo", "random")
PAIRS = {"smollm2-q4_1": "near-identical (Q4_1 draft)", "smollm2-q2_k": "weaker (Q2_K requantized draft)"}
TARGET = "smollm2-f32"


def load_prompts(n: int) -> list[dict]:
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    return rows[:n]


def predict(run: dict, rtt_ms: float, ar: dict) -> float:
    """Seconds the latency model predicts for this run (ar: the AR run on the same prompt).

    FSD's draft term is what the loop waited for its draft (a miss drafts, a hit waits ~nothing).
    """
    n, m = len(run["token_ids"]), run["metrics"]
    t_c = rtt_ms / 2 / 1e3
    if run["mode"] == "ar":
        return 2 * t_c + n * m["verify_ms"] / 1e3 / max(m["rounds"], 1)
    t_v = m["verify_ms"] / 1e3 / m["rounds"]
    t_draft = m["draft_ms"] / 1e3 / m["rounds"]
    return n / m["tau"] * (2 * t_c + t_draft + t_v)


def summarize(runs: list[dict]) -> dict:
    tok = sum(len(r["token_ids"]) for r in runs)
    wall = sum(r["metrics"]["wall_s"] for r in runs)
    rounds = sum(r["metrics"]["rounds"] for r in runs)
    drafted = sum(r["metrics"]["drafted"] for r in runs)
    return {
        "runs": len(runs),
        "tokens": tok,
        "wall_s": wall,
        "tokens_per_s": tok / wall,
        "tau": tok / rounds if rounds else None,
        "acceptance_rate": sum(r["metrics"]["accepted"] for r in runs) / drafted if drafted else None,
        "predicted_s": sum(r["predicted_s"] for r in runs),
        "target_forward_passes": sum(r["metrics"]["target_forward_passes"] for r in runs),
        "bytes_up": sum(r["metrics"]["bytes_up"] for r in runs),
        "bytes_down": sum(r["metrics"]["bytes_down"] for r in runs),
        "exact": all(r.get("exact", True) for r in runs),
        "verify_ms_per_round": sum(r["metrics"]["verify_ms"] for r in runs) / rounds if rounds else None,
        "draft_ms_per_round": sum(r["metrics"]["draft_ms"] for r in runs) / rounds if rounds else None,
        **_fsd_summary(runs),
    }


def _fsd_summary(runs: list[dict]) -> dict:
    if not runs or runs[0]["mode"] != "fsd":
        return {}
    hits = sum(r["metrics"]["predraft_hits"] for r in runs)
    misses = sum(r["metrics"]["predraft_misses"] for r in runs)
    rounds = sum(r["metrics"]["rounds"] for r in runs)
    return {
        "predraft_hits": hits,
        "predraft_misses": misses,
        "predraft_miss_rate": misses / (hits + misses) if hits + misses else None,
        "predraft_failures": sum(r["metrics"]["predraft_failures"] for r in runs),
        "avg_exit_layer": sum(r["metrics"]["exit_layer_sum"] for r in runs) / rounds if rounds else None,
        "exit_ms_per_round": sum(r["metrics"]["exit_ms"] for r in runs) / rounds if rounds else None,
        "exits_received": sum(r["metrics"]["exits_received"] for r in runs),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rtts", default="0,20,50,100", help="round-trip times in ms")
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--drafts", default=",".join(PAIRS))
    ap.add_argument("--modes", default="ar,sd,fsd", help="which of ar, sd, fsd to run in the main grid")
    ap.add_argument("--workers", type=int, default=FsdOptions.workers, help="FSD pre-draft branches at once")
    ap.add_argument("--ablations", action="store_true", help="also run the FSD ablations")
    ap.add_argument("--ablation-rtt", type=float, default=20.0)
    ap.add_argument("--ablation-prompts", type=int, default=3)
    ap.add_argument("--out", default="bench_results")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    rtts = [float(x) for x in args.rtts.split(",")]
    drafts = args.drafts.split(",")
    modes = args.modes.split(",")
    prompts = load_prompts(args.prompts)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    agent_cpus, server_cpus = pin_cores()
    config = {
        "rtts_ms": rtts,
        "gamma": args.gamma,
        "max_tokens": args.max_tokens,
        "prompts": len(prompts),
        "drafts": drafts,
        "modes": modes,
        "target": TARGET,
        "temperature": 0.0,
        "fsd_workers": args.workers,
        "agent_cpus": sorted(agent_cpus),
        "server_cpus": sorted(server_cpus),
        "cpu_count": os.cpu_count(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    print(
        f"bench: {len(rtts)} RTTs x {len(prompts)} prompts x modes {modes} x drafts {drafts}, gamma "
        f"{args.gamma}, {args.max_tokens} tokens; verifier on cores {sorted(server_cpus)}, drafts on "
        f"{sorted(agent_cpus)}",
        flush=True,
    )
    runs: list[dict] = []
    ablation: list[dict] = []
    with (
        LocalVerifier(target=TARGET, cpus=server_cpus, threads=len(server_cpus)) as server,
        NetemProxy("127.0.0.1", server.port) as link,
    ):
        os.sched_setaffinity(0, agent_cpus)
        drafters = {d: Drafter(d, threads=len(agent_cpus)) for d in drafts}
        first = drafters[drafts[0]]
        bench = Runner(link, drafters, args.max_tokens, args.workers)
        bench.warm_up(args.gamma)
        total = len(rtts) * len(prompts)
        step = 0
        for rtt in rtts:
            link.set_profile(LinkProfile.from_rtt(rtt))
            for i, p in enumerate(prompts):
                step += 1
                ids = first.tokenize(p["prompt"], chat=p["chat"])
                batch = bench.compare(ids, modes, drafts, args.gamma)
                line = [f"[{step}/{total}] rtt {rtt:>5.0f} ms  {p['category']:<13}"]
                for r in batch:
                    r.update(rtt_ms=rtt, prompt=i, category=p["category"])
                    r["predicted_s"] = predict(r, rtt, batch[0])
                    runs.append(r)
                    line.append(bench.describe(r))
                print("  |  ".join(line), flush=True)
        if args.ablations:
            ablation += run_ablations(
                bench, link, drafts[0], prompts[: args.ablation_prompts], args.ablation_rtt, args.gamma
            )
        bench.close()
        config["server_metrics_tail"] = server.metrics().splitlines()[-6:]
    if args.ablations:
        ablation += run_server_policies(
            drafters_spec=drafts[0],
            prompts=prompts[: args.ablation_prompts],
            rtt=args.ablation_rtt,
            gamma=args.gamma,
            max_tokens=args.max_tokens,
            workers=args.workers,
            agent_cpus=agent_cpus,
            server_cpus=server_cpus,
        )

    table = build_table(runs, rtts, drafts)
    result = {"config": config, "table": table, "ablations": ablation, "runs": runs}
    (out / "bench.json").write_text(json.dumps(result, indent=1))
    md = render_markdown(table, config) + render_ablations(ablation)
    (out / "bench.md").write_text(md)
    plot(table, drafts, out / "bench.png")
    if ablation:
        plot_ablations(ablation, out / "bench_ablations.png")
    print("\n" + md)
    print(f"wrote {out / 'bench.json'}, {out / 'bench.md'}, {out / 'bench.png'}")
    return 0 if all(r["exact"] for r in table) and all(a["exact"] for a in ablation) else 1


class Runner:
    """The decoders of one benchmark process: AR, SD and FSD per draft, through one emulated link."""

    def __init__(self, link: NetemProxy, drafters: dict[str, Drafter], max_tokens: int, workers: int):
        self.link = link
        self.drafters = drafters
        self.max_tokens = max_tokens
        self.sd = {d: EdgeDecoder(dr, DecoderConfig(url=link.url())) for d, dr in drafters.items()}
        self.fsd = {
            d: EdgeDecoder(dr, DecoderConfig(url=link.url(), fsd=FsdOptions(workers=workers)))
            for d, dr in drafters.items()
        }

    def warm_up(self, gamma: int) -> None:
        """First forward passes allocate caches; keep them out of the figures."""
        for d, dr in self.drafters.items():
            ids = dr.tokenize("Hello")
            self.sd[d].generate(ids, mode="sd", max_tokens=4, gamma=gamma)
            self.fsd[d].generate(ids, mode="fsd", max_tokens=8, gamma=gamma)
            self.sd[d].generate(ids, mode="ar", max_tokens=4)

    def run(self, decoder: EdgeDecoder, ids: list[int], mode: str, gamma: int, draft: str | None) -> dict:
        r = decoder.generate(ids, mode=mode, max_tokens=self.max_tokens, gamma=gamma).to_json()
        r.update(draft=draft, gamma=gamma)
        return r

    def compare(self, ids: list[int], modes: list[str], drafts: list[str], gamma: int) -> list[dict]:
        """AR, then SD and FSD per draft, back to back; every run is checked against AR's tokens."""
        ar = self.run(self.sd[drafts[0]], ids, "ar", gamma, None)
        batch = [ar] if "ar" in modes else []
        for d in drafts:
            for mode in ("sd", "fsd"):
                if mode in modes:
                    r = self.run((self.sd if mode == "sd" else self.fsd)[d], ids, mode, gamma, d)
                    r["exact"] = r["token_ids"] == ar["token_ids"]
                    batch.append(r)
        ar["exact"] = True
        return [ar] + [r for r in batch if r is not ar]

    @staticmethod
    def describe(r: dict) -> str:
        m = r["metrics"]
        label = "AR" if r["mode"] == "ar" else f"{r['mode'].upper()} {r['draft']}"
        extra = f" tau {m['tau']:.2f}" if r["mode"] != "ar" else ""
        if r["mode"] == "fsd":
            extra += f" miss {m['predraft_misses']}/{m['predraft_hits'] + m['predraft_misses']}"
        flag = "" if r.get("exact", True) else " NOT EXACT"
        return f"{label}: {m['tokens_per_s']:5.1f} tok/s{extra}{flag}"

    def close(self) -> None:
        for dec in [*self.sd.values(), *self.fsd.values()]:
            dec.close()


def run_ablations(
    bench: Runner, link: NetemProxy, draft: str, prompts: list[dict], rtt: float, gamma: int
) -> list[dict]:
    """Workers 1..8 and gamma 1..8 (SD beside FSD), robot queue policies; near-identical pair."""
    link.set_profile(LinkProfile.from_rtt(rtt))
    dr = bench.drafters[draft]
    sd = bench.sd[draft]
    inputs = [dr.tokenize(p["prompt"], chat=p["chat"]) for p in prompts]
    refs = [sd.generate(ids, mode="ar", max_tokens=bench.max_tokens).token_ids for ids in inputs]
    rows = []

    def measure(kind: str, value, decoder: EdgeDecoder, mode: str, g: int) -> None:
        runs = []
        for ids, ref in zip(inputs, refs, strict=True):
            r = bench.run(decoder, ids, mode, g, draft)
            r["exact"] = r["token_ids"] == ref
            runs.append(r)
        row = {
            "ablation": kind,
            "value": value,
            "mode": mode,
            "gamma": g,
            "rtt_ms": rtt,
            **summarize([dict(r, predicted_s=0.0) for r in runs]),
        }
        rows.append(row)
        print(
            f"ablation {kind}={value} {mode}: {row['tokens_per_s']:.1f} tok/s, miss rate "
            f"{row.get('predraft_miss_rate')}",
            flush=True,
        )

    for w in (1, 2, 4, 8):
        dec = EdgeDecoder(dr, DecoderConfig(url=link.url(), fsd=FsdOptions(workers=w)))
        dec.generate(inputs[0], mode="fsd", max_tokens=16, gamma=gamma)  # warm up its context
        measure("workers", w, dec, "fsd", gamma)
        dec.close()
    for g in range(1, 9):
        measure("gamma", g, sd, "sd", g)
        measure("gamma", g, bench.fsd[draft], "fsd", g)
    return rows


def run_server_policies(
    drafters_spec: str,
    prompts: list[dict],
    rtt: float,
    gamma: int,
    max_tokens: int,
    workers: int,
    agent_cpus: set[int],
    server_cpus: set[int],
) -> list[dict]:
    """Queue policy on the robot x on the server: one verifier per server policy."""
    rows = []
    for server_policy in POLICIES:
        with (
            LocalVerifier(
                target=TARGET, cpus=server_cpus, threads=len(server_cpus), extra_args=["--exit-policy", server_policy]
            ) as server,
            NetemProxy("127.0.0.1", server.port, LinkProfile.from_rtt(rtt)) as link,
        ):
            dr = Drafter(drafters_spec, threads=len(agent_cpus))
            bench = Runner(link, {drafters_spec: dr}, max_tokens, workers)
            bench.warm_up(gamma)
            inputs = [dr.tokenize(p["prompt"], chat=p["chat"]) for p in prompts]
            refs = [bench.run(bench.sd[drafters_spec], ids, "ar", gamma, None)["token_ids"] for ids in inputs]
            for robot_policy in POLICIES:
                dec = EdgeDecoder(
                    dr, DecoderConfig(url=link.url(), fsd=FsdOptions(workers=workers, policy=robot_policy))
                )
                dec.generate(inputs[0], mode="fsd", max_tokens=16, gamma=gamma)  # warm up its context
                runs = []
                for ids, ref in zip(inputs, refs, strict=True):
                    r = bench.run(dec, ids, "fsd", gamma, drafters_spec)
                    r["exact"] = r["token_ids"] == ref
                    runs.append(r)
                dec.close()
                row = {
                    "ablation": "policy",
                    "value": f"robot {robot_policy} x server {server_policy}",
                    "mode": "fsd",
                    "gamma": gamma,
                    "rtt_ms": rtt,
                    **summarize([dict(r, predicted_s=0.0) for r in runs]),
                }
                rows.append(row)
                print(
                    f"ablation {row['value']}: {row['tokens_per_s']:.1f} tok/s, miss rate {row['predraft_miss_rate']}",
                    flush=True,
                )
            bench.close()
    return rows


def build_table(runs: list[dict], rtts: list[float], drafts: list[str]) -> list[dict]:
    table = []
    for rtt in rtts:
        ar = summarize([r for r in runs if r["rtt_ms"] == rtt and r["mode"] == "ar"])
        table.append({"rtt_ms": rtt, "mode": "AR", "pair": "target only", **ar, "speedup": 1.0})
        for d in drafts:
            sd = None
            for mode in ("sd", "fsd"):
                sel = [r for r in runs if r["rtt_ms"] == rtt and r["draft"] == d and r["mode"] == mode]
                if not sel:
                    continue
                row = summarize(sel)
                row.update(
                    rtt_ms=rtt,
                    mode=mode.upper(),
                    pair=f"{d} -> {TARGET}",
                    speedup=row["tokens_per_s"] / ar["tokens_per_s"],
                )
                if mode == "sd":
                    sd = row
                elif sd is not None:
                    row["speedup_vs_sd"] = row["tokens_per_s"] / sd["tokens_per_s"]
                    # Projection for separate machines: each FSD round's verify pass as long as an SD
                    # round's in the same run, plus the exit heads; everything else as measured.
                    rounds = row["tokens"] / row["tau"]
                    extra_s = (
                        rounds
                        * (row["verify_ms_per_round"] - row["exit_ms_per_round"] - sd["verify_ms_per_round"])
                        / 1e3
                    )
                    row["separate_machines_tokens_per_s"] = row["tokens"] / (row["wall_s"] - max(0.0, extra_s))
                    row["separate_machines_speedup_vs_sd"] = row["separate_machines_tokens_per_s"] / sd["tokens_per_s"]
                table.append(row)
    return table


def render_markdown(table: list[dict], config: dict) -> str:
    head = (
        "| RTT ms | mode | pair | tokens/s | vs AR | SD->FSD | tau | acceptance | miss rate | avg exit layer | "
        "draft ms/round | verify ms/round | wall s | model s | bytes up | bytes down | exact | "
        "SD->FSD, separate machines (projected) |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    rows = []
    fmt = lambda v, f: "-" if v is None else format(v, f)
    for r in table:
        ar = r["mode"] == "AR"
        rows.append(
            f"| {r['rtt_ms']:.0f} | {r['mode']} | {r['pair']} | {r['tokens_per_s']:.2f} | "
            f"{r['speedup']:.2f}x | {fmt(r.get('speedup_vs_sd'), '.2f')} | "
            f"{'-' if ar else fmt(r['tau'], '.2f')} | {fmt(r['acceptance_rate'], '.3f')} | "
            f"{fmt(r.get('predraft_miss_rate'), '.3f')} | {fmt(r.get('avg_exit_layer'), '.1f')} | "
            f"{'-' if ar else fmt(r['draft_ms_per_round'], '.0f')} | {fmt(r['verify_ms_per_round'], '.0f')} | "
            f"{r['wall_s']:.1f} | {r['predicted_s']:.1f} | {r['bytes_up']} | {r['bytes_down']} | "
            f"{'yes' if r['exact'] else 'NO'} | {fmt(r.get('separate_machines_speedup_vs_sd'), '.2f')} |"
        )
    note = (
        f"\n{config['prompts']} prompts x {config['max_tokens']} tokens, gamma {config['gamma']}, temperature 0, "
        f"FSD with {config['fsd_workers']} pre-draft branch(es) at once; verifier on cores "
        f"{config['server_cpus']}, drafts on {config['agent_cpus']}; started {config['started']}. "
        "'model s' is the latency model's prediction from times measured in the same run. "
        "'verify ms/round' is the server's time per verification pass; in FSD it includes the exit heads, "
        "and on this one machine any slowdown from the robot pre-drafting on the other core "
        "(python -m tools.bench.contention). The last column projects separate machines: each FSD round's verify "
        "pass as long as an SD round's in the same run plus the exit heads' own time, the rest as measured.\n"
    )
    return head + "\n".join(rows) + "\n" + note


def render_ablations(rows: list[dict]) -> str:
    if not rows:
        return ""
    out = [
        f"\n## FSD ablations (near-identical pair, RTT {rows[0]['rtt_ms']:.0f} ms, {rows[0]['runs']} prompts)\n",
        "| ablation | value | mode | gamma | tokens/s | tau | miss rate | avg exit layer | verify ms/round | exact |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    fmt = lambda v, f: "-" if v is None else format(v, f)
    for r in rows:
        out.append(
            f"| {r['ablation']} | {r['value']} | {r['mode'].upper()} | {r['gamma']} | {r['tokens_per_s']:.2f} | "
            f"{fmt(r['tau'], '.2f')} | {fmt(r.get('predraft_miss_rate'), '.3f')} | "
            f"{fmt(r.get('avg_exit_layer'), '.1f')} | {fmt(r['verify_ms_per_round'], '.0f')} | "
            f"{'yes' if r['exact'] else 'NO'} |"
        )
    return "\n".join(out) + "\n"


def plot(table: list[dict], drafts: list[str], path: Path) -> None:
    ar = [r for r in table if r["mode"] == "AR"]
    series = [("target only (cloud AR)", [r["rtt_ms"] for r in ar], [r["tokens_per_s"] for r in ar])]
    notes = []
    for d in drafts:
        for mode in ("SD", "FSD"):
            rows = [r for r in table if r["pair"].startswith(d) and r["mode"] == mode]
            if rows:
                series.append((f"{mode}, draft {d}", [r["rtt_ms"] for r in rows], [r["tokens_per_s"] for r in rows]))
                notes += [(r["rtt_ms"], r["tokens_per_s"], f"tau {r['tau']:.1f}") for r in rows if mode == "SD"]
    line_plot(
        path,
        series,
        "round-trip time (ms)",
        "committed tokens / s",
        f"AR vs SD vs FSD through the emulated link (target {TARGET}, CPU)",
        notes=notes,
    )


def plot_ablations(rows: list[dict], path: Path) -> None:
    series = []
    w = [r for r in rows if r["ablation"] == "workers"]
    if w:
        series.append(("FSD vs pre-draft workers", [r["value"] for r in w], [r["tokens_per_s"] for r in w]))
    for mode in ("sd", "fsd"):
        g = [r for r in rows if r["ablation"] == "gamma" and r["mode"] == mode]
        if g:
            series.append((f"{mode.upper()} vs gamma", [r["value"] for r in g], [r["tokens_per_s"] for r in g]))
    line_plot(
        path,
        series,
        "pre-draft workers / gamma",
        "committed tokens / s",
        f"FSD ablations at RTT {rows[0]['rtt_ms']:.0f} ms",
    )


if __name__ == "__main__":
    sys.exit(main())
