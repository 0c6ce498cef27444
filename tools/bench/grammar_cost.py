"""What the answer grammar changes: tau, tokens per answer, parses and time, with and without it, side by side.

The same navigation prompts (tools/robot/nav_prompt_eval.py's situations: one frame, and 1-3 remembered
steps) go through SD (gamma 4, T = 0) against one local verifier behind the network emulator,
each prompt twice in a row after both sides have prefilled it: once free, once under the NaVILA answer grammar
(agent/robot/actions.py,
applied on both sides by protocol/grammar.py). Also timed: llama.cpp's grammar sampler over the
whole vocabulary (what a T > 0 position costs each side) and for one token (what a greedy position
costs when the best token is allowed).

    python -m tools.bench.grammar_cost --out docs/grammar          # ~3 min on 2 cores

Writes grammar.json, grammar.md and grammar.png under --out.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path

from agent.app.prompt import messages, observation_text
from agent.robot.actions import answer_grammar, answer_max_tokens, complete, parse_action
from agent.spec.decoder import DecoderConfig, EdgeDecoder
from agent.spec.drafter import Drafter
from protocol.sampling import SamplingParams
from tools.bench.link import served
from tools.cluster.netem import LinkProfile
from tools.plots import bar_plot
from tools.robot.nav_prompt_eval import TARGET, memory_situations, situations

RUNS = ("free", "grammar")


def mask_cost(drafter: Drafter, gbnf: str, repeats: int = 20) -> dict:
    """ms for a whole-vocabulary mask and for one allowed-token check, mid-reason (the widest state)."""
    state = drafter.grammars.get(gbnf).walk(drafter.tokenize("The red box is to the left"))
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=12, help="prompts of each set (single frame, with memory)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--rtt-ms", type=float, default=20.0)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--draft", default="smollm2-q4_1")
    ap.add_argument("--out", type=Path, default=Path("docs/grammar"))
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    args.out.mkdir(parents=True, exist_ok=True)
    gbnf = answer_grammar()
    cases = [([], s) for s in situations(args.n, args.seed)] + [
        (c.memory(), c.now) for c in memory_situations(args.n, args.seed)
    ]
    rows = {r: [] for r in RUNS}
    with served(None, LinkProfile.from_rtt(args.rtt_ms, jitter_ms=2)) as s:
        link, drafter = s.link, s.drafter(args.draft)
        dec = EdgeDecoder(drafter, DecoderConfig(url=link.url()))
        stops = dec.stop_ids()
        until = lambda ids: complete(drafter.detokenize(ids, skip=stops))  # noqa: E731
        try:
            for i, (memory, now) in enumerate(cases):
                ids = drafter.tokenize(
                    drafter.apply_chat_template(messages(f"go to the {TARGET}", observation_text(now), memory))
                )
                # both sides prefill the prompt first, so neither run below pays for it
                drafter.next_logits(ids)
                dec.generate(ids, mode="ar", max_tokens=1, session="cost")
                for run in RUNS:
                    grammar = gbnf if run == "grammar" else None
                    gen = dec.generate(
                        ids,
                        mode="sd",
                        gamma=args.gamma,
                        max_tokens=answer_max_tokens(),
                        params=SamplingParams(),
                        until=until,
                        grammar=grammar,
                        session="cost",
                    )
                    m = gen.metrics
                    rows[run].append(
                        {
                            "case": i,
                            "memory": len(memory),
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
                    )
                print(
                    f"[{i + 1:2d}/{len(cases)}] free {rows['free'][-1]['tokens']:3d} tok tau "
                    f"{rows['free'][-1]['tau'] or 0:.2f} {rows['free'][-1]['parse']:<8} | grammar "
                    f"{rows['grammar'][-1]['tokens']:3d} tok tau {rows['grammar'][-1]['tau'] or 0:.2f} "
                    f"{rows['grammar'][-1]['parse']}",
                    flush=True,
                )
            cost = mask_cost(drafter, gbnf)
        finally:
            dec.close()

    def summary(rs: list[dict]) -> dict:
        mean = lambda k: round(statistics.fmean(r[k] for r in rs if r[k] is not None), 3)  # noqa: E731
        return {
            "answers": len(rs),
            "tokens_per_answer": mean("tokens"),
            "tau": mean("tau"),
            "acceptance_rate": mean("acceptance_rate"),
            "rounds": mean("rounds"),
            "wall_ms": mean("wall_ms"),
            "verify_ms": mean("verify_ms"),
            "draft_ms": mean("draft_ms"),
            "parses": {k: sum(r["parse"] == k for r in rs) for k in ("exact", "tolerant", "miss")},
        }

    result = {
        "pair": f"{args.draft} -> smollm2-f32",
        "rtt_ms": args.rtt_ms,
        "gamma": args.gamma,
        "command": "python -m tools.bench.grammar_cost " + " ".join(argv if argv is not None else sys.argv[1:]),
        "summary": {r: summary(rows[r]) for r in RUNS},
        "mask_cost": cost,
        "rows": rows,
    }
    (args.out / "grammar.json").write_text(json.dumps(result, indent=1))
    s = result["summary"]
    lines = [
        f"# The answer grammar: SD with and without it ({result['pair']}, gamma {args.gamma}, T = 0, "
        f"RTT {args.rtt_ms:.0f} ms)",
        "",
        f"`{result['command']}`; {len(cases)} navigation prompts, each answered both ways in a row.",
        "",
        "| run | tokens/answer | tau | acceptance | rounds | ms/answer | verify ms | draft ms | exact | "
        "tolerant | miss |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in RUNS:
        x = s[r]
        lines.append(
            f"| {r} | {x['tokens_per_answer']} | {x['tau']} | {x['acceptance_rate']} | {x['rounds']} | "
            f"{x['wall_ms']} | {x['verify_ms']} | {x['draft_ms']} | {x['parses']['exact']} | "
            f"{x['parses']['tolerant']} | {x['parses']['miss']} |"
        )
    lines += [
        "",
        f"llama.cpp's grammar sampler on the draft's vocabulary ({cost['vocab']} tokens): a whole mask "
        f"{cost['whole_vocabulary_mask_ms']} ms (each T > 0 position, each side), one token "
        f"{cost['one_token_check_ms']} ms (a greedy position whose best token is allowed).",
    ]
    (args.out / "grammar.md").write_text("\n".join(lines) + "\n")
    bar_plot(
        args.out / "grammar.png",
        ["tokens/answer", "tau", "ms/answer / 100", "exact parses / answers x 10"],
        {
            r: [
                s[r]["tokens_per_answer"],
                s[r]["tau"],
                s[r]["wall_ms"] / 100,
                10 * s[r]["parses"]["exact"] / s[r]["answers"],
            ]
            for r in RUNS
        },
        "value",
        f"SD with and without the answer grammar ({result['pair']})",
    )
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
