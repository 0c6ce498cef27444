"""The navigation loop's memory (the last steps in the prompt, bounded, per task, cache-friendly) and the
offline envelope (unverified actions clamped, turns away from a target in view replaced by stop).

Fakes at the decoder's depth: a word tokenizer and a scripted decoder, so the prompt, the memory and
the envelope run as the robot runs them, without a model. The real tokenizer's prefix sharing is
checked under `real`.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from agent.app import config, prompt
from agent.app.config import ConfigError
from agent.app.memory import Recall, StepMemory
from agent.app.navigator import NavConfig, Navigator, offline_envelope
from agent.app.prompt import common_prefix, messages
from agent.decoding.decoder import Generation, Metrics
from agent.decoding.link import LinkLost
from agent.robot.actions import STOP, Action, parse_action
from agent.robot.camera import Frame, StaleFrame
from agent.robot.controllers.base import Command
from agent.robot.perception import Sighting

INSTRUCTION = "go to the red box"


class WordDrafter:
    """Word-level tokenizer with a growing vocabulary; a chat template that marks each turn."""

    def __init__(self):
        self.vocab: dict[str, int] = {}
        self.eos_ids = {0}
        self.primed: list[list[int]] = []

    def apply_chat_template(self, msgs: list[dict]) -> str:
        return "".join(f"<|{m['role']}|> {m['content']} <|end|> " for m in msgs) + "<|assistant|>"

    def tokenize(self, text: str) -> list[int]:
        return [self.vocab.setdefault(w, len(self.vocab) + 1) for w in text.split()]

    def detokenize(self, ids, skip=frozenset()) -> str:
        words = {i: w for w, i in self.vocab.items()}
        return " ".join(words[i] for i in ids if i not in skip)

    def next_logits(self, ids):
        self.primed.append(list(ids))
        return np.zeros(4, np.float32)


class ScriptedDecoder:
    """Answers each generation with the next scripted text; url None means no verifier (offline)."""

    def __init__(self, drafter: WordDrafter, answers: list[str], url: str | None = "ws://verifier"):
        self.drafter, self.answers, self.url = drafter, list(answers), url
        self.calls: list[dict] = []

    def connect(self) -> bool:
        return self.url is not None

    def stop_ids(self) -> set[int]:
        return set(self.drafter.eos_ids)

    def generate(
        self,
        prompt_ids,
        *,
        mode="sd",
        max_tokens=64,
        params=None,
        gamma=4,
        until=None,
        session=None,
        grammar=None,
        grammar_from=None,
        images=None,
    ):
        self.calls.append(
            {
                "ids": list(prompt_ids),
                "mode": mode,
                "session": session,
                "grammar": grammar,
                "grammar_from": grammar_from,
            }
        )
        if self.url is None and mode != "local":
            raise LinkLost("no verifier")
        text = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        return Generation(text, self.drafter.tokenize(text), mode, Metrics(rounds=1, tokens_per_s=10.0))


class ListGrabber:
    def read_latest(self, max_age_ms):
        return Frame(np.zeros((4, 4, 3), np.uint8), time.monotonic(), 1, {})


class ListPerception:
    """Sightings per step from a list (the last one repeats)."""

    kind = "sim"

    def __init__(self, views: list[list[Sighting]]):
        self.views = list(views)

    def describe(self, frame):
        return self.views.pop(0) if len(self.views) > 1 else self.views[0]


class _Safety:
    last_stop_reason = None


class RecordingControl:
    def __init__(self):
        self.motions, self.halts = [], []
        self.first_sent, self.peak_sent, self.safety = None, Command(), _Safety()

    def execute(self, motion, cancel=None):
        self.motions.append(motion)
        self.first_sent = self.peak_sent = motion.cmd
        return True

    def halt(self, reason="halt"):
        self.halts.append(reason)


def box(bearing: float, distance: float = 3.0) -> list[Sighting]:
    return [Sighting("red box", bearing, distance, "sim")]


def answer(action: Action) -> str:
    return f"I decide. {action.text}"


def make_nav(answers, views, url="ws://verifier", offline="hold", sets=(), **consts):
    """A navigator over scripted answers and views; `sets`: config overrides ("nav.memory_steps=2")."""
    drafter = WordDrafter()
    dec = ScriptedDecoder(drafter, answers, url)
    control = RecordingControl()
    navigator = Navigator(
        dec,
        ListGrabber(),
        ListPerception(views),
        control,
        config.load(
            None,
            [
                f'offline.policy="{offline}"',
                "link.reconnect_backoff_s=60.0",
                "link.reconnect_backoff_max_s=60.0",
                *sets,
            ],
        ),
        NavConfig(**consts),
    )
    navigator.check_link()
    return navigator, dec, control


def fixed_prefix_ids(navigator: Navigator, instruction: str = INSTRUCTION) -> list[int]:
    """The prompt up to this step's own part: system, examples and the task line (the text before the
    last user turn's memory/camera lines), tokenized on its own."""
    msgs = messages(instruction, "nothing")
    text = navigator.drafter.apply_chat_template(msgs)
    head = text[: text.rindex("Camera: nothing.")]
    return navigator.drafter.tokenize(head)


