"""The navigation loop that sees, with each Qwen-VL family's test pair (tests/models/qwen_vlm.py: Qwen2-VL, Qwen2.5-VL,
Qwen3-VL; M-RoPE, the image advancing the position by fewer than its tokens) on the llamacpp engine.

`perception.kind = "vlm"` over the simulator, as tests/agent/app/test_nav_vlm.py runs the SmolVLM pair: the chat
template lays the camera line's image part out as `<|vision_start|><|image_pad|><|vision_end|>` (the marker
`<|image_pad|>` is where libmtmd's image chunk goes, the prompt holds the text around it); a verified step's answer,
under the NaVILA grammar, is the target's own for that prompt and image; offline, the draft answers locally from
the same image. One test a family, the models and the server shared by the module (the nav prompt is ~1000 tokens).

Without a model: the real Qwen2-VL / Qwen2.5-VL chat template (the test models carry a shorter one) renders the
navigator's list-of-parts chat with the image part where the engines expect it, and a draft whose template writes
the marker outside the text its projector wraps an image in is refused when the navigator starts.
"""

from __future__ import annotations

import time

import pytest

from agent.app import config
from agent.app.navigator import Navigator
from agent.app.prompt import CAMERA, messages
from agent.robot.actions import STOP, parse_action
from agent.robot.perception import VlmPerception
from tests.agent.app.test_nav_vlm import (
    INSTRUCTION,
    MARKER,
    Control,
    Grabber,
    LinkDecoder,
    MarkerDrafter,
    frame,
    safe,
    sim_daemon,
    target_alone,
)

real = pytest.mark.real
FAMILIES = ("qwen2vl", "qwen2.5vl", "qwen3vl")
SPAN = "<|vision_start|><|image_pad|><|vision_end|>"

# Qwen2-VL-7B-Instruct's chat template (Qwen2.5-VL's is the same), as its tokenizer_config.json ships it
QWEN2_VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in "
    "content or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] "
    "== 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content %}"
    "{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}"
)


