"""The verifier on the real models: at T > 0 the committed token follows the target's distribution."""
import numpy as np
import pytest
from scipy import stats

from server_bridge import sampling, wire
from server_bridge.config import ServerConfig
from server_bridge.sampling import SamplingParams
from server_bridge.verifier import Verifier

pytestmark = pytest.mark.real


def test_real_draft_and_target_commit_the_targets_distribution(drafter, target):
    """Draft one token (real Q4_1 q), verify it (real f32 p), over and over from the same prefix.

    T = 1.5 and top-k 4 keep the support small and make the two models disagree
    often, so both the accept path and the residual path are exercised.
    """
    params = SamplingParams(temperature=1.5, top_k=4, seed=11)
    ids = drafter.tokenize("The robot turned", chat=False)
    verifier = Verifier(target, ServerConfig())
    session, _ = verifier.open(wire.Open("stat", ids, {"temperature": 1.5, "top_k": 4, "seed": 11}), 1, None)
    p = sampling.probs_from_logits(target.score(session.state, [])[0], params)      # [vocab]
    target.rewind(session.state, ids)
    support = np.flatnonzero(p)
    assert len(support) == 4

    rng = np.random.default_rng(5)
    firsts, rejected = [], 0
    for r in range(240):
        d = drafter.propose(ids, 1, params, rng)
        verdict, _ = verifier.verify(session, wire.Verify("stat", r, len(ids), d.ids,
                                                          {"kind": "full", "probs": d.q}))
        firsts.append(d.ids[0] if verdict.accepted else verdict.token)
        rejected += verdict.accepted == 0
        target.rewind(session.state, ids)                   # the next round starts from the same prefix
    counts = np.array([firsts.count(t) for t in support])
    assert counts.sum() == len(firsts), "a token outside the target's top-k was committed"
    assert rejected > 0                                     # the residual path really ran
    assert stats.chisquare(counts, p[support] * len(firsts)).pvalue > 1e-3
