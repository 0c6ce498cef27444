"""What the vision-language end-to-end tests share (tests/agent/decoding/test_vision_e2e.py, test_vision_mrope.py,
test_vision_mrope_torch.py, tests/server_bridge/ops/test_train_exits_vlm.py):
a frame as image bytes, a prompt with it, a
test pair's draft and target, the target's own greedy ids, one decoder run, and the checks each engine's pair
passes: every mode gives the target's ids, a draft rejected right after the image still does, a dropped link
re-opens by the image's hash, and what is committed after an image follows the target's distribution (χ²).

`vlm` is a test pair from tests/models (make_test_vlm.TinyVLM or qwen_vlm.QwenVLM): the same file fields.
tests/agent/conftest.py builds the `vdrafter` and `vserver` fixtures from a module's `vlm` and `vtarget`.
"""

import io

import numpy as np
from scipy import stats

from agent.decoding import DecoderSettings, open_decoder
from agent.decoding.drafter import Draft, Drafter
from protocol import sampling, wire
from protocol.images import PromptImage
from protocol.payload import PayloadSpec
from protocol.sampling import SamplingParams
from server_bridge.config import ServerConfig
from server_bridge.target import load_target
from server_bridge.verifier import Verifier
from tests.models import qwen_vlm as qv
from tools.cluster.netem import LinkProfile, NetemProxy

# seed -> (height, width) of a Qwen-VL frame: 48 tokens / 8 positions, 16 / 4, 48 / 8, 300 / 20
QWEN_SIZES = {0: (96, 128), 1: (64, 64), 2: (96, 128), 3: (240, 320)}
QWEN_SHORT = "<|im_start|>user\n" + qv.IMAGE_SPAN  # the first generated token follows the image's <|vision_end|>


def image_bytes(pixels: np.ndarray, fmt: str = "PNG") -> bytes:
    """[height, width, 3] uint8 pixels as an image file (a JPEG at quality 95)."""
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=fmt, quality=95)
    return out.getvalue()


def image_prompt(drafter, text: str, image: bytes) -> tuple[list[int], list[PromptImage]]:
    """`text` as the draft tokenizes it, with `image` at its (one) image marker."""
    ids = drafter.tokenize(text)
    return ids, [PromptImage.of(image, ids.index(drafter.image_marker))]


def qwen_frame(seed: int) -> bytes:
    """A Qwen-VL test frame: noise of QWEN_SIZES[seed] as a PNG."""
    return image_bytes(qv.random_image(seed, *QWEN_SIZES[seed]))


def qwen_prompt(drafter, seed: int, text: str = qv.PROMPT) -> tuple[list[int], list[PromptImage]]:
    return image_prompt(drafter, text, qwen_frame(seed))


def drafter(vlm) -> Drafter:
    """The robot's side of the pair: the Q8_0 draft and its f16 mmproj."""
    return open_decoder(DecoderSettings(draft=str(vlm.draft), threads=1, draft_mmproj=str(vlm.draft_mmproj))).drafter


def load(vlm, engine: str, **kw):
    """The pair's target on an engine: the Hugging Face directory through transformers on torch, the f32 GGUF
    + mmproj through libmtmd on llamacpp. `kw`: more of load_target's arguments (tap_layers)."""
    if engine == "torch":
        kw = dict(device="cpu", dtype="float32", threads=1, max_sequences=8, max_len=1024, **kw)
        return load_target(str(vlm.hf_dir), "torch", **kw)
    kw = dict(threads=1, max_sequences=8, kv_tokens=4096, mmproj=str(vlm.target_mmproj), **kw)
    return load_target(str(vlm.target), "llamacpp", **kw)


def greedy(target, ids, images, n: int) -> list[int]:
    """The target's own greedy ids, one token a pass, straight on the engine."""
    state, out = target.new_state(ids, images=images), []
    for _ in range(n):
        token = int(target.score(state, []).argmax(-1)[0])
        target.commit(state, [token], len(state.ids))
        out.append(token)
    target.free(state)
    return out


def generate(drafter, url, mode, ids, images, max_tokens: int, **kw):
    """One decoder run against the server at `url` (no early exits), gamma 4."""
    dec = open_decoder(DecoderSettings(verifier=url, exits="", **kw), drafter)
    try:
        return dec.generate(ids, mode=mode, max_tokens=max_tokens, gamma=4, images=images)
    finally:
        dec.close()


def qwen_references(drafter, target, max_tokens: int) -> dict:
    """(prompt, frame seed) -> the target's greedy ids after it, for qv.PROMPT and QWEN_SHORT, frames 0 and 1."""
    texts = (qv.PROMPT, QWEN_SHORT)
    return {(t, seed): greedy(target, *qwen_prompt(drafter, seed, t), max_tokens) for t in texts for seed in (0, 1)}


