"""The navigation loop that sees: `perception.kind = "vlm"` puts the camera frame itself in the step's prompt.

Without a model: the JPEG the perception makes, the chat as list-of-parts content with the image on the camera
line, the config's checks, and the image going with every generation of a step (verified, offline local, hold and
resume) at the decoder's depth. With the test VLM pair (tests/models/make_test_vlm.py: a random SmolVLM, the Q8_0 draft
with its projector on the robot, the f32 target with its projector behind a real server) over the simulator: the
prompt holds one image, the current frame's JPEG; a verified step's answer is the target's own (the same prompt
and image through the target alone); whatever the random weights say is parsed to an action or a safe stop;
offline local drafts from the image; a cut link resumes the same answer; `edge-agent run --perception vlm` end to
end.
"""

from __future__ import annotations

import json
import threading
import time

import cv2
import numpy as np
import pytest

from agent.app import cli, config
from agent.app.config import ConfigError
from agent.app.memory import Recall
from agent.app.navigator import NavConfig, Navigator
from agent.app.prompt import IMAGE_RECALL, SHOTS, messages
from agent.decoding import DecoderSettings, open_decoder
from agent.decoding.decoder import Generation, Metrics
from agent.decoding.link import LinkLost
from agent.robot.actions import FORWARD_CM, STOP, TURN_DEG, Action, parse_action
from agent.robot.camera import Frame
from agent.robot.controllers.base import Command
from agent.robot.perception import PERCEPTIONS, VlmPerception, fit_within
from protocol.images import PromptImage, image_format

real = pytest.mark.real
INSTRUCTION = "go to the red box"
MARKER = "<image>"


def frame(seed: int = 0, h: int = 120, w: int = 160, source: str | None = None) -> Frame:
    image = np.random.default_rng(seed).integers(0, 256, (h, w, 3), np.uint8)
    return Frame(image, time.monotonic(), seed + 1, {"source": source} if source else {})


# ------------------------------------------------------------------ the perception


def test_the_frame_becomes_a_jpeg_no_longer_than_max_side():
    p = PERCEPTIONS["vlm"](max_side=96, jpeg_quality=85)
    assert p.kind == "vlm" and p.describe(frame()) == []  # nothing in words
    shown = p.encode(frame(h=480, w=640))
    assert image_format(shown.data) == "jpeg" and (shown.width, shown.height) == (96, 72)
    decoded = cv2.imdecode(np.frombuffer(shown.data, np.uint8), cv2.IMREAD_COLOR)
    assert decoded.shape == (72, 96, 3)
    assert shown.describe() == f"camera image (96 x 72, {len(shown.data)} bytes)"
    small = p.encode(frame(h=40, w=30))  # never enlarged
    assert (small.width, small.height) == (30, 40)
    assert p.encode(frame(3)).data == p.encode(frame(3)).data  # the same frame, the same bytes
    assert p.encode(frame(3)).data != p.encode(frame(4)).data
    assert len(VlmPerception(96, 30).encode(frame(h=480, w=640)).data) < len(shown.data)
    assert fit_within(640, 480, 384) == (384, 288) and fit_within(480, 640, 384) == (288, 384)
    with pytest.raises(ValueError, match="uint8 BGR"):
        p.encode(Frame(np.zeros((8, 8), np.uint8), 0.0, 1))
    with pytest.raises(ValueError, match="jpeg_quality"):
        VlmPerception(jpeg_quality=0)


# ------------------------------------------------------------------ the prompt


def render(msgs) -> str:
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    from tests.models.make_test_vlm import CHAT_TEMPLATE

    return Jinja2ChatFormatter(CHAT_TEMPLATE, eos_token="", bos_token="")(messages=msgs).prompt


