"""A target whose vocabulary is the draft's plus a tail of padding ids (Qwen2-VL-7B's 152,064 rows over the
2B's 151,936 tokens) is served: the handshake agrees on the shared real part and no id past it ever comes down.

The rule (protocol.modelfiles.real_vocab_size): a trailing run of `[PAD<digits>]` pieces is padding, nothing
else is; vocab_hash covers the real part only, so an unpadded vocabulary hashes as it always did. End to end:
the tiny Qwen2-VL test model with 128 padding rows whose logits would win, served on the torch engine, against
its unpadded llama.cpp draft: SD at T = 0 gives the padded target's greedy ids over its real tokens, as AR does.
"""

import hashlib
import shutil

import pytest

from protocol.modelfiles import real_vocab_size, vocab_hash

PAD = 128
MAX_TOKENS = 12
TEXT = "<|im_start|>user\nDescribe the scene.<|im_end|>\n<|im_start|>assistant\n"


def _old_hash(pieces: list[bytes]) -> str:
    """vocab_hash as it was before padding tails were cut (every piece, then the count)."""
    h = hashlib.sha256()
    for p in pieces:
        p = p.replace("\u2581".encode(), b" ")
        h.update(len(p).to_bytes(4, "little"))
        h.update(p)
    h.update(len(pieces).to_bytes(8, "little"))
    return h.hexdigest()


def test_a_pad_tail_hashes_as_the_vocabulary_without_it():
    real = [b"a", b"\xc4\xa0b", b"<|im_end|>", "\u2581x".encode()]
    padded = real + [b"[PAD%d]" % i for i in range(len(real), len(real) + 5)]
    assert real_vocab_size(padded) == len(real) == real_vocab_size(real)
    assert vocab_hash(padded) == vocab_hash(real) == vocab_hash(iter(real)) == _old_hash(real)  # unpadded: unchanged
    assert real_vocab_size(real + [b"[PAD1]", b"[PAD2]"]) == len(real)  # SentencePiece converter's numbering


def test_only_a_tail_of_exact_pad_pieces_is_padding():
    middle = [b"a", b"[PAD1]", b"b"]
    assert real_vocab_size(middle) == 3 and vocab_hash(middle) == _old_hash(middle)
    for not_pad in (b"[PAD]", b"[PAD1] ", b"[pad3]", b"<PAD3>", b"[PAD-3]"):
        assert real_vocab_size([b"a", not_pad]) == 2
    assert vocab_hash([b"a", b"b"]) != vocab_hash([b"a", b"b", b"c"])  # a real tail still counts
    assert real_vocab_size([b"[PAD0]", b"[PAD1]"]) == 0


@pytest.fixture(scope="module")
def padded(qwen_vlm, tmp_path_factory):
    """(the test VLM, a copy of its HF directory with PAD embedding and lm_head rows more, its real size). The new
    lm_head rows are 4x the rows of tokens the model often picks, so unmasked they would win."""
    import torch
    from transformers import AutoModelForImageTextToText

    vlm = qwen_vlm("qwen2vl")
    out = tmp_path_factory.mktemp("padded")
    for f in vlm.hf_dir.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            shutil.copy(f, out / f.name)
    model = AutoModelForImageTextToText.from_pretrained(vlm.hf_dir, dtype=torch.float32)
    n = model.get_output_embeddings().weight.shape[0]
    model.resize_token_embeddings(n + PAD, mean_resizing=False)
    with torch.no_grad():
        w = model.get_output_embeddings().weight  # [n + PAD, hidden]
        common = w[:n].norm(dim=1).argsort(descending=True)[:PAD]  # the largest rows win most often
        w[n:] = 4.0 * w[common]
    model.config.get_text_config().vocab_size = n + PAD
    model.save_pretrained(out)
    return vlm, out, n


def test_a_padded_torch_target_serves_its_unpadded_draft(padded):
    from agent.decoding import DecoderSettings, open_decoder
    from protocol.sampling import SamplingParams
    from server_bridge.target import load_target
    from server_bridge.verifier import Verifier
    from tests.conftest import ThreadedServer

    vlm, hf_dir, n = padded
    drafter = open_decoder(DecoderSettings(draft=str(vlm.draft), threads=1)).drafter
    target = load_target(str(hf_dir), "torch", device="cpu", dtype="float32", threads=1, max_sequences=4)
    assert target.engine.vocab_size == n + PAD == drafter.vocab_size + PAD
    assert target.vocab_size == drafter.vocab_size == n and target.vocab_hash == drafter.vocab_hash
    ids = drafter.tokenize(TEXT)

    # the padded rows would win unmasked: the target's own greedy run, with and without them
    state, full, real = target.new_state(ids), [], []
    for _ in range(MAX_TOKENS):
        (rows,) = target.engine.forward([_pass(target, state)])
        logits = target.engine.to_numpy(rows)[-1]  # [n + PAD]
        full.append(int(logits.argmax()))
        real.append(int(logits[:n].argmax()))
        target.commit(state, [real[-1]], len(state.ids))
    target.free(state)
    assert any(t >= n for t in full), "the padding rows never win: the mask is not tested"
    assert max(real) < n

    seen = []
    with ThreadedServer(lambda cfg: Verifier(target, cfg), max_context=512) as server:
        for mode in ("ar", "sd"):
            dec = open_decoder(DecoderSettings(verifier=server.url, exits=""), drafter)
            try:
                gen = dec.generate(ids, mode=mode, max_tokens=MAX_TOKENS, gamma=4)
                assert dec.link.welcome.vocab_size == n  # the agreed vocabulary: the real part
            finally:
                dec.close()
            assert gen.token_ids == real[: len(gen.token_ids)], mode
            assert len(gen.token_ids) == MAX_TOKENS or gen.token_ids[-1] in drafter.eos_ids
            seen.append(gen.token_ids)
        assert seen[0] == seen[1]
        # sampled: verification, the residuals the robot resamples from (split) and ar draw over real ids only
        for mode, kind in (("sd", "full"), ("sd", "split"), ("ar", "none")):
            settings = DecoderSettings(verifier=server.url, exits="", payload=kind)
            dec = open_decoder(settings, drafter)
            try:
                params = SamplingParams(temperature=1.5, seed=3)
                gen = dec.generate(ids, mode=mode, max_tokens=MAX_TOKENS, gamma=4, params=params)
            finally:
                dec.close()
            seen.append(gen.token_ids)
    assert max(max(s) for s in seen) < n