def render(template: str, chat: list[dict]) -> str:
    """As agent/decoding/drafter.py's Drafter.apply_chat_template renders a GGUF's template."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    return Jinja2ChatFormatter(template, eos_token="", bos_token="")(messages=chat).prompt


@pytest.mark.parametrize("which", ["Qwen2-VL's own", "the test models'"])
def test_the_qwen_template_puts_the_image_span_on_the_camera_line(which):
    from tests.models.qwen_vlm import CHAT_TEMPLATE

    template = QWEN2_VL_TEMPLATE if which == "Qwen2-VL's own" else CHAT_TEMPLATE
    memory = ["Earlier camera: a wall. Then I stopped."]
    text = render(template, messages(INSTRUCTION, " (the way ahead is blocked)", memory, parts=True, image=True))
    assert text.count(SPAN) == 1 and text.count("<|image_pad|>") == 1
    last_user = text.rpartition("<|im_start|>user\n")[2]
    assert f"\n{CAMERA}{SPAN} (the way ahead is blocked).<|im_end|>\n<|im_start|>assistant\n" in last_user
    assert text.startswith("<|im_start|>system\n")  # nav's own system turn, not the template's default one
    text_only = render(template, messages(INSTRUCTION, "x", parts=True))  # the warm-up's prompt
    assert "<|vision_start|>" not in text_only and text_only.endswith(f"{CAMERA}x.<|im_end|>\n<|im_start|>assistant\n")


class WrappedDrafter(MarkerDrafter):
    """A marker that stands for the image chunk alone (as Qwen-VL's `<|image_pad|>`): the projector wraps it."""

    vision = type("Projector", (), {"wrappers": ("<|vision_start|>", "<|vision_end|>")})()

    def __init__(self, wrap: bool):
        super().__init__()
        self.wrap = wrap

    def apply_chat_template(self, msgs):
        image = f" <|vision_start|> {MARKER} <|vision_end|> " if self.wrap else f" {MARKER} "
        return " ".join(p["text"] if p["type"] == "text" else image for m in msgs for p in m["content"])


def test_a_template_that_writes_the_marker_unwrapped_is_refused_at_start():
    def navigator(drafter):
        return Navigator(
            LinkDecoder(drafter, "x"), Grabber(), VlmPerception(96), Control(), config.load(None, ["nav.grammar=false"])
        )

    with pytest.raises(ValueError, match="inside '<\\|vision_start\\|>'"):
        navigator(WrappedDrafter(wrap=False))
    n = navigator(WrappedDrafter(wrap=True))
    ids, images = n.prompt(INSTRUCTION, "", image=VlmPerception(96).encode(frame()).data)
    assert n.drafter.detokenize(ids[images[0].at - 1 : images[0].at + 2]) == f"<|vision_start|> {MARKER} <|vision_end|>"


# ------------------------------------------------------------------ the real pairs over the simulator


@pytest.fixture(scope="module", params=FAMILIES)
def qpair(request, qwen_vlm):
    """(family's test VLM, its draft on the robot, a real verifier over its target): one family at a time."""
    from agent.decoding import DecoderSettings, open_decoder
    from server_bridge.target import load_target
    from server_bridge.verifier import Verifier
    from tests.conftest import ThreadedServer

    vlm = qwen_vlm(request.param)
    drafter = open_decoder(DecoderSettings(draft=str(vlm.draft), threads=1, draft_mmproj=str(vlm.draft_mmproj))).drafter
    target = load_target(
        str(vlm.target), "llamacpp", threads=1, max_sequences=8, kv_tokens=4096, mmproj=str(vlm.target_mmproj)
    )
    with ThreadedServer(lambda cfg: Verifier(target, cfg), max_context=2048) as server:
        yield vlm, drafter, server


def fresh_step(d, task=""):
    """One navigation step that looked at a frame: a loaded machine's camera thread may not have a fresh one
    for the first step (a step that halts, says so and generates nothing); that step is taken again."""
    for _ in range(3):
        rec = d.nav.step(INSTRUCTION, task=task)
        if not rec.reason.startswith("no fresh camera frame"):
            return rec
        assert rec.verified_tokens == 0 and rec.unverified_tokens == 0 and rec.parse == "refused"
        time.sleep(0.5)
    raise AssertionError(f"no fresh camera frame in three steps: {rec.reason}")


@real
def test_a_qwen_pair_steps_verified_and_offline_from_the_frame(tmp_path, qpair):
    vlm, drafter, server = qpair
    d, frames = sim_daemon(tmp_path, vlm, drafter, server.url)
    try:
        rec = fresh_step(d, task="1")
        ids, images = d.nav.last_prompt_ids, d.nav.last_prompt_images
        assert rec.mode == "verified" and rec.perception == "vlm" and rec.verified_tokens > 0
        # the frame on the camera line, as the chat template wrote it: <|image_pad|> inside its wrappers
        (at,) = [i for i, t in enumerate(ids) if t == drafter.image_marker]
        assert drafter.image_marker == vlm.image_token_id and len(images) == 1 and images[0].at == at
        assert drafter.detokenize(ids[at - 1 : at + 2]) == SPAN
        assert drafter.detokenize(ids[:at]).endswith(f"\n{CAMERA}<|vision_start|>")
        assert images[0].data == d.nav.perception.encode(frames[-1]).data  # this step's frame
        assert rec.text == target_alone(drafter, server.url, d.nav).text  # exact: the target's own answer
        assert rec.decode["mode"] == "sd" and rec.decode["acceptance_rate"] > 0
        assert rec.parse in ("exact", "tolerant")  # the grammar: one reason and one NaVILA sentence
        safe(rec, d)
    finally:
        d.close()
    d, _ = sim_daemon(tmp_path, vlm, drafter, "")
    try:
        rec = fresh_step(d)
        assert rec.mode == "offline" and rec.unverified_tokens > 0 and rec.verified_tokens == 0
        assert "unverified" in rec.reason and len(d.nav.last_prompt_images) == 1
        assert rec.text == target_alone(drafter, None, d.nav, mode="local").text  # the draft's own, with the image
        safe(rec, d)
        if rec.action != str(STOP):  # the offline envelope: the smallest steps
            action = parse_action(rec.action_text).action
            assert action.amount <= (25 if action.kind == "forward" else 15)
    finally:
        d.close()