def every_mode_gives_the_targets_ids(drafter, url, mode, runs, max_tokens: int) -> None:
    """Each run, (ids, images, the target's greedy ids), through the decoder in `mode`: the target's ids (up to
    an eos), and outside AR drafts accepted (the draft saw the image too)."""
    for ids, images, expected in runs:
        gen = generate(drafter, url, mode, ids, images, max_tokens)
        assert gen.token_ids == expected[: len(gen.token_ids)]
        assert len(gen.token_ids) == max_tokens or gen.token_ids[-1] in drafter.eos_ids
        if mode != "ar":
            assert gen.metrics.accepted > 0  # the draft saw the image too: it is accepted


def rejected_right_after_the_prompt(drafter, url, mode, ids, images, expected, monkeypatch, max_tokens: int):
    """The first draft token after the prompt is the draft's second choice (second_choice_first): the target
    rejects it and the output is still its own `expected`, the rest of that draft wasted. The run, for more."""
    forced = second_choice_first(drafter, monkeypatch)
    gen = generate(drafter, url, mode, ids, images, max_tokens)
    assert forced and gen.token_ids == expected
    assert gen.token_ids[0] != forced[0] and gen.metrics.wasted_draft_tokens >= 4
    return gen


def reopens_by_hash(drafter, port: int, ids, images, expected, max_tokens: int, after_bytes_down: int) -> None:
    """The link to the server on `port` drops after `after_bytes_down` bytes of an SD run: the decoder re-opens
    and loses nothing (`expected`), and the re-open carries the image's sha256, not its bytes again."""
    with NetemProxy("127.0.0.1", port, LinkProfile.from_rtt(5)) as proxy:
        proxy.schedule_disconnect(after_bytes_down=after_bytes_down)
        gen = generate(drafter, proxy.url(), "sd", ids, images, max_tokens, reconnect_backoff_s=0.05)
        assert proxy.stats()["disconnects_injected"] >= 1
    assert gen.metrics.reconnects >= 1
    assert gen.token_ids == expected
    # the first open's frame holds the image, the re-open's not
    assert gen.metrics.bytes_up < 2 * len(images[0].data) + 4096


def second_choice_first(drafter, monkeypatch) -> list[int]:
    """Make the draft's first proposal start with its second choice (the target will reject it): the list
    that comes back holds that token once it has been proposed."""
    real = drafter.propose
    forced = []

    def propose(committed, k, *args, **kwargs):
        draft = real(committed, k, *args, **kwargs)
        if not forced and draft.ids:
            second = int(np.argsort(drafter.next_logits(committed))[-2])
            forced.append(second)
            draft = Draft([second] + draft.ids[1:], draft.q, draft.ms, draft.cands, draft.cand_p)
        return draft

    monkeypatch.setattr(drafter, "propose", propose)
    return forced


def follows_the_targets_distribution(drafter, target, ids, images, other, draws: int = 240) -> None:
    """Draft one token, verify it, from the same image prompt over and over: χ² against the target's p.

    The draft sees another image (`other`: a draft after the same image, e.g. a Q8_0 of the target, is too
    close to it to be rejected in 240 draws) so its q differs from p and the residual path runs; the token
    committed right after the target's image must still follow the target's p [vocab] there (top-4 at
    T = 1.5: four cells, 240 draws give each about 60). Every draw is rolled back to the prompt, so the KV
    is cut right after the image each time (by position with M-RoPE)."""
    params = SamplingParams(temperature=1.5, top_k=4, seed=11)
    drafter.use_images(other)
    verifier = Verifier(target, ServerConfig(max_context=1024))
    spec = PayloadSpec("full")
    open_ = wire.Open("stat", ids, {"temperature": 1.5, "top_k": 4, "seed": 11}, payload=spec.to_wire(), images=images)
    session, _ = verifier.open(open_, 1, None)
    p = sampling.probs_from_logits(target.score(session.state, [])[0], params)  # [vocab]
    target.rewind(session.state, ids)
    support = np.flatnonzero(p)
    assert len(support) == 4
    rng = np.random.default_rng(5)
    firsts, rejected = [], 0
    for r in range(draws):
        d = drafter.propose(ids, 1, params, rng, payload=spec)
        out = verifier.verify(session, wire.decode(wire.encode(wire.Verify("stat", r, len(ids), d.ids, d.wire_q()))))
        firsts.append(d.ids[0] if out.verdict.accepted else out.verdict.token)
        rejected += out.verdict.accepted == 0
        target.rewind(session.state, ids)
    target.free(session.state)
    counts = np.array([firsts.count(t) for t in support])
    assert counts.sum() == len(firsts)
    assert rejected > 0
    assert stats.chisquare(counts, p[support] * len(firsts)).pvalue > 1e-3
