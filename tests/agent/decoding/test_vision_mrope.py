"""The robot's side with a Qwen-VL pair (M-RoPE): the draft, FSD's branches and the round trip to a llamacpp target.

Each family's tiny random model (tests/models/qwen_vlm.py) takes a 96 x 128 image as 48 tokens but only
8 positions. The draft keeps its KV by position: its logits after an image prompt, and after a rollback
to right after the image, are the engine's for the same pass (the f32 target GGUF loaded as a draft, with
the engine's flash attention off as llama-cpp-python's `Llama` has it); its context is counted in cells.
FSD's branches start from that KV by position. End to end (the Q8_0 draft + f16 mmproj on the robot, the
f32 target + mmproj on the server) every mode gives the target's greedy ids with an image in the prompt,
two images give two outputs, a draft rejected at the first token after the image still gives them, a
dropped link re-opens by the image's hash, and at T > 0 the committed token right after the image follows
the target's distribution (χ²; tests/agent/vlm_pairs.py holds what the vision tests share).
"""

import numpy as np
import pytest

from agent.decoding import DecoderSettings, open_decoder
from agent.decoding.branches import BranchDrafter
from agent.decoding.drafter import DraftContextFull, Drafter
from protocol.sampling import SamplingParams
from server_bridge.engines import Pass, load_engine
from tests.agent import vlm_pairs as pairs
from tests.models import qwen_vlm as qv
from tools.cluster.netem import LinkProfile, NetemProxy

pytestmark = pytest.mark.real

GREEDY = SamplingParams()
MAX_TOKENS = 16
SHORT = pairs.QWEN_SHORT  # the first generated token follows the image's <|vision_end|>
# frames 0 .. 3 (pairs.QWEN_SIZES): 48 tokens / 8 positions, 16 / 4, 48 / 8, 300 / 20
encoded, prompt = pairs.qwen_frame, pairs.qwen_prompt


@pytest.fixture(scope="module", params=qv.FAMILIES)
def vlm(request, qwen_vlm):
    return qwen_vlm(request.param)  # made once per run (tests/conftest.py)


# --------------------------------------------------------------------------- the draft and its branches


@pytest.fixture(scope="module")
def f32_draft(vlm):
    """The f32 target pair loaded as a draft: its logits can be held to the engine's."""
    return Drafter(str(vlm.target), n_ctx=1024, threads=1, mmproj=vlm.target_mmproj)


@pytest.fixture(scope="module")
def engine(vlm):
    kw = dict(engine="llamacpp", threads=1, max_sequences=4, kv_tokens=1024, mmproj=vlm.target_mmproj)
    return load_engine(str(vlm.target), flash_attn="off", **kw), load_engine(str(vlm.target), **kw)


def test_the_draft_holds_an_image_by_position_and_rolls_back_to_right_after_it(f32_draft, engine):
    plain, _ = engine
    ids, images = prompt(f32_draft, 0)
    at = images[0].at
    f32_draft.use_images(images)
    assert f32_draft.kv_len(len(ids)) == len(ids) + 7 and f32_draft.kv_cells(len(ids)) == len(ids) + 47
    f32_draft.llm.n_tokens = 0  # nothing held: a fresh prefill
    row = f32_draft.next_logits(ids)
    assert f32_draft.llm.n_tokens == len(ids) + 7  # the next free position, not the cells held
    seq = plain.new_sequence()
    plain.forward([Pass(seq, 0, ids[:-1], 0, images={at: images[0]})])
    [ref] = plain.forward([Pass(seq, len(ids) - 1, ids[-1:], 1)])  # the last id alone, as the draft does
    assert np.abs(row - ref[0]).max() < 1e-4
    draft = f32_draft.propose(ids, 4, GREEDY, None)  # its KV now runs past the prompt
    assert draft.ids[0] == int(row.argmax())
    row = f32_draft.next_logits(ids[: at + 2])  # rejected from right after the image: <|vision_end|> again
    plain.truncate(seq, at + 1)
    [ref] = plain.forward([Pass(seq, at + 1, ids[at + 1 : at + 2], 1)])
    assert np.abs(row - ref[0]).max() < 1e-4
    row = f32_draft.next_logits(ids[: at + 1])  # ids that stop on the image: the row after it
    plain.truncate(seq, at)
    [ref] = plain.forward([Pass(seq, at, [ids[at]], 1, images={0: images[0]})])
    assert np.abs(row - ref[0]).max() < 1e-4
    plain.free(seq)


