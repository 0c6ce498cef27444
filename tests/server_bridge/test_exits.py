"""Early-exit adapters: cheap candidate scoring, save/load, and the shipped adapters beat the logit lens."""

import numpy as np
import pytest
import torch

from protocol import modelfiles
from server_bridge.engines.exits_torch import ExitHeads
from server_bridge.exits import ExitConfig

pytestmark = pytest.mark.real

SHIPPED = modelfiles.models_dir() / "exits" / "smollm2-f32"


@pytest.fixture(scope="module")
def shipped():
    return ExitHeads.load(SHIPPED)


def _greedy_hidden(torch_target, layers, texts, new_tokens=32):
    """The target's own greedy continuation of each text; hidden states at the exits, final argmax."""
    hidden, argmax = {l: [] for l in layers}, []
    target = torch_target.engine
    with torch.inference_mode(), target.plain_attention():
        for text in texts:
            ids = target.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            )
            x = torch.tensor([target.tokenizer.encode(ids, add_special_tokens=False)])
            seq = target.model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=target.tokenizer.eos_token_id,
            )
            o = target.model(seq, output_hidden_states=True)
            rows = slice(x.shape[1] - 1, seq.shape[1] - 1)
            for l in layers:
                hidden[l].append(o.hidden_states[l][0, rows])
            argmax.append(o.logits[0, rows].argmax(-1))
    return {l: torch.cat(h) for l, h in hidden.items()}, torch.cat(argmax)


def test_candidate_scoring_equals_the_full_head(shipped, torch_target):
    target = torch_target.engine
    h = torch.randn(5, target.model.config.hidden_size)
    cand = torch.randint(0, target.vocab_size, (5, 16))
    with torch.inference_mode():
        full = shipped.logits(target.model, shipped.layers[-1], h)  # [5, vocab]
        part = shipped.logits(target.model, shipped.layers[-1], h, cand)  # [5, 16]
    torch.testing.assert_close(part, full.gather(1, cand), rtol=1e-4, atol=1e-4)


def test_save_load_and_subsets(shipped, tmp_path):
    shipped.save(tmp_path / "x")
    again = ExitHeads.load(tmp_path / "x")
    assert again.layers == shipped.layers and again.config.info == shipped.config.info
    for k, v in shipped.state_dict().items():
        torch.testing.assert_close(again.state_dict()[k], v)
    sub = ExitHeads.load(tmp_path / "x", layers=shipped.layers[-2:])
    assert sub.layers == shipped.layers[-2:]
    torch.testing.assert_close(
        sub.adapters[str(sub.layers[0])].up.weight, shipped.adapters[str(sub.layers[0])].up.weight
    )
    with pytest.raises(ValueError, match="no trained exit"):
        ExitHeads.load(tmp_path / "x", layers=[3])
    with pytest.raises(ValueError):
        ExitConfig(layers=[12, 6], hidden=576)


def test_shipped_adapters_agree_with_the_final_layer_more_than_the_logit_lens(shipped, torch_target):
    """Held-out prompts (not in the training set): trained exits beat the same exits with zero adapters."""
    texts = [
        "Walk to the window and describe what a robot might see there.",
        "Write a haiku about a rainy street.",
        "Why is the sky blue? Answer in two sentences.",
    ]
    hidden, final = _greedy_hidden(torch_target, shipped.layers, texts)
    target = torch_target.engine
    lens = ExitHeads(ExitConfig(shipped.layers, shipped.config.hidden, shipped.config.rank))
    hits = {"trained": 0, "lens": 0}
    with torch.inference_mode():
        for l in shipped.layers:
            hits["trained"] += (shipped.logits(target.model, l, hidden[l]).argmax(-1) == final).sum().item()
            hits["lens"] += (lens.logits(target.model, l, hidden[l]).argmax(-1) == final).sum().item()
    assert hits["trained"] > hits["lens"] + 0.05 * len(final) * len(shipped.layers), hits


def test_taps_see_the_residual_stream_after_their_block_in_verify_passes_only(torch_target):
    target, engine = torch_target, torch_target.engine
    ids = engine.tokenizer.encode("The robot turned left at the")
    draft = [260, 2078, 30]
    seen = {}
    state = target.new_state(ids)
    with torch.inference_mode(), engine.plain_attention() as model:
        ref = model(torch.tensor([ids + draft]), output_hidden_states=True)
    hooks = [len(m._forward_hooks) for m in engine.model.model.layers]  # transformers' own recorder's, if any
    logits = target.score(state, draft, taps={l: (lambda h, l=l: seen.__setitem__(l, h.clone())) for l in (1, 12, 30)})
    for l in (1, 12):  # hidden_states[30] is after the final norm: compare 1, 12
        torch.testing.assert_close(seen[l], ref.hidden_states[l][0, -4:], rtol=1e-4, atol=1e-4)
    assert seen[30].shape == (4, engine.hidden_size)
    torch.testing.assert_close(torch.from_numpy(logits), ref.logits[0, -4:], rtol=1e-4, atol=1e-4)
    assert [len(m._forward_hooks) for m in engine.model.model.layers] == hooks  # removed after the pass
    with pytest.raises(ValueError, match="no decoder block 31"):
        target.score(state, draft, taps={31: print})