# ------------------------------------------------------------------ memory


def test_memory_keeps_the_last_steps_and_drops_the_oldest_first():
    turns = [Action("right", 45), Action("right", 30), Action("forward", 50), Action("left", 15)]
    navigator, dec, _ = make_nav(
        [answer(a) for a in turns] + [answer(STOP)],
        [[], box(40), box(5), box(-20), box(0, 0.4)],
        sets=["nav.memory_steps=2"],
    )
    recs = [navigator.step(INSTRUCTION) for _ in range(5)]
    # over two steps the memory is cut to one (half the bound) in one go, then grows again
    assert [r.memory_steps for r in recs] == [0, 1, 2, 1, 2]
    last_prompt = navigator.drafter.detokenize(dec.calls[-1]["ids"])
    # the two latest steps only, oldest first: what was seen and done, and nothing else
    tail = last_prompt[last_prompt.rindex("Task: go to the red box.") :]
    assert tail.count("Earlier camera:") == 2
    assert tail.index("red box ahead, 3.0 m away. Then I moved forward 50 cm.") < tail.index(
        "red box 20 degrees to the right, 3.0 m away. Then I turned left 15 degrees."
    )
    assert "turned right 45" not in tail and "turned right 30" not in tail
    assert navigator.memory.dropped == 4  # steps 1 and 2, then (after the stop) 3 and 4


def test_memory_is_bounded_in_tokens_of_the_draft_tokenizer():
    navigator, _, _ = make_nav(
        [answer(Action("left", 15))], [box(30)], sets=["nav.memory_steps=8", "nav.memory_max_tokens=40"]
    )
    recs = [navigator.step(INSTRUCTION) for _ in range(6)]
    line_tokens = len(
        navigator.drafter.tokenize(
            Recall("red box 30 degrees to the left, 3.0 m away", Action("left", 15), True).line()
        )
    )
    assert 2 * line_tokens <= 40 < 3 * line_tokens  # room for two lines, not three
    assert max(r.memory_tokens for r in recs) <= 40 and max(r.memory_steps for r in recs) == 2
    assert [r.memory_steps for r in recs] == [0, 1, 2, 1, 2, 1]  # over 40: cut to 20 tokens (one line)
    assert navigator.memory.tokens == len(navigator.drafter.tokenize("\n".join(navigator.memory.lines())))


