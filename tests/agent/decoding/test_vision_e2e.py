"""A vision-language pair end to end: the robot's draft VLM and the server's target VLM over the real wire.

The pair is the test VLM (tests/models/make_test_vlm.py: a random SmolVLM; its f32 GGUF + mmproj serve, its
Q8_0 GGUF + f16 mmproj draft). With an image in the prompt every mode must give the target's own
greedy ids at T = 0, on each engine; the image must reach the model on both sides (two images, two
outputs); at T > 0 the committed token must follow the target's distribution after the image; a bad
image is refused on its session alone; a re-open names the image by its sha256, and sends the bytes
again when the server no longer holds them.
"""

import asyncio
import threading
import time

import numpy as np
import pytest

from agent.decoding import DecoderSettings, open_decoder
from agent.decoding.link import ServerError
from protocol import wire
from protocol.images import MAX_IMAGE_PIXELS, MAX_IMAGE_SIDE, PromptImage
from runtime.vision import CACHED
from server_bridge.config import ServerConfig
from server_bridge.target import load_target
from server_bridge.verifier import Verifier
from tests.agent import vlm_pairs as pairs
from tests.conftest import ThreadedServer
from tests.models import make_test_vlm as tv

pytestmark = pytest.mark.real

MAX_TOKENS = 16


def encoded(seed: int, fmt: str = "PNG") -> bytes:
    return pairs.image_bytes(tv.random_image(seed), fmt)


@pytest.fixture(scope="module")
def vlm():
    return tv.make(log=lambda m: None)


@pytest.fixture(scope="module", params=["llamacpp", "torch"])
def vtarget(request, vlm):
    """The target VLM on each engine: the f32 GGUF + mmproj through libmtmd, the Hugging Face directory through
    transformers (its own processor and vision tower)."""
    return pairs.load(vlm, request.param)


# vdrafter and vserver: tests/agent/conftest.py


def prompt(drafter, seed: int, text: str = tv.PROMPT) -> tuple[list[int], list[PromptImage]]:
    return pairs.image_prompt(drafter, text, encoded(seed))


def generate(drafter, url, mode, ids, images, **kw):
    return pairs.generate(drafter, url, mode, ids, images, MAX_TOKENS, **kw)


@pytest.fixture(scope="module")
def reference(vdrafter, vtarget):
    """Per image seed: the target's greedy ids after the prompt with that image."""
    out = {}
    for seed in (0, 1):
        ids, images = prompt(vdrafter, seed)
        out[seed] = pairs.greedy(vtarget, ids, images, MAX_TOKENS)
    return out


def test_the_welcome_offers_images_with_the_drafts_marker(vdrafter, vserver, vtarget):
    dec = open_decoder(DecoderSettings(verifier=vserver.url), vdrafter)
    try:
        dec.connect()
        offered = dec.link.welcome.limits["images"]
    finally:
        dec.close()
    assert offered["marker"] == vdrafter.image_marker == vtarget.image_marker
    assert offered["max_images"] >= 1 and offered["max_bytes"] >= 1 << 20
    assert offered["max_side"] == MAX_IMAGE_SIDE and offered["max_pixels"] == MAX_IMAGE_PIXELS


@pytest.mark.parametrize("mode", ["ar", "sd", "fsd"])
def test_every_mode_gives_the_targets_greedy_ids_with_an_image(vdrafter, vserver, reference, mode):
    runs = [(*prompt(vdrafter, seed), reference[seed]) for seed in (0, 1)]
    pairs.every_mode_gives_the_targets_ids(vdrafter, vserver.url, mode, runs, MAX_TOKENS)


def test_the_image_reaches_the_model_on_both_sides(vdrafter, reference):
    """Two images: two target outputs, and two draft outputs (offline, the draft alone)."""
    assert reference[0] != reference[1]
    local = []
    for seed in (0, 1):
        ids, images = prompt(vdrafter, seed)
        dec = open_decoder(DecoderSettings(verifier=None), vdrafter)
        local.append(dec.generate(ids, mode="local", max_tokens=MAX_TOKENS, images=images).token_ids)
    assert local[0] != local[1]
    # the Q8_0 draft mostly agrees with its f32 target after the same image
    assert np.mean([a == b for a, b in zip(local[0], reference[0], strict=False)]) > 0.5


