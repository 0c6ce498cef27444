"""Benchmark the uplink payload modes (protocol/payload.py): what each costs on the link, and
what top-K truncation costs in acceptance.

    python -m tools.bench.payload [--part links|topk|all] [--out docs] [--prompts N]
                                  [--max-tokens 32] [--draft smollm2-q4_1] [--temperature 0.7]
                                  [--rtts 20,50] [--bandwidths 1,10,50,100]
                                  [--tokens 48] [--drafts smollm2-q4_1,smollm2-q2_k] [--temperatures 0.7,1.0]

Part `links`: bytes per verification round up and down, and committed tokens/s, per
payload mode through the emulated link at each RTT x bandwidth (the netem proxy's cap,
the same both ways): `none` at temperature 0 (greedy, ids only), then `full`, `topk`
(K = --topk) and `split` at --temperature, gamma fixed, the same seed per prompt in
every mode. For every link and prompt the modes run back to back, so machine noise
hits them alike. The verifier runs in its own process on its own core(s), the draft
here on the other(s), as in tools/bench/decoding.py. `full` sends k x V fp16 up (~98 KB a
position: ~3 s a round at 1 Mbit/s); `split` sends the target's float32 logits down
on every rejection (~196 KB). The robot's websocket keepalive is raised to
--keepalive-s: at its 2 s default a ping queued behind a full-q frame at 1 Mbit/s
times out and the link drops mid-round.

Part `topk`: the expected acceptance of one drafted token, beta = sum_x min(p(x), q_K(x)),
against K (TK-SLT's Fig. 3), computed without the network: a continuation is sampled
from the target at each temperature, and at each of its positions p is the target's
distribution and q_K the draft's, truncated to its top K and fp16-rounded exactly as
`payload.draw` puts it on the wire (K = full: the whole fp16 q). Mean over positions
with a bootstrap 95 % CI, and the relative gap to full (paired bootstrap).

Writes payload.json (each part's config and results, and the checks), payload.md
(the tables, declared below on tools/bench/harness.py), payload_links.png and payload_topk.png
into --out (--quick: one prompt, one link, a few tokens). Running one part
keeps the other's results from an existing payload.json. Ends by printing whether
split's uplink is <= 64 B a round and whether topk at DEFAULT_TOPK is within 2 % of
full's acceptance.
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

from agent.decoding import DecoderSettings, open_decoder
from agent.decoding.decoder import EdgeDecoder
from agent.decoding.link import LinkLost, ServerError
from protocol import payload, sampling
from protocol.payload import PayloadSpec
from protocol.sampling import SamplingParams
from tools.bench import harness
from tools.bench.link import load_prompts, served
from tools.cluster.netem import LinkProfile

TARGET = "smollm2-f32"  # --target: any name or GGUF path the server takes (see README for Gemma 3)
MODES = ("none", "full", "topk", "split")
KS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024)
SPLIT_UPLINK_MAX = 64  # bytes a round: the claim checked for split at gamma 4
TOPK_GAP_MAX = 0.02  # relative acceptance gap of topk at DEFAULT_TOPK to full
RUN_FIELDS = (
    "tau",
    "acceptance_rate",
    "rounds",
    "wall_s",
    "tokens_per_s",
    "bytes_up_per_round",
    "bytes_down_per_round",
    "round_bytes_up",
    "round_bytes_down",
    "residuals",
    "drafted",
    "accepted",
    "reconnects",
    "draft_ms",
    "verify_ms",
    "network_ms",
)


# --------------------------------------------------------------------------- part A: links


def run_links(args, prompts: list[dict]) -> dict:
    """Every mode back to back per link profile and prompt, through one verifier and one proxy."""
    links = [(rtt, bw) for rtt in args.rtts for bw in args.bandwidths]
    config = {
        "modes": list(MODES),
        "rtts_ms": args.rtts,
        "bandwidths_mbps": args.bandwidths,
        "temperature": args.temperature,
        "topk": args.topk,
        "gamma": args.gamma,
        "max_tokens": args.max_tokens,
        "prompts": len(prompts),
        "draft": args.draft,
        "target": args.target,
        "seed": args.seed,
        "keepalive_s": args.keepalive_s,
        "cpu_count": os.cpu_count(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    runs: list[dict] = []
    with served(args.target) as s:
        config |= s.cores()
        print(
            f"links: {len(links)} links x {len(prompts)} prompts x modes {list(MODES)}, gamma {args.gamma}, "
            f"{args.max_tokens} tokens, T {args.temperature}; verifier on cores {config['server_cpus']}, draft on "
            f"{config['agent_cpus']}",
            flush=True,
        )
        link, drafter = s.link, s.drafter(args.draft)
        # a full q frame takes seconds at 1 Mbit/s and a keepalive ping queues behind it
        decoders = {
            m: open_decoder(
                DecoderSettings(verifier=link.url(), payload=m, topk=args.topk, keepalive_s=args.keepalive_s),
                drafter,
            )
            for m in MODES
        }
        inputs = [drafter.tokenize(p["prompt"], chat=p["chat"] and bool(drafter.chat_template)) for p in prompts]
        for m, dec in decoders.items():  # first passes allocate caches: keep them out of the figures
            dec.generate(
                inputs[0], mode="sd", max_tokens=4, params=mode_params(m, args.temperature, 0), gamma=args.gamma
            )
        total, step = len(links) * len(prompts) * len(MODES), 0
        for rtt, bw in links:
            link.set_profile(LinkProfile.from_rtt(rtt, bandwidth_mbps=bw))
            for i, ids in enumerate(inputs):
                for m, dec in decoders.items():
                    step += 1
                    r = run_one(dec, ids, m, args, seed=args.seed + i)
                    r.update(rtt_ms=rtt, bandwidth_mbps=bw, prompt=i, category=prompts[i]["category"])
                    runs.append(r)
                    print(f"[{step}/{total}] rtt {rtt:>3.0f} ms {bw:>5g} Mbit/s prompt {i} {describe(r)}", flush=True)
        for dec in decoders.values():
            dec.close()
        config["server_metrics_tail"] = s.metrics_tail()
    return {"config": config, "runs": runs, "summary": summarize_links(runs)}


def mode_params(mode: str, temperature: float, seed: int) -> SamplingParams:
    """`none` is the greedy baseline; the payload modes sample at `temperature`."""
    return SamplingParams(0.0 if mode == "none" else temperature, 0, seed)


def run_one(dec: EdgeDecoder, ids: list[int], mode: str, args, seed: int) -> dict:
    """One generation's record; a run the link gave up on is recorded with its error, not fatal."""
    params = mode_params(mode, args.temperature, seed)
    row = {"mode": mode, "temperature": params.temperature, "seed": seed}
    try:
        g = dec.generate(ids, mode="sd", max_tokens=args.max_tokens, params=params, gamma=args.gamma).to_json()
    except (LinkLost, ServerError) as e:
        return {**row, "payload": str(dec.payload.for_params(params)), "error": str(e), "tokens": len(e.token_ids)}
    m = g["metrics"]
    return {**row, "payload": m["payload"], "tokens": len(g["token_ids"]), **{f: m[f] for f in RUN_FIELDS}}


