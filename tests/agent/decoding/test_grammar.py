"""Answers under the NaVILA grammar, on both sides, exactly (protocol/structured.py).

The robot's draft and the server's target each compile the same GBNF over their own GGUF's
vocabulary. These tests check that both sides mask identically at every position of recorded
answers, that every decoding mode and payload yields the target's own masked greedy ids at
T = 0, and that at T > 0 the committed token follows the masked, renormalised target.
"""

import json

import numpy as np
import pytest
from scipy import stats

from agent.decoding import DecoderSettings, open_decoder
from agent.robot.actions import VOCABULARY, answer_grammar, answer_max_tokens, parse_action
from protocol import payload, sampling, wire
from protocol.grammar import GrammarError
from protocol.payload import PayloadSpec
from protocol.sampling import SamplingParams
from server_bridge.config import ServerConfig
from server_bridge.verifier import Verifier

pytestmark = pytest.mark.real

GBNF = answer_grammar()
TASKS = [
    ("go to the red box", "red box 35 degrees to the left, 2.1 m away"),
    ("go to the blue ball", "nothing"),
    ("go to the green box", "green box ahead, 0.4 m away"),
]
# answers as a model writes them (the shapes of agent/app/prompt.py's examples), one per kind of action
RECORDED = [
    "The red box is to the left, so I turn left. The next action is turn left 30 degree.",
    "I do not see the blue ball, so I look around. The next action is turn right 45 degree.",
    "The green box is within reach, so I stop. I think I should stop because I have finished the instruction.",
    "The box is ahead, so I move forward. The next action is move forward 75 cm.",
]


def prompt(drafter, task, seen):
    return drafter.tokenize(
        drafter.apply_chat_template(
            [
                {"role": "system", "content": "You are a robot. Give one reason, then one action."},
                {"role": "user", "content": f"Task: {task}.\nCamera: {seen}."},
            ]
        )
    )


def target_greedy(target, ids, max_tokens, grammar=None):
    """The reference: the target alone, one token at a time, argmax of its logits under the grammar."""
    state = target.new_state(ids)
    walk = target.grammar(grammar or {"gbnf": GBNF}).start()
    out = []
    for _ in range(max_tokens):
        token = walk.argmax(target.score(state, [])[0])
        out.append(token)
        if token in target.eos_ids:
            break
        walk.accept(token)
        target.commit(state, [token], len(state.ids))
    return out


@pytest.fixture(scope="module")
def grammar_server(target):
    from tests.conftest import ThreadedServer

    with ThreadedServer(lambda cfg: Verifier(target, cfg)) as server:
        yield server


@pytest.fixture(scope="module")
def references(drafter, target):
    return [target_greedy(target, prompt(drafter, *t), answer_max_tokens()) for t in TASKS]


def test_both_sides_mask_the_same_at_every_position_of_recorded_answers(drafter, target):
    """The draft's Q4_1 GGUF and the target's F32 GGUF, each through LLGuidance."""
    robot, server = drafter.grammars.compile("gbnf", GBNF), target.grammar({"gbnf": GBNF})
    positions = 0
    for text in RECORDED:
        ids = drafter.tokenize(text) + sorted(drafter.eos_ids)
        a, b = robot.start(), server.start()
        for t in ids:
            ma, mb = a.mask(), b.mask()
            assert np.array_equal(ma, mb)
            assert ma[t], f"{drafter.detokenize([t])!r} of a recorded answer is masked out"
            assert 0 < ma.sum() < len(ma)
            a.accept(t)
            b.accept(t)
            positions += 1
    assert positions > 60


def test_the_grammar_admits_every_navila_sentence_and_nothing_after_it(drafter):
    g = drafter.grammars.compile("gbnf", GBNF)
    for action in VOCABULARY:
        state = g.walk(drafter.tokenize(f"I see it. {action.text}"))
        allowed = set(np.flatnonzero(state.mask()).tolist())
        assert drafter.eos_ids <= allowed and len(allowed) <= 4  # complete: only end-of-generation ids
    with pytest.raises(GrammarError):
        g.walk(drafter.tokenize("I see it. The next action is move forward 1 m."))
    with pytest.raises(GrammarError):
        drafter.grammars.compile("gbnf", "root ::= (")


