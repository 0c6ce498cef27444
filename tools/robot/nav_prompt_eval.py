"""How well does a model navigate from the perception text? Its action against the scripted policy's.

Two sets of random situations (seeded):

single  one frame, no memory: the target at a random bearing (-60..60 degrees) and
        distance (0.3..5 m), or not in view (1 in 6). The same cases as before the
        prompt had a memory, so the figures compare across prompt versions.
memory  1-3 earlier steps (what the camera showed, what the robot did), then the frame
        now, from a consistent geometry (90 degree field of view, 6 m range, turns and
        forward steps moving the target's bearing and distance). Four kinds in turn:
        the target out of view now but seen before (to the left, then to the right),
        in view now, never seen. Run with the memory in the prompt and, for comparison, without it (the
        prompt as the robot had it before: the current frame only).

For each, the navigation prompt (agent/app/prompt.py) goes through the model alone (local
decoding: no verifier, so this measures the draft; the target is the same model in
float32 and agrees with the Q4_1 draft on ~96 % of greedy tokens) and the parsed action
is compared with the scripted policy's (`scripted_action`; with a memory, `recalled_action`:
a target out of view is turned back to by the bearing it must have now, the search
turn otherwise):

    exact   the same action (kind and amount)
    kind    the same kind: forward, left, right or stop
    safe    not a forward step into the target (forward when the scripted policy stops)
    back    memory set, target out of view but seen before: the turn goes to its side

Writes docs/nav_prompt_eval.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from agent.app.memory import Recall
from agent.app.prompt import AHEAD_DEG, messages, observation_text
from agent.decoding import DecoderSettings, open_decoder
from agent.decoding.drafter import Drafter
from agent.robot.actions import (
    FORWARD_CM,
    TURN_DEG,
    Action,
    answer_grammar,
    answer_max_tokens,
    complete,
    parse_action,
    snap,
)
from agent.robot.perception import Sighting
from agent.robot.scripted import scripted_action

KINDS = ("forward", "left", "right", "stop")
TARGET = "red box"
HFOV_DEG, RANGE_M = 90.0, 6.0  # what the camera sees (agent/robot/perception.py's defaults)


@dataclass
class Case:
    now: list[Sighting]  # what the camera shows
    history: list[tuple[list[Sighting], Action]]  # earlier steps, oldest first
    kind: str = "single"  # single | recalled | visible | unseen

    def memory(self) -> list[str]:
        return [Recall(observation_text(seen), action, verified=True).line() for seen, action in self.history]


def situations(n: int, seed: int) -> list[list[Sighting]]:
    rnd = random.Random(seed)
    out = []
    for _ in range(n):
        if rnd.random() < 1 / 6:
            out.append([])
        else:
            out.append([Sighting("red box", round(rnd.uniform(-60, 60), 1), round(rnd.uniform(0.3, 5.0), 2), "sim")])
    return out


def memory_situations(n: int, seed: int) -> list[Case]:
    """n cases with 1-3 earlier steps; kinds in turn: recalled (to the left), visible, recalled (to the
    right), unseen; so a model that only ever turns one way cannot score on the recalled ones."""
    rnd = random.Random(seed + 1)
    kinds = (("recalled", "left"), ("visible", None), ("recalled", "right"), ("unseen", None))
    out = []
    while len(out) < n:
        kind, side = kinds[len(out) % len(kinds)]
        case = _random_history(rnd)
        if case.kind == kind and (side is None or recalled_action(case).kind == side):
            out.append(case)
    return out


def _seen(bearing: float, distance: float) -> list[Sighting]:
    if abs(bearing) <= HFOV_DEG / 2 and distance <= RANGE_M:
        return [Sighting(TARGET, round(bearing, 1), round(distance, 2), "sim")]
    return []


def _moved(bearing: float, distance: float, action: Action) -> tuple[float, float]:
    """The target's bearing (degrees, + left) and distance after the robot's action."""
    if action.kind in ("left", "right"):
        b = bearing - action.amount if action.kind == "left" else bearing + action.amount
        return (b + 180) % 360 - 180, distance
    if action.kind == "forward":
        x = distance * math.cos(math.radians(bearing)) - action.amount / 100
        y = distance * math.sin(math.radians(bearing))
        return math.degrees(math.atan2(y, x)), math.hypot(x, y)
    return bearing, distance


def _random_history(rnd: random.Random) -> Case:
    bearing, distance = rnd.uniform(-120, 120), rnd.uniform(1.0, 5.0)
    history = []
    for _ in range(rnd.choice((1, 2, 3))):
        seen = _seen(bearing, distance)
        if seen and abs(bearing) < AHEAD_DEG and rnd.random() < 0.7:
            action = Action("forward", rnd.choice(FORWARD_CM))
        else:
            action = Action(rnd.choice(("left", "right")), rnd.choice(TURN_DEG))
        history.append((seen, action))
        bearing, distance = _moved(bearing, distance, action)
    now = _seen(bearing, distance)
    ever = any(seen for seen, _ in history)
    kind = "visible" if now else "recalled" if ever and distance <= RANGE_M else "unseen" if not ever else "other"
    return Case(now, history, kind)


def recalled_action(case: Case) -> Action:
    """The scripted policy with a memory: what is in view decides; a target out of view but seen before is
    turned back to (by the bearing it has now after the actions since, at most 45 degrees); else search."""
    if case.now or not any(seen for seen, _ in case.history):
        return parse_action(scripted_action(case.now)).action
    last = max(i for i, (seen, _) in enumerate(case.history) if seen)
    bearing, distance = case.history[last][0][0].bearing_deg, case.history[last][0][0].distance_m
    for _, action in case.history[last:]:
        bearing, distance = _moved(bearing, distance, action)
    return Action("left" if bearing > 0 else "right", snap(min(abs(bearing), TURN_DEG[-1]), TURN_DEG))


def evaluate(
    drafter: Drafter, cases: list[Case], use_memory: bool = True, label: str = "", grammar: bool = True
) -> dict:
    """The draft alone on each case, under the answer grammar as the robot decodes (nav.grammar) unless told not."""
    dec = open_decoder(drafter=drafter)
    gbnf = answer_grammar() if grammar else None
    stops = dec.stop_ids()
    until = lambda ids: complete(drafter.detokenize(ids, skip=stops))  # noqa: E731
    confusion = {w: {g: 0 for g in KINDS} for w in KINDS}
    exact = kind = unsafe = 0
    back = {"n": 0, "toward": 0}
    parses = {"exact": 0, "tolerant": 0, "miss": 0}
    ms, tokens, prompt_tokens, rows = [], [], [], []
    for i, case in enumerate(cases):
        obs = observation_text(case.now)
        memory = case.memory() if use_memory else []
        ids = drafter.tokenize(drafter.apply_chat_template(messages("go to the " + TARGET, obs, memory)))
        t0 = time.perf_counter()
        gen = dec.generate(
            ids, mode="local", max_tokens=answer_max_tokens() if grammar else 40, until=until, grammar=gbnf
        )
        ms.append((time.perf_counter() - t0) * 1e3)
        tokens.append(len(gen.token_ids))
        prompt_tokens.append(len(ids))
        got = parse_action(gen.text)
        want = recalled_action(case) if case.history else parse_action(scripted_action(case.now)).action
        parses[got.how] += 1
        exact += got.action == want
        kind += got.action.kind == want.kind
        unsafe += want.kind == "stop" and got.action.kind == "forward"
        confusion[want.kind][got.action.kind] += 1
        if case.kind == "recalled":
            back["n"] += 1
            back["toward"] += got.action.kind == want.kind
        rows.append(
            {
                "kind": case.kind,
                "memory": memory,
                "observation": obs,
                "want": str(want),
                "got": str(got.action),
                "parse": got.how,
                "text": gen.text.strip(),
            }
        )
        print(
            f"  {drafter.name} {label} {i + 1}/{len(cases)}: {obs} ({len(memory)} remembered) -> {got.action} "
            f"(want {want})",
            file=sys.stderr,
            flush=True,
        )
    dec.close()
    n = len(cases)
    return {
        "draft": drafter.name,
        "set": label,
        "memory": use_memory,
        "n": n,
        "exact_agreement": round(exact / n, 3),
        "kind_agreement": round(kind / n, 3),
        "forward_when_stop": unsafe,
        "back_toward": round(back["toward"] / back["n"], 3) if back["n"] else None,
        "recalled_cases": back["n"],
        "parses": parses,
        "confusion": confusion,
        "mean_ms": round(sum(ms) / n, 1),
        "mean_tokens": round(sum(tokens) / n, 1),
        "mean_prompt_tokens": round(sum(prompt_tokens) / n, 1),
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=60, help="single-frame situations")
    ap.add_argument("--n-memory", type=int, default=40, help="situations with earlier steps (0: none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--drafts", default="smollm2-q4_1,smollm2-q2_k")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("docs"))
    ap.add_argument("--no-grammar", action="store_true", help="free answers (the robot with nav.grammar = false)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    single = [Case(seen, []) for seen in situations(args.n, args.seed)]
    remembered = memory_situations(args.n_memory, args.seed) if args.n_memory else []
    results = []
    for draft in args.drafts.split(","):
        drafter = open_decoder(DecoderSettings(draft=draft, threads=args.threads)).drafter
        grammar = not args.no_grammar
        results.append(evaluate(drafter, single, label="single", grammar=grammar))
        if remembered:
            results.append(evaluate(drafter, remembered, use_memory=True, label="memory", grammar=grammar))
            results.append(evaluate(drafter, remembered, use_memory=False, label="memory, not shown", grammar=grammar))
    args.out.mkdir(parents=True, exist_ok=True)
    report = {
        "command": "python -m tools.robot.nav_prompt_eval " + " ".join(argv or sys.argv[1:]),
        "n": args.n,
        "n_memory": args.n_memory,
        "seed": args.seed,
        "results": results,
    }
    (args.out / "nav_prompt_eval.json").write_text(json.dumps(report, indent=1))
    lines = [
        f"# Navigation prompt: the model's action against the scripted policy ({args.n} single-frame "
        f"situations, {args.n_memory} with 1-3 earlier steps; seed {args.seed})",
        "",
        "`memory, not shown`: the memory cases with the current frame only (the prompt before it had a memory). "
        "`back`: of the memory cases whose target is out of view but was seen, the share turned to its side.",
        "",
        f"Answers {'free' if args.no_grammar else 'under the answer grammar (nav.grammar, as the robot decodes)'}.",
        "",
        "| model (local, no verifier) | set | exact action | same kind | back | parses exact / tolerant / miss "
        "| forward when it should stop | mean prompt tokens | mean tokens | mean ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        p = r["parses"]
        back = "" if r["back_toward"] is None else f"{r['back_toward']:.0%} of {r['recalled_cases']}"
        lines.append(
            f"| {r['draft']} | {r['set']} | {r['exact_agreement']:.0%} | {r['kind_agreement']:.0%} | {back} | "
            f"{p['exact']} / {p['tolerant']} / {p['miss']} | {r['forward_when_stop']} | "
            f"{r['mean_prompt_tokens']} | {r['mean_tokens']} | {r['mean_ms']} |"
        )
    for r in results:
        lines += [
            "",
            f"Confusion for {r['draft']}, {r['set']} (rows: the scripted policy; columns: the model)",
            "",
            "| want \\ got | " + " | ".join(KINDS) + " |",
            "|---" * (len(KINDS) + 1) + "|",
        ]
        lines += [f"| {w} | " + " | ".join(str(r["confusion"][w][g]) for g in KINDS) + " |" for w in KINDS]
    (args.out / "nav_prompt_eval.md").write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(4.2 * len(results), 3.8))
    for ax, r in zip(axes if len(results) > 1 else [axes], results, strict=True):
        grid = [[r["confusion"][w][g] for g in KINDS] for w in KINDS]
        ax.imshow(grid, cmap="Blues")
        for i in range(4):
            for j in range(4):
                ax.text(j, i, grid[i][j], ha="center", va="center")
        ax.set_xticks(range(4), KINDS)
        ax.set_yticks(range(4), KINDS)
        ax.set_xlabel("model")
        ax.set_ylabel("scripted policy")
        ax.set_title(
            f"{r['draft']}, {r['set']}: exact {r['exact_agreement']:.0%}, kind {r['kind_agreement']:.0%}", fontsize=8
        )
    fig.tight_layout()
    fig.savefig(args.out / "nav_prompt_eval.png", dpi=110)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