def test_the_camera_line_holds_the_image_and_the_examples_stay_text():
    memory = [Recall(IMAGE_RECALL, Action("left", 15), True).line()]
    msgs = messages(INSTRUCTION, "", memory, parts=True, image=True)
    assert all(isinstance(m["content"], list) for m in msgs)
    assert all(m["content"] == [{"type": "text", "text": m["content"][0]["text"]}] for m in msgs[:-1])
    assert msgs[-1]["content"][1] == {"type": "image"}
    text = render(msgs)
    assert text.count(MARKER) == 1
    assert text.endswith(
        f"Task: go to the red box.\nEarlier camera: {IMAGE_RECALL}. Then I turned left 15 degrees.\n"
        f"Camera: {MARKER}.<end_of_utterance>\nAssistant:"
    )
    for _, _, seen, answer in SHOTS:  # the few-shot turns as the text path has them
        assert f"Camera: {seen}.<end_of_utterance>\nAssistant: {answer}<end_of_utterance>" in text
    # what follows the image on its line (the blocked-way note), and the text prompt of the same chat as parts
    blocked = render(messages(INSTRUCTION, "; the way ahead is blocked, 0.3 m away", parts=True, image=True))
    assert blocked.endswith(f"Camera: {MARKER}; the way ahead is blocked, 0.3 m away.<end_of_utterance>\nAssistant:")
    as_text = render(messages(INSTRUCTION, "nothing", parts=True))
    assert MARKER not in as_text and "Camera: nothing.<end_of_utterance>" in as_text
    # a plain string content renders to nothing under this template: why a VLM draft gets parts
    assert SHOTS[0][3] not in render(messages(INSTRUCTION, "nothing"))
    with pytest.raises(ValueError, match="parts"):
        messages(INSTRUCTION, "", image=True)


# ------------------------------------------------------------------ config


@pytest.mark.parametrize(
    "overrides,msg",
    [
        (['perception.kind="vlm"'], "agent.draft_mmproj"),
        (['perception.kind="eyes"'], "perception.kind must be one of"),
        (["perception.image_max_side=8"], "image_max_side"),
        (["perception.jpeg_quality=101"], "jpeg_quality"),
        (['perception.jpeg_quality="high"'], "jpeg_quality must be int"),
    ],
)
def test_bad_vlm_settings_are_refused_with_the_field_named(overrides, msg):
    with pytest.raises(ConfigError, match=msg):
        config.load(None, overrides)


def test_vlm_settings_load_on_any_robot():
    cfg = config.load(
        None,
        [
            'perception.kind="vlm"',
            'agent.draft_mmproj="/models/draft-mmproj.gguf"',
            'robot.controller="serial"',
            'camera.source="/dev/video0"',
            "perception.image_max_side=256",
            "perception.jpeg_quality=70",
        ],
    )
    assert (cfg.perception.kind, cfg.perception.image_max_side, cfg.perception.jpeg_quality) == ("vlm", 256, 70)
    assert cfg.agent.draft_mmproj == "/models/draft-mmproj.gguf"
    example = config.load("systemd/edge-agent.toml")
    assert example.agent.draft_mmproj == "" and example.perception.image_max_side == 384


def test_run_perception_vlm_without_a_projector_exits_2(capsys, tmp_path):
    listen = f"unix:{tmp_path / 'api.sock'}"
    rc = cli.main(["run", "--controller", "sim", "--perception", "vlm", "--listen", listen, "--telemetry", ""])
    assert rc == 2 and "agent.draft_mmproj" in capsys.readouterr().err


# ------------------------------------------------------------------ the step, at the decoder's depth


class MarkerDrafter:
    """Word tokenizer whose "<image>" is one marker id; renders list-of-parts content as a VLM template does."""

    image_marker = 1
    eos_ids = {0}

    def __init__(self):
        self.vocab = {MARKER: 1}
        self.images: list = []

    def apply_chat_template(self, msgs):
        return " ".join(p["text"] if p["type"] == "text" else f" {MARKER} " for m in msgs for p in m["content"])

    def tokenize(self, text):
        return [self.vocab.setdefault(w, len(self.vocab) + 1) for w in text.split()]

    def detokenize(self, ids, skip=frozenset()):
        words = {i: w for w, i in self.vocab.items()}
        return " ".join(words[i] for i in ids if i not in skip)

    def use_images(self, images):
        self.images = list(images or [])

    def next_logits(self, ids):
        return np.zeros(4, np.float32)


class LinkDecoder:
    """Answers every generation with `answer`; `down` makes remote ones raise LinkLost with `committed` tokens."""

    def __init__(self, drafter, answer: str):
        self.drafter, self.answer, self.url, self.down, self.committed = drafter, answer, "ws://v", False, 0
        self.calls: list[dict] = []

    def connect(self) -> bool:
        return not self.down

    def stop_ids(self):
        return {0}

    def generate(self, prompt_ids, *, mode="sd", images=None, **kw):
        self.calls.append({"ids": list(prompt_ids), "mode": mode, "images": images})
        ids = self.drafter.tokenize(self.answer)
        if self.down and mode != "local":
            lost = LinkLost("cut")
            lost.token_ids = ids[: self.committed]
            raise lost
        return Generation(self.answer, ids, mode, Metrics(rounds=1, tokens_per_s=10.0))


