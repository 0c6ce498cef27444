"""NaVILA's action vocabulary: parse a model's text into one bounded action, and turn it into motion.

The vocabulary is closed (NaVILA, arXiv 2412.04453; 10 strings):

    The next action is move forward {25|50|75} cm.
    The next action is turn {left|right} {15|30|45} degree.
    I think I should stop because I have finished the instruction.

Parsing is layered (go2-vla-navila's "frozen vocabulary" lesson):

1. exact   - one of the 10 strings, after normalising case and spaces (the period optional);
2. tolerant - "next action is ..." or a move/turn phrase with a number, snapped to the
   nearest allowed value (35 degrees -> 30, 1 m -> 75 cm); a bare "turn left" takes the
   smallest step, as NaVILA's own parser does;
3. miss    - anything else means stop. Never "move forward" by default: NaVILA-Bench
   maps unrecognised text to forward for 0.5 s, which is the failure copied here on purpose
   not to copy.

Within a layer the earliest match in the text wins, so reasoning that precedes the
action sentence cannot override it unless it is itself a complete action.
Every action is bounded (at most 75 cm or 45 degrees), which bounds the harm of any
one bad output.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Sequence

from .controllers.base import Command

FORWARD_CM = (25, 50, 75)
TURN_DEG = (15, 30, 45)
KINDS = ("forward", "left", "right", "stop")
STOP_TEXT = "I think I should stop because I have finished the instruction."


@dataclass(frozen=True)
class Action:
    kind: str  # forward | left | right | stop
    amount: int = 0  # cm for forward, degrees for a turn, 0 for stop

    def __post_init__(self):
        allowed = {"forward": FORWARD_CM, "left": TURN_DEG, "right": TURN_DEG, "stop": (0,)}
        if self.kind not in allowed or self.amount not in allowed[self.kind]:
            raise ValueError(f"not a NaVILA action: {self.kind} {self.amount}")

    @property
    def text(self) -> str:
        """The canonical NaVILA sentence."""
        if self.kind == "stop":
            return STOP_TEXT
        if self.kind == "forward":
            return f"The next action is move forward {self.amount} cm."
        return f"The next action is turn {self.kind} {self.amount} degree."

    def __str__(self) -> str:
        return (
            "stop"
            if self.kind == "stop"
            else (f"forward {self.amount} cm" if self.kind == "forward" else f"turn {self.kind} {self.amount} deg")
        )


STOP = Action("stop")
VOCABULARY = tuple(
    [Action("forward", d) for d in FORWARD_CM] + [Action(s, a) for s in ("left", "right") for a in TURN_DEG] + [STOP]
)


REASON_MAX_CHARS = 100  # the reason sentence, its period included


REASON_CHARS = "a-zA-Z0-9 ,;'-"  # what the reason holds after its capital letter, up to its period
_REASON_TEXT = re.compile(f"[A-Z][{REASON_CHARS}]*")


def answer_grammar(
    reason_max_chars: int = REASON_MAX_CHARS, allowed: Sequence[Action] = VOCABULARY, openings: Sequence[str] = ()
) -> str:
    """The answer as GBNF: one short reason sentence, free, then exactly one of the 10 NaVILA sentences.

    Both sides decode under it (protocol/structured.py: LLGuidance, which reads GBNF, on the draft
    and on the target), so every answer parses exactly and the controller never guesses. The
    reason is letters, digits, spaces and , ; ' - up to its period; the action is one
    alternative per vocabulary entry, generated from VOCABULARY so the two never drift apart.
    `allowed`: the actions the robot can take now (agent/robot/feasible.py), in VOCABULARY's order
    whatever order they come in; the whole vocabulary gives the same text as ever.
    `openings`: how the reason may begin (agent/app/prompt.py grounded_openings: what the camera line says, so the
    reason cannot claim a side it was not shown); the rest of the reason stays free and the whole still fits
    `reason_max_chars`, so `answer_max_tokens` bounds it as before. None: any reason.
    """
    if reason_max_chars < 2:
        raise ValueError("the reason needs room for a capital letter and its period")
    wanted = set(allowed)
    if not wanted or not wanted <= set(VOCABULARY):
        raise ValueError(f"the answer needs at least one NaVILA action, and only those: {sorted(map(str, wanted))}")
    bad = [o for o in openings if not _REASON_TEXT.fullmatch(o) or len(o) > reason_max_chars - 1]
    if bad:
        raise ValueError(f"a reason opens with a capital letter and {REASON_CHARS} within its bound, not {bad}")
    actions = " | ".join(f'"{a.text}"' for a in VOCABULARY if a in wanted)
    if openings:
        begin = "(" + " | ".join(f'"{o}"' for o in dict.fromkeys(openings)) + ") "
        rest = reason_max_chars - 1 - max(map(len, openings))
    else:
        begin, rest = "[A-Z] ", reason_max_chars - 2
    return f'root ::= reason " " action\nreason ::= {begin}[{REASON_CHARS}]{{0,{rest}}} "."\naction ::= {actions}\n'


def answer_max_tokens(reason_max_chars: int = REASON_MAX_CHARS) -> int:
    """Tokens that always suffice for a whole answer under `answer_grammar`: the grammar allows no empty
    token, so an answer has at most as many tokens as characters (and one stop token)."""
    return reason_max_chars + 1 + max(len(a.text) for a in VOCABULARY) + 1


@dataclass(frozen=True)
class Parsed:
    action: Action
    how: str  # exact | tolerant | miss
    span: str = ""  # the text that decided it ("" on a miss)
    note: str = ""  # what the tolerant parse changed, why it missed


def _norm(text: str) -> str:
    return re.sub(r"\s+", " ", text.lower()).strip()


# "the next action is turn left 30 degree" with the final period optional; "degrees" is NaVILA's too
_EXACT = [
    (a, re.compile(re.escape(_norm(a.text).rstrip(".")).replace("degree", "degrees?") + r"(?=\.|\s|$)"))
    for a in VOCABULARY
]
_NUM = r"(\d+(?:\.\d+)?)"
_FORWARD = re.compile(
    r"\b(?:move|go|walk|step)s?\s+(?:straight\s+)?forwards?(?:\s+(?:by\s+)?"
    + _NUM
    + r"\s*(cm|centimet(?:er|re)s?|m|met(?:er|re)s?)\b)?"
)
_TURN = re.compile(r"\bturns?\s+(?:to\s+the\s+)?(left|right)(?:\s+(?:by\s+)?" + _NUM + r"\s*(?:°|deg(?:ree)?s?)?)?")
_STOP = re.compile(r"\bstop\b")
_NEXT = re.compile(r"next action is\s+([^.\n]*)")


def snap(value: float, allowed: tuple[int, ...]) -> int:
    """The allowed value nearest to `value` (ties go to the smaller step)."""
    return min(allowed, key=lambda a: (abs(a - value), a))


def _tolerant(text: str) -> tuple[Action, str, str] | None:
    """The earliest move/turn/stop phrase in `text`, snapped; None if there is none."""
    found = []
    for m in _FORWARD.finditer(text):
        if m.group(1) is None:
            found.append((m.start(), Action("forward", FORWARD_CM[0]), m.group(0), "no distance: smallest step"))
            continue
        cm = float(m.group(1)) * (100.0 if m.group(2).startswith("m") and not m.group(2).startswith("mm") else 1.0)
        a = Action("forward", snap(cm, FORWARD_CM))
        found.append((m.start(), a, m.group(0), "" if cm == a.amount else f"snapped {cm:g} cm to {a.amount}"))
    for m in _TURN.finditer(text):
        side = m.group(1)
        if m.group(2) is None:
            found.append((m.start(), Action(side, TURN_DEG[0]), m.group(0), "no angle: smallest step"))
            continue
        deg = float(m.group(2))
        a = Action(side, snap(deg, TURN_DEG))
        found.append((m.start(), a, m.group(0), "" if deg == a.amount else f"snapped {deg:g} degrees to {a.amount}"))
    for m in _STOP.finditer(text):
        found.append((m.start(), STOP, m.group(0), ""))
    if not found:
        return None
    _, action, span, note = min(found, key=lambda f: f[0])
    return action, span, note


def parse_action(text: str) -> Parsed:
    """The one action a model's answer asks for; anything unparseable is `stop` (how="miss")."""
    if not isinstance(text, str) or not text.strip():
        return Parsed(STOP, "miss", note="empty output")
    t = _norm(text)
    exact = [(m.start(), a, m.group(0)) for a, rx in _EXACT for m in [rx.search(t)] if m]
    if exact:
        _, action, span = min(exact, key=lambda e: e[0])
        return Parsed(action, "exact", span)
    nxt = _NEXT.search(t)  # the sentence the model was asked to write, if it wrote one
    if nxt:
        hit = _tolerant(nxt.group(1))
        if hit:
            return Parsed(hit[0], "tolerant", hit[1], hit[2])
    hit = _tolerant(t)
    if hit:
        return Parsed(hit[0], "tolerant", hit[1], hit[2])
    return Parsed(STOP, "miss", note="no action in the output: stopping")