def test_memory_is_per_task():
    navigator, _, _ = make_nav([answer(Action("left", 15))], [box(30)])
    navigator.step(INSTRUCTION, task="1")
    assert navigator.step(INSTRUCTION, task="1").memory_steps == 1
    assert navigator.step("go to the blue ball", task="1").memory_steps == 0  # a new instruction
    assert navigator.step("go to the blue ball", task="1").memory_steps == 1
    assert navigator.step("go to the blue ball", task="2").memory_steps == 0  # a new task


def test_memory_off_gives_the_prompt_without_memory():
    navigator, dec, _ = make_nav([answer(Action("left", 15))], [box(30)], sets=["nav.memory_steps=0"])
    for _ in range(3):
        rec = navigator.step(INSTRUCTION)
    assert rec.memory_steps == 0 and rec.memory_tokens == 0
    assert dec.calls[-1]["ids"] == navigator.prompt_ids(INSTRUCTION, rec.observation)


def test_memory_marks_unverified_and_cut_short_steps():
    assert (
        Recall("nothing", Action("right", 15), verified=False).line()
        == "Earlier camera: nothing. Then I turned right 15 degrees (unverified)."
    )
    assert (
        Recall("nothing", Action("forward", 25), verified=True, completed=False).line()
        == "Earlier camera: nothing. Then I moved forward 25 cm (cut short)."
    )
    assert (
        Recall("red box ahead, within reach", STOP, verified=True).line()
        == "Earlier camera: red box ahead, within reach. Then I stopped."
    )


def test_step_memory_unit_bounds():
    memory = StepMemory(3, 32, lambda text: len(text.split()))
    assert memory.start("a") and not memory.start("a")
    for i in range(5):
        memory.add(Recall(f"seen {i}", Action("left", 15), True))
    assert len(memory) <= 3 and memory.tokens <= 32 and memory.lines()[-1].startswith("Earlier camera: seen 4.")
    assert memory.start("b") and len(memory) == 0 and memory.tokens == 0


def test_each_prompt_shares_the_whole_fixed_prefix_and_the_memory_so_far_with_the_previous_one():
    """The draft's KV and the server session keep the common token prefix: with memory appended at the
    end, a step's prompt holds the previous one up to its camera line (and, once the memory is full and
    its oldest line goes, still the whole fixed part: system, examples, task)."""
    views = [[], box(40), box(20), box(5), box(-3)]
    navigator, dec, _ = make_nav([answer(Action("right", 15))], views, sets=["nav.memory_steps=3"])
    navigator.warm_up()
    fixed = fixed_prefix_ids(navigator)
    recs = [navigator.step(INSTRUCTION) for _ in range(len(views))]
    prompts = [c["ids"] for c in dec.calls if c["mode"] != "ar"]
    warm = navigator.drafter.primed[0]
    assert common_prefix(prompts[0], warm) >= len(fixed) - len(navigator.drafter.tokenize("go to the red box."))
    for i in range(1, len(prompts)):
        before, now = prompts[i - 1], prompts[i]
        shared = common_prefix(before, now)
        assert now[: len(fixed)] == fixed and shared >= len(fixed)
        assert recs[i].prefix_shared_tokens == shared and recs[i].prompt_tokens == len(now)
        if recs[i].memory_steps > recs[i - 1].memory_steps:  # memory grew: all of the previous memory kept
            camera_at = navigator.drafter.detokenize(before).rindex("Camera:")
            assert shared >= len(navigator.drafter.tokenize(navigator.drafter.detokenize(before)[:camera_at]))
    assert [r.memory_steps for r in recs] == [0, 1, 2, 3, 1]
    assert all(c["session"] == navigator.session for c in dec.calls)


