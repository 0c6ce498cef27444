"""What the answer grammar changes: tau, tokens per answer, parses and time, with and without it, side by side.

The same navigation prompts (tools/robot/nav_prompt_eval.py's situations: one frame, and 1-3 remembered
steps) go through SD (gamma 4, T = 0) against one local verifier behind the network emulator,
each prompt twice in a row after both sides have prefilled it: once free, once under the NaVILA answer grammar
(agent/robot/actions.py,
applied on both sides by protocol/structured.py, LLGuidance). Also timed: the grammar's mask over the
whole vocabulary (what a T > 0 position costs each side) and for one token (what a greedy position
costs when the best token is allowed).

    python -m tools.bench.grammar_cost --out docs/grammar          # ~3 min on 2 cores; --quick: 2 prompts

Writes grammar.json, grammar.md and grammar.png under --out (tools/bench/harness.py).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time

from agent.app.prompt import messages, observation_text
from agent.decoding import DecoderSettings, open_decoder
from agent.decoding.decoder import EdgeDecoder
from agent.decoding.drafter import Drafter
from agent.robot.actions import answer_grammar, answer_max_tokens, complete, parse_action
from protocol.sampling import SamplingParams
from tools.bench import harness
from tools.bench.link import served
from tools.cluster.netem import LinkProfile
from tools.robot.nav_prompt_eval import TARGET, memory_situations, situations

RUNS = ("free", "grammar")


def mask_cost(drafter: Drafter, gbnf: str, repeats: int = 20) -> dict:
    """ms for a whole-vocabulary mask and for one allowed-token check, mid-reason (the widest state)."""
    state = drafter.grammars.compile("gbnf", gbnf).walk(drafter.tokenize("The red box is to the left"))
    t0 = time.perf_counter()
    for _ in range(repeats):
        state.mask()
    whole = (time.perf_counter() - t0) * 1e3 / repeats
    t0 = time.perf_counter()
    for _ in range(repeats):
        state.allows(drafter.tokenize(" so")[0])
    one = (time.perf_counter() - t0) * 1e3 / repeats
    return {
        "whole_vocabulary_mask_ms": round(whole, 2),
        "one_token_check_ms": round(one, 3),
        "vocab": drafter.vocab_size,
    }


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--n", type=int, default=12, help="prompts of each set (single frame, with memory)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--rtt-ms", type=float, default=20.0)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--draft", default="smollm2-q4_1")


def measure(args: argparse.Namespace) -> dict:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if args.quick:
        args.n = 1
    gbnf = answer_grammar()
    cases = [([], s) for s in situations(args.n, args.seed)] + [
        (c.memory(), c.now) for c in memory_situations(args.n, args.seed)
    ]
    rows: dict[str, list[dict]] = {r: [] for r in RUNS}
    with served(None, LinkProfile.from_rtt(args.rtt_ms, jitter_ms=2)) as s:
        drafter = s.drafter(args.draft)
        dec = open_decoder(DecoderSettings(verifier=s.link.url()), drafter)
        stops = dec.stop_ids()
        try:
            for i, (memory, now) in enumerate(cases):
                ids = drafter.tokenize(
                    drafter.apply_chat_template(messages(f"go to the {TARGET}", observation_text(now), memory))
                )
                # both sides prefill the prompt first, so neither run below pays for it
                drafter.next_logits(ids)
                dec.generate(ids, mode="ar", max_tokens=1, session="cost")
                for run in RUNS:
                    rows[run].append(
                        answer(dec, ids, gbnf if run == "grammar" else None, args.gamma, stops)
                        | {"case": i, "memory": len(memory)}
                    )
                f, g = rows["free"][-1], rows["grammar"][-1]
                print(
                    f"[{i + 1:2d}/{len(cases)}] free {f['tokens']:3d} tok tau {f['tau'] or 0:.2f} {f['parse']:<8} | "
                    f"grammar {g['tokens']:3d} tok tau {g['tau'] or 0:.2f} {g['parse']}",
                    flush=True,
                )
            cost = mask_cost(drafter, gbnf)
        finally:
            dec.close()
    return {
        "pair": f"{args.draft} -> smollm2-f32",
        "rtt_ms": args.rtt_ms,
        "gamma": args.gamma,
        "prompts": len(cases),
        "summary": [summary(r, rows[r]) for r in RUNS],
        "mask_cost": cost,
        "rows": rows,
    } | cost


def answer(dec: EdgeDecoder, ids: list[int], grammar: str | None, gamma: int, stops: set[int]) -> dict:
    """One SD answer at T = 0 (under `grammar` where given), stopped where the action is complete."""
    detok = dec.drafter.detokenize
    gen = dec.generate(
        ids,
        mode="sd",
        gamma=gamma,
        max_tokens=answer_max_tokens(),
        params=SamplingParams(),
        until=lambda out: complete(detok(out, skip=stops)),
        grammar=grammar,
        session="cost",
    )
    m = gen.metrics
    return {
        "tokens": len(gen.token_ids),
        "tau": m.tau,
        "rounds": m.rounds,
        "acceptance_rate": m.acceptance_rate,
        "wall_ms": round(m.wall_s * 1e3, 1),
        "verify_ms": round(m.verify_ms, 1),
        "draft_ms": round(m.draft_ms, 1),
        "parse": parse_action(gen.text).how,
        "text": gen.text,
    }


def summary(run: str, rs: list[dict]) -> dict:
    """Means over one run's answers, and how many parsed exactly, tolerantly or not at all."""

    def mean(k: str) -> float:
        return round(statistics.fmean(r[k] for r in rs if r[k] is not None), 3)

    row = {"run": run, "answers": len(rs), "tokens_per_answer": mean("tokens"), "tau": mean("tau")}
    row |= {k: mean(k) for k in ("acceptance_rate", "rounds", "wall_ms", "verify_ms", "draft_ms")}
    row |= {k: sum(r["parse"] == k for r in rs) for k in ("exact", "tolerant", "miss")}
    return row | {"wall_ms_100": row["wall_ms"] / 100, "exact_x10": 10 * row["exact"] / len(rs)}