class _Safety:
    last_stop_reason = None


class Control:
    def __init__(self):
        self.motions, self.halts, self.safety = [], [], _Safety()
        self.first_sent = self.peak_sent = Command()

    def execute(self, motion, cancel=None):
        self.motions.append(motion)
        return True

    def halt(self, reason="halt"):
        self.halts.append(reason)


class Grabber:
    def __init__(self):
        self.seed = 0

    def read_latest(self, max_age_ms):
        self.seed += 1
        return frame(self.seed)


def fake_nav(answer, offline="local", sets=(), **consts):
    """A navigator over one scripted answer; `sets`: config overrides ("agent.max_plan_age_s=30")."""
    drafter = MarkerDrafter()
    dec = LinkDecoder(drafter, answer)
    n = Navigator(
        dec,
        Grabber(),
        VlmPerception(96),
        Control(),
        config.load(
            None,
            [f'offline.policy="{offline}"', "nav.grammar=false", "link.reconnect_backoff_s=60", *sets]
            + ["link.reconnect_backoff_max_s=60"],
        ),
        NavConfig(**consts),
    )
    n.check_link()
    return n, dec


def only_image(call, perception=None, seed=None) -> PromptImage:
    perception = perception or VlmPerception(96)
    ids, images = call["ids"], call["images"]
    assert ids.count(MarkerDrafter.image_marker) == 1 and len(images) == 1
    assert images[0].at == ids.index(MarkerDrafter.image_marker) and image_format(images[0].data) == "jpeg"
    if seed is not None:
        assert images[0].data == perception.encode(frame(seed)).data
    return images[0]


def test_every_generation_of_a_step_carries_its_image():
    n, dec = fake_nav("I look. The next action is turn left 15 degree.")
    rec = n.step(INSTRUCTION)
    assert rec.mode == "verified" and rec.perception == "vlm" and rec.action == "turn left 15 deg"
    assert rec.observation.startswith("camera image (96 x 72, ")
    first = only_image(dec.calls[-1], seed=1)
    assert n.last_prompt_images == [first] and dec.calls[-1]["ids"] == n.last_prompt_ids
    # the link drops after 3 committed tokens: the draft finishes locally from them, with the same image
    dec.down, dec.committed = True, 3
    rec = n.step(INSTRUCTION)
    assert rec.mode == "offline" and rec.verified_tokens == 3
    remote, local = dec.calls[-2:]
    assert local["mode"] == "local" and local["ids"][: len(remote["ids"])] == remote["ids"]
    assert only_image(local, seed=2) == only_image(remote, seed=2) != first
    # later prompts remember that an image was seen, never the image: one image a prompt, the current frame
    prompt = n.drafter.detokenize(dec.calls[-1]["ids"])
    assert prompt.count(f"Earlier camera: {IMAGE_RECALL}.") == 1 and prompt.count(MARKER) == 1


def test_hold_resumes_with_the_same_image():
    n, dec = fake_nav(
        "I look. The next action is move forward 25 cm.",
        offline="hold",
        sets=["agent.max_plan_age_s=30.0", "link.verify_timeout_s=1.0"],
        hold_wait_s=0.01,
    )
    dec.down, dec.committed = True, 2
    n.links.next_probe = 0.0

    def restore():
        time.sleep(0.2)
        dec.down = False
        n.links.next_probe = 0.0

    threading.Thread(target=restore, daemon=True).start()
    rec = n.step(INSTRUCTION)
    assert rec.mode == "verified" and "resumed" in rec.reason
    cut, resumed = dec.calls[0], dec.calls[-1]
    assert resumed["ids"][: len(cut["ids"])] == cut["ids"] and only_image(resumed) == only_image(cut)


def test_an_api_image_goes_as_the_image():
    n, dec = fake_nav("I look. The next action is stop.")
    sent = frame(7, h=300, w=400, source="api")
    rec = n.step(INSTRUCTION, frame=sent)
    assert rec.perception == "vlm" and rec.observation.startswith("API image (96 x 72, ")
    assert only_image(dec.calls[-1]).data == VlmPerception(96).encode(sent).data
    assert rec.action == str(STOP) and n.control.halts[-1] == "model_stop"