@pytest.mark.real
def test_the_real_tokenizer_keeps_the_prefix_of_the_previous_prompt(drafter):
    """With SmolLM2's BPE the appended memory line does not re-tokenize what came before it."""
    fixed_text = drafter.apply_chat_template(messages(INSTRUCTION, "nothing"))
    fixed_text = fixed_text[: fixed_text.rindex("Camera: nothing.")]
    fixed = drafter.tokenize(fixed_text)
    memory = [Recall("red box 40 degrees to the left, 3.1 m away", Action("right", 45), True).line()]
    first = drafter.tokenize(
        drafter.apply_chat_template(messages(INSTRUCTION, "red box 40 degrees to the left, 3.1 m away"))
    )
    second = drafter.tokenize(drafter.apply_chat_template(messages(INSTRUCTION, "nothing", memory)))
    more = memory + [Recall("nothing", Action("right", 45), False).line()]
    third = drafter.tokenize(drafter.apply_chat_template(messages(INSTRUCTION, "nothing", more)))
    assert first[: len(fixed)] == fixed == second[: len(fixed)] == third[: len(fixed)]
    head = drafter.apply_chat_template(messages(INSTRUCTION, "nothing", memory))
    head = drafter.tokenize(head[: head.rindex("Camera: nothing.")])
    assert third[: len(head)] == head  # the second prompt's memory is reused too
    assert len(fixed) > 500  # the fixed part is most of the prompt


# ------------------------------------------------------------------ the offline envelope


def test_an_unverified_forward_step_is_clamped_and_slowed():
    navigator, _, control = make_nav([answer(Action("forward", 75))], [box(2, 3.0)], url=None, offline="local")
    rec = navigator.step(INSTRUCTION)
    assert rec.mode == "offline" and rec.envelope == "clamped" and rec.action == "forward 25 cm"
    assert "forward 75 cm reduced to forward 25 cm" in rec.parse_note and "reduced" in rec.reason
    motion = control.motions[-1]
    assert motion.cmd.vx == pytest.approx(0.25) and motion.cmd.vx * motion.duration_s == pytest.approx(0.25)
    assert navigator.offline_clamped == 1 and navigator.offline_turn_away_stops == 0
    assert navigator.memory.lines()[-1].endswith("Then I moved forward 25 cm (unverified).")


def test_an_unverified_turn_is_clamped_to_the_offline_limit():
    navigator, _, control = make_nav(
        [answer(Action("left", 45))], [box(50)], url=None, offline="local", sets=["offline.max_turn_deg=30"]
    )
    rec = navigator.step(INSTRUCTION)
    assert rec.envelope == "clamped" and rec.action == "turn left 30 deg"
    motion = control.motions[-1]
    assert motion.cmd.wz == pytest.approx(0.5236 * 0.5)
    assert abs(motion.cmd.wz) * motion.duration_s == pytest.approx(np.radians(30))


def test_a_verified_action_keeps_its_size_and_speed():
    navigator, _, control = make_nav([answer(Action("forward", 75))], [box(2, 3.0)])
    rec = navigator.step(INSTRUCTION)
    assert rec.mode == "verified" and rec.envelope == "" and rec.action == "forward 75 cm"
    assert control.motions[-1].cmd.vx == pytest.approx(0.5) and navigator.offline_clamped == 0


def test_an_unverified_turn_away_from_the_target_in_view_is_replaced_by_stop():
    """The demo's failure: offline, the draft turned right with the red box 40 degrees to the left."""
    navigator, _, control = make_nav([answer(Action("right", 15))], [box(40)], url=None, offline="local")
    rec = navigator.step(INSTRUCTION)
    assert rec.action == "stop" and rec.envelope == "turned_away_stop" and control.motions == []
    assert "turns away from the red box 40 degrees to the left" in rec.parse_note
    assert "not the task done" in rec.reason and control.halts[-1] == "offline_turn_away"
    assert navigator.offline_turn_away_stops == 1 and navigator.offline_clamped == 0
    assert navigator.memory.lines()[-1].endswith("Then I stopped (unverified).")