def test_a_new_frame_reencodes_its_image_at_its_position_and_keeps_the_text_before(f32_draft, monkeypatch):
    """Navigation steps: the same prompt with another frame (8 positions, then 4) keeps the KV before the image,
    and gives a fresh prefill's logits; the first frame again gives its own."""
    calls = []
    real = f32_draft.vision.eval
    monkeypatch.setattr(f32_draft.vision, "eval", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    ids, first = prompt(f32_draft, 0)
    f32_draft.use_images(first)
    f32_draft.llm.n_tokens = 0
    row = f32_draft.next_logits(ids)
    f32_draft.use_images(prompt(f32_draft, 1)[1])
    other = f32_draft.next_logits(ids)
    assert calls == [first[0].at] * 2 and f32_draft.llm.n_tokens == len(ids) + 3  # re-encoded at its position
    f32_draft.llm.n_tokens = 0
    assert np.array_equal(f32_draft.next_logits(ids), other) and not np.allclose(other, row)
    f32_draft.use_images(first)
    assert np.array_equal(f32_draft.next_logits(ids), row)


def test_a_prompt_written_by_hand_wraps_its_marker_as_the_chat_template_does(f32_draft):
    chat, _ = f32_draft.image_prompt("Describe the scene.", [encoded(0)], chat=True)
    plain, images = f32_draft.image_prompt("Describe the scene.", [encoded(0)])
    assert chat == f32_draft.tokenize(qv.PROMPT) and plain == f32_draft.tokenize(qv.IMAGE_SPAN + "Describe the scene.")
    assert images[0].at == plain.index(f32_draft.image_marker) == 1


def test_the_draft_context_counts_an_images_cells(vlm):
    """A 240 x 320 image: 300 cells, 20 positions. The prompt's positions fit 256 cells, its cells do not."""
    small = Drafter(str(vlm.draft), n_ctx=256, threads=1, mmproj=vlm.draft_mmproj)
    ids, images = prompt(small, 3)
    small.use_images(images)
    assert small.llm.n_ctx() == 256 and small.kv_len(len(ids)) + 4 < 256 <= small.kv_cells(len(ids))
    with pytest.raises(DraftContextFull, match="KV cells do not fit"):
        small.next_logits(ids)
    with pytest.raises(DraftContextFull):
        small.propose(ids, 4, GREEDY, None)


def test_branches_start_after_an_image_by_position(f32_draft, engine):
    """FSD's branch context: its base after an image prompt and a draft is the engine's pass (the same flash
    attention), and a branch from a correction right after the prompt drafts what the draft would."""
    _, flash = engine
    ids, images = prompt(f32_draft, 2)
    f32_draft.use_images(images)
    draft = f32_draft.propose(ids, 4, GREEDY, None)
    branches = BranchDrafter(f32_draft, slots=2, n_ctx=1024, threads=1)
    bonus = branches.base(ids, draft.ids)
    assert branches.held == f32_draft.expand(ids + draft.ids)  # by position: the image as 8 stand-ins
    seq = flash.new_sequence()
    [rows] = flash.forward([Pass(seq, 0, ids + draft.ids, 1, images={images[0].at: images[0]})])
    assert np.abs(bonus - rows[0]).max() < 1e-4
    keys = [(int(np.argsort(f32_draft.next_logits(ids))[-2]),), tuple(draft.ids) + (int(bonus.argmax()),)]
    started = [branches.start(key, len(ids), 3, np.random.default_rng(0)) for key in keys]
    while not all(b.done for b in started):
        branches.step([b for b in started if not b.done], GREEDY)
    for b in started:
        assert b.ids == f32_draft.propose(ids + list(b.key), 3, GREEDY, None).ids
    flash.free(seq)


# --------------------------------------------------------------------------- end to end


# vdrafter and vserver: tests/agent/conftest.py


@pytest.fixture(scope="module")
def vtarget(vlm):
    return pairs.load(vlm, "llamacpp")


@pytest.fixture(scope="module")
def reference(vdrafter, vtarget):
    """(prompt, image seed) -> the target's greedy ids after it."""
    return pairs.qwen_references(vdrafter, vtarget, MAX_TOKENS)


@pytest.mark.parametrize("mode", ["ar", "sd", "fsd"])
def test_every_mode_gives_the_targets_greedy_ids_with_an_image(vdrafter, vserver, reference, mode):
    runs = [(*prompt(vdrafter, seed), reference[qv.PROMPT, seed]) for seed in (0, 1)]
    pairs.every_mode_gives_the_targets_ids(vdrafter, vserver.url, mode, runs, MAX_TOKENS)


def test_two_images_give_two_outputs_on_both_sides(vdrafter, reference):
    assert reference[qv.PROMPT, 0] != reference[qv.PROMPT, 1]
    local = []
    for seed in (0, 1):  # the draft alone (offline)
        ids, images = prompt(vdrafter, seed)
        local.append(
            open_decoder(DecoderSettings(verifier=None), vdrafter).generate(
                ids, mode="local", max_tokens=MAX_TOKENS, images=images
            )
        )
    assert local[0].token_ids != local[1].token_ids


@pytest.mark.parametrize("mode", ["sd", "fsd"])
def test_a_draft_rejected_right_after_the_image_still_gives_the_targets_ids(
    vdrafter, vserver, reference, monkeypatch, mode
):
    """The first draft token (it follows the image's <|vision_end|>) is the draft's second choice: the server
    rejects it and cuts its KV at that position, the robot rolls its draft back there (FSD: pre-drafts the
    correction in a branch cut there), and the output is the target's own."""
    ids, images = prompt(vdrafter, 0, SHORT)
    expected = reference[SHORT, 0]
    # FSD through 40 ms of round trip: on loopback a loaded machine can answer before the correction's branch
    # is drafted (a miss, exact all the same), and the hit is what this test looks for
    with NetemProxy("127.0.0.1", vserver.port, LinkProfile.from_rtt(40 if mode == "fsd" else 0)) as proxy:
        gen = pairs.rejected_right_after_the_prompt(
            vdrafter, proxy.url(), mode, ids, images, expected, monkeypatch, MAX_TOKENS
        )
    if mode == "fsd":
        assert gen.metrics.predraft_hits > 0  # the branch of the correction, started right after the image


def test_a_dropped_link_reopens_by_hash_and_loses_nothing(vdrafter, vserver, reference):
    ids, images = prompt(vdrafter, 1)
    pairs.reopens_by_hash(
        vdrafter, vserver.port, ids, images, reference[qv.PROMPT, 1], MAX_TOKENS, after_bytes_down=400
    )


def test_the_targets_distribution_right_after_an_image_at_temperature(vdrafter, vtarget):
    ids, images = prompt(vdrafter, 0, SHORT)  # 48 cells, 8 positions; the draft sees 16 cells, 4 positions
    pairs.follows_the_targets_distribution(vdrafter, vtarget, ids, images, prompt(vdrafter, 1, SHORT)[1])