def test_vlm_perception_needs_a_draft_that_sees():
    from tests.agent.app.test_nav_memory import ScriptedDecoder, WordDrafter

    with pytest.raises(ValueError, match="agent.draft_mmproj"):
        Navigator(ScriptedDecoder(WordDrafter(), ["x"]), Grabber(), VlmPerception(), Control())


# ------------------------------------------------------------------ the real pair over the simulator


@pytest.fixture(scope="module")
def vlm():
    from tests.models import make_test_vlm as tv

    return tv.make(log=lambda m: None)


@pytest.fixture(scope="module")
def vdrafter(vlm):
    from agent.decoding import DecoderSettings, open_decoder

    return open_decoder(DecoderSettings(draft=str(vlm.draft), threads=1, draft_mmproj=str(vlm.draft_mmproj))).drafter


@pytest.fixture(scope="module")
def vserver(vlm):
    from server_bridge.target import load_target
    from server_bridge.verifier import Verifier
    from tests.conftest import ThreadedServer

    target = load_target(
        str(vlm.target), "llamacpp", threads=1, max_sequences=8, kv_tokens=4096, mmproj=str(vlm.target_mmproj)
    )
    with ThreadedServer(lambda cfg: Verifier(target, cfg), max_context=2048) as server:
        yield server


def sim_daemon(tmp_path, vlm, vdrafter, url, offline="local", **overrides):
    from agent.app.daemon import Daemon
    from agent.app.sdnotify import Notifier
    from agent.robot.controllers.sim import SimController

    sets = [
        f'link.verifier="{url}"',
        'perception.kind="vlm"',
        f'agent.draft_mmproj="{vlm.draft_mmproj}"',
        "perception.image_max_side=128",
        f'offline.policy="{offline}"',
        f'telemetry.path="{tmp_path / "telemetry.jsonl"}"',
        "link.verify_timeout_s=5",
        "camera.fps=20",
        "agent.max_plan_age_s=30",
    ] + [f"{k}={v}" for k, v in overrides.items()]
    d = Daemon(config.load(None, sets), drafter=vdrafter, controller=SimController(start=1), notifier=Notifier({}))
    d.start()
    frames = []
    read = d.grabber.read_latest
    d.nav.grabber = type("Recorded", (), {"read_latest": lambda self, ms: frames.append(read(ms)) or frames[-1]})()
    return d, frames


def target_alone(drafter, url, n: Navigator, mode="ar") -> Generation:
    """The latest step's prompt and image through the target alone (or the draft alone: mode local), under the
    navigator's answer grammar and stop rule."""
    dec = open_decoder(DecoderSettings(verifier=None if mode == "local" else url), drafter)
    try:
        return dec.generate(
            n.last_prompt_ids,
            mode=mode,
            max_tokens=n.max_tokens,
            until=n.answers.until([]),
            grammar=n.answers.grammar,
            images=n.last_prompt_images,
        )
    finally:
        dec.close()


def safe(rec, d) -> None:
    """Whatever the random weights said: one NaVILA action that was run within the limits, or a stop."""
    assert rec.parse in ("exact", "tolerant", "miss")
    action = parse_action(rec.text).action
    assert rec.action == str(action) or rec.envelope
    assert (
        action == STOP
        or action.kind in ("left", "right")
        and action.amount in TURN_DEG
        or action.kind == "forward"
        and action.amount in FORWARD_CM
    )
    assert abs(rec.command_peak["vx"]) <= d.cfg.safety.max_vx and abs(rec.command_peak["wz"]) <= d.cfg.safety.max_wz


@real
def test_verified_steps_show_the_frame_and_answer_as_the_target_alone(tmp_path, vlm, vdrafter, vserver):
    d, frames = sim_daemon(tmp_path, vlm, vdrafter, vserver.url)
    try:
        warm = d.nav.last_prompt_ids  # the warm-up's text prompt: the fixed prefix prefilled
        assert vdrafter.image_marker not in warm
        shown = []
        for i in range(2):
            rec = d.nav.step(INSTRUCTION, task="1")
            ids, images = d.nav.last_prompt_ids, d.nav.last_prompt_images
            assert rec.mode == "verified" and rec.perception == "vlm" and rec.verified_tokens > 0
            assert ids.count(vdrafter.image_marker) == 1 and len(images) == 1
            assert images[0].at == ids.index(vdrafter.image_marker)
            assert images[0].data == d.nav.perception.encode(frames[-1]).data  # the frame of this step
            assert rec.observation == f"camera image (128 x 96, {len(images[0].data)} bytes)"
            assert rec.text == target_alone(vdrafter, vserver.url, d.nav).text  # exact: the target's own
            assert rec.decode["mode"] == "sd" and rec.decode["acceptance_rate"] > 0  # the draft saw the image too
            assert rec.memory_steps == i and rec.prefix_shared_tokens >= 0.9 * len(warm)
            safe(rec, d)
            shown.append(images[0])
            if rec.action == str(STOP):  # a stop does not move the robot: turn it by hand
                x, y, theta = d.world.pose
                d.world.set_pose(x, y, theta + 0.5)
                time.sleep(0.2)  # a frame of the new pose
        assert shown[0].sha256 != shown[1].sha256  # two frames, two images
        prompt = vdrafter.detokenize(d.nav.last_prompt_ids)
        assert prompt.count(f"Earlier camera: {IMAGE_RECALL}.") == 1
    finally:
        d.close()


