"""The greedy rule at an early exit, on toy heads whose exit logits are the hidden rows themselves (fast)."""

import logging

import numpy as np
import pytest

from server_bridge.exits import ExitPass, candidate_rows, first_rejection

V = 32  # vocabulary = hidden size: the LM head is the identity


class Lens:
    """An ExitScorer with exits at layers 2 and 3 whose logits are the hidden rows (identity norm and head)."""

    layers = [2, 3]

    def logits(self, layer, hidden, candidates=None):
        return hidden.copy() if candidates is None else np.take_along_axis(hidden, candidates, 1)


@pytest.fixture
def toy():
    return None, Lens()


def _softmax(x):
    e = np.exp(np.asarray(x) - np.max(x))
    return e / e.sum()


def _rows(*best, low=0.0, high=5.0):
    """hidden [n, V]: row i peaks at token best[i] (a dict {token: score} gives several scores)."""
    h = np.full((len(best), V), low, np.float32)
    for i, b in enumerate(best):
        for t, s in b.items() if isinstance(b, dict) else [(b, high)]:
            h[i, t] = s
    return h


def test_candidate_rows_add_the_draft_token_and_mask_repeats():
    ids, dup = candidate_rows(np.array([7, 3]), np.array([[9, 7, 1], [4, 4, 2]], np.int32))
    assert ids.tolist() == [[1, 7, 7, 9], [2, 3, 4, 4]]
    assert dup.tolist() == [[False, False, True, False], [False, False, False, True]]


def test_first_rejection():
    assert first_rejection(np.array([3, 5, 7]), np.array([3, 5, 9])) == 2
    assert first_rejection(np.array([3, 5, 7]), np.array([4, 5, 7])) == 0
    assert first_rejection(np.array([3, 5, 7]), np.array([3, 5, 7])) == 3
    assert first_rejection(np.array([], int), np.array([], int)) == 0


def test_rows_score_only_their_candidates_and_the_first_disagreement_decides(toy):
    model, heads = toy
    draft = [3, 5, 7]
    cands = np.array([[3, 10, 11], [12, 13, 14], [20, 21, 22]], np.int32)
    # row 1 peaks at 30 (not a candidate): among {12, 13, 14, 5} it prefers 13 over the drafted 5
    hidden = _rows(3, {30: 9.0, 13: 4.0, 5: 3.0}, 7, 8)
    v = ExitPass(heads, [2], draft, cands).score(2, hidden)
    assert (v.accepted, v.tokens) == (1, [3, 13])
    p = _softmax([0.0, 4.0, 0.0, 3.0])  # {12, 13, 14, 5}; the duplicate 3 in row 0
    assert v.confidence == pytest.approx(float(p.max()), rel=1e-5)


def test_without_candidates_a_row_scores_the_whole_vocabulary(toy):
    model, heads = toy
    v = ExitPass(heads, [2], [3, 5], None).score(2, _rows(3, 30, 8))
    assert (v.accepted, v.tokens) == (1, [3, 30])


def test_the_bonus_row_pays_the_full_head_once_then_scores_its_top_ids(toy, monkeypatch):
    model, heads = toy
    calls = []
    real = heads.logits
    monkeypatch.setattr(
        heads, "logits", lambda l, h, c=None: calls.append((l, None if c is None else c.shape)) or real(l, h, c)
    )
    probe = ExitPass(heads, [2, 3], [3, 5], np.array([[3, 1], [5, 1]], np.int32), bonus_candidates=4)
    first = probe.score(2, _rows(3, 5, {25: 6.0, 26: 5.0, 27: 4.0, 28: 3.0, 29: 2.0}))
    assert (first.accepted, first.tokens) == (2, [3, 5, 25])
    # at the next exit token 29 would win over the full vocabulary, but it is not among the first exit's top 4
    second = probe.score(3, _rows(3, 5, {29: 9.0, 26: 5.0, 27: 4.0}))
    assert second.tokens == [3, 5, 26]
    assert calls == [(2, (2, 3)), (2, None), (3, (2, 3)), (3, (1, 4))]


def test_an_empty_draft_is_all_bonus_row(toy):
    model, heads = toy
    v = ExitPass(heads, [2], [], np.zeros((0, 4), np.int32)).score(2, _rows(17))
    assert (v.accepted, v.tokens) == (0, [17])


def test_taps_emit_only_a_changed_verdict_and_time_themselves(toy):
    model, heads = toy
    sent = []
    probe = ExitPass(heads, [2, 3], [3], None, emit=sent.append)
    probe.taps[2](_rows(3, 8))
    probe.taps[3](_rows(3, 8))  # same verdict: not sent again
    assert [v.tokens for v in probe.verdicts] == [[3, 8], [3, 8]]
    assert [(v.layer, v.tokens) for v in sent] == [(2, [3, 8])]
    assert probe.agreeing_layer([3, 8]) == 2 and probe.agreeing_layer([9]) is None
    assert probe.ms > 0


def test_a_failing_exit_is_logged_once_and_the_rest_of_the_pass_skips_exits(toy, monkeypatch, caplog):
    model, heads = toy
    monkeypatch.setattr(heads, "logits", lambda *a, **k: 1 / 0)
    probe = ExitPass(heads, [2, 3], [3], None, emit=lambda v: None)
    with caplog.at_level(logging.ERROR, logger="server_bridge.exits"):
        probe.taps[2](_rows(3, 8))  # does not raise
        probe.taps[3](_rows(3, 8))
    assert probe.failed and probe.verdicts == []
    assert len(caplog.records) == 1 and "layer 2" in caplog.records[0].getMessage()


def test_an_emit_that_raises_does_not_escape(toy):
    model, heads = toy

    def emit(v):
        raise RuntimeError("loop closed")

    probe = ExitPass(heads, [2], [3], None, emit=emit)
    probe.taps[2](_rows(3, 8))
    assert probe.failed
