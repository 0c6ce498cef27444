"""How well does a model navigate from the perception text? Its action against the scripted policy's.

Random situations (seeded): the target at a random bearing (-60..60 degrees) and
distance (0.3..5 m), or not in view (1 in 6). For each, the navigation prompt
(agent/nav.py) goes through the model alone (local decoding: no verifier, so
this measures the draft; the target is the same model in float32 and agrees
with the Q4_1 draft on ~96 % of greedy tokens) and the parsed action is
compared with `scripted_action`'s:

    exact   the same action (kind and amount)
    kind    the same kind: forward, left, right or stop
    safe    not a forward step into the target (forward when the scripted policy stops)

Writes docs/nav_prompt_eval.{json,md,png}.
"""
from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import time
from pathlib import Path

from agent.decoder import EdgeDecoder
from agent.drafter import Drafter
from agent.nav import messages, observation_text
from agent.robot.actions import complete, parse_action
from agent.robot.perception import Sighting
from agent.robot.scripted import scripted_action

KINDS = ("forward", "left", "right", "stop")


def situations(n: int, seed: int) -> list[list[Sighting]]:
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        if rnd.random() < 1 / 6:
            out.append([])
        else:
            out.append([Sighting("red box", round(rnd.uniform(-60, 60), 1), round(rnd.uniform(0.3, 5.0), 2), "sim")])
    return out


def evaluate(draft: str, cases: list[list[Sighting]], threads: int) -> dict:
    drafter = Drafter(draft, threads=threads)
    dec = EdgeDecoder(drafter)
    stops = dec.stop_ids()
    until = lambda ids: complete(drafter.detokenize(ids, skip=stops))      # noqa: E731
    confusion = {w: {g: 0 for g in KINDS} for w in KINDS}
    exact = kind = unsafe = 0
    parses = {"exact": 0, "tolerant": 0, "miss": 0}
    ms, tokens, rows = [], [], []
    for i, seen in enumerate(cases):
        obs = observation_text(seen)
        ids = drafter.tokenize(drafter.apply_chat_template(messages("go to the red box", obs)))
        t0 = time.perf_counter()
        gen = dec.generate(ids, mode="local", max_tokens=40, until=until)
        ms.append((time.perf_counter() - t0) * 1e3)
        tokens.append(len(gen.token_ids))
        got = parse_action(gen.text)
        want = parse_action(scripted_action(seen)).action
        parses[got.how] += 1
        exact += got.action == want
        kind += got.action.kind == want.kind
        unsafe += want.kind == "stop" and got.action.kind == "forward"
        confusion[want.kind][got.action.kind] += 1
        rows.append({"observation": obs, "want": str(want), "got": str(got.action), "parse": got.how,
                     "text": gen.text.strip()})
        print(f"  {draft} {i + 1}/{len(cases)}: {obs} -> {got.action} (want {want})", file=sys.stderr, flush=True)
    dec.close()
    n = len(cases)
    return {"draft": draft, "n": n, "exact_agreement": round(exact / n, 3), "kind_agreement": round(kind / n, 3),
            "forward_when_stop": unsafe, "parses": parses, "confusion": confusion,
            "mean_ms": round(sum(ms) / n, 1), "mean_tokens": round(sum(tokens) / n, 1), "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--drafts", default="smollm2-q4_1,smollm2-q2_k")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("docs"))
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    cases = situations(args.n, args.seed)
    results = [evaluate(d, cases, args.threads) for d in args.drafts.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"command": "python -m tools.nav_prompt_eval " + " ".join(argv or sys.argv[1:]), "n": args.n,
              "seed": args.seed, "results": results}
    (args.out / "nav_prompt_eval.json").write_text(json.dumps(report, indent=1))
    lines = [f"# Navigation prompt: the model's action against the scripted policy ({args.n} situations, "
             f"seed {args.seed})", "", "| model (local, no verifier) | exact action | same kind | parses exact / "
             "tolerant / miss | forward when it should stop | mean tokens | mean ms |", "|---|---|---|---|---|---|---|"]
    for r in results:
        p = r["parses"]
        lines.append(f"| {r['draft']} | {r['exact_agreement']:.0%} | {r['kind_agreement']:.0%} | {p['exact']} / "
                     f"{p['tolerant']} / {p['miss']} | {r['forward_when_stop']} | {r['mean_tokens']} | {r['mean_ms']} |")
    for r in results:
        lines += ["", f"Confusion for {r['draft']} (rows: the scripted policy; columns: the model)", "",
                  "| want \\ got | " + " | ".join(KINDS) + " |", "|---" * (len(KINDS) + 1) + "|"]
        lines += [f"| {w} | " + " | ".join(str(r["confusion"][w][g]) for g in KINDS) + " |" for w in KINDS]
    (args.out / "nav_prompt_eval.md").write_text("\n".join(lines) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(results), figsize=(4.2 * len(results), 3.8))
    for ax, r in zip(axes if len(results) > 1 else [axes], results):
        grid = [[r["confusion"][w][g] for g in KINDS] for w in KINDS]
        ax.imshow(grid, cmap="Blues")
        for i in range(4):
            for j in range(4):
                ax.text(j, i, grid[i][j], ha="center", va="center")
        ax.set_xticks(range(4), KINDS)
        ax.set_yticks(range(4), KINDS)
        ax.set_xlabel("model")
        ax.set_ylabel("scripted policy")
        ax.set_title(f"{r['draft']}: exact {r['exact_agreement']:.0%}, kind {r['kind_agreement']:.0%}", fontsize=9)
    fig.tight_layout()
    fig.savefig(args.out / "nav_prompt_eval.png", dpi=110)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