def test_unverified_turns_toward_the_target_or_while_searching_still_run():
    navigator, _, control = make_nav(
        [answer(Action("left", 15)), answer(Action("right", 45))], [box(40), []], url=None, offline="local"
    )
    assert navigator.step(INSTRUCTION).envelope == ""  # toward the box: as asked
    rec = navigator.step(INSTRUCTION)  # nothing in view: a search turn
    assert rec.envelope == "clamped" and rec.action == "turn right 15 deg" and len(control.motions) == 2


@pytest.mark.parametrize(
    "bearing,action,stops",
    [
        (40, Action("right", 15), True),
        (-25, Action("left", 45), True),  # off to one side, turn to the other
        (40, Action("left", 15), False),
        (-25, Action("right", 15), False),  # toward it
        (0, Action("left", 15), True),
        (3, Action("right", 15), True),  # ahead: a turn takes it off the axis
        (7, Action("left", 15), False),
        (-8, Action("right", 15), False),  # ahead, the turn centres it
        (40, Action("forward", 25), False),
        (0, STOP, False),
    ],
)
def test_turns_away_by_bearing(bearing, action, stops):
    run, envelope, _ = offline_envelope(action, Sighting("red box", bearing, 2.0, "sim"), 75, 45)
    assert (envelope == "turned_away_stop") == stops and (run == STOP) == (stops or action == STOP)


def test_no_target_in_view_means_no_turn_away_rule():
    assert offline_envelope(Action("right", 45), None, 75, 45) == (Action("right", 45), "", "")
    assert offline_envelope(Action("right", 45), None, 25, 15)[:2] == (Action("right", 15), "clamped")
    assert offline_envelope(Action("forward", 75), None, 60, 45)[0] == Action("forward", 50)


class StaleGrabber:
    def read_latest(self, max_age_ms):
        raise StaleFrame(f"camera test: newest frame is 900 ms old (limit {max_age_ms:.0f} ms)")


@pytest.mark.parametrize("url", ["ws://verifier", None])
def test_a_step_without_a_fresh_frame_is_halted_neither_verified_nor_offline(url):
    """No frame, no answer: the record says halted whatever the link, and no summary counts it as decided."""
    from agent.app.transcript import step_lines

    navigator, dec, control = make_nav([answer(Action("forward", 25))], [box(0)], url=url)
    navigator.grabber = StaleGrabber()
    rec = navigator.step(INSTRUCTION)
    assert rec.mode == "halted" and rec.parse == "refused" and rec.reason.startswith("no fresh camera frame")
    assert rec.link == ("up" if url else "down") and dec.calls == [] and control.motions == []
    assert control.halts == ["stale_frame"] and navigator.offline_steps == 0
    assert "HALTED" in step_lines(1, rec) and "VERIFIED" not in step_lines(1, rec)


def test_a_turn_away_stop_does_not_end_the_daemons_task_as_done(tmp_path):
    """An envelope stop halts the robot for this step; the task goes on (and ends by max_steps here)."""
    from agent.app.daemon import Daemon
    from agent.app.sdnotify import Notifier
    from agent.robot.controllers.sim import SimController

    cfg = config.load(None, ['telemetry.path=""', 'offline.policy="local"'])
    d = Daemon(cfg, controller=SimController(), notifier=Notifier({}))
    d.nav, _, d.control = make_nav([answer(Action("right", 30))], [box(40)], url=None, offline="local")
    d._run_task({"id": 1, "instruction": INSTRUCTION, "frame": None, "max_steps": 3})
    assert d.history[-1]["state"] == "max_steps" and d.nav.steps == 3
    status = d.status()
    assert status["offline_turn_away_stops"] == 3 and status["offline_clamped"] == 0


# ------------------------------------------------------------------ config