def describe(r: dict) -> str:
    if "error" in r:
        return f"{r['mode']:<5} FAILED after {r['tokens']} tokens: {r['error']}"
    acc = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
    lost = f"  reconnects {r['reconnects']}" if r["reconnects"] else ""
    return (
        f"{r['mode']:<5} {r['tokens_per_s']:6.2f} tok/s  tau {r['tau']:.2f}  acc {acc}  "
        f"up {r['bytes_up_per_round']:9.0f} B/round  down {r['bytes_down_per_round']:8.0f} B/round  "
        f"residuals {r['residuals']}  wall {r['wall_s']:.1f} s{lost}"
    )


def summarize_links(runs: list[dict]) -> list[dict]:
    """Per (mode, RTT, bandwidth): bytes per round (over all rounds), committed tokens / total wall, acceptance."""
    rows = []
    keys = sorted(
        {(r["mode"], r["rtt_ms"], r["bandwidth_mbps"]) for r in runs}, key=lambda k: (MODES.index(k[0]), k[1], k[2])
    )
    for mode, rtt, bw in keys:
        sel = [r for r in runs if (r["mode"], r["rtt_ms"], r["bandwidth_mbps"]) == (mode, rtt, bw)]
        ok = [r for r in sel if "error" not in r]
        rounds = sum(r["rounds"] for r in ok)
        drafted = sum(r["drafted"] for r in ok)
        wall = sum(r["wall_s"] for r in ok)
        tokens = sum(r["tokens"] for r in ok)
        rows.append(
            {
                "mode": mode,
                "payload": sel[0]["payload"],
                "rtt_ms": rtt,
                "bandwidth_mbps": bw,
                "runs": len(ok),
                "failed": len(sel) - len(ok),
                "tokens": tokens,
                "wall_s": wall,
                "rounds": rounds,
                "tokens_per_s": tokens / wall if wall else None,
                "tau": tokens / rounds if rounds else None,
                "acceptance_rate": sum(r["accepted"] for r in ok) / drafted if drafted else None,
                "bytes_up_per_round": sum(r["round_bytes_up"] for r in ok) / rounds if rounds else None,
                "bytes_down_per_round": sum(r["round_bytes_down"] for r in ok) / rounds if rounds else None,
                "residuals_per_round": sum(r["residuals"] for r in ok) / rounds if rounds else None,
            }
        )
    return rows


