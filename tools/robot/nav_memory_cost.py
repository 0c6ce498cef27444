"""What the navigation prompt's memory costs on the draft: tokens, and prefill time with and without the cache.

For N = 0, 2, 4, 8 remembered steps (typical lines: a sighting or "nothing", a turn or a
step, some unverified) it reports the prompt's tokens, the memory's tokens, and the
draft's prefill time (`Drafter.next_logits`: the KV of the prefix it already holds is
kept, the rest is evaluated):

    cold      nothing cached (the robot's first step after a restart)
    grow      the previous step's prompt and its answer cached, memory one line shorter:
              the common case while the memory fills (only the new line and the camera
              line are new)
    full      the previous step's prompt and answer cached, but its oldest line dropped
              since (memory full): everything after the task line is new
    same      N = 0 only: the previous step's prompt cached, only the camera line new

The server's session keeps the same prefix (server_bridge/target.py `rewind`), so the
same token counts are what it prefills. Median of --repeat runs. Writes
docs/nav_memory_cost.{json,md}.

    taskset -c 1 .venv/bin/python -m tools.robot.nav_memory_cost --threads 1
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path

from agent.app.memory import Recall
from agent.app.prompt import common_prefix, messages
from agent.decoding import DecoderSettings, open_decoder
from agent.decoding.drafter import Drafter
from agent.robot.actions import Action

INSTRUCTION = "go to the red box"
ANSWER = "The red box is to the left, so I turn left. The next action is turn left 30 degree."
# a plausible task, oldest first: search, sight, turn toward, walk, lose it, ...
HISTORY = [
    Recall("nothing", Action("left", 45), True),
    Recall("nothing", Action("right", 45), False),
    Recall("red box 40 degrees to the left, 3.4 m away", Action("left", 45), True),
    Recall("red box ahead, 3.2 m away", Action("forward", 75), True),
    Recall("red box 12 degrees to the right, 2.5 m away", Action("right", 15), True),
    Recall("red box ahead, 2.4 m away", Action("forward", 25), False, completed=False),
    Recall("red box ahead, 2.2 m away", Action("forward", 75), True),
    Recall("nothing", Action("left", 15), True),
    Recall("red box 18 degrees to the right, 1.4 m away", Action("right", 15), True),
]
CAMERA = "red box ahead, 1.3 m away"


def prompt(drafter: Drafter, memory: list[Recall], camera: str = CAMERA) -> list[int]:
    return drafter.tokenize(drafter.apply_chat_template(messages(INSTRUCTION, camera, [r.line() for r in memory])))


def prefill_ms(drafter: Drafter, cached: list[int] | None, ids: list[int]) -> float:
    """Time next_logits(ids) with `cached` in the KV first (None: an empty KV)."""
    if cached is None:
        drafter.llm.reset()  # n_tokens = 0: the next eval drops every KV entry
    else:
        drafter.next_logits(cached)
    t0 = time.perf_counter()
    drafter.next_logits(ids)
    return (time.perf_counter() - t0) * 1e3


def measure(drafter: Drafter, n: int, repeat: int) -> dict:
    answer = drafter.tokenize(ANSWER)
    memory = HISTORY[len(HISTORY) - n :] if n else []
    ids = prompt(drafter, memory)
    before_grow = prompt(drafter, memory[:-1], "red box 18 degrees to the right, 1.4 m away") + answer if n else None
    before_full = (
        prompt(drafter, HISTORY[len(HISTORY) - n - 1 : -1], "red box 18 degrees to the right, 1.4 m away") + answer
        if n
        else None
    )
    before_same = prompt(drafter, [], "red box 18 degrees to the right, 1.4 m away") + answer
    fixed = common_prefix(
        prompt(drafter, [], "nothing"),
        drafter.tokenize(drafter.apply_chat_template(messages("go to the blue ball", "nothing"))),
    )
    mem_tokens = len(drafter.tokenize("\n".join(r.line() for r in memory))) if memory else 0
    row = {"memory_steps": n, "prompt_tokens": len(ids), "memory_tokens": mem_tokens, "fixed_prefix_tokens": fixed}
    cases = {"cold": None}
    if n:
        cases.update(grow=before_grow, full=before_full)
    else:
        cases["same"] = before_same
    for name, cached in cases.items():
        times = [prefill_ms(drafter, cached, ids) for _ in range(repeat)]
        row[f"{name}_ms"] = round(statistics.median(times), 1)
        row[f"{name}_new_tokens"] = len(ids) - (0 if cached is None else min(common_prefix(cached, ids), len(ids) - 1))
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", default="smollm2-q4_1")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", default="0,2,4,8")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path("docs"))
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    drafter = open_decoder(DecoderSettings(draft=args.draft, threads=args.threads)).drafter
    prefill_ms(drafter, None, prompt(drafter, []))  # warm the weights and the allocator
    rows = [measure(drafter, int(n), args.repeat) for n in args.steps.split(",")]
    report = {
        "command": "python -m tools.robot.nav_memory_cost " + " ".join(argv if argv is not None else sys.argv[1:]),
        "draft": args.draft,
        "threads": args.threads,
        "repeat": args.repeat,
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "nav_memory_cost.json").write_text(json.dumps(report, indent=1))
    lines = [
        f"# Navigation memory: prompt tokens and draft prefill ({args.draft}, {args.threads} thread(s), "
        f"median of {args.repeat})",
        "",
        "new = tokens evaluated (the rest comes from the KV cache). grow: the previous step's prompt and "
        "answer cached, its memory one line shorter; full: the same, but its oldest line dropped since; "
        "same (N = 0): only the camera line differs.",
        "",
        "| memory steps | prompt tokens | memory tokens | fixed prefix | cold ms (new) | after a step, growing "
        "ms (new) | after a step, memory full ms (new) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        warm = (
            f"{r['same_ms']} ({r['same_new_tokens']})" if "same_ms" in r else f"{r['grow_ms']} ({r['grow_new_tokens']})"
        )
        full = f"{r['full_ms']} ({r['full_new_tokens']})" if "full_ms" in r else "-"
        lines.append(
            f"| {r['memory_steps']} | {r['prompt_tokens']} | {r['memory_tokens']} | "
            f"{r['fixed_prefix_tokens']} | {r['cold_ms']} ({r['cold_new_tokens']}) | {warm} | {full} |"
        )
    (args.out / "nav_memory_cost.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
