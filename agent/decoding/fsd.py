"""FSD's robot side, kept across generations (`FsdDrafts`): the pre-drafter, the early exits a session
asks for, each round's draft (pre-drafted, else drafted now) and the early-exit hints before its result.

The round itself (send, wait, check, report) is the EdgeDecoder's `_fsd_round`, reported as SD's is
(agent/decoding/report.py); what is here is what only FSD does (agent/decoding/predraft.py does the pre-drafting).
"""

from __future__ import annotations

import logging
import time

from protocol import wire

from . import replies
from .drafter import Draft, Drafter
from .link import VerifierLink
from .predraft import PreDrafter
from .run import Run
from .settings import FsdOptions

log = logging.getLogger(__name__)


class FsdDrafts:
    """FSD's drafts for the EdgeDecoder: the pre-drafter, made by the first FSD generation and kept."""

    def __init__(self, drafter: Drafter, options: FsdOptions, verify_timeout_s: float) -> None:
        self.drafter = drafter
        self.options = options
        self.verify_timeout_s = verify_timeout_s
        self.predrafter: PreDrafter | None = None

    def exit_layers(self, welcome: wire.Welcome) -> list[int]:
        """The early exits an FSD session asks for: those configured that the verifier has (None: all)."""
        offered, asked = welcome.exits, self.options.exits
        layers = list(offered) if asked is None else [l for l in asked if l in offered]
        if asked and len(layers) < len(asked):
            log.warning("the verifier has exits at %s; asked for %s, using %s", offered, asked, layers)
        return layers

    def ready(self) -> PreDrafter:
        """The pre-drafter: its own llama context, made once and kept across generations."""
        if self.predrafter is None:
            fsd = self.options
            self.predrafter = PreDrafter(
                self.drafter,
                workers=fsd.workers,
                policy=fsd.policy,
                n_cands=fsd.n_cands,
                threads=fsd.threads,
                guesses=fsd.guesses,
            )
        return self.predrafter

    def forget(self, run: Run) -> None:
        """Drop what was pre-drafted for the run's next round (its last round is not going on)."""
        run.last_round = None
        if self.predrafter is not None:
            self.predrafter.cancel()

    def close(self) -> None:
        if self.predrafter is not None:
            self.predrafter.close()
            self.predrafter = None

    def draft(self, run: Run, predrafter: PreDrafter, k: int) -> tuple[Draft, float, str]:
        """This round's draft of k tokens: pre-drafted for how the last round ended, else drafted now; with
        the ms the loop waited for it (a hit costs it ~nothing: T_p as the loop sees it) and the pre-draft's
        outcome (RoundReport.predraft: hit, miss, failed; "" without a last round)."""
        waited, outcome = 0.0, ""
        draft: Draft | None = None
        if run.last_round is not None:
            t1 = time.perf_counter()
            draft, hit = predrafter.take(*run.last_round)
            waited += (time.perf_counter() - t1) * 1e3  # what the loop waited for its draft
            outcome = "hit" if hit else "failed" if draft is None else "miss"
        grammar = run.grammar_at()
        if draft is not None and grammar is not None:
            # pre-drafted under the grammar (predraft.py), so this keeps it whole; a safeguard all the same: a prefix
            # of a draft is a valid draft (its tokens were drawn from the q sent with them)
            draft = draft.head(grammar.clone().advance(draft.ids))
        if draft is None or len(draft.ids) < k:
            n_cands = self.options.n_cands
            draft = self.drafter.propose(
                run.committed, k, run.params, run.rng, n_cands=n_cands, payload=run.spec, grammar=grammar
            )
            waited += draft.ms
        return draft.head(k), waited, outcome

    def deadline(self) -> float:
        """When the result of a round sent now is due (time.monotonic), however many hints come first."""
        return time.monotonic() + self.verify_timeout_s

    def next_reply(
        self,
        run: Run,
        link: VerifierLink,
        predrafter: PreDrafter,
        sid: str,
        number: int,
        draft: Draft,
        vocab: int,
        deadline: float,
    ) -> wire.Message:
        """The next reply to round `number`: an early-exit hint (checked, then offered to the pre-drafter), or
        the reply that ends the round (its result, which the round checks)."""
        reply = link.recv(sid=sid, timeout_s=max(0.0, deadline - time.monotonic()))
        if isinstance(reply, wire.Exit):
            replies.check_exit(reply, number, draft.ids, vocab, run.exit_layers)
            predrafter.offer(number, reply.layer, reply.tokens, reply.confidence)
        return reply