def _pass(target, state):
    """The engine Pass that scores the state's pending ids (as Target.score, but the rows uncut)."""
    from server_bridge.engines import Pass

    return Pass(state.seq, state.cached, state.ids[state.cached :], 1, None, None)


def test_hello_from_a_draft_with_a_pad_tail_is_welcomed_with_the_real_size(padded):
    """Symmetrically: the draft's full size may exceed the target's real one (its own tail); never fall short."""
    from agent.decoding.link import ServerError, VerifierLink
    from server_bridge.target import load_target
    from server_bridge.verifier import Verifier
    from tests.conftest import ThreadedServer

    vlm, hf_dir, n = padded
    target = load_target(str(vlm.hf_dir), "torch", device="cpu", dtype="float32", threads=1, max_sequences=2)
    with ThreadedServer(lambda cfg: Verifier(target, cfg), max_context=512) as server:
        link = VerifierLink(server.url, vocab_hash=target.vocab_hash, vocab_size=n + PAD)
        try:
            assert link.connect().vocab_size == n
        finally:
            link.close()
        link = VerifierLink(server.url, vocab_hash=target.vocab_hash, vocab_size=n - 1)
        with pytest.raises(ServerError) as e:
            link.connect()
        assert e.value.code == "vocab_mismatch"
        link.close()


@pytest.fixture(scope="module")
def padded_draft(padded, tmp_path_factory):
    """The padded HF directory as a draft GGUF (Q8_0, llama.cpp's own converter): its vocabulary ends in
    the [PAD<id>] rows the converter writes, as Qwen2-VL-2B's does."""
    from tests.models.llama_convert import convert, converter_dir

    _, hf_dir, n = padded
    out = tmp_path_factory.mktemp("padded-draft") / "draft.gguf"
    convert(converter_dir(), hf_dir, [(out, "q8_0", False)], log=lambda *_: None)
    return out


def test_a_padded_draft_draws_from_its_real_vocabulary_against_a_padded_target(padded, padded_draft):
    from agent.decoding import DecoderSettings, open_decoder
    from protocol.sampling import SamplingParams
    from server_bridge.target import load_target
    from server_bridge.verifier import Verifier
    from tests.conftest import ThreadedServer

    vlm, hf_dir, n = padded
    drafter = open_decoder(DecoderSettings(draft=str(padded_draft), threads=1)).drafter
    assert drafter.vocab_size == n + PAD and drafter.vocab_real == n  # the tail the converter wrote
    ids = drafter.tokenize(TEXT)
    assert drafter.next_logits(ids).shape == (n,)  # the padding rows (4x the common ones) are never drawn
    target = load_target(str(hf_dir), "torch", device="cpu", dtype="float32", threads=1, max_sequences=4)
    assert target.vocab_hash == drafter.vocab_hash
    with ThreadedServer(lambda cfg: Verifier(target, cfg), max_context=512) as server:
        runs = {}
        for mode, kind, temperature in (("ar", "none", 0.0), ("sd", "full", 0.0), ("sd", "full", 1.5)):
            # full: the q of every drafted token is a row of the agreed width, which the verifier checks
            settings = DecoderSettings(verifier=server.url, exits="", payload=kind)
            dec = open_decoder(settings, drafter)
            try:
                params = SamplingParams(temperature=temperature, seed=5)
                gen = dec.generate(ids, mode=mode, max_tokens=MAX_TOKENS, gamma=4, params=params)
                assert dec.link.welcome.vocab_size == n
            finally:
                dec.close()
            runs[(mode, temperature)] = gen.token_ids
    assert runs[("sd", 0.0)] == runs[("ar", 0.0)]  # exact: the target's own greedy ids
    assert max(max(r) for r in runs.values()) < n


def test_the_exits_of_a_padded_target_score_its_real_vocabulary_alone(padded, tmp_path):
    """An early exit's full-vocabulary row is the agreed vocabulary's: a [PAD] row (here 4x the common ones,
    so it would win) never becomes an exit's token, which the robot would refuse as outside the vocabulary."""
    import torch

    from server_bridge.config import ServerConfig
    from server_bridge.engines.exits_torch import ExitHeads
    from server_bridge.exit_setup import load_exits
    from server_bridge.exits import ExitConfig
    from server_bridge.target import load_target

    vlm, hf_dir, n = padded
    target = load_target(str(hf_dir), "torch", device="cpu", dtype="float32", threads=1, max_sequences=2)
    heads = ExitHeads(ExitConfig([1], target.engine.hidden_size, rank=4, target=target.name))
    heads.save(tmp_path / "exits")
    scorer = load_exits(ServerConfig(exits=str(tmp_path / "exits"), exit_layers=[1]), target)
    hidden = torch.randn(3, target.engine.hidden_size)
    row = scorer.heads.logits(target.engine.model, 1, hidden)  # [3, vocab]
    assert row.shape == (3, n)
    unmasked = hidden @ target.engine.model.get_output_embeddings().weight.T  # [3, n + PAD]
    assert unmasked.shape[1] == n + PAD
