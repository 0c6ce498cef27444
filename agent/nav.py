"""The navigation loop: camera frame + instruction -> prompt -> speculative generation -> one
NaVILA action -> the control loop, with a declared offline mode when the verifier is gone.

Perception. With vision-language models on both sides the frame itself would go
into the prompt. The bundled models (SmolLM2-135M) read text only, so a
perception step turns the frame into text first: in the simulator the objects
the camera could see, with bearing and distance (`perception.kind = "sim"`,
ground truth); on a robot a pluggable detector (`"color"`: HSV blobs). Every
telemetry record says which (`perception`).

Offline. The verifier is unreachable (connect fails, the link drops) or answers
later than `verify_timeout_s`: the robot stops at once and the step goes on in
the configured offline policy:
    hold   the robot stays stopped. Within the step it waits for the link up to
           the plan's age limit and resumes the same generation from the tokens the
           target already committed (exact, nothing redone); later steps probe the
           link with backoff and re-plan from a fresh frame when it is back.
    local  the draft model alone finishes the answer from the committed tokens;
           the action and its record are marked unverified.
The next step after the link answers again is verified. Committed tokens are
never dropped: they end in the action (resumed or finished locally) and in the
telemetry record either way.
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Callable

from protocol.sampling import SamplingParams

from .decoder import EdgeDecoder
from .link import LinkLost, ServerError
from .robot.actions import STOP, complete, motion_for, parse_action
from .robot.camera import FrameGrabber, StaleFrame
from .robot.control import ControlLoop

log = logging.getLogger(__name__)

OFFLINE_POLICIES = ("hold", "local")

SYSTEM = ("You are a robot programmed for navigation tasks. Decide your next action, which could be turning left "
          "or right by 15, 30 or 45 degree, moving forward 25, 50 or 75 cm, or stop if the task is completed.")

# Few-shot turns (task, what the camera shows, answer). A 135M model copies the shape of its
# examples; with one short reason that names the side ("so I turn right") it picks the side
# right far more often than with bare numbers (tools/nav_prompt_eval.py measures it).
SHOTS = [
    ("go to the blue ball", "blue ball 40 degrees to the left, 3.1 m away",
     "The blue ball is to the left, so I turn left. The next action is turn left 45 degree."),
    ("go to the green box", "green box ahead, 2.4 m away",
     "The green box is ahead, so I move forward. The next action is move forward 75 cm."),
    ("go to the yellow cone", "nothing",
     "I do not see the yellow cone, so I look around. The next action is turn left 45 degree."),
    ("go to the yellow cone", "yellow cone 20 degrees to the right, 1.5 m away",
     "The yellow cone is to the right, so I turn right. The next action is turn right 15 degree."),
    ("go to the blue ball", "blue ball ahead, within reach",
     "The blue ball is within reach, so I stop. I think I should stop because I have finished the instruction."),
    ("go to the green box", "green box ahead, 0.9 m away",
     "The green box is ahead, so I move forward. The next action is move forward 25 cm."),
    ("go to the yellow cone", "yellow cone 31 degrees to the right, 2.0 m away",
     "The yellow cone is to the right, so I turn right. The next action is turn right 30 degree."),
    ("go to the green box", "green box 16 degrees to the left, 1.2 m away",
     "The green box is to the left, so I turn left. The next action is turn left 15 degree."),
    ("go to the blue ball", "blue ball ahead, 1.3 m away",
     "The blue ball is ahead, so I move forward. The next action is move forward 50 cm."),
]


def observation_text(sightings, reach_m: float = 0.6, ahead_deg: float = 10.0) -> str:
    """What the camera shows, in words: "red box 35 degrees to the left, 2.1 m away; ..." or "nothing"."""
    parts = []
    for s in sightings:
        where = "ahead" if abs(s.bearing_deg) < ahead_deg else \
            f"{abs(s.bearing_deg):.0f} degrees to the {'left' if s.bearing_deg > 0 else 'right'}"
        dist = "within reach" if s.distance_m < reach_m else f"{s.distance_m:.1f} m away"
        parts.append(f"{s.name} {where}, {dist}")
    return "; ".join(parts) if parts else "nothing"


GENERIC = {"the", "a", "an", "to", "go", "object", "thing"}


def relevant(sightings, instruction: str) -> list:
    """The sightings the instruction names best ("red box" in "go to the red box"), nearest first.

    This is the text-prompted detection a robot would run (an open-vocabulary detector
    queried with the task's object): a 135M model copies whatever object comes first,
    so distractors are left out. A sighting is scored by the words its name shares with
    the instruction; the best score wins ("red box" over "red ball"; a colour detector's
    "red object" still matches "red box"). Nothing the instruction names in view: nothing.
    """
    words = set(instruction.lower().replace(".", " ").replace(",", " ").split()) - GENERIC
    score = {id(s): len(words & (set(s.name.lower().split()) - GENERIC)) for s in sightings}
    best = max(score.values(), default=0)
    return sorted((s for s in sightings if best and score[id(s)] == best), key=lambda s: s.distance_m)


def messages(instruction: str, observation: str) -> list[dict]:
    msgs = [{"role": "system", "content": SYSTEM}]
    for task, seen, answer in SHOTS:
        msgs += [{"role": "user", "content": f"Task: {task}.\nCamera: {seen}."},
                 {"role": "assistant", "content": answer}]
    task = instruction.strip().rstrip(".")
    msgs.append({"role": "user", "content": f"Task: {task}.\nCamera: {observation}."})
    return msgs


@dataclass(frozen=True)
class NavConfig:
    mode: str = "sd"                    # how verified steps decode: sd | fsd | ar
    gamma: int = 4
    max_tokens: int = 40                # NaVILA decodes at most 32; the reason takes a few more
    temperature: float = 0.0
    seed: int = 0
    offline: str = "hold"               # hold | local
    verify_timeout_s: float = 2.0       # an answer later than this counts as a lost link
    max_frame_age_ms: float = 500.0     # refuse to plan from an older frame
    max_plan_age_s: float = 5.0         # never act on a plan whose frame is older than this
    reach_m: float = 0.6                # "within reach" in the observation text
    speed: float = 0.5                  # m/s for "move forward" (NaVILA-Bench)
    turn_rate: float = 0.5236           # rad/s for turns (pi/6, NaVILA-Bench)
    probe_backoff_s: float = 0.2        # offline: first wait before probing the link again
    probe_backoff_max_s: float = 5.0
    hold_wait_s: float = 0.5            # hold: pause between probes while the robot waits

    def __post_init__(self):
        if self.mode not in ("sd", "fsd", "ar"):
            raise ValueError(f"agent.mode must be sd, fsd or ar, got {self.mode!r}")
        if self.offline not in OFFLINE_POLICIES:
            raise ValueError(f"offline.policy must be one of {OFFLINE_POLICIES}, got {self.offline!r}")
        for name in ("max_tokens", "verify_timeout_s", "max_frame_age_ms", "max_plan_age_s", "speed", "turn_rate",
                     "probe_backoff_s", "probe_backoff_max_s", "hold_wait_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")


@dataclass
class Step:
    """One telemetry record: what the robot saw, what the model said, what was sent, how long it took."""
    step: int
    task: str
    instruction: str
    t: float                            # wall clock (time.time()) at the start of the step
    mode: str = "verified"              # verified | offline
    offline_policy: str = "hold"
    perception: str = ""                # sim (ground truth) | color (detector) | image (from the API)
    observation: str = ""
    text: str = ""                      # the raw model text (verified and unverified parts together)
    verified_tokens: int = 0            # committed by the target
    unverified_tokens: int = 0          # written by the draft alone (offline local)
    action: str = "stop"                # the parsed action, e.g. "turn left 30 deg"
    action_text: str = STOP.text        # its canonical NaVILA sentence
    parse: str = ""                     # exact | tolerant | miss | refused (no plan made)
    parse_note: str = ""
    command: dict = field(default_factory=lambda: {"vx": 0.0, "vy": 0.0, "wz": 0.0})   # first set-point sent (clamped)
    command_peak: dict = field(default_factory=lambda: {"vx": 0.0, "vy": 0.0, "wz": 0.0})  # largest set-point sent
    completed: bool = False             # the motion ran to its end
    reason: str = ""                    # why this action (or why none)
    link: str = "up"                    # up | down
    latency_ms: dict = field(default_factory=dict)  # frame_age, perceive, generate, act, step
    decode: dict = field(default_factory=dict)      # tau, acceptance_rate, rounds, tokens_per_s, ...

    def to_json(self) -> dict:
        return asdict(self)


class Navigator:
    def __init__(self, decoder: EdgeDecoder, grabber: FrameGrabber, perception, control: ControlLoop,
                 config: NavConfig = NavConfig(), emit: Callable[[dict], None] = lambda event: None,
                 on_mode: Callable[[str], None] = lambda mode: None, clock: Callable[[], float] = time.monotonic):
        self.decoder = decoder
        self.drafter = decoder.drafter
        self.grabber = grabber
        self.perception = perception
        self.control = control
        self.cfg = config
        self.emit = emit
        self.on_mode = on_mode
        self.clock = clock
        self.params = SamplingParams(temperature=config.temperature, seed=config.seed)
        self.link = "unknown"           # up | down | unknown (no step yet)
        self._backoff = config.probe_backoff_s
        self._next_probe = 0.0
        self.steps = 0
        self.offline_steps = 0
        self.session = f"nav-{uuid.uuid4().hex[:12]}"     # one server session: the few-shot prefix stays cached

    # -------------------------------------------------------------- the link

    def check_link(self) -> bool:
        """Probe the verifier now (at start, and while offline when the backoff allows)."""
        if self.decoder.url is None:
            self._mark("down", "no verifier configured")
            return False
        if self.decoder.connect():
            self._mark("up", "verifier answered")
            return True
        self._mark("down", "verifier unreachable")
        return False

    def _probe_if_due(self) -> bool:
        if self.link != "down":
            return True
        if self.clock() < self._next_probe:
            return False
        ok = self.check_link()
        if not ok:
            self._next_probe = self.clock() + self._backoff
            self._backoff = min(self.cfg.probe_backoff_max_s, self._backoff * 2)
        return ok

    def _mark(self, state: str, why: str) -> None:
        if state == self.link:
            return
        previous, self.link = self.link, state
        if state == "up":
            self._backoff = self.cfg.probe_backoff_s
            if previous == "down":
                log.warning("verifier is back: verified mode (%s)", why)
        else:
            self._next_probe = self.clock() + self._backoff
            log.warning("verifier lost (%s): offline mode, policy %s", why, self.cfg.offline)
        mode = "verified" if state == "up" else "offline"
        self.on_mode(mode)
        self.emit({"event": "mode", "mode": mode, "offline_policy": self.cfg.offline, "why": why})

    # -------------------------------------------------------------- one step

    def warm_up(self) -> None:
        """Prefill the prompt's fixed part (system and examples) on both sides before the first task.

        The first step would otherwise pay the whole prompt's prefill (seconds for the
        float32 target on a CPU) and its plan would be stale before it is made.
        """
        ids = self.prompt_ids("look around", "nothing")
        t0 = self.clock()
        self.drafter.next_logits(ids)           # the robot's side: the draft's KV cache
        if self.link == "up":                   # the server's: the session's KV, kept for the next steps
            try:
                self.decoder.generate(ids, mode="ar", max_tokens=1, params=self.params, session=self.session)
            except (LinkLost, ServerError) as e:
                self._mark("down", str(e))
        log.info("prompt prefix (%d tokens) prefilled in %.1fs", len(ids), self.clock() - t0)

    def prompt_ids(self, instruction: str, observation: str) -> list[int]:
        return self.drafter.tokenize(self.drafter.apply_chat_template(messages(instruction, observation)))

    def step(self, instruction: str, task: str = "", cancel: threading.Event | None = None,
             frame=None) -> Step:
        """Look, decide, act once. `frame` replaces the camera (an image sent through the local API)."""
        self.steps += 1
        t0 = self.clock()
        rec = Step(self.steps, task, instruction, time.time(), offline_policy=self.cfg.offline,
                   perception=getattr(self.perception, "kind", type(self.perception).__name__))
        try:
            if frame is None:
                frame = self.grabber.read_latest(self.cfg.max_frame_age_ms)
            else:
                rec.perception = "image"
        except StaleFrame as e:
            self.control.halt("stale_frame")
            return self._finish(rec, t0, parse="refused", reason=f"no fresh camera frame: {e}")
        rec.latency_ms["frame_age"] = round((self.clock() - frame.t) * 1e3, 1)
        t1 = self.clock()
        try:
            sightings = self.perception.describe(frame)
        except Exception as e:              # a detector fault must not kill the loop: stop and say why
            log.exception("perception failed")
            self.control.halt("perception_error")
            return self._finish(rec, t0, parse="refused", reason=f"perception failed: {type(e).__name__}: {e}")
        rec.observation = observation_text(relevant(sightings, instruction), self.cfg.reach_m)
        rec.latency_ms["perceive"] = round((self.clock() - t1) * 1e3, 1)
        self.emit({"event": "observation", "step": rec.step, "observation": rec.observation})
        ids = self.prompt_ids(instruction, rec.observation)

        t2 = self.clock()
        decided = self._decide(ids, rec, frame.t, cancel)
        rec.latency_ms["generate"] = round((self.clock() - t2) * 1e3, 1)
        if not decided:
            self.control.halt("holding")
            return self._finish(rec, t0)
        parsed = parse_action(rec.text)
        rec.action, rec.action_text, rec.parse, rec.parse_note = str(parsed.action), parsed.action.text, \
            parsed.how, parsed.note
        self.emit({"event": "reasoning", "step": rec.step, "text": rec.text, "mode": rec.mode})
        plan_age = self.clock() - frame.t
        if plan_age > self.cfg.max_plan_age_s:
            self.control.halt("stale_plan")
            rec.parse_note = f"{rec.action} ({rec.parse}) not acted on"
            rec.action, rec.action_text, rec.parse = str(STOP), STOP.text, "refused"
            return self._finish(rec, t0, reason=f"plan is {plan_age:.1f}s older than its frame "
                                                f"(limit {self.cfg.max_plan_age_s}s): not acted on")
        if cancel is not None and cancel.is_set():
            self.control.halt("cancelled")
            return self._finish(rec, t0, reason="cancelled")
        if parsed.action == STOP:
            self.control.halt("model_stop" if parsed.how != "miss" else "unparseable")
            rec.completed = True
            return self._finish(rec, t0, reason=rec.reason or (
                "the model says the task is done" if parsed.how != "miss" else f"unparseable output: {parsed.note}"))
        t3 = self.clock()
        self.emit({"event": "moving", "step": rec.step, "action": rec.action, "mode": rec.mode})
        rec.completed = self.control.execute(motion_for(parsed.action, self.cfg.speed, self.cfg.turn_rate), cancel)
        rec.latency_ms["act"] = round((self.clock() - t3) * 1e3, 1)
        first, peak = self.control.first_sent, self.control.peak_sent
        rec.command = first.to_json() if first is not None else {"vx": 0.0, "vy": 0.0, "wz": 0.0}
        rec.command_peak = peak.to_json()
        return self._finish(rec, t0, reason=rec.reason or (
            "" if rec.completed else f"motion cut short ({self.control.safety.last_stop_reason})"))

    def _finish(self, rec: Step, t0: float, parse: str | None = None, reason: str | None = None) -> Step:
        if parse is not None:
            rec.parse = parse
        if reason:
            rec.reason = reason
        rec.link = "up" if self.link == "up" else "down"
        rec.latency_ms["step"] = round((self.clock() - t0) * 1e3, 1)
        if rec.mode == "offline":
            self.offline_steps += 1
        self.emit({"event": "action", "step": rec.step, "action": rec.action, "mode": rec.mode,
                   "command": rec.command, "reason": rec.reason, "latency_ms": rec.latency_ms})
        return rec

    # -------------------------------------------------------------- generation, verified or not

    def _until(self, prefix: list[int]) -> Callable[[list[int]], bool]:
        stops = self.decoder.stop_ids()
        return lambda out: complete(self.drafter.detokenize(prefix + out, skip=stops))

    def _decide(self, ids: list[int], rec: Step, frame_t: float, cancel) -> bool:
        """Fill rec.text (and mode, tokens, decode metrics); False when the robot must hold."""
        committed: list[int] = []
        if self._probe_if_due():
            try:
                gen = self.decoder.generate(ids, mode=self.cfg.mode, max_tokens=self.cfg.max_tokens,
                                            params=self.params, gamma=self.cfg.gamma, until=self._until([]),
                                            session=self.session)
                self._mark("up", "generation verified")
                self._take(rec, gen)
                return True
            except (LinkLost, ServerError) as e:
                self.control.halt("link_lost")              # stop at once; decide what next below
                committed = list(e.token_ids)
                self._mark("down", str(e))
                rec.reason = (f"verifier lost mid-answer after {len(committed)} committed tokens: {e}" if committed
                              else f"verifier unreachable: {e}")
        else:
            rec.reason = "verifier unreachable"
        rec.mode = "offline"
        if self.cfg.offline == "local":
            return self._finish_locally(ids, committed, rec)
        return self._hold(ids, committed, rec, frame_t, cancel)

    def _finish_locally(self, ids, committed, rec) -> bool:
        gen = self.decoder.generate(ids + committed, mode="local", params=self.params,
                                    max_tokens=max(1, self.cfg.max_tokens - len(committed)),
                                    until=self._until(committed))
        rec.verified_tokens, rec.unverified_tokens = len(committed), len(gen.token_ids)
        rec.text = self.drafter.detokenize(committed + gen.token_ids, skip=self.decoder.stop_ids())
        rec.decode = {"mode": "local", "tokens": len(gen.token_ids), "tokens_per_s": round(gen.metrics.tokens_per_s, 2)}
        rec.reason = (rec.reason + "; " if rec.reason else "") + "offline local: the draft model alone, unverified"
        return True

    def _hold(self, ids, committed, rec, frame_t, cancel) -> bool:
        """Stay stopped; resume the same answer if the link returns while the frame is still fresh."""
        while self.clock() - frame_t < self.cfg.max_plan_age_s - self.cfg.verify_timeout_s:
            if cancel is not None and cancel.is_set():
                break
            if self._probe_if_due():
                try:
                    gen = self.decoder.generate(ids + committed, mode=self.cfg.mode, params=self.params,
                                                max_tokens=max(1, self.cfg.max_tokens - len(committed)),
                                                gamma=self.cfg.gamma, until=self._until(committed),
                                                session=self.session)
                except (LinkLost, ServerError) as e:
                    committed += list(e.token_ids)
                    self._mark("down", str(e))
                    continue
                self._take(rec, gen, prefix=committed)
                rec.reason += f"; resumed from {len(committed)} committed tokens when the verifier came back"
                return True
            time.sleep(min(self.cfg.hold_wait_s, max(0.0, self._next_probe - self.clock())))
        rec.action, rec.action_text, rec.parse = str(STOP), STOP.text, "refused"
        rec.reason = (rec.reason + "; " if rec.reason else "") + "offline hold: stopped, waiting for the verifier"
        rec.verified_tokens = len(committed)
        rec.text = self.drafter.detokenize(committed, skip=self.decoder.stop_ids())
        return False

    def _take(self, rec: Step, gen, prefix: list[int] = ()) -> None:
        rec.mode = "verified"               # every token of the answer was committed by the target
        rec.text = self.drafter.detokenize(list(prefix) + gen.token_ids, skip=self.decoder.stop_ids())
        rec.verified_tokens = len(prefix) + len(gen.token_ids)
        m = gen.metrics
        rec.decode = {"mode": gen.mode, "tokens": len(gen.token_ids), "rounds": m.rounds, "tau": m.tau,
                      "acceptance_rate": m.acceptance_rate, "tokens_per_s": round(m.tokens_per_s, 2),
                      "draft_ms": round(m.draft_ms, 1), "verify_ms": round(m.verify_ms, 1),
                      "network_ms": round(m.network_ms, 1), "bytes_up": m.bytes_up, "bytes_down": m.bytes_down,
                      "reconnects": m.reconnects}
