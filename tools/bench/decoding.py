"""Benchmark: cloud AR vs edge-cloud SD vs FSD through the emulated link, for both model pairs.

    python -m tools.bench.decoding [--rtts 0,20,50,100] [--gamma 4] [--max-tokens 64] [--prompts 10]
                          [--ablations] [--ablation-rtt 20] [--ablation-prompts 3]

FSD is SD with early-exit verdicts streamed by the verifier and pre-drafting
on the robot while it waits (agent/decoding/predraft.py). With --ablations it also runs
the FSD paper's ablations on the near-identical pair at one RTT: pre-draft
workers 1..8, gamma 1..8 (SD and FSD) and the early-verdict queue policy on the
robot x on the server (the server policy needs one verifier per policy).

The verifier runs in its own process pinned to its own core(s); the drafts run
here on the other core(s). For every RTT and prompt the modes run back to
back (AR, SD with each draft), so machine noise hits them alike. Writes
bench.json (every run, plus the config in use), bench.md (the table),
bench.png (tokens/s against RTT) and, with --ablations, bench_ablations.png into --out, and
prints beside each measurement what the latency model predicts:

    cloud AR = 2*T_c + n*T_q            SD = n/tau * (2*T_c + gamma*T_p + T_v)

with T_c the one-way delay, T_q the target's time per AR token, T_p the
draft's time per token and T_v the target's time per verification round
(T_q for gamma+1 positions), all measured in the same run.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from agent.decoding import DecoderSettings, open_decoder
from agent.decoding.decoder import EdgeDecoder, FsdOptions
from agent.decoding.drafter import Drafter
from tools.bench import harness
from tools.bench.link import TARGET, load_prompts, served, summarize
from tools.cluster.netem import LinkProfile, NetemProxy

POLICIES = ("priority", "fifo", "random")
PAIRS = {"smollm2-q4_1": "near-identical (Q4_1 draft)", "smollm2-q2_k": "weaker (Q2_K requantized draft)"}


def predict(run: dict, rtt_ms: float) -> float:
    """Seconds the latency model predicts for this run.

    FSD's draft term is what the loop waited for its draft (a miss drafts, a hit waits ~nothing).
    """
    n, m = len(run["token_ids"]), run["metrics"]
    t_c = rtt_ms / 2 / 1e3
    if run["mode"] == "ar":
        return 2 * t_c + n * m["verify_ms"] / 1e3 / max(m["rounds"], 1)
    t_v = m["verify_ms"] / 1e3 / m["rounds"]
    t_draft = m["draft_ms"] / 1e3 / m["rounds"]
    return n / m["tau"] * (2 * t_c + t_draft + t_v)


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--rtts", type=harness.floats, default=[0.0, 20.0, 50.0, 100.0], help="round-trip times in ms")
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--drafts", type=harness.names, default=list(PAIRS))
    ap.add_argument("--modes", type=harness.names, default=["ar", "sd", "fsd"], help="of ar, sd, fsd: the main grid")
    ap.add_argument("--workers", type=int, default=FsdOptions.workers, help="FSD pre-draft branches at once")
    ap.add_argument("--ablations", action="store_true", help="also run the FSD ablations")
    ap.add_argument("--ablation-rtt", type=float, default=20.0)
    ap.add_argument("--ablation-prompts", type=int, default=3)


def measure(args: argparse.Namespace) -> dict:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if args.quick:  # one prompt, one RTT, a few tokens: the script checked end to end
        args.prompts, args.rtts, args.max_tokens, args.ablation_prompts = 1, args.rtts[:1], 8, 1
    prompts = load_prompts(args.prompts)
    result: dict = {"target": TARGET, "prompts": len(prompts), "max_tokens": args.max_tokens, "gamma": args.gamma}
    result |= {"workers": args.workers, "ablation_rtt": args.ablation_rtt, "ablation_prompts": args.ablation_prompts}
    runs: list[dict] = []
    ablation: list[dict] = []
    with served() as s:
        result |= s.cores()
        drafters = {d: s.drafter(d) for d in args.drafts}
        bench = Runner(s.link, drafters, args.max_tokens, args.workers)
        bench.warm_up(args.gamma)
        total, step = len(args.rtts) * len(prompts), 0
        for rtt in args.rtts:
            s.link.set_profile(LinkProfile.from_rtt(rtt))
            for i, p in enumerate(prompts):
                step += 1
                ids = drafters[args.drafts[0]].tokenize(p["prompt"], chat=p["chat"])
                line = [f"[{step}/{total}] rtt {rtt:>5.0f} ms  {p['category']:<13}"]
                for r in bench.compare(ids, args.modes, args.drafts, args.gamma):
                    r.update(rtt_ms=rtt, prompt=i, category=p["category"], predicted_s=predict(r, rtt))
                    runs.append(r)
                    line.append(bench.describe(r))
                print("  |  ".join(line), flush=True)
        if args.ablations:
            ablation += run_ablations(
                bench, s.link, args.drafts[0], prompts[: args.ablation_prompts], args.ablation_rtt, args.gamma
            )
        bench.close()
        result["server_metrics_tail"] = s.metrics_tail()
    if args.ablations:
        ablation += run_server_policies(args, prompts[: args.ablation_prompts])
    result |= {"table": build_table(runs, args.rtts, args.drafts), "ablations": ablation, "runs": runs}
    result["exact"] = all(r["exact"] for r in result["table"] + ablation)
    if ablation:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        ABLATION_PLOT.write(Path(args.out) / "bench_ablations.png", result)
    return result


class Runner:
    """The decoders of one benchmark process: AR, SD and FSD per draft, through one emulated link."""

    def __init__(self, link: NetemProxy, drafters: dict[str, Drafter], max_tokens: int, workers: int):
        self.link = link
        self.drafters = drafters
        self.max_tokens = max_tokens
        self.sd = {d: open_decoder(DecoderSettings(verifier=link.url()), dr) for d, dr in drafters.items()}
        self.fsd = {
            d: open_decoder(DecoderSettings(verifier=link.url(), predraft_workers=workers), dr)
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
            "series": "FSD vs pre-draft workers" if kind == "workers" else f"{mode.upper()} vs gamma",
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
        dec = open_decoder(DecoderSettings(verifier=link.url(), predraft_workers=w), dr)
        dec.generate(inputs[0], mode="fsd", max_tokens=16, gamma=gamma)  # warm up its context
        measure("workers", w, dec, "fsd", gamma)
        dec.close()
    for g in range(1, 9):
        measure("gamma", g, sd, "sd", g)
        measure("gamma", g, bench.fsd[draft], "fsd", g)
    return rows


def run_server_policies(args: argparse.Namespace, prompts: list[dict]) -> list[dict]:
    """Queue policy on the robot x on the server: one verifier per server policy."""
    drafters_spec, rtt, gamma, workers = args.drafts[0], args.ablation_rtt, args.gamma, args.workers
    rows = []
    for server_policy in POLICIES:
        with served(profile=LinkProfile.from_rtt(rtt), extra_args=["--exit-policy", server_policy]) as s:
            link, dr = s.link, s.drafter(drafters_spec)
            bench = Runner(link, {drafters_spec: dr}, args.max_tokens, workers)
            bench.warm_up(gamma)
            inputs = [dr.tokenize(p["prompt"], chat=p["chat"]) for p in prompts]
            refs = [bench.run(bench.sd[drafters_spec], ids, "ar", gamma, None)["token_ids"] for ids in inputs]
            for robot_policy in POLICIES:
                dec = open_decoder(
                    DecoderSettings(verifier=link.url(), predraft_workers=workers, queue_policy=robot_policy), dr
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
        ar_row = {
            "rtt_ms": rtt,
            "mode": "AR",
            "pair": "target only",
            "series": "target only (cloud AR)",
            **ar,
            "speedup": 1.0,
        }
        table.append(ar_row | {"tau": None, "draft_ms_per_round": None})  # AR drafts nothing
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
                    series=f"{mode.upper()}, draft {d}",
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


def _yes(v: bool) -> str:
    return "yes" if v else "NO"


C = harness.Col
REPORT = harness.Report(
    "bench",
    "# AR vs SD vs FSD through the emulated link (target {target})",
    [
        harness.Table(
            "table",
            [
                C("rtt_ms", "RTT ms", "{:.0f}"),
                C("mode"),
                C("pair"),
                C("tokens_per_s", "tokens/s", "{:.2f}"),
                C("speedup", "vs AR", "{:.2f}x"),
                C("speedup_vs_sd", "SD->FSD", "{:.2f}"),
                C("tau", "tau", "{:.2f}"),
                C("acceptance_rate", "acceptance", "{:.3f}"),
                C("predraft_miss_rate", "miss rate", "{:.3f}"),
                C("avg_exit_layer", "avg exit layer", "{:.1f}"),
                C("draft_ms_per_round", "draft ms/round", "{:.0f}"),
                C("verify_ms_per_round", "verify ms/round", "{:.0f}"),
                C("wall_s", "wall s", "{:.1f}"),
                C("predicted_s", "model s", "{:.1f}"),
                C("bytes_up", "bytes up"),
                C("bytes_down", "bytes down"),
                C("exact", fmt=_yes),
                C("separate_machines_speedup_vs_sd", "SD->FSD, separate machines (projected)", "{:.2f}"),
            ],
            note="{prompts} prompts x {max_tokens} tokens, gamma {gamma}, temperature 0, FSD with "
            "{workers} pre-draft branch(es) at once; verifier on cores {server_cpus}, drafts on "
            "{agent_cpus}; started {started}. 'model s' is the latency model's prediction from times measured in "
            "the same run. 'verify ms/round' is the server's time per verification pass; in FSD it includes the "
            "exit heads, and on this one machine any slowdown from the robot pre-drafting on the other core "
            "(python -m tools.bench.contention). The last column projects separate machines: each FSD round's "
            "verify pass as long as an SD round's in the same run plus the exit heads' own time, the rest as "
            "measured.",
        ),
    ],
    harness.Plot(
        "table",
        x="rtt_ms",
        ys={"": "tokens_per_s"},
        group="series",
        xlabel="round-trip time (ms)",
        ylabel="committed tokens / s",
        title="AR vs SD vs FSD through the emulated link (target {target}, CPU)",
    ),
    extra=lambda result: ABLATIONS.render(result) if result["ablations"] else [],
)
ABLATIONS = harness.Table(
    "ablations",
    [
        C("ablation"),
        C("value"),
        C("mode", fmt=str.upper),
        C("gamma"),
        C("tokens_per_s", "tokens/s", "{:.2f}"),
        C("tau", "tau", "{:.2f}"),
        C("predraft_miss_rate", "miss rate", "{:.3f}"),
        C("avg_exit_layer", "avg exit layer", "{:.1f}"),
        C("verify_ms_per_round", "verify ms/round", "{:.0f}"),
        C("exact", fmt=_yes),
    ],
    "## FSD ablations (near-identical pair, RTT {ablation_rtt:.0f} ms, {ablation_prompts} prompts)",
)
ABLATION_PLOT = harness.Plot(
    "ablations",
    x="value",
    ys={"": "tokens_per_s"},
    group="series",
    xlabel="pre-draft workers / gamma",
    ylabel="committed tokens / s",
    title="FSD ablations at RTT {ablation_rtt:.0f} ms",
    where=lambda r: r["ablation"] != "policy",
)


def main(argv: list[str] | None = None) -> int:
    return harness.main(
        __doc__, REPORT, measure, add_args, argv, out="bench_results", module="tools.bench.decoding", pin_cores=False
    )


if __name__ == "__main__":
    sys.exit(main())