# --------------------------------------------------------------------------- part B: acceptance vs K


def run_topk(args, prompts: list[dict]) -> dict:
    """beta per position for every draft, temperature and K on target-sampled continuations."""
    from server_bridge.target import load_target  # the target: only this part needs it

    ks = sorted(set(args.ks) | {payload.DEFAULT_TOPK})
    config = {
        "temperatures": args.temperatures,
        "ks": ks,
        "drafts": args.drafts,
        "target": args.target,
        "prompts": len(prompts),
        "tokens": args.tokens,
        "seed": args.seed,
        "bootstrap": args.bootstrap,
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    print(
        f"topk: drafts {args.drafts} x T {args.temperatures} x {len(prompts)} prompts x {args.tokens} "
        f"target-sampled tokens; K {ks} and full",
        flush=True,
    )
    target = load_target(args.target)
    drafters = {d: open_decoder(DecoderSettings(draft=d, threads=os.cpu_count() or 1)).drafter for d in args.drafts}
    first = drafters[args.drafts[0]]
    betas: dict[tuple[str, float], dict[int | None, list[float]]] = {
        (d, t): {k: [] for k in [*ks, None]} for d in args.drafts for t in args.temperatures
    }
    stops = set(target.eos_ids) | first.eos_ids
    for t in args.temperatures:
        for i, p in enumerate(prompts):
            ids = first.tokenize(p["prompt"], chat=p["chat"] and bool(first.chat_template))  # Gemma GGUF: none
            params = SamplingParams(t, 0, args.seed + i)
            tokens, target_logits = target_continuation(target, ids, args.tokens, params, stops)
            for d, drafter in drafters.items():
                for j in range(len(tokens)):
                    row = position_betas(target_logits[j], drafter.next_logits(ids + tokens[:j]), params, ks)
                    for k, b in row.items():
                        betas[(d, t)][k].append(b)
                full = np.mean(betas[(d, t)][None][-len(tokens) :])
                print(
                    f"T {t} prompt {i} draft {d}: {len(tokens)} positions, mean acceptance (full q) {full:.3f}",
                    flush=True,
                )
    rows = []
    for (d, t), by_k in betas.items():
        for row in summarize_topk({k: np.array(v) for k, v in by_k.items()}, args.bootstrap, args.seed):
            rows.append({"draft": d, "temperature": t, **row})
    return {"config": config, "rows": rows}


def target_continuation(
    target, prompt_ids: list[int], n: int, params: SamplingParams, stops: set[int]
) -> tuple[list[int], np.ndarray]:
    """Up to n tokens sampled from the target after prompt_ids, and the float32 logits [n, V] each was drawn from."""
    rng = np.random.default_rng(params.seed)
    state = target.new_state(prompt_ids)
    tokens, rows = [], []
    for _ in range(n):
        logits = target.score(state, [])[0]
        token = sampling.sample(sampling.probs_from_logits(logits[None], params)[0], rng)
        target.commit(state, [token], len(state.ids))
        rows.append(logits)
        tokens.append(token)
        if token in stops:
            break
    return tokens, np.stack(rows)


def wire_q(draft_logits: np.ndarray, params: SamplingParams, k: int | None) -> np.ndarray:
    """The q [V] the draft samples from and the server judges by: top-k renormalized and fp16-rounded
    (k None: the whole fp16 q), built by the robot's own `payload.draw`."""
    spec = PayloadSpec("full") if k is None else PayloadSpec("topk", k)
    return payload.draw(draft_logits, params, spec, np.random.default_rng(0))[1]


def acceptance(p: np.ndarray, q: np.ndarray) -> float:
    """The chance one token drawn from q is accepted against p: sum_x min(p(x), q(x))."""
    return float(np.minimum(p, q).sum())


def position_betas(
    target_logits: np.ndarray, draft_logits: np.ndarray, params: SamplingParams, ks: list[int]
) -> dict[int | None, float]:
    """beta at one position for every K and for full (key None)."""
    p = sampling.probs_from_logits(np.asarray(target_logits)[None], params)[0]
    return {k: acceptance(p, wire_q(draft_logits, params, k)) for k in [*ks, None]}


def summarize_topk(betas: dict[int | None, np.ndarray], n_boot: int, seed: int) -> list[dict]:
    """Mean beta per K with a bootstrap 95 % CI over positions, and the relative gap to full (key None).

    The gap's CI resamples the same positions for K and full: it is the paired difference.
    """
    full = betas[None]
    idx = np.random.default_rng(seed).integers(0, len(full), (n_boot, len(full)))
    full_means = full[idx].mean(axis=1)
    rows = []
    for k in sorted(betas, key=lambda k: np.inf if k is None else k):
        b = betas[k]
        means = b[idx].mean(axis=1)
        rows.append(
            {
                "k": k,
                "positions": len(b),
                "acceptance": float(b.mean()),
                "ci95": [float(x) for x in np.percentile(means, [2.5, 97.5])],
                "gap_to_full": float(1 - b.mean() / full.mean()),
                "gap_ci95": [float(x) for x in np.percentile(1 - means / full_means, [2.5, 97.5])],
            }
        )
    return rows


# --------------------------------------------------------------------------- checks and reports


def checks(result: dict) -> dict:
    """The two claims payload.py rests on, from whichever parts the result holds."""
    out: dict = {}
    links = result.get("links")
    if links:
        ok = [r for r in links["runs"] if r["mode"] == "split" and "error" not in r]
        rounds = sum(r["rounds"] for r in ok)
        if rounds:
            up = sum(r["round_bytes_up"] for r in ok) / rounds
            out["split_uplink"] = {
                "bytes_up_per_round": up,
                "gamma": links["config"]["gamma"],
                "limit": SPLIT_UPLINK_MAX,
                "ok": up <= SPLIT_UPLINK_MAX,
            }
        acc = {
            m: _acceptance([r for r in links["runs"] if r["mode"] == m and "error" not in r]) for m in ("full", "topk")
        }
        if None not in acc.values():
            gap = 1 - acc["topk"] / acc["full"]
            out["topk_gap_links"] = {
                "k": links["config"]["topk"],
                "temperature": links["config"]["temperature"],
                "topk": acc["topk"],
                "full": acc["full"],
                "gap": gap,
                "ok": abs(gap) <= TOPK_GAP_MAX,
            }
    topk = result.get("topk")
    if topk:
        out["topk_gap"] = [
            {
                "draft": r["draft"],
                "temperature": r["temperature"],
                "k": r["k"],
                "gap": r["gap_to_full"],
                "gap_ci95": r["gap_ci95"],
                "ok": abs(r["gap_to_full"]) <= TOPK_GAP_MAX,
            }
            for r in topk["rows"]
            if r["k"] == payload.DEFAULT_TOPK
        ]
    return out


def _acceptance(runs: list[dict]) -> float | None:
    drafted = sum(r["drafted"] for r in runs)
    return sum(r["accepted"] for r in runs) / drafted if drafted else None


def check_lines(c: dict) -> list[str]:
    lines = []
    if "split_uplink" in c:
        s = c["split_uplink"]
        lines.append(
            f"split uplink per round at gamma {s['gamma']}: {s['bytes_up_per_round']:.1f} B -> "
            f"{'<=' if s['ok'] else 'ABOVE'} {s['limit']} B"
        )
    for g in c.get("topk_gap", []):
        lines.append(
            f"topk K={g['k']} vs full, {g['draft']} T {g['temperature']} (part B): gap "
            f"{100 * g['gap']:.2f} % (95 % CI {100 * g['gap_ci95'][0]:.2f}..{100 * g['gap_ci95'][1]:.2f}) "
            f"-> {'within' if g['ok'] else 'NOT within'} {100 * TOPK_GAP_MAX:.0f} %"
        )
    if "topk_gap_links" in c:
        g = c["topk_gap_links"]
        lines.append(
            f"topk K={g['k']} vs full, T {g['temperature']} (part A, measured): acceptance {g['topk']:.3f} "
            f"vs {g['full']:.3f}, gap {100 * g['gap']:.2f} % -> {'within' if g['ok'] else 'NOT within'} "
            f"{100 * TOPK_GAP_MAX:.0f} % (few prompts: noisy)"
        )
    return lines or ["no results to check"]


def merge(old: dict | None, new: dict) -> dict:
    """The new parts over the old file's; the checks recomputed from what is there."""
    result = {k: v for k, v in (old or {}).items() if k in ("links", "topk")}
    result.update(new)
    result["checks"] = checks(result)
    return result


# --------------------------------------------------------------------------- report


def links_view(links: dict) -> dict:
    """Part A as the report reads it: its config, and a row per (mode, RTT, bandwidth) with its plot series."""
    label = {"none": "none (greedy)"}
    rows = [
        r
        | {"link": f"{r['bandwidth_mbps']:g}", "series": f"{label.get(r['mode'], r['payload'])}, RTT {r['rtt_ms']:.0f}"}
        for r in links["summary"]
    ]
    return links["config"] | {"rows": rows}


def topk_view(topk: dict) -> dict:
    """Part B as the report reads it: a row per K with a cell per (draft, T), and the plot's long rows."""
    c = topk["config"]
    cell = {(r["draft"], r["temperature"], r["k"]): r for r in topk["rows"]}
    cols = [f"{d}, T {t}" for d in c["drafts"] for t in c["temperatures"]]
    wide = [
        {"k": "full" if k is None else k}
        | {f"{d}, T {t}": cell[(d, t, k)] for d in c["drafts"] for t in c["temperatures"]}
        for k in [*c["ks"], None]
    ]
    long = [
        r | {"K": "full" if r["k"] is None else str(r["k"]), "series": f"{r['draft']}, T {r['temperature']}"}
        for r in topk["rows"]
    ]
    return c | {"rows": wide, "cols": cols, "long": long, "positions": topk["rows"][0]["positions"]}


def _beta(r: dict) -> str:
    gap = "" if r["k"] is None else f", gap {100 * r['gap_to_full']:.1f} %"
    return f"{r['acceptance']:.3f} ({r['ci95'][0]:.3f}-{r['ci95'][1]:.3f}){gap}"


C = harness.Col
LINKS = harness.Table(
    "rows",
    [
        C("mode"),
        C("payload"),
        C("rtt_ms", "RTT ms", "{:.0f}"),
        C("bandwidth_mbps", "Mbit/s", "{:g}"),
        C("bytes_up_per_round", "bytes up/round", "{:,.0f}"),
        C("bytes_down_per_round", "bytes down/round", "{:,.0f}"),
        C("tokens_per_s", "tokens/s", "{:.2f}"),
        C("tau", "tau", "{:.2f}"),
        C("acceptance_rate", "acceptance", "{:.3f}"),
        C("residuals_per_round", "residuals/round", "{:.2f}"),
        C("runs"),
        C("failed"),
    ],
    "## Bytes and speed per link ({draft} -> {target})",
    "{prompts} prompts x {max_tokens} tokens per run, gamma {gamma} (fixed policy); `none` greedy, the others at "
    "T {temperature} with the same seed per prompt; bandwidth capped both ways by the netem proxy; verifier on "
    "cores {server_cpus}, draft on {agent_cpus}; started {started}. Bytes are the verify and result frames of a "
    "round (split's residual logits included), averaged over all rounds.",
)
TOPK = harness.Table(
    "rows",
    lambda view: [C("k", "K")] + [C(col, fmt=_beta) for col in view["cols"]],
    "## Acceptance against K (target {target})",
    "beta = sum_x min(p(x), q_K(x)) per position of {prompts} target-sampled continuations (<= {tokens} tokens "
    "each; {positions} positions for the first column), q_K as `payload.draw` sends it (top K renormalized, fp16). "
    "Mean (bootstrap 95 % CI over positions, {bootstrap} resamples); gap = 1 - beta_K / beta_full. "
    "Started {started}.",
)
LINKS_PLOT = harness.Plot(
    "rows",
    x="link",
    ys={"": "tokens_per_s"},
    group="series",
    xlabel="bandwidth (Mbit/s, each way)",
    ylabel="committed tokens / s",
    title="Payload modes, {draft} -> {target}, gamma {gamma}, T {temperature}",
)
TOPK_PLOT = harness.Plot(
    "long",
    x="K",
    ys={"": "acceptance"},
    group="series",
    xlabel="K (top-K ids sent per position; full: the whole q)",
    ylabel="acceptance (sum min(p, q_K))",
    title=f"Acceptance against K (DEFAULT_TOPK = {payload.DEFAULT_TOPK})",
)


def sections(result: dict) -> list[str]:
    """Each part's table where the result holds it, then the checks."""
    lines = LINKS.render(links_view(result["links"])) if result.get("links") else []
    lines += TOPK.render(topk_view(result["topk"])) if result.get("topk") else []
    return lines + ["## Checks", ""] + [f"- {line}" for line in check_lines(result["checks"])]


REPORT = harness.Report("payload", "# Uplink payload modes", [], intro="`{command}`", extra=sections)


def write_plots(out: Path, result: dict) -> None:
    """payload_links.png (tok/s against bandwidth, a line per mode and RTT) and payload_topk.png."""
    out.mkdir(parents=True, exist_ok=True)
    if result.get("links"):
        LINKS_PLOT.write(out / "payload_links.png", links_view(result["links"]))
    if result.get("topk"):
        TOPK_PLOT.write(out / "payload_topk.png", topk_view(result["topk"]))


# --------------------------------------------------------------------------- CLI


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--part", choices=("links", "topk", "all"), default="all")
    ap.add_argument("--prompts", type=int, help="prompts per part (default 3 for links, 6 for topk)")
    ap.add_argument("--seed", type=int, default=0, help="prompt i samples with seed + i")
    ap.add_argument("--target", default=TARGET, help="target name or GGUF path (both parts)")
    links = ap.add_argument_group("part links")
    links.add_argument("--draft", default="smollm2-q4_1")
    links.add_argument("--max-tokens", type=int, default=32)
    links.add_argument("--temperature", type=float, default=0.7, help="of full, topk and split (none is greedy)")
    links.add_argument("--topk", type=int, default=payload.DEFAULT_TOPK, help="K of the topk mode")
    links.add_argument("--gamma", type=int, default=4)
    links.add_argument("--rtts", type=harness.floats, default=[20.0, 50.0], help="round-trip times in ms")
    links.add_argument("--bandwidths", type=harness.floats, default=[1.0, 10.0, 50.0, 100.0], help="Mbit/s each way")
    links.add_argument(
        "--keepalive-s",
        type=float,
        default=10.0,
        help="the robot's websocket ping interval and timeout; its default 2 s is shorter than "
        "one full-q frame at 1 Mbit/s",
    )
    topk = ap.add_argument_group("part topk")
    topk.add_argument("--drafts", type=harness.names, default=["smollm2-q4_1", "smollm2-q2_k"])
    topk.add_argument("--temperatures", type=harness.floats, default=[0.7, 1.0])
    topk.add_argument("--tokens", type=int, default=48, help="target-sampled tokens per prompt")
    topk.add_argument("--ks", type=harness.ints, default=list(KS))
    topk.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples for the CIs")


def measure(args: argparse.Namespace) -> dict:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if args.quick:  # one prompt, one link, one draft and temperature, a few tokens: the script end to end
        args.prompts, args.rtts, args.bandwidths, args.max_tokens = 1, args.rtts[:1], args.bandwidths[-1:], 8
        args.drafts, args.temperatures, args.tokens, args.ks, args.bootstrap = args.drafts[:1], [0.7], 8, [1, 16], 100
    new: dict = {}
    if args.part in ("links", "all"):
        new["links"] = run_links(args, load_prompts(args.prompts or 3))
    if args.part in ("topk", "all"):
        new["topk"] = run_topk(args, load_prompts(args.prompts or 6))
    path = Path(args.out) / "payload.json"
    old = json.loads(path.read_text()) if args.part != "all" and path.exists() else None
    result = merge(old, new)
    write_plots(Path(args.out), result)
    print("\n".join(check_lines(result["checks"])), flush=True)
    result["exact"] = not any("error" in r for r in new.get("links", {}).get("runs", []))  # a lost run exits 1
    return result


def main(argv: list[str] | None = None) -> int:
    return harness.main(__doc__, REPORT, measure, add_args, argv, out="docs", pin_cores=False)


if __name__ == "__main__":
    sys.exit(main())