@pytest.mark.parametrize(
    "mode,gamma,kind",
    [
        ("ar", 0, "none"),
        ("sd", 2, "none"),
        ("sd", 4, "none"),
        ("sd", 4, "full"),
        ("sd", 4, "topk"),
        ("sd", 4, "split"),
        ("fsd", 4, "none"),
    ],
)
def test_every_mode_and_payload_gives_the_targets_constrained_greedy_ids(
    drafter, grammar_server, references, mode, gamma, kind
):
    dec = open_decoder(DecoderSettings(verifier=grammar_server.url, payload=kind, exits=""), drafter)
    try:
        for task, ref in zip(TASKS, references, strict=True):
            gen = dec.generate(
                prompt(drafter, *task), mode=mode, gamma=gamma, max_tokens=answer_max_tokens(), grammar=GBNF
            )
            assert gen.token_ids == ref
            assert parse_action(gen.text).how == "exact"
    finally:
        dec.close()


BOXES = {  # the schema of tests/agent/app/test_openai_api.py, as the Python API sends it
    "type": "object",
    "properties": {"colour": {"enum": ["red", "green", "blue"]}, "count": {"type": "integer", "minimum": 0}},
    "required": ["colour", "count"],
    "additionalProperties": False,
}


def test_a_json_schema_gives_the_targets_constrained_greedy_ids_in_every_mode(drafter, target, grammar_server):
    """A schema travels as itself ({"json_schema": text}) and both sides compile it with LLGuidance: AR, SD and
    FSD (pre-drafting under it) commit the target's own masked greedy ids, and the answer validates."""
    import json

    from agent.client import schema_grammar

    sent = schema_grammar(BOXES)
    ids = drafter.tokenize(
        drafter.apply_chat_template([{"role": "user", "content": "How many red boxes are there? Answer in JSON."}])
    )
    ref = target_greedy(target, ids, 32, sent)
    dec = open_decoder(DecoderSettings(verifier=grammar_server.url, exits=""), drafter)
    try:
        for mode in ("ar", "sd", "fsd"):
            gen = dec.generate(ids, mode=mode, gamma=4, max_tokens=32, grammar=sent)
            assert gen.token_ids == ref, mode
    finally:
        dec.close()
    answer = json.loads(drafter.detokenize(ref, skip=drafter.eos_ids))
    assert answer["colour"] in ("red", "green", "blue") and set(answer) == {"colour", "count"}


@pytest.mark.parametrize("mode", ["sd", "fsd"])
@pytest.mark.parametrize("kind", ["full", "topk", "split"])
def test_sampled_answers_under_the_grammar_always_parse_and_sd_replays_its_seed(
    weak_drafter, grammar_server, mode, kind
):
    """T = 1 with the weaker draft (rejections common, split's residuals drawn on the robot): every answer is
    one reason and one NaVILA sentence, and in sd the same seed gives the same ids."""
    dec = open_decoder(
        DecoderSettings(verifier=grammar_server.url, payload=kind, topk=16, exits=""),
        weak_drafter,
    )
    try:
        for seed in range(2):
            params = SamplingParams(temperature=1.0, seed=seed)
            ids = prompt(weak_drafter, *TASKS[seed])
            runs = [
                dec.generate(ids, mode=mode, gamma=4, max_tokens=answer_max_tokens(), grammar=GBNF, params=params)
                for _ in range(2 if mode == "sd" else 1)
            ]
            for gen in runs:
                assert parse_action(gen.text).how == "exact", gen.text
            assert runs[0].token_ids == runs[-1].token_ids
            assert runs[0].metrics.payload.startswith(kind)
    finally:
        dec.close()


