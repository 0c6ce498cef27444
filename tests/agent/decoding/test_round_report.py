"""A verify round's result is one immutable report (agent/decoding/report.py) that `Run.apply` alone writes to its
generation: reports of two generations applied in interleaved order give each its own totals."""

import dataclasses
from itertools import zip_longest

import pytest

from agent.decoding import DecoderSettings, open_decoder
from agent.decoding.policy import DraftController, DraftPolicy
from agent.decoding.report import RoundReport
from agent.decoding.run import Run
from protocol.sampling import SamplingParams
from server_bridge.verifier import Verifier
from tests.conftest import ThreadedServer

pytestmark = pytest.mark.real

SPEC = DecoderSettings().payload_spec.for_params(SamplingParams())  # greedy: ids only
PROMPTS = [("Go to the kitchen and stop next to the red chair.", "sd"), ("def fibonacci(n):", "fsd")]
# every Metrics figure a verify round writes (through Run.apply and nowhere else)
ROUND_FIGURES = (
    "rounds",
    "drafted",
    "accepted",
    "wasted_draft_tokens",
    "residuals",
    "draft_ms",
    "verify_ms",
    "network_ms",
    "round_bytes_up",
    "round_bytes_down",
    "predraft_hits",
    "predraft_misses",
    "predraft_failures",
    "exits_received",
    "exit_layer_sum",
    "exit_ms",
)


@pytest.fixture(scope="module")
def reported(drafter, target):
    """Two real generations (SD, FSD) on one decoder, with the reports each applied, in order."""
    with ThreadedServer(lambda cfg: Verifier(target, cfg)) as server:
        return _generate_recording(drafter, server.url)


def _generate_recording(drafter, url):
    applied: list[tuple[Run, RoundReport]] = []
    real_apply = Run.apply

    def recording(run: Run, report: RoundReport, stops: set[int]) -> bool:
        applied.append((run, report))
        return real_apply(run, report, stops)

    dec = open_decoder(DecoderSettings(verifier=url, gamma=4), drafter)
    Run.apply = recording  # type: ignore[method-assign]
    try:
        gens = []
        for text, mode in PROMPTS:
            prompt = drafter.tokenize(text)
            gens.append((prompt, dec.generate(prompt, mode=mode, max_tokens=20)))
        limit = dec.link.welcome.limits["max_draft_len"]
        stops = dec.stop_ids()
    finally:
        Run.apply = real_apply  # type: ignore[method-assign]
        dec.close()
    runs = list(dict.fromkeys(run for run, _ in applied))
    assert len(runs) == 2
    return [(p, g, [r for run, r in applied if run is runs[i]]) for i, (p, g) in enumerate(gens)], limit, stops


def test_two_generations_reports_applied_interleaved_give_each_its_own_totals(drafter, reported):
    """The rounds of an SD and an FSD generation, applied to fresh runs alternately (as two generations sharing a
    draft model would interleave them): each run commits its own generation's ids and adds up to its figures."""
    generations, limit, stops = reported
    fresh = []
    for prompt, gen, reports in generations:
        assert len(reports) == gen.metrics.rounds >= 2
        run = Run(prompt, gen.mode, 20, SamplingParams(), 4, None, None, SPEC)
        run.controller = DraftController(DraftPolicy(), 4, limit)
        fresh.append(run)
    (_, _, a), (_, _, b) = generations
    for ra, rb in zip_longest(a, b):
        for run, report in ((fresh[0], ra), (fresh[1], rb)):
            if report is not None:
                run.apply(report, stops)
    for run, (_, gen, _) in zip(fresh, generations, strict=True):
        assert run.finished(stops) == gen.token_ids
        for name in ROUND_FIGURES:
            assert getattr(run.m, name) == getattr(gen.metrics, name), name
        assert run.controller is not None and run.controller.lengths == gen.metrics.draft_lengths
    fsd = generations[1][1].metrics
    assert fsd.predraft_hits + fsd.predraft_misses == fsd.rounds - 1  # the FSD run's pre-draft outcomes came along


def test_a_round_report_is_immutable(reported):
    """A report cannot be changed once made: what a round did is fixed before its generation sees it."""
    ((_, _, reports), _), _, _ = reported
    report = reports[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.accepted = report.drafted  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.committed = ()  # type: ignore[misc]
    assert isinstance(report.committed, tuple) and hash(report) == hash(dataclasses.replace(report))
    with pytest.raises(ValueError):
        dataclasses.replace(report, accepted=report.drafted + 1)  # more accepted than drafted is no round


def test_a_failed_round_counts_what_it_spent_and_commits_nothing(drafter, reported):
    """A round whose link dropped after the reply came (or whose reply broke the protocol) reports its drafting, its
    bytes and FSD's outcome: they count, nothing of it is committed and the draft policy is not told."""
    ((prompt, _, _), _), limit, stops = reported
    run = Run(prompt, "fsd", 20, SamplingParams(), 4, None, None, SPEC)
    run.controller = DraftController(DraftPolicy(), 4, limit)
    failed = RoundReport(0, "fsd", 4, 3.5, bytes_up=40, bytes_down=30, predraft="miss", exits=1)
    assert not failed.verified and run.apply(failed, stops) is False
    assert run.committed == prompt and run.m.rounds == run.m.drafted == 0 and run.controller.lengths == {}
    assert (run.m.draft_ms, run.m.round_bytes_up, run.m.round_bytes_down) == (3.5, 40, 30)
    assert (run.m.predraft_misses, run.m.predraft_hits, run.m.exits_received) == (1, 0, 1)