def test_a_text_prompt_after_an_image_prompt_drafts_as_text(vdrafter, vserver, vtarget):
    """use_images([]) leaves no image behind: the draft's KV of the image is not reused for text."""
    ids = vdrafter.tokenize("User: Describe a red box.<end_of_utterance>\nAssistant:")
    expected = pairs.greedy(vtarget, ids, [], MAX_TOKENS)
    assert generate(vdrafter, vserver.url, "sd", ids, None).token_ids == expected[:MAX_TOKENS]


def test_a_dropped_link_reopens_by_hash_and_loses_nothing(vdrafter, vserver, reference):
    ids, images = prompt(vdrafter, 0)
    pairs.reopens_by_hash(vdrafter, vserver.port, ids, images, reference[0], MAX_TOKENS, after_bytes_down=700)


def test_a_server_that_lost_the_image_gets_its_bytes_again(vdrafter, vserver, vtarget, reference, monkeypatch):
    """A re-open by sha256 that the server no longer holds: unknown_image, the robot sends the bytes, exact."""
    ids, images = prompt(vdrafter, 1)
    real = vdrafter.propose
    calls = []

    def propose(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # the server restarts: its sessions and images gone
            asyncio.run_coroutine_threadsafe(forget(), vserver.loop).result(10)
        return real(*args, **kwargs)

    def evict_images():  # as many other images as the server keeps: ours is out
        for seed in range(10, 10 + CACHED):
            vtarget.engine.image_positions(PromptImage.of(encoded(seed), 0))

    async def forget():
        await asyncio.get_running_loop().run_in_executor(vserver.server.model_thread, evict_images)
        return vserver.server.sessions.evict_idle(now=time.monotonic() + 1e9)

    monkeypatch.setattr(vdrafter, "propose", propose)
    gen = generate(vdrafter, vserver.url, "sd", ids, images)
    assert gen.metrics.reopens == 2  # unknown_session, then unknown_image
    assert gen.token_ids == reference[1]


def test_a_bad_image_is_refused_on_its_session_alone(vdrafter, vserver, vtarget, reference):
    ids, images = prompt(vdrafter, 0)
    corrupt = PromptImage(images[0].at, "0" * 64, b"\x89PNG\r\n\x1a\n" + b"\0" * 64)
    verifier = Verifier(vtarget, ServerConfig(max_context=1024))
    good, _ = verifier.open(wire.Open("good", ids, {"temperature": 0.0}, images=images), 1, None)
    for bad, code in [
        ([corrupt], "bad_image"),
        ([PromptImage(images[0].at - 1, images[0].sha256, images[0].data)], "bad_image"),
        ([PromptImage(images[0].at, "ab" * 32)], "unknown_image"),
    ]:
        with pytest.raises(wire.WireError) as e:
            verifier.open(wire.Open("bad", ids, {"temperature": 0.0}, images=bad), 1, None)
        assert e.value.code == code and e.value.sid == "bad"
    # the good session goes on as if nothing happened
    out = verifier.verify(good, wire.Verify("good", 0, len(ids), reference[0][:3], {"kind": "none"}))
    assert out.verdict.accepted == 3


def test_a_target_without_its_projector_says_no_vision(vlm, vdrafter):
    """The same GGUF served without --mmproj reads text only: the robot learns it from welcome, before it
    sends the image, and the server refuses an open with images on its own."""
    blind = load_target(str(vlm.target), "llamacpp", threads=1, max_sequences=2, kv_tokens=1024)
    assert not blind.sees
    ids, images = prompt(vdrafter, 0)
    with ThreadedServer(lambda cfg: Verifier(blind, cfg), max_context=1024) as server:
        with pytest.raises(ServerError) as e:
            generate(vdrafter, server.url, "sd", ids, images)
        assert e.value.code == "no_vision"
        assert "--mmproj" in e.value.message
    with pytest.raises(wire.WireError) as e:
        Verifier(blind, ServerConfig()).open(wire.Open("x", ids, {"temperature": 0.0}, images=images), 1, None)
    assert e.value.code == "no_vision"


def test_the_targets_distribution_after_an_image_at_temperature(vdrafter, vtarget):
    """Draft one token, verify it, from the same image prompt over and over: χ² against the target's p (the
    draft sees another image, so the residual path runs)."""
    ids, images = prompt(vdrafter, 0)
    pairs.follows_the_targets_distribution(vdrafter, vtarget, ids, images, prompt(vdrafter, 1)[1])


def test_the_command_lines(vlm, tmp_path, capsys):
    """server-bridge serve --mmproj (through the config it builds) and edge-agent generate --draft-mmproj --image."""
    import json

    from agent.app import cli as agent_cli
    from server_bridge import cli as server_cli
    from server_bridge.server import target_from_config

    assert server_cli.main(["serve", "--target", str(vlm.target), "--mmproj", str(tmp_path / "none.gguf")]) == 2
    assert "no projector file" in capsys.readouterr().err
    config = ServerConfig(
        target=str(vlm.target), mmproj=str(vlm.target_mmproj), threads=1, max_sessions=4, max_context=1024
    )
    target = target_from_config(config)
    assert target.sees
    files = []
    for seed in (0, 1):
        files.append(tmp_path / f"frame{seed}.jpg")
        files[-1].write_bytes(encoded(seed, "JPEG"))
    (tmp_path / "frame.gif").write_bytes(b"GIF89a" + b"\0" * 32)
    with ThreadedServer(lambda cfg: Verifier(target, cfg), max_context=1024) as server:

        def run(*args):
            rc = agent_cli.main(
                [
                    "generate",
                    "--verifier",
                    server.url,
                    "--draft",
                    str(vlm.draft),
                    "--draft-mmproj",
                    str(vlm.draft_mmproj),
                    "--threads",
                    "1",
                    "--max-tokens",
                    "8",
                    "--json",
                    "--prompt",
                    "Describe the scene.",
                    "--chat",
                    *args,
                ]
            )
            captured = capsys.readouterr()
            return rc, (json.loads(captured.out.strip().splitlines()[-1]) if rc == 0 else captured.err)

        outs = {mode: run("--mode", mode, "--image", str(files[0])) for mode in ("ar", "sd", "fsd")}
        assert all(rc == 0 for rc, _ in outs.values())
        assert outs["sd"][1]["token_ids"] == outs["fsd"][1]["token_ids"] == outs["ar"][1]["token_ids"]
        assert run("--mode", "ar", "--image", str(files[1]))[1]["token_ids"] != outs["ar"][1]["token_ids"]
        rc, err = run("--mode", "sd", "--image", str(tmp_path / "frame.gif"))
        assert rc == 2 and "JPEG or a PNG" in err
    rc = agent_cli.main(
        [
            "generate",
            "--local",
            "--draft",
            str(vlm.draft),
            "--threads",
            "1",
            "--image",
            str(files[0]),
            "--prompt",
            "Describe the scene.",
        ]
    )
    assert rc == 2 and "--draft-mmproj" in capsys.readouterr().err


def test_the_draft_prefills_an_image_once_and_keeps_the_shared_prefix(vdrafter, monkeypatch):
    """A navigation step after another with the same frame re-encodes nothing; a new frame re-encodes the
    image and what follows it only; the logits are those of a fresh prefill either way."""
    calls = []
    real = vdrafter.vision.eval
    monkeypatch.setattr(vdrafter.vision, "eval", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    ids, images = prompt(vdrafter, 0)
    vdrafter.use_images(images)
    vdrafter.llm.n_tokens = 0  # nothing held: a fresh prefill
    first = vdrafter.next_logits(ids)
    assert len(calls) == 1
    longer = vdrafter.next_logits(ids + [int(first.argmax())])
    assert len(calls) == 1  # the same image: its positions are kept
    vdrafter.use_images(prompt(vdrafter, 1)[1])
    other = vdrafter.next_logits(ids)
    assert len(calls) == 2 and calls[-1] == images[0].at  # a new frame: re-encoded at its own position
    assert not np.allclose(other, first)
    vdrafter.use_images(images)
    assert np.array_equal(vdrafter.next_logits(ids), first)
    assert vdrafter.llm.n_tokens == len(vdrafter.expand(ids)) and longer.shape == first.shape


def test_an_opens_images_are_decoded_off_the_model_thread(vdrafter, vserver, vtarget, monkeypatch):
    """DESIGN's Trust: the server decodes an open's image (libmtmd's bitmap and tiles; PIL and the processor)
    in its image thread before the open reaches the model thread, which every robot waits on."""
    vision = vtarget.engine.vision
    name = "_tokenize" if hasattr(vision, "_tokenize") else "_prepare"  # llamacpp's libmtmd, torch's processor
    decode, threads = getattr(vision, name), []

    def spy(image):
        threads.append(threading.current_thread().name)
        return decode(image)

    monkeypatch.setattr(vision, name, spy)
    ids, images = prompt(vdrafter, 7)  # an image no other test sent: not cached
    assert generate(vdrafter, vserver.url, "sd", ids, images).token_ids
    assert threads and all(t.startswith("images") for t in threads), threads
