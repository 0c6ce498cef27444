"""A Qwen-VL pair (M-RoPE) end to end on the torch engine: the robot's llama.cpp draft against a transformers target.

The same pair as tests/agent/test_vision_mrope.py (each family's tiny random model, tools/models/qwen_vlm.py: the
Q8_0 draft + f16 mmproj on the robot), with the server's target the Hugging Face directory on the torch engine:
its greedy ids with an image are transformers' own `generate`, every mode gives them, a draft rejected at the
first token after the image (a 96 x 128 image: 48 cells, 8 positions) still gives them, two images give two
outputs, a dropped link re-opens by the image's hash, and at T > 0 the token committed right after the image
follows the target's distribution (χ², the same check as the llamacpp engine's).
"""

import io

import numpy as np
import pytest

from agent.decoder import EdgeDecoder, FsdOptions, ReconnectPolicy
from agent.drafter import Draft, Drafter
from protocol.images import PromptImage
from server_bridge.target import load_target
from server_bridge.verifier import Verifier
from tests.agent.test_vision_mrope import follows_the_targets_distribution
from tests.conftest import ThreadedServer
from tools.cluster.netem import LinkProfile, NetemProxy
from tools.models import qwen_vlm as qv

pytestmark = pytest.mark.real

MAX_TOKENS = 12
SIZES = {0: (96, 128), 1: (64, 64)}  # seed -> (height, width): 48 cells / 8 positions, 16 / 4
SHORT = "<|im_start|>user\n" + qv.IMAGE_SPAN  # the first generated token follows the image's <|vision_end|>


def encoded(seed: int) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(qv.random_image(seed, *SIZES[seed])).save(out, format="PNG")
    return out.getvalue()


def prompt(drafter, seed: int, text: str = qv.PROMPT) -> tuple[list[int], list[PromptImage]]:
    ids = drafter.tokenize(text)
    return ids, [PromptImage.of(encoded(seed), ids.index(drafter.image_marker))]


@pytest.fixture(scope="module", params=qv.FAMILIES)
def vlm(request, qwen_vlm):
    return qwen_vlm(request.param)


@pytest.fixture(scope="module")
def vdrafter(vlm):
    return Drafter(str(vlm.draft), n_ctx=1024, threads=1, mmproj=vlm.draft_mmproj)


@pytest.fixture(scope="module")
def vtarget(vlm):
    return load_target(str(vlm.hf_dir), "torch", device="cpu", dtype="float32", threads=1, max_sequences=8)


@pytest.fixture(scope="module")
def vserver(vtarget):
    with ThreadedServer(lambda cfg: Verifier(vtarget, cfg), max_context=1024) as server:
        yield server


def greedy(target, ids, images, n=MAX_TOKENS) -> list[int]:
    """The target's own greedy ids, one token a pass, straight on the engine."""
    state, out = target.new_state(ids, images=images), []
    for _ in range(n):
        token = int(target.score(state, []).argmax(-1)[0])
        target.commit(state, [token], len(state.ids))
        out.append(token)
    target.free(state)
    return out


@pytest.fixture(scope="module")
def reference(vdrafter, vtarget):
    """(prompt, image seed) -> the target's greedy ids after it."""
    return {
        (text, seed): greedy(vtarget, *prompt(vdrafter, seed, text)) for text in (qv.PROMPT, SHORT) for seed in (0, 1)
    }


def generate(drafter, url, mode, ids, images, **kw):
    dec = EdgeDecoder(drafter, url, fsd=FsdOptions(exits=()), **kw)
    try:
        return dec.generate(ids, mode=mode, max_tokens=MAX_TOKENS, gamma=4, images=images)
    finally:
        dec.close()


def test_the_targets_greedy_ids_are_transformers_own_and_two_images_give_two(vlm, vtarget, reference):
    assert vtarget.engine.mrope and vtarget.sees
    for seed in (0, 1):
        ref = qv.hf_run(vlm.hf_dir, qv.random_image(seed, *SIZES[seed]), n=MAX_TOKENS)
        assert reference[qv.PROMPT, seed] == ref.greedy
    assert reference[qv.PROMPT, 0] != reference[qv.PROMPT, 1]


@pytest.mark.parametrize("mode", ["ar", "sd", "fsd"])
def test_every_mode_gives_the_targets_greedy_ids_with_an_image(vdrafter, vserver, reference, mode):
    for seed in (0, 1):
        gen = generate(vdrafter, vserver.url, mode, *prompt(vdrafter, seed))
        assert gen.token_ids == reference[qv.PROMPT, seed][: len(gen.token_ids)]
        assert len(gen.token_ids) == MAX_TOKENS or gen.token_ids[-1] in vdrafter.eos_ids
        if mode != "ar":
            assert gen.metrics.accepted > 0  # the draft saw the image too


@pytest.mark.parametrize("mode", ["sd", "fsd"])
def test_a_draft_rejected_right_after_the_image_still_gives_the_targets_ids(
    vdrafter, vserver, reference, monkeypatch, mode
):
    """The first draft token (it follows the image's <|vision_end|>) is the draft's second choice: the torch
    engine rejects it and cuts the sequence at that text index, whose position is the image's positions (8)
    past the marker, not its cells (48)."""
    ids, images = prompt(vdrafter, 0, SHORT)
    real = vdrafter.propose
    forced = []

    def propose(committed, k, *args, **kwargs):
        draft = real(committed, k, *args, **kwargs)
        if not forced and draft.ids:
            second = int(np.argsort(vdrafter.next_logits(committed))[-2])
            forced.append(second)
            draft = Draft([second] + draft.ids[1:], draft.q, draft.ms, draft.cands, draft.cand_p)
        return draft

    monkeypatch.setattr(vdrafter, "propose", propose)
    gen = generate(vdrafter, vserver.url, mode, ids, images)
    assert forced and gen.token_ids == reference[SHORT, 0]
    assert gen.token_ids[0] != forced[0] and gen.metrics.wasted_draft_tokens >= 4


def test_a_dropped_link_reopens_by_hash_and_loses_nothing(vdrafter, vserver, reference):
    ids, images = prompt(vdrafter, 1)
    with NetemProxy("127.0.0.1", vserver.port, LinkProfile.from_rtt(5)) as proxy:
        proxy.schedule_disconnect(after_bytes_down=400)
        gen = generate(vdrafter, proxy.url(), "sd", ids, images, reconnect=ReconnectPolicy(backoff_s=0.05))
        assert proxy.stats()["disconnects_injected"] >= 1
    assert gen.metrics.reconnects >= 1 and gen.token_ids == reference[qv.PROMPT, 1]
    assert gen.metrics.bytes_up < 2 * len(images[0].data) + 4096  # the re-open named the image by its hash


def test_the_targets_distribution_right_after_an_image_at_temperature(vdrafter, vtarget):
    ids, images = prompt(vdrafter, 0, SHORT)  # 48 cells, 8 positions; the draft sees 16 cells, 4 positions
    follows_the_targets_distribution(vdrafter, vtarget, ids, images, prompt(vdrafter, 1, SHORT)[1])