def complete(text: str) -> bool:
    """True once `text` holds a finished action sentence (generation can end there)."""
    t = _norm(text)
    for _, rx in _EXACT:  # a whole sentence: its period or a line break seen
        m = rx.search(t)
        if m and t[m.end() : m.end() + 1] in (".", "\n"):
            return True
    m = _NEXT.search(t)
    return bool(m and re.search(r"[.\n]", t[m.end() : m.end() + 1] or "") and _tolerant(m.group(1)))


@dataclass(frozen=True)
class Motion:
    """A velocity held for a duration (NaVILA-Bench's get_vel_command)."""

    cmd: Command
    duration_s: float


def motion_for(action: Action, speed: float = 0.5, turn_rate: float = math.pi / 6) -> Motion:
    """forward d cm: vx = speed for d / speed s; turn a degrees: wz = +-turn_rate for a / turn_rate s.

    NaVILA-Bench uses 0.5 m/s and pi/6 rad/s. The executor ramps down through the
    rate limiter at the end, which gives back the distance the ramp up lost.
    """
    if action.kind == "stop":
        return Motion(Command(), 0.0)
    if action.kind == "forward":
        return Motion(Command(vx=speed), action.amount / 100.0 / speed)
    sign = 1.0 if action.kind == "left" else -1.0
    return Motion(Command(wz=sign * turn_rate), math.radians(action.amount) / turn_rate)
