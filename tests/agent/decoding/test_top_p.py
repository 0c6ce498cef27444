"""Nucleus (top_p) sampling end to end on the real models: every token committed at temperature > 0 with
top_p = 0.5 lies in the target's own nucleus, on both engines (numpy and device maths), for every mode."""

import numpy as np
import pytest

from agent.decoding import DecoderSettings, open_decoder
from protocol import sampling
from protocol.sampling import SamplingParams

pytestmark = pytest.mark.real

PARAMS = SamplingParams(temperature=1.0, seed=4, top_p=0.5)
SLACK = 1e-3  # a separate pass may round the logits a little differently from the verification pass


@pytest.fixture(scope="module", params=["llamacpp", "torch"])
def engine_target(request):
    return request.getfixturevalue("target" if request.param == "llamacpp" else "torch_target")


@pytest.fixture(scope="module")
def server(engine_target):
    from server_bridge.verifier import Verifier
    from tests.conftest import ThreadedServer

    with ThreadedServer(lambda cfg: Verifier(engine_target, cfg)) as server:
        yield server


def _mass_above(target, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """For each generated token, the target's probability mass (T = 1, before top_p) strictly above its own:
    the token is in the nucleus of top_p exactly when that mass is below top_p."""
    state = target.new_state(prompt)
    try:
        logits = target.score(state, tokens[:-1])  # [n, vocab]: row i is the distribution of tokens[i]
    finally:
        target.free(state)
    p = sampling.probs_from_logits(logits, SamplingParams(temperature=PARAMS.temperature))
    chosen = p[np.arange(len(tokens)), tokens]
    return np.where(p > chosen[:, None], p, 0.0).sum(-1)


@pytest.mark.parametrize("mode, kind", [("sd", "split"), ("sd", "topk"), ("ar", "none")])
def test_every_committed_token_lies_in_the_targets_nucleus(weak_drafter, engine_target, server, mode, kind):
    """The weaker draft under T = 1 is rejected often, so corrections (split's residual drawn on the robot,
    topk's drawn on the server) and bonus tokens are all checked, not only accepted drafts."""
    dec = open_decoder(DecoderSettings(verifier=server.url, payload=kind, topk=16, exits=""), weak_drafter)
    prompt = weak_drafter.tokenize("Write a short poem about a robot in a kitchen.", chat=True)
    try:
        gen = dec.generate(prompt, mode=mode, gamma=4, max_tokens=24, params=PARAMS)
    finally:
        dec.close()
    tokens = gen.token_ids
    assert len(tokens) > 4
    above = _mass_above(engine_target, prompt, tokens)
    assert (above < PARAMS.top_p + SLACK).all(), f"tokens outside the target's nucleus: {above.round(3)}"
    if mode == "sd":
        assert gen.metrics.wasted_draft_tokens > 0  # rejections happened: corrections were drawn
        assert (gen.metrics.residuals > 0) == (kind == "split")


def test_edge_agent_generate_takes_top_p(make_server, capsys):
    """--top-p reaches the verifier (a seed replays the same tokens) and a bad one is refused before any model
    loads, saying what is wrong."""
    import json

    from agent.app import cli

    server = make_server()
    args = ["generate", "--verifier", server.url, "--prompt", "Name a colour.", "--chat", "--threads", "1"]
    args += ["--max-tokens", "8", "--temperature", "1.0", "--seed", "3", "--top-p", "0.5", "--json"]
    runs = []
    for _ in range(2):
        assert cli.main(args) == 0
        runs.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["token_ids"])
    assert runs[0] == runs[1] and len(runs[0]) > 0
    for bad in ("0", "1.5", "nan"):
        assert cli.main([*args[:-2], bad]) == 2
        assert "top_p must be a finite number in (0, 1]" in capsys.readouterr().err


def test_a_verifier_that_predates_top_p_is_refused_before_any_sampling(drafter):
    """A welcome without limits.top_p is from a server that would ignore sampling.top_p and sample the whole
    distribution: the robot refuses it with no_top_p rather than call that output the nucleus's."""
    from agent.decoding.link import ServerError
    from tests.agent.decoding.test_hostile_verifier import FakeVerifier  # its welcome is an older server's: no top_p

    ids = drafter.tokenize("Name a colour.", chat=True)
    with FakeVerifier(drafter) as fake:
        dec = open_decoder(DecoderSettings(verifier=fake.url), drafter)
        try:
            with pytest.raises(ServerError) as e:
                dec.generate(ids, mode="sd", max_tokens=4, params=PARAMS)
            assert e.value.code == "no_top_p" and "top_p" in e.value.message
            assert fake.opens == []  # refused before the open
            # the same verifier serves top_p = 1 (the whole distribution) as before
            gen = dec.generate(ids, mode="sd", max_tokens=4, params=SamplingParams(temperature=1.0, seed=4))
            assert gen.token_ids and len(fake.opens) == 1
        finally:
            dec.close()
