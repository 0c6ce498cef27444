"""The navigation loop: camera frame + instruction -> prompt -> speculative generation -> one
NaVILA action -> the control loop, with a declared offline mode when the verifier is gone.

A step (`Navigator.step`) looks (`_look`: the frame, perception, the observation in words or
the image), composes the prompt (`_compose`: agent/app/prompt.py, with the task's memory from
agent/app/memory.py), decides (agent/app/answering.py's `Answerer.decide`: the answer, verified
or offline, on the link `LinkState` keeps) and acts (`_act`: parse_action, the offline envelope,
then a halt or a motion). Every telemetry record (`Step`, agent/app/step.py) says which
perception made it (`perception`) and what the prompt held.

Offline. The verifier is unreachable (connect fails, the link drops) or answers
later than `verify_timeout_s`: the robot stops at once and the step goes on in
the configured offline policy:
    hold   the robot stays stopped. Within the step it waits for the link up to
           the plan's age limit and resumes the same generation from the tokens the
           target already committed (exact, nothing redone); later steps probe the
           link with backoff and re-plan from a fresh frame when it is back.
    local  the draft model alone finishes the answer from the committed tokens;
           the action and its record are marked unverified, and it runs in a stricter
           envelope: at most `offline.max_forward_cm` / `offline.max_turn_deg` (a larger
           step is reduced to the largest NaVILA step within), at `offline.speed_scale`
           of the speed, and a turn away from the target in view is replaced by a stop
           (a halt, not the task done). Step.envelope says which.
The next step after the link answers again is verified. Committed tokens are
never dropped: they end in the action (resumed or finished locally) and in the
telemetry record either way.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence, cast

from agent.decoding.decoder import EdgeDecoder
from agent.decoding.link import LinkLost, ServerError
from agent.robot.actions import (
    FORWARD_CM,
    STOP,
    TURN_DEG,
    Action,
    Motion,
    Parsed,
    answer_grammar,
    motion_for,
    parse_action,
)
from agent.robot.camera import Frame, FrameGrabber, StaleFrame
from agent.robot.control import ControlLoop
from agent.robot.feasible import EVERYTHING, Feasibility
from agent.robot.perception import CameraImage, Sighting
from protocol.images import PromptImage
from protocol.sampling import SamplingParams

from .answering import Answerer, LinkState, compile_answer_grammars
from .config import Config
from .lookahead import clearance_after, seen_after
from .memory import Recall, StepMemory
from .prompt import (
    AHEAD_DEG,
    IMAGE_RECALL,
    answer_limits,
    blocked_text,
    common_prefix,
    grounded_openings,
    image_index,
    messages,
    observation_text,
    relevant,
)
from .step import Step

log = logging.getLogger(__name__)

UNSEEN_TURNS = 1  # a detector that sees nothing the instruction names: turns the robot may make to look, per task


class Perception(Protocol):
    """A frame in, the sightings in it out (agent/robot/perception.py); `kind` names it where it has one."""

    def describe(self, frame: Frame) -> list[Sighting]: ...


class SeeingPerception(Perception, Protocol):
    """Perception "vlm": the frame itself, encoded for the prompt."""

    def encode(self, frame: Frame) -> CameraImage: ...


@dataclass(frozen=True)
class View:
    """What one step saw, for its prompt, its action and its memory."""

    frame_t: float  # the frame's capture time (time.monotonic()): the plan's age counts from it
    seen: list[Sighting]  # the sightings the instruction names, nearest first (can be empty)
    shown: CameraImage | None  # perception "vlm": the image on the camera line; else None (the line is words)
    blocked: str  # the blocked-way note ("" when the way ahead is clear or not measured)
    recalled: str  # what later prompts remember it saw


@dataclass(frozen=True)
class Plan:
    """A decided step not yet acted on (Navigator.plan); `Navigator.act` acts on it."""

    rec: Step  # its record so far: what it saw and what the model said
    view: View
    t0: float  # when the step began (its look)


@dataclass(frozen=True)
class Moving:
    """A step whose motion runs (Navigator.act with wait=False); `Navigator.settle` waits for its end."""

    rec: Step
    action: Action  # what runs (after the offline envelope)
    motion: Motion
    recalled: str
    t0: float  # when the step began
    t_move: float  # when its motion started


def feasibility(config: Config, control: Any) -> Feasibility:
    """What the robot can do now, per nav.feasible (the safety layer's range source and obstacle stop) and
    nav.grounded (the target's rules); both need the answer grammar."""
    safety = getattr(control, "safety", None)
    return Feasibility(
        getattr(safety, "ranges", None) if config.nav.grammar and config.nav.feasible else None,
        getattr(getattr(safety, "limits", None), "min_clearance_m", None),
        toward=config.nav.grammar and config.nav.grounded,
    )


# ------------------------------------------------------------------ the offline envelope


def largest_within(allowed: tuple[int, ...], limit: float) -> int:
    """The largest NaVILA step not over `limit` (the limits are validated to hold at least the smallest)."""
    return max(a for a in allowed if a <= limit)


def turns_away(action: Action, target: Sighting | None, ahead_deg: float = AHEAD_DEG) -> bool:
    """Whether a turn leaves a target the robot sees: it is off to one side and the turn goes to the
    other, or it is ahead and the turn takes it out of the ahead cone (bearing b, positive left; a
    turn left by a moves it to b - a, a turn right to b + a)."""
    if target is None or action.kind not in ("left", "right"):
        return False
    b = target.bearing_deg
    if abs(b) >= ahead_deg:
        return (b > 0) != (action.kind == "left")
    after = b - action.amount if action.kind == "left" else b + action.amount
    return abs(after) > ahead_deg


def offline_envelope(
    action: Action, target: Sighting | None, max_forward_cm: float, max_turn_deg: float, ahead_deg: float = AHEAD_DEG
) -> tuple[Action, str, str]:
    """The action an unverified answer may run: (action, envelope, note).

    envelope "" (as asked), "clamped" (reduced to the largest NaVILA step within the offline
    limits) or "turned_away_stop" (it turns away from the target in view: the robot halts,
    which is not the task done). `target` is the relevant sighting in view now, or None.
    """
    run, envelope, note = action, "", ""
    if action.kind == "forward" and action.amount > max_forward_cm:
        run = Action("forward", largest_within(FORWARD_CM, max_forward_cm))
    elif action.kind in ("left", "right") and action.amount > max_turn_deg:
        run = Action(action.kind, largest_within(TURN_DEG, max_turn_deg))
    if run != action:
        envelope, note = "clamped", f"offline envelope: {action} reduced to {run}"
    if target is not None and turns_away(run, target, ahead_deg):
        side = (
            "ahead"
            if abs(target.bearing_deg) < ahead_deg
            else f"{abs(target.bearing_deg):.0f} degrees to the {'left' if target.bearing_deg > 0 else 'right'}"
        )
        return STOP, "turned_away_stop", f"offline envelope: {action} turns away from the {target.name} {side}: stopped"
    return run, envelope, note


@dataclass(frozen=True)
class NavConfig:
    """The navigator's own constants, which no config sets; everything else it reads from the config's
    sections (agent/app/config.py: agent, link, offline, nav, camera), where each setting is declared."""

    speed: float = 0.5  # m/s for "move forward" (NaVILA-Bench)
    turn_rate: float = 0.5236  # rad/s for turns (pi/6, NaVILA-Bench)
    hold_wait_s: float = 0.5  # hold: pause between probes while the robot waits
    ahead_deg: float = AHEAD_DEG  # a bearing within this is "ahead" (observation text, offline envelope)

    def __post_init__(self):
        for name in ("speed", "turn_rate", "hold_wait_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        if not 0 < self.ahead_deg < 45:
            raise ValueError(f"ahead_deg must be in (0, 45) degrees, got {self.ahead_deg!r}")


class Navigator:
    def __init__(
        self,
        decoder: EdgeDecoder,
        grabber: FrameGrabber,
        perception: Perception,
        control: ControlLoop,
        config: Config | None = None,
        consts: NavConfig = NavConfig(),
        emit: Callable[[dict], None] = lambda event: None,
        on_mode: Callable[[str], None] = lambda mode: None,
        clock: Callable[[], float] = time.monotonic,
        turns: Callable[[], AbstractContextManager[Any]] = nullcontext,
    ):
        self.decoder = decoder
        self.turns = turns  # the draft model's turn for a step's generation (agent/app/drafting.py: chat waits)
        self.drafter = decoder.drafter
        self.grabber = grabber
        self.perception = perception
        self.control = control
        self.cfg = config = config or Config()  # the sections it reads: agent, link, offline, nav, camera
        self.consts = consts
        self.emit = emit
        self.on_mode = on_mode
        self.clock = clock
        self.params = SamplingParams(temperature=config.agent.temperature, seed=config.agent.seed)
        self.links = LinkState(decoder, config, emit, on_mode, clock)  # the verifier's link: Navigator.link
        self.steps = 0
        self.offline_steps = 0
        self.offline_clamped = 0  # unverified actions reduced to the offline envelope
        self.offline_turn_away_stops = 0  # unverified turns away from a target in view, replaced by stop
        # A camera's detector ("color") that sees nothing the instruction names: the robot never walks, turns at
        # most UNSEEN_TURNS times to look, then stops and the task ends "not_seen" (Step.envelope).
        self.guards_unseen = getattr(perception, "kind", None) == "color"
        self.unseen_turns = 0  # this task's
        self.memory = StepMemory(
            config.nav.memory_steps, config.nav.memory_max_tokens, lambda text: len(self.drafter.tokenize(text))
        )
        # A vision-language draft (loaded with its mmproj) has an image marker and a chat template that reads
        # list-of-parts content; with perception "vlm" the frame itself goes in the prompt on that marker.
        self.parts = getattr(self.drafter, "image_marker", None) is not None
        self.sees = getattr(perception, "kind", None) == "vlm"
        if self.sees and not self.parts:
            raise ValueError(
                "perception 'vlm' puts the camera image in the prompt: the draft must be a "
                "vision-language model loaded with its projector (agent.draft_mmproj)"
            )
        if self.sees:  # at start, not at the first step: the draft's chat template lays the image out as expected
            chat = messages("look around", "", parts=True, image=True)
            image_index(self.drafter, self.drafter.tokenize(self.drafter.apply_chat_template(chat)))
        self._last_ids: list[int] = []  # the previous prompt: what both KV caches start from
        self._last_images: list[PromptImage] = []  # its image (perception "vlm"), else none
        self.session = f"nav-{uuid.uuid4().hex[:12]}"  # one server session: the few-shot prefix stays cached
        self.grammar, self.max_tokens = answer_limits(
            config.nav.grammar, config.agent.max_tokens
        )  # the answer grammar or not; a step narrows its own (Navigator._feasible) into the answerer's
        self.feasibility = feasibility(config, control)  # what the robot can do now (agent/robot/feasible.py)
        # The step's answer, verified or in the offline policy (agent/app/answering.py).
        self.answers = Answerer(
            decoder,
            self.links,
            control,
            config,
            self.params,
            self.session,
            self.grammar,
            self.max_tokens,
            consts.hold_wait_s,
            clock,
        )
        self.last_look: tuple[Frame, list[Sighting]] | None = None  # the latest step's frame and sightings
        self._looks: dict[int, tuple[Frame, list[Sighting]]] = {}  # the last steps' (overlapped: one decided ahead)
        self.hfov_deg = float(getattr(perception, "hfov_deg", 90.0))  # what a look moved by a turn still sees

    # -------------------------------------------------------------- the link

    @property
    def link(self) -> str:
        """The verifier's link: up | down | unknown (no step yet)."""
        return self.links.state

    def check_link(self) -> bool:
        """Probe the verifier now (at start, and while offline when the backoff allows)."""
        return self.links.check()

    # -------------------------------------------------------------- one step

    def warm_up(self) -> None:
        """Prefill the prompt's fixed part (system and examples) on both sides before the first task.

        The first step would otherwise pay the whole prompt's prefill (seconds for the
        float32 target on a CPU) and its plan would be stale before it is made.
        """
        ids = self.prompt_ids("look around", "nothing")  # with perception "vlm" the text before the image
        self._last_ids = ids
        t0 = self.clock()
        if self.parts:
            self.drafter.use_images([])  # a text prompt: no image of an earlier generation on its markers
        self.drafter.next_logits(ids)  # the robot's side: the draft's KV cache
        compile_answer_grammars(self.drafter, self.grammar, self.feasibility)
        if self.link == "up":  # the server's: the session's KV, kept for the next steps
            try:
                self.decoder.generate(ids, mode="ar", max_tokens=1, params=self.params, session=self.session)
            except (LinkLost, ServerError) as e:
                self.links.mark("down", str(e))
        log.info("prompt prefix (%d tokens) prefilled in %.1fs", len(ids), self.clock() - t0)

    def prompt_ids(self, instruction: str, observation: str, memory: Sequence[str] = ()) -> list[int]:
        """A text prompt: `observation` in words on the camera line."""
        return self.prompt(instruction, observation, memory)[0]

    def prompt(
        self,
        instruction: str,
        observation: str,
        memory: Sequence[str] = (),
        image: bytes | None = None,
        note: str = "",
    ) -> tuple[list[int], list[PromptImage]]:
        """(ids, images): with `image` (JPEG/PNG bytes) the camera line holds it, on the prompt's one image
        marker, and `observation` is what follows it on the line; `note`: what cannot be done now (the line
        before the camera's). ValueError when the prompt holds another number of markers (an instruction that
        spells the marker out)."""
        chat = messages(instruction, observation, memory, parts=self.parts, image=image is not None, note=note)
        ids = self.drafter.tokenize(self.drafter.apply_chat_template(chat))
        if image is None:
            return ids, []
        return ids, [PromptImage.of(image, image_index(self.drafter, ids))]

    def look_of(self, step: int) -> tuple[Frame, list[Sighting]] | None:
        """The frame and sightings step `step` decided on (one of the last few), else None."""
        return self._looks.get(step)

    @property
    def last_prompt_ids(self) -> list[int]:
        """The prompt of the latest step (with its memory)."""
        return list(self._last_ids)

    @property
    def last_prompt_images(self) -> list[PromptImage]:
        """The image of the latest step's prompt (perception "vlm"), else []."""
        return list(self._last_images)

    def _clearance_ahead(self, during: Motion | None = None) -> float | None:
        """The free distance straight ahead from the controller's range source; None without one. `during`: the
        motion under way, with agent.overlap_look "end": ahead from the pose it will reach (agent/app/overlap.py)."""
        ranges = getattr(getattr(self.control, "safety", None), "ranges", None)
        if ranges is None or not self.cfg.nav.blocked_m:
            return None
        try:
            if during is not None and self.cfg.agent.overlap_look == "end":
                return clearance_after(ranges.clearance_m, during)
            return ranges.clearance_m(0.0)
        except Exception:  # a range fault must not stop the step: the safety layer still checks
            log.exception("reading the range ahead failed")
            return None

    def step(
        self, instruction: str, task: str = "", cancel: threading.Event | None = None, frame: Frame | None = None
    ) -> Step:
        """Look, decide, act once (sequential). `frame` replaces the camera (an image sent through the local API).
        agent/app/overlap.py's `Overlapped` runs the same parts with the next decision made during the motion."""
        plan = self.plan(instruction, task, cancel, frame)
        return plan if isinstance(plan, Step) else cast(Step, self.act(plan, cancel))

    def plan(
        self,
        instruction: str,
        task: str = "",
        cancel: threading.Event | None = None,
        frame: Frame | None = None,
        during: Moving | None = None,
    ) -> Plan | Step:
        """Look and decide: the Plan to act on, or the finished Step when nothing was decided (no fresh frame,
        holding). `during`: the motion under way, when deciding the next step while it runs (the look is
        moved to the pose it will reach, agent.overlap_look)."""
        self.steps += 1
        t0 = self.clock()
        if self.memory.start((task, instruction.strip())):
            log.info("new task %r (%s): memory cleared", task, instruction.strip())
            self.unseen_turns = 0
            self.feasibility.reset()
        rec = Step(
            self.steps,
            task,
            instruction,
            time.time(),
            offline_policy=self.cfg.offline.policy,
            perception=getattr(self.perception, "kind", type(self.perception).__name__),
        )
        self.last_look = None
        view = self._look(rec, instruction, frame, during)
        if isinstance(view, str):  # no fresh frame, or perception failed: the robot halted, nothing decided
            rec.mode = "halted"  # neither verified nor offline: no model answered, whatever the link
            return self._finish(rec, t0, parse="refused", reason=view)
        ids, images = self._compose(rec, instruction, view, self._feasible(rec, view))
        t2 = self.clock()
        with self.turns():
            decided = self.answers.decide(ids, images, rec, view.frame_t, cancel)
        rec.latency_ms["generate"] = round((self.clock() - t2) * 1e3, 1)
        if not decided:
            self.control.halt("holding")
            return self._finish(rec, t0)
        return Plan(rec, view, t0)

    def act(self, plan: Plan, cancel: threading.Event | None = None, wait: bool = True) -> Step | Moving:
        """Act on a plan: the finished Step, or (wait=False, a motion) the Moving to `settle` once it ends."""
        return self._act(plan.rec, plan.view, plan.t0, cancel, wait)

    def _look(self, rec: Step, instruction: str, frame: Frame | None, during: Moving | None = None) -> View | str:
        """The frame (the camera's, or the API's) perceived and put in words on rec; why not (the robot halted)."""
        source = "camera" if frame is None else "API"
        try:
            if frame is None:
                frame = self.grabber.read_latest(self.cfg.camera.max_age_ms)
            elif not self.sees:  # with "vlm" an API image is shown to the models as the camera's is
                rec.perception = "image"
        except StaleFrame as e:
            self.control.halt("stale_frame")
            return f"no fresh camera frame: {e}"
        rec.latency_ms["frame_age"] = round((self.clock() - frame.t) * 1e3, 1)
        pose = frame.meta.get("pose")
        rec.decided_at = [round(float(v), 3) for v in pose][:3] if pose is not None else []
        t1 = self.clock()
        try:
            sightings = self.perception.describe(frame)
            shown = cast(SeeingPerception, self.perception).encode(frame) if self.sees else None
        except Exception as e:  # a detector fault must not kill the loop: stop and say why
            log.exception("perception failed")
            self.control.halt("perception_error")
            return f"perception failed: {type(e).__name__}: {e}"
        self.last_look = self._looks[rec.step] = (frame, sightings)
        for old in [k for k in self._looks if k < rec.step - 2]:  # a step's and the one decided ahead of it
            del self._looks[old]
        clearance = self._clearance_ahead(during.motion if during else None)
        if during is not None and self.cfg.agent.overlap_look == "end":  # what the robot will see there
            sightings = seen_after(sightings, during.motion, self.hfov_deg)
        seen = relevant(sightings, instruction)
        blocked = blocked_text(clearance, seen, self.cfg.nav.blocked_m, self.consts.ahead_deg, self.cfg.agent.reach_m)
        if shown is None:
            rec.observation = observation_text(seen, self.cfg.agent.reach_m, self.consts.ahead_deg) + blocked
            recalled = rec.observation
        else:  # the camera line: "Camera: <image>" + blocked + "."
            rec.observation = shown.describe(source) + blocked
            recalled = IMAGE_RECALL + blocked
        rec.latency_ms["perceive"] = round((self.clock() - t1) * 1e3, 1)
        self.emit({"event": "observation", "step": rec.step, "observation": rec.observation})
        return View(frame.t, seen, shown, blocked, recalled)

    def _feasible(self, rec: Step, view: View) -> str:
        """This step's answer grammar, the answerer's: only the actions the robot can take now (nav.feasible) and a
        reason that opens with what the camera shows (nav.grounded); rec says what was left out and why. Returns
        the prompt's note on it ("" when nothing was)."""
        now = self.feasibility.now(view.seen, self.consts.ahead_deg, self.cfg.agent.reach_m)
        grounded = self.cfg.nav.grounded and view.shown is None  # the camera line in words: what the reason says
        opening = grounded_openings(view.seen, self.cfg.agent.reach_m, self.consts.ahead_deg) if grounded else ()
        if self.grammar is not None:
            self.answers.grammar = answer_grammar(allowed=now.allowed, openings=opening)
        if now is not EVERYTHING and now.refused:
            rec.refused = f"{', '.join(map(str, now.refused))}: {'; '.join(w for w in (now.why, now.steer) if w)}"
        return now.note

    def _compose(self, rec: Step, instruction: str, view: View, note: str = "") -> tuple[list[int], list[PromptImage]]:
        """This step's prompt (with the task's memory and `note`, what cannot be done now); rec says its size and
        what it shares with the last one."""
        shown = view.shown
        observation = view.blocked if shown else rec.observation  # with an image, what follows it on the line
        ids, images = self.prompt(
            instruction, observation, self.memory.lines(), image=shown.data if shown else None, note=note
        )
        rec.memory_steps, rec.memory_tokens, rec.prompt_tokens = len(self.memory), self.memory.tokens, len(ids)
        rec.prefix_shared_tokens = common_prefix(ids, self._last_ids)
        self._last_ids, self._last_images = ids, images
        return ids, images

    def _act(
        self, rec: Step, view: View, t0: float, cancel: threading.Event | None, wait: bool = True
    ) -> Step | Moving:
        """Act on rec.text: not at all when the plan is stale or the task cancelled; unverified, within the
        offline envelope; a stop halts the robot, any other action runs through the control loop."""
        parsed = parse_action(rec.text)
        action = parsed.action
        rec.action, rec.action_text, rec.parse, rec.parse_note = str(action), action.text, parsed.how, parsed.note
        self.emit({"event": "reasoning", "step": rec.step, "text": rec.text, "mode": rec.mode})
        plan_age, limit = self.clock() - view.frame_t, self.cfg.agent.max_plan_age_s
        if plan_age > limit:
            self.control.halt("stale_plan")
            rec.parse_note = f"{rec.action} ({rec.parse}) not acted on"
            rec.action, rec.action_text, rec.parse = str(STOP), STOP.text, "refused"
            return self._finish(
                rec,
                t0,
                reason=f"plan is {plan_age:.1f}s older than its frame (limit {limit}s): not acted on",
            )
        if cancel is not None and cancel.is_set():
            self.control.halt("cancelled")
            return self._finish(rec, t0, reason="cancelled")
        if rec.mode == "offline":  # unverified: the stricter envelope
            action = self._envelope(action, view.seen[0] if view.seen else None, rec)
            rec.action, rec.action_text = str(action), action.text
        if self.guards_unseen and not view.seen:
            action = self._unseen(action, rec)
        if action == STOP:
            return self._stop(rec, parsed, view.recalled, t0)
        return self._move(rec, action, view.recalled, t0, cancel, wait)

    def _stop(self, rec: Step, parsed: Parsed, recalled: str, t0: float) -> Step:
        """Halt: the model's stop (the task done), an unparseable answer's, or the offline envelope's."""
        if rec.envelope in ("turned_away_stop", "not_seen"):
            self.control.halt("offline_turn_away" if rec.envelope == "turned_away_stop" else "not_seen")
        else:
            self.control.halt("model_stop" if parsed.how != "miss" else "unparseable")
        rec.completed = True
        self._remember(rec, STOP, recalled)
        done = "the model says the task is done" if parsed.how != "miss" else f"unparseable output: {parsed.note}"
        return self._finish(rec, t0, reason=rec.reason or done)

    def _move(
        self, rec: Step, action: Action, recalled: str, t0: float, cancel: threading.Event | None, wait: bool = True
    ) -> Step | Moving:
        """Run the action's motion (slower when unverified); rec says the set-points sent and whether it ran out.
        wait=False: the motion is started and the Moving returned (the memory says it is under way)."""
        t3 = self.clock()
        self.emit({"event": "moving", "step": rec.step, "action": rec.action, "mode": rec.mode})
        scale = self.cfg.offline.speed_scale if rec.mode == "offline" else 1.0
        motion = motion_for(action, self.consts.speed * scale, self.consts.turn_rate * scale)
        rec.latency_ms.setdefault("standing", round((t3 - t0) * 1e3, 1))  # sequential: the whole look and think
        moving = Moving(rec, action, motion, recalled, t0, t3)
        if wait:
            return self._moved(moving, self.control.execute(motion, cancel))
        self.control.start_motion(motion)
        self.memory.add(Recall(recalled, action, verified=rec.mode == "verified", under_way=True))
        return moving

    def settle(self, moving: Moving, cancel: threading.Event | None = None) -> Step:
        """Wait for a motion `act(wait=False)` started to end (or be cut short); the step's record finished."""
        return self._moved(moving, self.control.wait_motion(cancel, moving.motion.duration_s + 5.0))

    def _moved(self, moving: Moving, completed: bool) -> Step:
        rec = moving.rec
        rec.completed = completed
        if not rec.completed:
            rec.stopped_by = getattr(getattr(self.control, "safety", None), "last_stop_reason", None) or "halt"
        self.feasibility.moved(moving.action, rec.stopped_by)
        self._remember(rec, moving.action, moving.recalled)
        end = getattr(self.control, "ended_at", None)  # when the motion ended (not when settle saw it: overlapped)
        end = end if end is not None and end >= moving.t_move else self.clock()
        rec.latency_ms["act"] = round((end - moving.t_move) * 1e3, 1)
        first, peak = self.control.first_sent, self.control.peak_sent
        rec.command = first.to_json() if first is not None else {"vx": 0.0, "vy": 0.0, "wz": 0.0}
        rec.command_peak = peak.to_json()
        return self._finish(
            rec,
            moving.t0,
            t_end=end,
            reason=rec.reason
            or ("" if rec.completed else f"motion cut short ({self.control.safety.last_stop_reason})"),
        )

    def _envelope(self, action: Action, target: Sighting | None, rec: Step) -> Action:
        """An unverified action within the offline limits, or stop when it turns away from the target in view."""
        run, rec.envelope, note = offline_envelope(
            action, target, self.cfg.offline.max_forward_cm, self.cfg.offline.max_turn_deg, self.consts.ahead_deg
        )
        if rec.envelope:
            rec.parse_note = "; ".join(n for n in (rec.parse_note, note) if n)
            rec.reason = "; ".join(n for n in (rec.reason, note) if n)
            if rec.envelope == "clamped":
                self.offline_clamped += 1
            else:
                self.offline_turn_away_stops += 1
                rec.reason += " (a halt, not the task done)"
            log.warning("%s", note)
        return run

    def _unseen(self, action: Action, rec: Step) -> Action:
        """Nothing the instruction names in the detector's view: one turn to look (UNSEEN_TURNS a task), else a
        stop with Step.envelope "not_seen", which ends the task (agent/robot/episode.py); never a step forward."""
        if action.kind in ("left", "right") and self.unseen_turns < UNSEEN_TURNS:
            self.unseen_turns += 1
            return action
        instead = "" if action == STOP else f" instead of {action}"
        note = f"I do not see what the instruction names ({rec.observation}), so I stop{instead}"
        rec.envelope = "not_seen"
        rec.parse_note = "; ".join(n for n in (rec.parse_note, "not_seen") if n)
        rec.reason = "; ".join(n for n in (rec.reason, note) if n)
        rec.action, rec.action_text = str(STOP), STOP.text
        log.warning("%s", note)
        return STOP

    def _remember(self, rec: Step, action: Action, observation: str) -> None:
        """What this step saw (in words: an image step's is IMAGE_RECALL) and did, for the next steps' prompts
        (only steps that acted)."""
        self.memory.settle(
            Recall(observation, action, verified=rec.mode == "verified", completed=rec.completed or action == STOP)
        )

    def finish(self, rec: Step, t0: float, reason: str) -> Step:
        """Close a step's record (a plan refused outside the navigator: agent/app/overlap.py)."""
        return self._finish(rec, t0, reason=reason)

    def _finish(
        self, rec: Step, t0: float, parse: str | None = None, reason: str | None = None, t_end: float | None = None
    ) -> Step:
        if parse is not None:
            rec.parse = parse
        if reason:
            rec.reason = reason
        rec.link = "up" if self.link == "up" else "down"
        rec.latency_ms["step"] = round(((self.clock() if t_end is None else t_end) - t0) * 1e3, 1)
        if rec.mode == "offline":
            self.offline_steps += 1
        self.emit(
            {
                "event": "action",
                "step": rec.step,
                "action": rec.action,
                "mode": rec.mode,
                "command": rec.command,
                "reason": rec.reason,
                "latency_ms": rec.latency_ms,
            }
        )
        return rec
