"""The navigation prompt: what the model reads each step (system text, few-shot turns, task, memory, camera).

Perception. The bundled models (SmolLM2-135M) read text only, so a perception step
turns the frame into text first: in the simulator the objects the camera could see,
with bearing and distance (`perception.kind = "sim"`, ground truth); on a robot a
pluggable detector (`"color"`: HSV blobs). `relevant` keeps the sightings the task names,
`observation_text` puts them in words. With a vision-language draft and target
(`"vlm"`: the draft loaded with its mmproj) the frame itself goes into the prompt: the
last user turn's camera line is "Camera: <the image>." (a JPEG on the image marker, sent
with every generation of the step). The few-shot turns stay text: they teach the answer's
shape. A prompt holds one image, the current frame; remembered steps say only that an
image was seen (IMAGE_RECALL). A VLM's chat template reads list-of-parts content, so with
a VLM draft every turn is rendered as parts (`messages(parts=True)`; SmolVLM and the
Qwen-VL families alike: tests/agent/app/test_nav_vlm.py, test_nav_vlm_qwen.py).

Layout. The system text and the examples come first and never change, the task, the memory
(oldest first, agent/app/memory.py) and the camera last: the next step's prompt shares this
one's tokens up to its camera line, so the draft's KV (Drafter keeps the common prefix) and the
server session's (re-opened with the same name, `rewind` keeps the common prefix) are reused
(`common_prefix` counts it; tools/robot/nav_memory_cost.py measures it).

The answer. The model answers with one short reason and one NaVILA sentence; the answer
grammar both sides decode under and the parser that turns the text into an action are the
action vocabulary's own (agent/robot/actions.py: answer_grammar, parse_action, complete), and
`answer_limits` picks the grammar and the token budget a step decodes with.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

from agent.robot.actions import REASON_CHARS, Action, answer_grammar, answer_max_tokens
from agent.robot.perception import Sighting

SYSTEM = (
    "You are a robot programmed for navigation tasks. Decide your next action, which could be turning left "
    "or right by 15, 30 or 45 degree, moving forward 25, 50 or 75 cm, or stop if the task is completed."
)

# Few-shot turns (task, what the robot remembers, what the camera shows, answer). A 135M model copies
# the shape of its examples; with one short reason that names the side ("so I turn right") it picks the
# side right far more often than with bare numbers (tools/robot/nav_prompt_eval.py measures it). The turns
# with a memory show how to use one: a target seen before and turned away from since is turned back to
# (on either side); a target still ahead is walked on to; what the camera shows now wins over memory.
# The wording is brittle at this size: reasons that start "The X is not in view, but it was to the
# left before" answered more memory cases right but stopped at none of the targets within reach, so
# the answers keep the shape of the examples without memory. A small turn for a target just off
# ahead (12 degrees) keeps the robot from swinging past it with 30-degree turns (the demo's start 3).
# The forward step stays mostly 25 cm: after "move forward " the model copies a digit of the
# distance it read, and 2 outranks 7 there. Measure any change with the eval.
SHOTS: list[tuple[str, tuple[tuple[str, Action], ...], str, str]] = [
    (
        "go to the blue ball",
        (),
        "blue ball 40 degrees to the left, 3.1 m away",
        "The blue ball is to the left, so I turn left. The next action is turn left 45 degree.",
    ),
    (
        "go to the green box",
        (),
        "green box ahead, 2.4 m away",
        "The green box is ahead, so I move forward. The next action is move forward 75 cm.",
    ),
    (
        "go to the yellow cone",
        (),
        "nothing",
        "I do not see the yellow cone, so I look around. The next action is turn left 45 degree.",
    ),
    (
        "go to the blue ball",
        (("blue ball 40 degrees to the left, 3.1 m away", Action("right", 15)), ("nothing", Action("right", 30))),
        "nothing",
        "I saw the blue ball to the left and I turned right since, so I turn left. "
        "The next action is turn left 45 degree.",
    ),
    (
        "go to the yellow cone",
        (),
        "yellow cone 20 degrees to the right, 1.5 m away",
        "The yellow cone is to the right, so I turn right. The next action is turn right 15 degree.",
    ),
    (
        "go to the green box",
        (("green box ahead, 2.9 m away", Action("forward", 75)),),
        "green box ahead, 2.2 m away",
        "The green box is still ahead, so I keep going. The next action is move forward 75 cm.",
    ),
    (
        "go to the blue ball",
        (),
        "blue ball ahead, within reach",
        "The blue ball is within reach, so I stop. I think I should stop because I have finished the instruction.",
    ),
    (
        "go to the yellow cone",
        (("yellow cone 35 degrees to the right, 2.5 m away", Action("left", 45)),),
        "nothing",
        "I saw the yellow cone to the right and I turned left since, so I turn right. "
        "The next action is turn right 45 degree.",
    ),
    (
        "go to the green box",
        (),
        "green box ahead, 0.9 m away",
        "The green box is ahead, so I move forward. The next action is move forward 25 cm.",
    ),
    (
        "go to the blue ball",
        (("nothing", Action("left", 45)),),
        "blue ball 25 degrees to the right, 2.0 m away",
        "The blue ball is to the right, so I turn right. The next action is turn right 30 degree.",
    ),
    (
        "go to the yellow cone",
        (),
        "yellow cone 31 degrees to the right, 2.0 m away",
        "The yellow cone is to the right, so I turn right. The next action is turn right 30 degree.",
    ),
    (
        "go to the green box",
        (("nothing", Action("left", 45)),),
        "nothing",
        "I still do not see the green box, so I look around. The next action is turn left 45 degree.",
    ),
    (
        "go to the blue ball",
        (),
        "blue ball 12 degrees to the right, 3.8 m away",
        "The blue ball is to the right, so I turn right. The next action is turn right 15 degree.",
    ),
    (
        "go to the green box",
        (),
        "green box 16 degrees to the left, 1.2 m away",
        "The green box is to the left, so I turn left. The next action is turn left 15 degree.",
    ),
    (
        "go to the blue ball",
        (),
        "blue ball ahead, 1.3 m away",
        "The blue ball is ahead, so I move forward. The next action is move forward 50 cm.",
    ),
]
AHEAD_DEG = 10.0  # a bearing within this of 0 is "ahead"


def observation_text(sightings: Sequence[Sighting], reach_m: float = 0.6, ahead_deg: float = AHEAD_DEG) -> str:
    """What the camera shows, in words: "red box 35 degrees to the left, 2.1 m away; ..." or "nothing"."""
    parts = []
    for s in sightings:
        where = (
            "ahead"
            if abs(s.bearing_deg) < ahead_deg
            else f"{abs(s.bearing_deg):.0f} degrees to the {'left' if s.bearing_deg > 0 else 'right'}"
        )
        dist = "within reach" if s.distance_m < reach_m else f"{s.distance_m:.1f} m away"
        parts.append(f"{s.name} {where}, {dist}")
    return "; ".join(parts) if parts else "nothing"


def blocked_text(
    clearance_m: float | None,
    seen: Sequence[Sighting],
    blocked_m: float,
    ahead_deg: float = AHEAD_DEG,
    reach_m: float = 0.6,
) -> str:
    """ "; the way ahead is blocked, 0.3 m away" when the range ahead is under blocked_m, else "".

    The robot's range source (the simulator's ray cast, the Go2's range finder) sees what the object list
    does not: walls and furniture. Said only when what blocks is not the target itself (a target seen
    ahead, no farther than the reading plus its reach): walking up to it is the task.

    Off by default (nav.blocked_m = 0). Measured with tools/robot/nav_prompt_eval.py (smollm2-q4_1, seed 0, one
    run each): one few-shot turn that uses it ("nothing; the way ahead is blocked, 0.3 m away" -> turn
    left 45) took the single-frame cases from 60 % to 65 % exact (100 % same kind both), but the memory
    cases from 25 % to 15 % exact, 62 % to 38 % same kind, and turning back to a seen target from 65 % to
    35 %. The same turn just before the last example made every case fail. Without an example a 135M
    model has nothing to copy, so the line waits for a prompt that gains from it.
    """
    if clearance_m is None or not blocked_m or clearance_m >= blocked_m:
        return ""
    if any(abs(s.bearing_deg) < ahead_deg and s.distance_m <= clearance_m + reach_m for s in seen):
        return ""
    return f"; the way ahead is blocked, {clearance_m:.1f} m away"


def grounded_openings(seen: Sequence[Sighting], reach_m: float = 0.6, ahead_deg: float = AHEAD_DEG) -> tuple[str, ...]:
    """How the answer's reason may begin this step: what the camera line says, in the examples' words.

    A 135M model invents a side when it sees nothing ("The yellow ball is to the right", the camera line
    "nothing"), then turns right and left by turns or walks forward blind; the answer grammar built with these
    openings (agent/robot/actions.py answer_grammar) lets its reason say only what the camera shows: nothing the
    instruction names -> "I do not see the " or "I still do not see the " (the model names it and goes on);
    the nearest sighting within reach, ahead, to one side -> "The red box is within reach", "... is ahead" or
    "... is still ahead", "... is to the left". The rest of the reason and the action stay the model's choice
    (the target's, exactly). () when a name cannot be said in the reason's letters (no opening is forced then).
    """
    if not seen:
        return ("I do not see the ", "I still do not see the ")
    s = seen[0]
    if s.distance_m < reach_m:
        said = ["within reach"]
    elif abs(s.bearing_deg) < ahead_deg:
        said = ["ahead", "still ahead"]
    else:
        said = [f"to the {'left' if s.bearing_deg > 0 else 'right'}"]
    openings = tuple(f"The {s.name} is {w}" for w in said)
    return openings if all(_SAYABLE.fullmatch(o) for o in openings) else ()


_SAYABLE = re.compile(f"[A-Z][{REASON_CHARS}]{{0,60}}")

GENERIC = {"the", "a", "an", "to", "go", "object", "thing"}


def relevant(sightings: Sequence[Sighting], instruction: str) -> list[Sighting]:
    """The sightings the instruction names best ("red box" in "go to the red box"), nearest first.

    This is the text-prompted detection a robot would run (an open-vocabulary detector
    queried with the task's object): a 135M model copies whatever object comes first,
    so distractors are left out. A sighting qualifies only if the instruction holds every
    word of its name ("yellow box" is not "the yellow ball", even with the ball out of
    view; a colour detector's "red object" still matches "red box"); of those, the most
    shared words win. Nothing the instruction names in view: nothing.
    """
    words = set(instruction.lower().replace(".", " ").replace(",", " ").split()) - GENERIC
    names = {id(s): set(s.name.lower().split()) - GENERIC for s in sightings}
    score = {i: len(words & name) if name <= words else 0 for i, name in names.items()}
    best = max(score.values(), default=0)
    return sorted((s for s in sightings if best and score[id(s)] == best), key=lambda s: s.distance_m)


def did_text(action: Action) -> str:
    """An action done, in the prompt's words: "turned left 30 degrees", "moved forward 50 cm", "stopped".

    In the past tense, not NaVILA's own words: a small model copies the last action sentence it
    read, and "turn left" right above the camera line would be one to copy.
    """
    if action.kind == "stop":
        return "stopped"
    return (
        f"moved forward {action.amount} cm"
        if action.kind == "forward"
        else f"turned {action.kind} {action.amount} degrees"
    )


def memory_line(observation: str, did: str) -> str:
    """One remembered step as the prompt shows it (oldest first, so a new step only appends a line)."""
    return f"Earlier camera: {observation}. Then I {did}."


CAMERA = "Camera: "
IMAGE_RECALL = "an image, not shown again"  # a remembered image step's observation in later prompts


def user_turn(task: str, observation: str, memory: Sequence[str] = (), note: str = "") -> str:
    """The last user turn: the task, the remembered steps (oldest first), what cannot be done now and why
    (`note`, agent/robot/feasible.py: only when something cannot), what the camera shows now. The note sits
    before the camera line: the camera stays last, as in every example, and the next step's prompt still
    shares this one's tokens up to the end of its memory."""
    return "\n".join(
        [f"Task: {task.strip().rstrip('.')}.", *memory, *([note] if note else []), f"{CAMERA}{observation}."]
    )


def text_part(text: str) -> dict[str, Any]:
    """One text part of a list-of-parts message."""
    return {"type": "text", "text": text}


def messages(
    instruction: str,
    observation: str,
    memory: Sequence[str] = (),
    parts: bool = False,
    image: bool = False,
    note: str = "",
) -> list[dict[str, Any]]:
    """The chat: system, the few-shot turns (never changing, so cached on both sides), then this step.

    Everything that changes from step to step (memory, camera) sits in the last user turn, after
    the task: the prompt of the next step shares all of this one up to the end of its memory.

    parts: every turn's content is a list of parts, as a vision-language model's chat template reads it
    (SmolVLM's renders a plain string as nothing); the system and few-shot turns are one text part each.
    image (parts only): the camera line holds the image itself, "Camera: <image>." with the image part
    where the text would be; `observation` is then what follows the image on that line ("" or the
    blocked-way note). The template writes the part as its family does: SmolVLM's `<image>`, Qwen-VL's
    `<|vision_start|><|image_pad|><|vision_end|>` (the marker `<|image_pad|>` inside the text libmtmd wraps an
    image in, as runtime/vision.py expects). `note`: what the robot cannot do now and why (user_turn).
    """
    if image and not parts:
        raise ValueError("an image in the prompt needs list-of-parts content (parts=True)")
    msgs: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    for task, remembered, seen, answer in SHOTS:
        recalled = [memory_line(o, did_text(a)) for o, a in remembered]  # verified, ran to its end: no marks
        msgs += [{"role": "user", "content": user_turn(task, seen, recalled)}, {"role": "assistant", "content": answer}]
    msgs.append({"role": "user", "content": user_turn(instruction, observation, memory, note)})
    if not parts:
        return msgs
    msgs = [{"role": m["role"], "content": [text_part(m["content"])]} for m in msgs]
    if image:
        head, camera, tail = msgs[-1]["content"][0]["text"].rpartition(CAMERA)
        msgs[-1]["content"] = [text_part(head + camera), {"type": "image"}, text_part(tail)]
    return msgs


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two prompts share (the KV both sides reuse from the previous step)."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def answer_limits(grammar: bool, max_tokens: int) -> tuple[str | None, int]:
    """(grammar, max_tokens) a step decodes with: under the answer grammar (agent/robot/actions.py) the draft drafts
    and the target verifies, so an answer is always one reason and one NaVILA sentence and within
    answer_max_tokens it always ends; without it, the configured nav max_tokens."""
    return (answer_grammar(), answer_max_tokens()) if grammar else (None, max_tokens)


def image_index(drafter: Any, ids: list[int]) -> int:
    """The index of the prompt's one image marker. A marker that stands for the image chunk alone (Qwen-VL's
    `<|image_pad|>`) must sit inside the text the projector wraps an image in (`<|vision_start|>` ...
    `<|vision_end|>`, which the family's chat template writes): ValueError otherwise."""
    at = [i for i, t in enumerate(ids) if t == drafter.image_marker]
    if len(at) != 1:
        raise ValueError(
            f"the step's prompt holds {len(at)} image markers, not the camera image's one: "
            "the instruction or the memory spells the marker out"
        )
    wrappers = getattr(getattr(drafter, "vision", None), "wrappers", None)
    if wrappers:
        before, after = (drafter.tokenize(w) for w in wrappers)
        i = at[0]
        if ids[i - len(before) : i] != before or ids[i + 1 : i + 1 + len(after)] != after:
            around = drafter.detokenize(ids[max(0, i - 3) : i + 4])
            raise ValueError(
                f"the draft's chat template writes the image as {around!r}: its projector expects the marker "
                f"inside {wrappers[0]!r} ... {wrappers[1]!r} (a template of another model family?)"
            )
    return at[0]
