"""A Qwen-VL pair (M-RoPE) end to end on the torch engine: the robot's llama.cpp draft against a transformers target.

The same pair as tests/agent/decoding/test_vision_mrope.py (each family's tiny random model,
tests/models/qwen_vlm.py: the Q8_0 draft + f16 mmproj on the robot), with the server's target the Hugging Face
directory on the torch engine: its greedy ids with an image are transformers' own `generate`, every mode gives them,
a draft rejected at the first token after the image (a 96 x 128 image: 48 cells, 8 positions) still gives them, two
images give two outputs, a dropped link re-opens by the image's hash, and at T > 0 the token committed right after
the image follows the target's distribution (χ², the same check as the llamacpp engine's).
"""

import pytest

from tests.agent import vlm_pairs as pairs
from tests.models import qwen_vlm as qv

pytestmark = pytest.mark.real

MAX_TOKENS = 12
SIZES = pairs.QWEN_SIZES  # seeds 0 and 1 here: 48 cells / 8 positions, 16 / 4
SHORT = pairs.QWEN_SHORT  # the first generated token follows the image's <|vision_end|>
prompt = pairs.qwen_prompt


@pytest.fixture(scope="module", params=qv.FAMILIES)
def vlm(request, qwen_vlm):
    return qwen_vlm(request.param)


# vdrafter and vserver: tests/agent/conftest.py


@pytest.fixture(scope="module")
def vtarget(vlm):
    return pairs.load(vlm, "torch")


@pytest.fixture(scope="module")
def reference(vdrafter, vtarget):
    """(prompt, image seed) -> the target's greedy ids after it."""
    return pairs.qwen_references(vdrafter, vtarget, MAX_TOKENS)


def test_the_targets_greedy_ids_are_transformers_own_and_two_images_give_two(vlm, vtarget, reference):
    assert vtarget.engine.mrope and vtarget.sees
    for seed in (0, 1):
        ref = qv.hf_run(vlm.hf_dir, qv.random_image(seed, *SIZES[seed]), n=MAX_TOKENS)
        assert reference[qv.PROMPT, seed] == ref.greedy
    assert reference[qv.PROMPT, 0] != reference[qv.PROMPT, 1]


@pytest.mark.parametrize("mode", ["ar", "sd", "fsd"])
def test_every_mode_gives_the_targets_greedy_ids_with_an_image(vdrafter, vserver, reference, mode):
    runs = [(*prompt(vdrafter, seed), reference[qv.PROMPT, seed]) for seed in (0, 1)]
    pairs.every_mode_gives_the_targets_ids(vdrafter, vserver.url, mode, runs, MAX_TOKENS)


@pytest.mark.parametrize("mode", ["sd", "fsd"])
def test_a_draft_rejected_right_after_the_image_still_gives_the_targets_ids(
    vdrafter, vserver, reference, monkeypatch, mode
):
    """The first draft token (it follows the image's <|vision_end|>) is the draft's second choice: the torch
    engine rejects it and cuts the sequence at that text index, whose position is the image's positions (8)
    past the marker, not its cells (48)."""
    ids, images = prompt(vdrafter, 0, SHORT)
    expected = reference[SHORT, 0]
    pairs.rejected_right_after_the_prompt(vdrafter, vserver.url, mode, ids, images, expected, monkeypatch, MAX_TOKENS)


def test_a_dropped_link_reopens_by_hash_and_loses_nothing(vdrafter, vserver, reference):
    ids, images = prompt(vdrafter, 1)
    pairs.reopens_by_hash(
        vdrafter, vserver.port, ids, images, reference[qv.PROMPT, 1], MAX_TOKENS, after_bytes_down=400
    )


def test_the_targets_distribution_right_after_an_image_at_temperature(vdrafter, vtarget):
    ids, images = prompt(vdrafter, 0, SHORT)  # 48 cells, 8 positions; the draft sees 16 cells, 4 positions
    pairs.follows_the_targets_distribution(vdrafter, vtarget, ids, images, prompt(vdrafter, 1, SHORT)[1])