def test_a_pass_that_dies_midway_leaves_nothing_a_later_pass_sees(torch_target):
    target = torch_target
    ids = target.engine.tokenizer.encode("Go to the red door")
    state = target.new_state(ids)

    def boom(hidden):
        raise RuntimeError("tap failed")

    with pytest.raises(RuntimeError, match="tap failed"):
        target.score(state, [288, 1535], taps={12: boom})
    assert state.cached == len(ids) - 1
    fresh = target.new_state(ids)
    np.testing.assert_array_equal(target.score(state, [288, 1535]), target.score(fresh, [288, 1535]))


# --------------------------------------------------------------------------- the llamacpp engine's exits


def test_the_numpy_heads_are_the_torch_heads(shipped, target, torch_target):
    """NumpyExitHeads (adapters in numpy, norm and LM head from the GGUF) against the torch modules."""
    from server_bridge.exits import NumpyExitHeads

    heads = NumpyExitHeads.load(SHIPPED, target.engine.path)
    assert heads.layers == shipped.layers and heads.head.shape == (target.vocab_size, heads.config.hidden)
    rng = np.random.default_rng(0)
    h = (rng.standard_normal((5, heads.config.hidden)) * 20).astype(np.float32)
    cand = rng.integers(0, target.vocab_size, (5, 16))
    for l in heads.layers:
        with torch.inference_mode():
            ref = shipped.logits(torch_target.engine.model, l, torch.from_numpy(h)).numpy()
        np.testing.assert_allclose(heads.logits(l, h), ref, rtol=1e-4, atol=1e-3)
        np.testing.assert_allclose(heads.logits(l, h, cand), np.take_along_axis(ref, cand, 1), rtol=1e-4, atol=1e-3)
    sub = NumpyExitHeads.load(SHIPPED, target.engine.path, layers=[26])
    assert sub.layers == [26]
    with pytest.raises(ValueError, match="no trained exit"):
        NumpyExitHeads.load(SHIPPED, target.engine.path, layers=[3])


def test_llamacpp_taps_see_the_residual_stream_after_their_block(target, torch_target):
    """The eval callback hands each tapped layer the same rows as transformers' hidden_states[l]."""
    ids = target.tokenizer.encode("The robot turned left at the")
    draft = [260, 2078, 30]
    seen = {}
    state = target.new_state(ids)
    layers = target.engine.tapped
    assert layers == [12, 18, 22, 26]
    logits = target.score(state, draft, taps={l: (lambda h, l=l: seen.__setitem__(l, h.copy())) for l in layers})
    with torch.inference_mode(), torch_target.engine.plain_attention() as model:
        ref = model(torch.tensor([ids + draft]), output_hidden_states=True)
    for l in layers:
        rows = ref.hidden_states[l][0, -4:].numpy()
        assert seen[l].shape == rows.shape
        # f16 KV on llama.cpp: within 1e-3 of the rows' scale (measured: 3e-4)
        assert np.abs(seen[l] - rows).max() < 1e-3 * np.abs(rows).max(), l
    np.testing.assert_allclose(logits, ref.logits[0, -4:].numpy(), atol=0.1)
    with pytest.raises(ValueError, match="not tapped"):
        target.score(state, draft, taps={13: print})


def test_the_server_taps_llama_cpp_only_for_the_exits_it_serves():
    from server_bridge.config import ServerConfig
    from server_bridge.server import target_from_config
    from server_bridge.verifier import Verifier

    small = dict(max_sessions=2, max_context=256, threads=1)
    named = ServerConfig(exits=str(SHIPPED), exit_layers=[18, 26], **small)
    served = target_from_config(named)
    assert served.engine.tapped == [18, 26] and Verifier(served, named).exit_layers == [18, 26]
    plain = target_from_config(ServerConfig(**small))  # "auto": no exits on llamacpp (they do not pay)
    assert plain.engine.tapped == [] and target_from_config(ServerConfig(exits="", **small)).engine.tapped == []
    # an engine made without taps: "auto" exits stay off, adapters named outright are an error
    assert Verifier(plain, ServerConfig()).exits is None
    with pytest.raises(ValueError, match="taps layers"):
        Verifier(plain, ServerConfig(exits=str(SHIPPED)))