def test_local_generation_under_the_grammar_always_parses(drafter):
    dec = open_decoder(DecoderSettings(verifier=None), drafter)
    for task in TASKS:
        for seed in range(3):
            gen = dec.generate(
                prompt(drafter, *task),
                mode="local",
                max_tokens=answer_max_tokens(),
                grammar=GBNF,
                params=SamplingParams(temperature=1.5, seed=seed),
            )
            assert parse_action(gen.text).how == "exact", gen.text


@pytest.mark.parametrize("spec", [PayloadSpec("full"), PayloadSpec("topk", 2), PayloadSpec("split")], ids=str)
def test_sampled_verification_commits_the_masked_renormalised_target(drafter, target, spec):
    """Right after the reason sentence the grammar allows only the action sentences' first tokens, and the
    target's unmasked top 4 holds others. T = 1.5 with top-k 4 over the allowed ones: the committed token
    (accepted draft or residual correction) follows p' = norm(p * mask)."""
    params = SamplingParams(temperature=1.5, top_k=4, seed=3)
    answer = drafter.tokenize("The red box is to the left, so I turn left.")
    ids = prompt(drafter, *TASKS[0]) + answer
    n_prompt = len(ids) - len(answer)
    verifier = Verifier(target, ServerConfig())
    session, _ = verifier.open(
        wire.Open(
            "gstat",
            ids,
            {"temperature": 1.5, "top_k": 4, "seed": 3},
            payload=spec.to_wire(),
            grammar={"gbnf": GBNF, "from": n_prompt},
        ),
        1,
        None,
    )
    mask = session.grammar.mask()
    logits = target.score(session.state, [])[0]
    target.rewind(session.state, ids)
    p = sampling.probs_from_logits(logits, params, mask)
    assert not np.array_equal(p > 0, sampling.probs_from_logits(logits, params) > 0), "the mask changed nothing"
    support = np.flatnonzero(p)
    grammar = drafter.grammars.compile("gbnf", GBNF).walk(answer)
    rng = np.random.default_rng(5)
    firsts, rejected = [], 0
    for r in range(240):
        d = drafter.propose(ids, 1, params, rng, payload=spec, grammar=grammar)
        out = verifier.verify(session, wire.decode(wire.encode(wire.Verify("gstat", r, len(ids), d.ids, d.wire_q()))))
        token = out.verdict.token
        if out.residual is not None:  # split: the robot draws the correction
            res = wire.decode(wire.encode(wire.Result("gstat", r, 0, -1, len(ids), {}, out.residual))).residual
            token = payload.correction(res["logits"], res["ids"], d.q.row(0), params, rng)
        firsts.append(d.ids[0] if out.verdict.accepted else token)
        rejected += out.verdict.accepted == 0
        target.rewind(session.state, ids)
        session.grammar = target.grammar({"gbnf": GBNF}).walk(answer)  # the next round starts from the same prefix
        session.owed = None
    counts = np.array([firsts.count(t) for t in support])
    assert counts.sum() == len(firsts), "a token outside the masked top-k was committed"
    assert all(mask[t] for t in firsts)
    assert rejected > 0
    assert stats.chisquare(counts, p[support] * len(firsts)).pvalue > 1e-3


def test_a_bad_grammar_or_a_prompt_outside_it_is_refused_on_that_session_only(drafter, target):
    verifier = Verifier(target, ServerConfig())
    ids = prompt(drafter, *TASKS[0])
    greedy = {"temperature": 0.0, "top_k": 0, "seed": 0}
    with pytest.raises(wire.WireError, match="grammar"):
        verifier.open(wire.Open("g1", ids, greedy, grammar={"gbnf": "root ::= (", "from": len(ids)}), 1, None)
    for bad in ('{"oneOf": [{"required": ["a"]}, {"required": ["b"]}]}', '{"type": "bogus"}', "{"):
        with pytest.raises(wire.WireError, match="grammar") as e:
            verifier.open(wire.Open("g5", ids, greedy, grammar={"json_schema": bad, "from": len(ids)}), 1, None)
        assert e.value.code == "bad_field"
    with pytest.raises(wire.WireError, match="grammar"):
        verifier.open(wire.Open("g6", ids, greedy, grammar={"lark": "start: nowhere", "from": len(ids)}), 1, None)
    with pytest.raises(wire.WireError, match="not allowed"):
        verifier.open(wire.Open("g2", ids, greedy, grammar={"gbnf": GBNF, "from": len(ids) - 2}), 1, None)
    session, _ = verifier.open(wire.Open("g3", ids, greedy, grammar={"gbnf": GBNF, "from": len(ids)}), 1, None)
    assert session.grammar is not None
    with pytest.raises(wire.WireError):  # from past the prompt: refused by the wire's check
        wire.decode(wire.encode(wire.Open("g4", ids, greedy, grammar={"gbnf": GBNF, "from": len(ids) + 1})))