@real
def test_offline_local_drafts_from_the_image(tmp_path, vlm, vdrafter, vserver):
    d, frames = sim_daemon(tmp_path, vlm, vdrafter, "")
    try:
        rec = d.nav.step(INSTRUCTION)
        assert rec.mode == "offline" and rec.unverified_tokens > 0 and rec.verified_tokens == 0
        assert "unverified" in rec.reason and len(d.nav.last_prompt_images) == 1
        assert rec.text == target_alone(vdrafter, None, d.nav, mode="local").text  # the draft's own answer
        safe(rec, d)
        if rec.action != str(STOP):  # the offline envelope: the smallest steps
            action = parse_action(rec.action_text).action
            assert action.amount <= (25 if action.kind == "forward" else 15)
    finally:
        d.close()


@real
def test_a_cut_link_resumes_the_same_answer_with_the_image(tmp_path, vlm, vdrafter, vserver):
    from tools.cluster.netem import LinkProfile, NetemProxy

    with NetemProxy("127.0.0.1", vserver.port, LinkProfile.from_rtt(5)) as proxy:
        d, _ = sim_daemon(tmp_path, vlm, vdrafter, proxy.url(), offline="hold", **{"link.verify_timeout_s": 1.5})
        try:
            d.nav.step(INSTRUCTION)
            proxy.refuse_new(True)
            proxy.schedule_disconnect(after_bytes_down=260)  # past opened (its resume secret too), mid-answer

            def restore():
                deadline = time.monotonic() + 60
                while d.nav.link != "down" and time.monotonic() < deadline:
                    time.sleep(0.01)
                time.sleep(0.5)
                proxy.refuse_new(False)

            threading.Thread(target=restore, daemon=True).start()
            rec = d.nav.step(INSTRUCTION)
            assert rec.mode == "verified" and "resumed" in rec.reason and "lost mid-answer" in rec.reason
            assert rec.text == target_alone(vdrafter, vserver.url, d.nav).text  # nothing lost, nothing redone
        finally:
            proxy.refuse_new(False)
            d.close()


@real
def test_run_perception_vlm_end_to_end(tmp_path, capsys, vlm, vserver):
    telemetry = tmp_path / "t.jsonl"
    rc = cli.main(
        [
            "run",
            "--controller",
            "sim",
            "--perception",
            "vlm",
            "--verifier",
            vserver.url,
            "--listen",
            f"unix:{tmp_path / 'api.sock'}",
            "--telemetry",
            str(telemetry),
            "--set",
            f'agent.draft="{vlm.draft}"',
            "--set",
            f'agent.draft_mmproj="{vlm.draft_mmproj}"',
            "--set",
            "agent.threads=1",
            "--set",
            "link.verify_timeout_s=5",
            "--instruction",
            INSTRUCTION,
            "--max-steps",
            "2",
            "--exit-when-done",
            "--json",
        ]
    )
    out = capsys.readouterr()
    assert rc == 0, out.err[-2000:]
    summary = json.loads(out.out.strip().splitlines()[-1])
    records = [json.loads(line) for line in telemetry.read_text().splitlines()]
    acted = [r for r in records if r["parse"] != "refused"]
    assert 1 <= len(acted) <= 2 and summary["verified_steps"] == len(acted) and summary["offline_steps"] == 0
    assert summary["collisions"] == 0 and summary["end"] in ("done", "max_steps")
    for r in acted:
        assert r["perception"] == "vlm" and r["observation"].startswith("camera image (")
        assert r["mode"] == "verified" and r["verified_tokens"] > 0 and r["parse"] in ("exact", "tolerant")
