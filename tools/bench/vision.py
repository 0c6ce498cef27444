"""What a navigation step costs when the robot sees: the camera image in the prompt against the same step in words.

Each step is the navigation loop's own (agent/app/navigator.py): the system prompt and few-shot turns, the task, and the
camera line, through a real `server-bridge serve` and the robot's EdgeDecoder in SD. Side by side, alternately,
each in its own server session:

  text   the camera line in words ("a red box 1.2 m ahead"), as perception "sim" or "color" writes it;
  image  the camera line holding the frame itself (perception "vlm"): a new JPEG each step, rendered by the
         simulator from a new pose and encoded as VlmPerception does (longest side --max-side).

Per step it records: the robot's prompt ids (and the frame's JPEG encode), the draft's prefill of the
changed prompt (its image encoded by libmtmd and the text after it; the few-shot prefix stays in its KV),
the server's passes (the open's prefill and the verify rounds; a new frame's preprocessing and encoding by
libmtmd land in them), the uplink bytes of the step (the image's bytes go on the first open; a re-open after
a lost link sends its 64-character sha256 instead) and the whole step's wall time for --tokens answer tokens.

The default pair is the test VLM (tests/models/make_test_vlm.py: a random tiny SmolVLM, Q8_0 draft + f16 mmproj, f32
target + f32 mmproj), which says what the machinery costs, not what a real model's vision tower costs; give a
real pair with --draft/--draft-mmproj/--target/--mmproj (GGUFs: the server on llamacpp):

    python -m tools.bench.vision --out bench_results/vision                 # ~1 min on the 2-core machine
    python -m tools.bench.vision --draft SmolVLM-256M-Instruct-Q8_0.gguf \\
        --draft-mmproj mmproj-SmolVLM-256M-Instruct-Q8_0.gguf --target SmolVLM-500M-Instruct-f16.gguf \\
        --mmproj mmproj-SmolVLM-500M-Instruct-f16.gguf --out bench_results/vision_smolvlm

Server and robot are pinned to different cores when there are two. Writes vision.json, vision.md, vision.png
(tools/bench/harness.py; --quick: one step of each kind).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from tools.bench import harness

INSTRUCTION = "go to the red box"


def frames(n: int, width: int, height: int):
    """n camera images of the default scene from poses turning in place (each step sees something new)."""
    from agent.robot.sim import make_world

    world = make_world("red_box", start=0)
    x, y, theta = world.pose
    for i in range(n):
        yield world.render_camera(width, height, pose=(x, y, theta + 0.35 * i))


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--steps", type=int, default=6, help="steps of each kind, alternating")
    ap.add_argument("--tokens", type=int, default=16, help="answer tokens a step")
    ap.add_argument("--max-side", type=int, default=384, help="perception.image_max_side")
    ap.add_argument("--camera", default="640x480", help="the camera's frame, WxH, before the resize")
    for flag in ("--draft", "--draft-mmproj", "--target", "--mmproj"):
        ap.add_argument(flag, help="a GGUF of your pair (all four, or none for the test VLM)")
    ap.add_argument("--threads", type=int, default=1)


def measure(args: argparse.Namespace) -> dict:
    given = [args.draft, args.draft_mmproj, args.target, args.mmproj]
    if any(given) and not all(given):
        raise SystemExit("a pair needs all four: --draft, --draft-mmproj, --target, --mmproj")
    if args.quick:
        args.steps, args.tokens = 1, 4

    from agent.app.prompt import messages
    from agent.decoding import DecoderSettings, open_decoder
    from agent.robot.camera import Frame
    from agent.robot.perception import VlmPerception
    from server_bridge.ops.fleet import LocalVerifier

    if all(given):
        pair = {"draft": args.draft, "draft_mmproj": args.draft_mmproj, "target": args.target, "mmproj": args.mmproj}
        label = f"{Path(args.draft).name} -> {Path(args.target).name}"
    else:
        from tests.models import make_test_vlm

        vlm = make_test_vlm.make()
        pair = {
            "draft": str(vlm.draft),
            "draft_mmproj": str(vlm.draft_mmproj),
            "target": str(vlm.target),
            "mmproj": str(vlm.target_mmproj),
        }
        label = "test VLM (random tiny SmolVLM): Q8_0 draft -> f32 target"
    width, height = (int(v) for v in args.camera.lower().split("x"))
    cores = sorted(os.sched_getaffinity(0))
    server_cores, robot_core = ({cores[-1]}, cores[0]) if len(cores) > 1 else (None, cores[0])

    drafter = open_decoder(
        DecoderSettings(draft=pair["draft"], threads=args.threads, draft_mmproj=pair["draft_mmproj"])
    ).drafter
    perception = VlmPerception(args.max_side)
    chat = drafter.apply_chat_template
    text = chat(messages(INSTRUCTION, "a red box 1.2 m ahead, slightly left", parts=True))
    image_text = chat(messages(INSTRUCTION, "", parts=True, image=True))  # the camera line holds the marker
    rows = {"text": [], "image": []}
    with LocalVerifier(
        target=pair["target"],
        cpus=server_cores,
        threads=args.threads,
        extra_args=["--mmproj", pair["mmproj"], "--engine", "llamacpp"],
    ) as server:
        if len(cores) > 1:
            os.sched_setaffinity(0, {robot_core})
        decoder = open_decoder(DecoderSettings(verifier=server.url), drafter)
        decoder.generate(
            drafter.tokenize(text), mode="sd", max_tokens=4, session="text"
        )  # the few-shot prefix, both sides
        for i, bgr in enumerate(frames(args.steps + 1, width, height)):
            for kind in ("text", "image"):
                t0 = time.perf_counter()
                ids, images = drafter.tokenize(text), []
                if kind == "image":
                    shown = perception.encode(Frame(bgr, time.monotonic(), i + 1))
                    ids, images = drafter.image_prompt(image_text, [shown.data])
                t1 = time.perf_counter()
                drafter.use_images(images)
                drafter.next_logits(ids)  # the draft's prefill of this step
                t2 = time.perf_counter()
                gen = decoder.generate(
                    ids, mode="sd", max_tokens=args.tokens, images=images, session=kind
                )  # one session each, as the loop keeps
                t3 = time.perf_counter()
                if i == 0:
                    continue  # first of each: warm-up
                m = gen.metrics
                rows[kind].append(
                    {
                        "encode_ms": (t1 - t0) * 1e3,
                        "draft_prefill_ms": (t2 - t1) * 1e3,
                        "server_prefill_ms": m.prefill_ms,
                        "server_ms": m.prefill_ms + m.verify_ms,
                        "generate_ms": (t3 - t2) * 1e3,
                        "step_ms": (t3 - t0) * 1e3,
                        "bytes_up": m.bytes_up,
                        "tokens": len(gen.token_ids),
                        "tau": m.tau,
                        "image_bytes": len(images[0].data) if images else 0,
                        "image_positions": drafter.vision.positions(images[0]) if images else 0,
                    }
                )
                r = rows[kind][-1]
                print(
                    f"  step {i} {kind:5s}: prompt {r['encode_ms']:.1f} ms, draft prefill "
                    f"{r['draft_prefill_ms']:.1f} ms, server passes {r['server_ms']:.1f} ms, step "
                    f"{r['step_ms']:.0f} ms, {r['bytes_up']} bytes up",
                    flush=True,
                )
        decoder.close()
    median = {k: {f: round(statistics.median(r[f] for r in v), 2) for f in v[0] if f != "tau"} for k, v in rows.items()}
    return {
        "pair": label,
        "files": pair,
        "camera": args.camera,
        "max_side": args.max_side,
        "image_positions": rows["image"][-1]["image_positions"] if rows["image"] else None,
        "reopen_bytes_per_image": 64,
        "machine": f"{platform.machine()} {os.cpu_count()} cores, server "
        f"{sorted(server_cores) if server_cores else 'shared'}, robot core {robot_core}, {args.threads} thread",
        "steps": rows,
        "median": median,
        "table": [
            {"what": name, "short": SHORT.get(f, ""), "text": median["text"][f], "image": median["image"][f]}
            for f, name in FIELDS
        ],
    }


FIELDS = [
    ("encode_ms", "robot: the prompt's ids (and the frame's JPEG), ms"),
    ("draft_prefill_ms", "robot: draft prefill, ms"),
    ("server_prefill_ms", "server: open's prefill, ms"),
    ("server_ms", "server: all the step's passes (open + verify rounds), ms"),
    ("generate_ms", "the SD answer (open included), ms"),
    ("step_ms", "the step, ms"),
    ("bytes_up", "uplink bytes"),
    ("tokens", "answer tokens"),
]
SHORT = {  # the plotted fields' bar labels
    "encode_ms": "prompt (+ JPEG)",
    "draft_prefill_ms": "draft prefill",
    "server_ms": "server passes",
    "step_ms": "whole step",
}
REPORT = harness.Report(
    "vision",
    "# A navigation step with the camera image against the same step in words ({pair})",
    [
        harness.Table(
            "table",
            [
                harness.Col("what", " "),
                harness.Col("text", "in words", "{:g}"),
                harness.Col("image", "with the image", "{:g}"),
            ],
            title="Medians over the steps. A re-open after a lost link sends each image's sha256 (64 characters) in "
            "place of its bytes.",
        )
    ],
    harness.Plot(
        "table",
        x="short",
        ys={"in words": "text", "with the image": "image"},
        xlabel="",
        ylabel="ms (median)",
        title="A navigation step: the image against words",
        kind="bar",
        where=lambda r: bool(r["short"]),
    ),
    intro="`{command}` ({machine}); camera {camera} resized to a longest side of {max_side}; the image takes "
    "{image_positions} positions on the draft.",
)


def main(argv: list[str] | None = None) -> int:
    return harness.main(__doc__, REPORT, measure, add_args, argv, out="bench_results/vision", pin_cores=False)


if __name__ == "__main__":
    sys.exit(main())
