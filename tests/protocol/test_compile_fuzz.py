"""A fuzzer of the compile path of both sides: random schemas and grammars within the caps, built to be deep, wide
and recursive (tools/schemas/hostile.py: reference chains, nested combinators, long alternations, long and nested
regexes, `%json` in Lark, issue 50's attacks among them), through the robot's Drafter and the verifier's target as
each compiles an open's grammar. Every answer is a compile or a typed refusal, within its deadline; nothing
crashes this process; the seed reproduces a failure (EDGESPEC_FUZZ_SEED, EDGESPEC_FUZZ_CASES)."""

from __future__ import annotations

import os
import time

import pytest

from protocol import structured
from protocol.grammar import GrammarError
from tools.schemas.hostile import Fuzz

SEED = int(os.environ.get("EDGESPEC_FUZZ_SEED", "50"))
CASES = int(os.environ.get("EDGESPEC_FUZZ_CASES", "150"))  # per side: ~10-30 s here
BUDGET_S = 90.0  # the whole run of one side stops here, whatever CASES says
# One answer's bound: a turn (the fuzzer is one peer, so it may wait for the worker its last runaway killed to be
# back: ~0.5 s here), the worker's deadline, then this process's compile of what passed there.
ANSWER_S = 2 * structured.COMPILE_TIMEOUT_S + 3.0


@pytest.mark.real
@pytest.mark.parametrize("side", ["robot", "server", "server, chain bound lifted"])
def test_random_grammars_compile_or_are_refused_in_time_on_each_side(side, request, monkeypatch):
    """With the chain bound lifted, the attacks reach the workers and crash them: the worker pool, not the bound,
    is what keeps the process alive."""
    if "lifted" in side:
        monkeypatch.setattr(structured, "MAX_REFERENCE_CHAIN", 10**6)
    if side == "robot":  # as the Client compiles a request's grammar (agent/client.py)
        compile_one = request.getfixturevalue("drafter").grammars.for_wire
    else:  # as the verifier compiles an open's (server_bridge/opens.py)
        compile_one = request.getfixturevalue("target").grammar
    fuzz = Fuzz(SEED + len(side))
    outcomes: dict[str, int] = {}
    slow = []
    t_start = time.monotonic()
    for i in range(CASES):
        if time.monotonic() - t_start > BUDGET_S:
            break
        kind, text = fuzz.case()
        t0 = time.monotonic()
        try:
            constraint = compile_one({kind: text}, "fuzz")
            constraint.start().mask()  # its first mask, taken again here
            outcome = "compiled"
        except GrammarError as e:
            outcome = "refused: " + _reason(str(e))
        took = time.monotonic() - t0
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
        if took > ANSWER_S:
            slow.append(f"case {i} ({kind}, {len(text)} bytes, seed {SEED}): {took:.2f} s, {outcome}")
    print(f"{side}: {sum(outcomes.values())} cases: {outcomes}")
    assert not slow, "answers past their deadline:\n" + "\n".join(slow)
    assert outcomes.get("compiled", 0) >= sum(outcomes.values()) // 4, outcomes  # the fuzzer is not all refusals
    assert any(k.startswith("refused") for k in outcomes), outcomes
    if "lifted" in side:
        assert outcomes.get("refused: crashed", 0) > 0, outcomes


def _reason(message: str) -> str:
    """A refusal's kind, for the tally: its first words."""
    for words in (
        "chain",
        "crashed",
        "to compile and was stopped",
        "repeats",
        "cannot be enforced",
        "does not compile",
    ):
        if words in message:
            return words
    return message[:40]
