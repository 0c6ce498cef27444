"""FSD on a vision-language target, as the paper ran it (Qwen2-VL): early-exit adapters trained by
`server-bridge train-exits` on a tiny Qwen-VL test model (tests/models/qwen_vlm.py), with an image in some of its
prompts, load for the same model on both engines (the Hugging Face directory on torch, its f32 GGUF + mmproj on
llamacpp, tapped through the eval callback), early verdicts stream during FSD rounds with an image in the
prompt, pre-drafting from them hits, and FSD gives AR's ids at T = 0.

The test models have 2 decoder blocks, so the one exit sits after block 1. A random model's first block says
little about its last on prompts it has not seen (held-out agreement stays near the logit lens's ~10 %), so the
adapters are trained on the robot's own prompt and frames, as a deployment would (`--prompts`, `--images`): a
few prompts, some with an image (chat and plain), 16 generated tokens each, 300 steps of a rank-32 adapter,
seconds, once per family. Pre-drafting with the robot's own guesses off then hits from the exits' verdicts alone.

SmolVLM's test model (make_test_vlm.py) trains and loads too, but its near-flat logits leave its first block
little to learn from (~39 % agreement on its own training positions, the logit lens ~34 %), so the round
trip with exits runs on the Qwen-VL families only.
"""

import json

import numpy as np
import pytest
import torch

from agent.decoding import DecoderSettings, open_decoder
from protocol.images import PromptImage
from server_bridge import cli
from server_bridge.engines.exits_torch import ExitHeads
from server_bridge.exits import ExitConfig, NumpyExitHeads
from server_bridge.verifier import Verifier
from tests.agent import vlm_pairs as pairs
from tests.conftest import ThreadedServer
from tests.models import make_test_vlm as tv
from tests.models import qwen_vlm as qv

pytestmark = pytest.mark.real

MAX_TOKENS = 16
SIZES = {0: (96, 128), 1: (64, 64)}  # seed -> (height, width)
TRAIN = [
    "--layers", "1", "--rank", "32", "--gen-tokens", str(MAX_TOKENS), "--candidates", "16", "--negatives", "2048",
    "--steps", "300", "--batch", "64", "--threads", "1", "--max-len", "512", "--image-every", "2",
]  # fmt: skip
# with --image-every 2: prompts 0, 2 and 4 lead with frames 0, 1 and 0 (chat, chat, plain behind the placeholder)
PROMPTS = [
    {"chat": True, "prompt": "Describe the scene."},
    {"chat": True, "prompt": "Where is the door?"},
    {"chat": True, "prompt": "Describe the scene."},
    {"chat": False, "prompt": "The robot turned left at the"},
    {"chat": False, "prompt": "Ahead of the robot:"},
]


def encoded(family: str, seed: int) -> bytes:
    return pairs.image_bytes(tv.random_image(seed) if family == "smolvlm" else qv.random_image(seed, *SIZES[seed]))


def prompt(drafter, family: str, seed: int) -> tuple[list[int], list[PromptImage]]:
    """The robot's chat prompt "Describe the scene." with the frame (the trainer's PROMPTS[0] and [2])."""
    return drafter.image_prompt("Describe the scene.", [encoded(family, seed)], chat=True)


@pytest.fixture(scope="module", params=("smolvlm",) + qv.FAMILIES)
def family(request):
    return request.param


@pytest.fixture(scope="module")
def vlm(family, qwen_vlm):
    return qwen_vlm(family)  # made once per run (tests/conftest.py)


@pytest.fixture(scope="module")
def adapters(family, vlm, tmp_path_factory):
    """The adapters' path prefix (what `serve --exits` takes), trained once for the module."""
    out = tmp_path_factory.mktemp("exits")
    (out / "frames").mkdir()
    for seed in SIZES:
        (out / "frames" / f"{seed}.png").write_bytes(encoded(family, seed))
    (out / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    data = ["--prompts", str(out / "prompts.jsonl"), "--heldout", str(out / "prompts.jsonl")]
    argv = ["--target", str(vlm.hf_dir), "--name", family, "--out", str(out), "--images", str(out / "frames")]
    assert cli.main(["train-exits", *argv, *data, *TRAIN]) == 0
    return out / family


@pytest.fixture(scope="module")
def vdrafter(vlm):
    return pairs.drafter(vlm)


def load(vlm, engine: str):
    """The family's target on an engine, on llamacpp tapped at the exit's block (what `serve --exits` asks of it)."""
    return pairs.load(vlm, engine, **({"tap_layers": [1]} if engine == "llamacpp" else {}))


def test_the_trainer_reads_prompts_with_an_image_and_writes_adapters_both_engines_load(family, vlm, adapters):
    config = ExitConfig.load(adapters)
    assert config.layers == [1] and config.hidden == vlm.shape.hidden and config.target == family
    assert config.info["prompts_with_an_image"] == 6 and config.info["train_positions"] > 0
    assert config.info["agreement_heldout"]["1"] > config.info["agreement_logit_lens"]["1"]
    # the numpy heads over the GGUF's final norm and LM head are the torch heads over the HF model's
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(vlm.hf_dir, dtype=torch.float32)
    heads, numpy_heads = ExitHeads.load(adapters), NumpyExitHeads.load(adapters, vlm.target)
    h = torch.randn(3, config.hidden) * 2
    with torch.inference_mode():
        ref = heads.logits(model, 1, h).numpy()
    assert np.abs(numpy_heads.logits(1, h.numpy()) - ref).max() < 1e-3 * np.abs(ref).max()


@pytest.mark.parametrize("engine", ["llamacpp", "torch"])
@pytest.mark.parametrize("family", qv.FAMILIES, indirect=True)
def test_fsd_with_trained_exits_and_an_image_streams_verdicts_hits_and_gives_ar_ids(
    family, engine, vlm, vdrafter, adapters
):
    vtarget = load(vlm, engine)
    with ThreadedServer(lambda cfg: Verifier(vtarget, cfg), max_context=1024, exits=str(adapters)) as server:
        assert server.server.verifier.exit_layers == [1]
        hits = 0
        for seed in (0, 1):
            ids, images = prompt(vdrafter, family, seed)
            reference = pairs.greedy(vtarget, ids, images, MAX_TOKENS)
            out = {}
            for mode, fsd in (("ar", {}), ("fsd", {}), ("exits only", {"guesses": False})):
                dec = open_decoder(DecoderSettings(verifier=server.url, **fsd), vdrafter)
                try:
                    run = "ar" if mode == "ar" else "fsd"
                    out[mode] = dec.generate(ids, mode=run, max_tokens=MAX_TOKENS, gamma=4, images=images)
                finally:
                    dec.close()
            for mode, gen in out.items():
                assert gen.token_ids == reference[: len(gen.token_ids)], mode
                assert len(gen.token_ids) == MAX_TOKENS or gen.token_ids[-1] in vdrafter.eos_ids
            for mode in ("fsd", "exits only"):
                m = out[mode].metrics
                assert m.exits_received > 0 and m.avg_exit_layer is not None, mode
                assert m.predraft_hits + m.predraft_misses == m.rounds - 1
            hits += out["exits only"].metrics.predraft_hits  # branches started from the exits' verdicts alone
        print("hits", hits, out["fsd"].metrics.predraft_hits, out["exits only"].metrics.exits_received)
        assert hits > 0
