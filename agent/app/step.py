"""One navigation step's telemetry record (`Step`): what the robot saw, what the model said, what it did."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from agent.robot.actions import STOP


@dataclass
class Step:
    """One telemetry record: what the robot saw, what the model said, what was sent, how long it took."""

    step: int
    task: str
    instruction: str
    t: float  # wall clock (time.time()) at the start of the step
    mode: str = "verified"  # verified | offline | halted (no answer: no fresh frame, perception failed)
    offline_policy: str = "hold"
    perception: str = ""  # sim (ground truth) | color (detector) | image (from the API, as text) |
    # vlm (the image itself in the prompt, the camera's or the API's)
    observation: str = ""
    text: str = ""  # the raw model text (verified and unverified parts together)
    verified_tokens: int = 0  # committed by the target
    unverified_tokens: int = 0  # written by the draft alone (offline local)
    action: str = "stop"  # the parsed action, e.g. "turn left 30 deg"
    action_text: str = STOP.text  # its canonical NaVILA sentence
    parse: str = ""  # exact | tolerant | miss | refused (no plan made)
    parse_note: str = ""
    envelope: str = ""  # "" | clamped | turned_away_stop (offline) | not_seen: the robot changed the action itself
    command: dict = field(default_factory=lambda: {"vx": 0.0, "vy": 0.0, "wz": 0.0})  # first set-point sent (clamped)
    command_peak: dict = field(default_factory=lambda: {"vx": 0.0, "vy": 0.0, "wz": 0.0})  # largest set-point sent
    completed: bool = False  # the motion ran to its end
    stopped_by: str = ""  # the safety stop that cut the motion short (obstacle, stale_frame, ...); "" if none did
    refused: str = ""  # the actions left out of this step's answer grammar and why (agent/robot/feasible.py)
    reason: str = ""  # why this action (or why none)
    link: str = "up"  # up | down
    latency_ms: dict = field(default_factory=dict)  # frame_age, perceive, generate, act, step
    decode: dict = field(default_factory=dict)  # tau, acceptance_rate, rounds, tokens_per_s, ...
    memory_steps: int = 0  # remembered steps in this step's prompt
    memory_tokens: int = 0  # their size in draft tokens (bounded by nav.memory_max_tokens)
    prompt_tokens: int = 0  # the whole prompt
    prefix_shared_tokens: int = 0  # of it, shared with the previous step's prompt (KV reused on both sides)
    decided_during: int = 0  # agent.overlap: the step during whose motion this one was decided (0: standing)
    decided_at: list = field(default_factory=list)  # [x, y, theta] of its frame (a simulator's), where it looked
    # latency_ms also says what overlapped: think_moving (look and think while the previous motion ran) and
    # standing (the robot stood still between the previous motion's end and this one's start)

    def to_json(self) -> dict:
        return asdict(self)