C = harness.Col
REPORT = harness.Report(
    "grammar",
    "# The answer grammar: SD with and without it ({pair}, gamma {gamma}, T = 0, RTT {rtt_ms:.0f} ms)",
    [
        harness.Table(
            "summary",
            [
                C("run"),
                C("tokens_per_answer", "tokens/answer"),
                C("tau"),
                C("acceptance_rate", "acceptance"),
                C("rounds"),
                C("wall_ms", "ms/answer"),
                C("verify_ms", "verify ms"),
                C("draft_ms", "draft ms"),
                C("exact"),
                C("tolerant"),
                C("miss"),
            ],
            note="llama.cpp's grammar sampler on the draft's vocabulary ({vocab} tokens): a whole mask "
            "{whole_vocabulary_mask_ms} ms (each T > 0 position, each side), one token {one_token_check_ms} ms "
            "(a greedy position whose best token is allowed).",
        )
    ],
    harness.Plot(
        "summary",
        x="run",
        ys={
            "tokens/answer": "tokens_per_answer",
            "tau": "tau",
            "ms/answer / 100": "wall_ms_100",
            "exact parses / answers x 10": "exact_x10",
        },
        xlabel="",
        ylabel="value",
        title="SD with and without the answer grammar ({pair})",
        kind="bar",
    ),
    intro="`{command}`; {prompts} navigation prompts, each answered both ways in a row.",
)


def main(argv: list[str] | None = None) -> int:
    return harness.main(
        __doc__, REPORT, measure, add_args, argv, out="docs/grammar", module="tools.bench.grammar_cost", pin_cores=False
    )


if __name__ == "__main__":
    sys.exit(main())