def test_the_new_config_keys_load_and_reach_the_navigator():
    cfg = config.load(
        None,
        [
            "nav.memory_steps=2",
            "nav.memory_max_tokens=80",
            "offline.max_forward_cm=50",
            "offline.max_turn_deg=30",
            "offline.speed_scale=0.25",
        ],
    )
    assert (cfg.nav.memory_steps, cfg.nav.memory_max_tokens) == (2, 80)
    assert (cfg.offline.max_forward_cm, cfg.offline.max_turn_deg, cfg.offline.speed_scale) == (50, 30, 0.25)
    default = config.load(None)
    assert (
        default.nav.memory_steps,
        default.offline.max_forward_cm,
        default.offline.max_turn_deg,
        default.offline.speed_scale,
    ) == (4, 25, 15, 0.5)


@pytest.mark.parametrize(
    "override,msg",
    [
        ("offline.max_forward_cm=10", "offline.max_forward_cm must be 25..75"),
        ("offline.max_forward_cm=100", "offline.max_forward_cm"),
        ("offline.max_turn_deg=5", "offline.max_turn_deg"),
        ("offline.max_turn_deg=90", "offline.max_turn_deg must be 15..45"),
        ("offline.speed_scale=0", "offline.speed_scale must be in"),
        ("offline.speed_scale=1.5", "offline.speed_scale"),
        ('offline.speed_scale="fast"', "speed_scale must be float"),
        ("nav.memory_steps=-1", "nav.memory_steps must be 0..32"),
        ("nav.memory_steps=100", "nav.memory_steps"),
        ("nav.memory_steps=2.5", "nav.memory_steps must be 0..32"),
        ("nav.memory_max_tokens=8", "nav.memory_max_tokens must be 32..2048"),
        ("nav.memory_turns=3", "no field"),
    ],
)
def test_bad_memory_and_envelope_values_are_refused_with_the_key_named(override, msg):
    with pytest.raises(ConfigError, match=msg):
        config.load(None, [override])


@pytest.mark.parametrize(
    "cls,field,value",
    [
        (config.NavSection, "memory_steps", 99),
        (config.NavSection, "memory_max_tokens", 4),
        (NavConfig, "ahead_deg", 0),
        (config.OfflineSection, "max_forward_cm", 0),
        (config.OfflineSection, "max_turn_deg", 60),
        (config.OfflineSection, "speed_scale", -1),
    ],
)
def test_nav_config_validates_too(cls, field, value):
    with pytest.raises(ValueError):
        cls(**{field: value})


def test_the_answers_still_parse_exactly_after_the_memory_examples():
    """Every example answer is a free reason sentence and one exact NaVILA sentence."""
    for _, _, _, text in prompt.SHOTS:
        parsed = parse_action(text)
        assert parsed.how == "exact" and text.count(".") == 2


# ------------------------------------------------------------------ the prompt eval's memory cases


def test_the_prompt_evals_memory_cases_are_consistent_and_balanced():
    """tools/robot/nav_prompt_eval.py: a target turned away from is turned back to; the kinds come in turn."""
    from tools.robot.nav_prompt_eval import Case, memory_situations, recalled_action

    away = Case([], [(box(40), Action("right", 45)), ([], Action("right", 30))], "recalled")
    assert recalled_action(away) == Action("left", 45)  # 40 + 45 + 30 = 115 to the left
    assert recalled_action(Case([], [(box(-30), Action("left", 45))], "recalled")) == Action("right", 45)
    assert recalled_action(Case([], [([], Action("right", 45))], "unseen")) == Action("left", 45)  # search
    assert recalled_action(Case(box(20, 2.0), [([], Action("left", 45))], "visible")) == Action("left", 15)
    cases = memory_situations(16, 0)
    assert [c.kind for c in cases[:4]] == ["recalled", "visible", "recalled", "unseen"]
    sides = [recalled_action(c).kind for c in cases if c.kind == "recalled"]
    assert sides.count("left") == sides.count("right") == 4
    for c in cases:
        assert 1 <= len(c.history) <= 3 and len(c.memory()) == len(c.history)
        assert bool(c.now) == (c.kind == "visible")
        assert any(seen for seen, _ in c.history) == (c.kind != "unseen") or c.kind == "visible"
