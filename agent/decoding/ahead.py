"""SD's next draft made while this round is verified, in the draft's own context (greedy rounds).

A round sends its draft and waits for the verdict: on the robot's one core the draft then idles for the server's
pass and the round trip. `draft_ahead` uses that wait: it takes the server's coming token to be the draft's own
choice after the draft (the masked argmax, under the grammar as the target will be) and drafts the next round from
there, before the reply is read (`VerifierLink.request(meanwhile=...)`). When the reply accepts the whole draft
and its token is that guess, the next round sends the draft made ahead at once (`Ahead.fits`); otherwise it
drafts as ever, from a KV the drafter rolls back to the committed prefix.

The output does not change: a draft is only a proposal, and a greedy draft is the same whenever it is drafted
(its tokens are the draft's argmax after the same ids). Sampled rounds (T > 0) draft nothing ahead: a draw made
ahead and thrown away would move the seeded generator, so a seeded generation would depend on its timings; so do
rounds a rejection predictor watches (it judges each token as it is drafted).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from protocol.payload import PayloadSpec
from protocol.sampling import SamplingParams
from protocol.structured import ConstraintState

from .drafter import Draft, Drafter

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Ahead:
    """The next round's draft, made after `after` (this round's committed ids, its draft and the guessed token)."""

    after: tuple[int, ...]
    draft: Draft

    def fits(self, committed: list[int]) -> bool:
        """Whether the round now starts where this draft was made: every token accepted and the guess right."""
        return len(committed) == len(self.after) and tuple(committed) == self.after


def draft_ahead(
    drafter: Drafter,
    committed: list[int],
    draft: Draft,
    k: int,
    params: SamplingParams,
    spec: PayloadSpec,
    grammar: ConstraintState | None,
    stops: set[int],
) -> Ahead | None:
    """Draft k tokens after committed + draft + the draft's own next token (module doc); None when no draft can
    follow (sampling, an empty draft, a stop drafted or guessed, a grammar that ends) or drafting failed (the
    next round then drafts as ever, and meets the failure there if it is one)."""
    if not params.greedy or k < 1 or not draft.ids or any(t in stops for t in draft.ids):
        return None
    seq = committed + draft.ids
    try:
        walk = None
        if grammar is not None:
            walk = grammar.clone()
            for t in draft.ids:
                walk.accept(t)
            if walk.is_accepting():  # the answer may end here: the target's next token may be its end
                return None
        logits = drafter.next_logits(seq)
        guess = int(np.argmax(logits)) if walk is None else walk.argmax(logits)
        if guess in stops:
            return None
        if walk is not None:
            walk.accept(guess)
        after = seq + [guess]
        nxt = drafter.propose(after, k, params, np.random.default_rng(0), payload=spec, grammar=walk)
    except Exception as e:  # only the head start is lost
        log.debug("drafting ahead failed: %s", e)
        return None
    return Ahead(tuple(after), nxt) if nxt.ids else None