def test_a_robot_that_needs_a_grammar_refuses_a_verifier_without_one(drafter, grammar_server, monkeypatch):
    from agent.decoding.link import ServerError
    from server_bridge.target import Target

    monkeypatch.setattr(Target, "grammar_kinds", property(lambda self: ["gbnf"]))  # a server before LLGuidance
    dec = open_decoder(DecoderSettings(verifier=grammar_server.url), drafter)
    try:
        with pytest.raises(ServerError, match="json_schema"):
            dec.generate(prompt(drafter, *TASKS[0]), mode="sd", max_tokens=8, grammar={"json_schema": "{}"})
    finally:
        dec.close()
    monkeypatch.setattr(Target, "grammars_supported", property(lambda self: False))
    dec = open_decoder(DecoderSettings(verifier=grammar_server.url), drafter)
    try:
        with pytest.raises(ServerError, match="grammar"):
            dec.generate(prompt(drafter, *TASKS[0]), mode="sd", max_tokens=8, grammar=GBNF)
    finally:
        dec.close()


def test_the_torch_engine_masks_with_its_gguf_vocabulary_and_stays_exact(drafter, target, torch_target, references):
    """The torch engine runs the grammar on the vocabulary of the GGUF it was converted from (vocab only)."""
    a, b = target.grammar({"gbnf": GBNF}).start(), torch_target.grammar({"gbnf": GBNF}).start()
    for t in drafter.tokenize(RECORDED[0]):
        assert np.array_equal(a.mask(), b.mask())
        a.accept(t)
        b.accept(t)
    from tests.conftest import ThreadedServer

    with ThreadedServer(lambda cfg: Verifier(torch_target, cfg)) as server:
        dec = open_decoder(DecoderSettings(verifier=server.url), drafter)
        try:
            gen = dec.generate(
                prompt(drafter, *TASKS[0]), mode="sd", gamma=4, max_tokens=answer_max_tokens(), grammar=GBNF
            )
        finally:
            dec.close()
    assert gen.token_ids == references[0]


def test_llguidances_bounds_met_midway_are_that_sessions_bad_field(drafter, target):
    """An anyOf of two objects of 480 optional properties opens (its first mask is fine) and, one token in,
    passes LLGuidance's 2,000 items a parser row: the round is answered bad_field, naming the grammar, on that
    session alone; another session's round in the same verifier is verified as usual."""
    verifier = Verifier(target, ServerConfig())
    ids = prompt(drafter, *TASKS[0])
    greedy = {"temperature": 0.0, "top_k": 0, "seed": 0}

    def wide(prefix: str) -> dict:
        return {"type": "object", "properties": {f"{prefix}{i}": {"type": "integer"} for i in range(480)}}

    schema = json.dumps({"anyOf": [wide("p"), wide("q")]})
    session, _ = verifier.open(
        wire.Open("wide", ids, greedy, grammar={"json_schema": schema, "from": len(ids)}), 1, None
    )
    plain, _ = verifier.open(wire.Open("plain", ids, greedy), 1, None)
    draft = drafter.tokenize('{"p1": 1}')[:3]
    with pytest.raises(wire.WireError, match="grammar") as e:
        verifier.verify(session, wire.Verify("wide", 0, len(ids), draft, None))
    assert e.value.code == "bad_field" and "2000" in str(e.value)
    assert verifier.verify(plain, wire.Verify("plain", 0, len(ids), draft, None)).verdict is not None
