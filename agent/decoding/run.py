"""One generation's state (`Run`): made by EdgeDecoder.generate, handed to every round, dropped when it returns.

The EdgeDecoder itself keeps only what spans generations (the drafter, the link and its sessions, the
cost estimates); everything here is one prompt's: the committed ids, the grammar's walk over them,
the images, the payload, the draft policy's per-generation controller and the metrics.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from protocol import wire
from protocol.images import ImageError, PromptImage, check_offered
from protocol.payload import PayloadSpec
from protocol.sampling import SamplingParams
from protocol.structured import ConstraintState, Vocabulary

from .link import ProtocolViolation, ServerError
from .metrics import Metrics
from .policy import DraftController
from .report import RoundReport, StreamReport


class GrammarWalk:
    """The draft's walk of a generation's grammar over the committed ids, which only grow.

    `grammar` is the wire's: one of protocol.wire.GRAMMAR_KINDS with its text ({"json_schema": text},
    {"lark": text} or {"gbnf": text}), compiled by LLGuidance over the draft's vocabulary as the server compiles it
    over the target's (protocol/structured.py)."""

    def __init__(self, grammar: dict[str, str], start: int, prompt_ids: list[int], vocab: Vocabulary) -> None:
        if not 0 <= start <= len(prompt_ids):
            raise ValueError(f"grammar_from {start} lies outside the prompt of {len(prompt_ids)} tokens")
        if len(grammar) != 1 or not set(grammar) <= set(wire.GRAMMAR_KINDS):
            raise ValueError(
                f"a grammar is one of {', '.join(wire.GRAMMAR_KINDS)} with its text, not {sorted(grammar)}"
            )
        self.kind = next(iter(grammar))
        self.wire: dict[str, str | int] = {**grammar, "from": start}  # Open.grammar
        # GrammarError (SchemaError) when it does not compile or the prompt's constrained part leaves it
        self.state: ConstraintState = vocab.for_wire(grammar).walk(prompt_ids[start:])
        self.pos = len(prompt_ids)  # the state is the walk over committed[:pos]

    def at(self, committed: list[int]) -> ConstraintState:
        """The state after `committed`, walked on from where it was. A token the grammar forbids means the
        verifier did not apply it: GrammarError."""
        for t in committed[self.pos :]:
            self.state.accept(t)
        self.pos = len(committed)
        return self.state

    def check(self, committed: list[int], new: list[int], stops: set[int], what: str) -> None:
        """`new` (to follow committed) must be what the grammar allows: the verifier masks the target with it.
        Walks the state on past them (up to a stop id, where the generation ends), or raises
        ProtocolViolation and leaves it as it was."""
        state = self.at(committed)
        end = next((i + 1 for i, t in enumerate(new) if t in stops), len(new))
        walk = state.clone() if end > 1 else state  # accept() leaves the state as it was when it refuses
        if walk.advance(new[:end]) < end:
            raise ProtocolViolation(f"{what} leave the grammar the session is constrained by: {new[:end]}")
        self.state, self.pos = walk, len(committed) + end


class Run:
    """One generation: its request, what it has committed so far, and its per-generation helpers."""

    def __init__(
        self,
        prompt_ids: list[int],
        mode: str,
        max_tokens: int,
        params: SamplingParams,
        gamma: int,
        session: str | None,
        until: Callable[[list[int]], bool] | None,
        spec: PayloadSpec,
    ) -> None:
        self.mode = mode
        self.max_tokens = max_tokens
        self.params = params
        self.gamma = gamma  # the draft policy's starting (fixed: only) length
        self.session = session  # a named server session kept open after the generation; None: a fresh one
        self.until = until
        self.spec = spec  # this generation's uplink payload (none when greedy)
        self.n_prompt = len(prompt_ids)
        self.committed = list(prompt_ids)  # the prompt and every token the target committed after it
        self.rng = np.random.default_rng(params.seed)
        self.m = Metrics(payload=str(spec) if mode in ("sd", "fsd") else "none")  # ar and local send no q
        self.grammar: GrammarWalk | None = None
        self.images: list[PromptImage] = []  # the prompt's images
        self.image_bytes = True  # the next open sends their bytes (else their sha256)
        self.owed: int | None = None  # split: the correction drawn here and not yet sent
        self.exit_layers: list[int] = []  # the exits the open session asked for (hints from others break it)
        self.controller: DraftController | None = None  # the draft policy's, made at the first open (SD, FSD)
        self.last_round: tuple[int, tuple[int, ...]] | None = None  # FSD: whose next draft is pre-drafted
        self._checked = 0  # output lengths `until` was asked about

    def generated(self) -> list[int]:
        return self.committed[self.n_prompt :]

    def remaining(self) -> int:
        """Tokens this generation may still commit."""
        return self.max_tokens - len(self.committed) + self.n_prompt

    def finished(self, stops: set[int]) -> list[int] | None:
        """The output when the generation is over (a stop id, `until`, max_tokens), else None."""
        out = self.generated()
        stop = next((i for i, t in enumerate(out) if t in stops), None)
        if stop is not None:  # SD can commit tokens past a stop id in one round
            out = out[: stop + 1]
        cut = self.cut(out)
        if cut is not None:
            return out[:cut]
        if stop is not None:
            return out
        if len(out) >= self.max_tokens:
            return out[: self.max_tokens]
        return None

    def cut(self, out: list[int]) -> int | None:
        """The shortest length at which `until` holds, checking only lengths not checked before."""
        if self.until is None:
            return None
        for n in range(self._checked + 1, len(out) + 1):
            if self.until(out[:n]):
                return n
        self._checked = len(out)
        return None

    def grammar_at(self) -> ConstraintState | None:
        """The grammar's state after the committed ids; None without a grammar."""
        return None if self.grammar is None else self.grammar.at(self.committed)

    def check(self, new: list[int], stops: set[int], what: str) -> None:
        """Under a grammar, tokens the target committed must be what it allows: else ProtocolViolation."""
        if self.grammar is not None:
            self.grammar.check(self.committed, new, stops, what)

    def commit(self, new: list[int], stops: set[int], what: str) -> None:
        """Append tokens the target committed, checked against the grammar first (ProtocolViolation)."""
        self.check(new, stops, what)
        self.committed.extend(new)

    def apply(self, report: RoundReport, stops: set[int]) -> bool:
        """Write one round's report to this generation: the one place a verify round reaches the committed ids,
        the metrics and the draft policy. True when the policy (AS2) has just turned speculation off.

        Its costs count whether it was verified or not. Its result is committed first (under a grammar, checked
        first: ProtocolViolation, and nothing of the result is committed or counted), then counted and told to the
        policy."""
        m = self.m
        m.draft_ms += report.draft_ms
        m.round_bytes_up += report.bytes_up
        m.round_bytes_down += report.bytes_down
        m.exits_received += report.exits
        if report.predraft:
            m.predraft_hits += report.predraft == "hit"
            m.predraft_misses += report.predraft != "hit"
            m.predraft_failures += report.predraft == "failed"
        if report.committed is None:
            return False
        self.commit(list(report.committed), stops, f"the tokens committed by round {report.number}")
        self.owed = report.owed
        if report.mode == "fsd":
            self.last_round = (report.number, report.committed)
        m.residuals += report.owed is not None
        m.rounds += 1
        m.drafted += report.drafted
        m.accepted += report.accepted
        m.wasted_draft_tokens += report.drafted - report.accepted
        m.verify_ms += report.verify_ms
        m.network_ms += max(0.0, report.rtt_ms - report.verify_ms)
        m.target_forward_passes += report.passes
        m.exit_layer_sum += report.exit_layer
        m.exit_ms += report.exit_ms
        ctl = self.controller
        if ctl is None:
            raise ValueError(f"round {report.number} verified before the draft policy was made")
        network_ms = report.rtt_ms - report.verify_ms
        if not ctl.observe(
            report.number, report.drafted, report.accepted, report.draft_ms, report.verify_ms, network_ms
        ):
            return False
        ctl.switched("ar", m.rounds, len(self.committed))
        return True

    def apply_stream(self, report: StreamReport) -> None:
        """Write what a target-only stream cost to this generation's metrics (its tokens are committed already), and
        AS2's switch back to speculating to the draft policy."""
        m = self.m
        m.rounds += report.rounds
        m.streamed_tokens += report.streamed
        m.target_forward_passes += report.passes
        m.verify_ms += report.verify_ms
        m.network_ms += report.network_ms
        if report.speculate and self.controller is not None:
            self.controller.switched("sd", m.rounds, len(self.committed))

    def open_images(self, welcome: wire.Welcome, marker: int | None, sid: str) -> list[PromptImage]:
        """The images as an open sends them; ServerError before sending when the verifier cannot read them."""
        if not self.images:
            return []
        offered = welcome.limits.get("images")
        if not isinstance(offered, dict):
            raise ServerError(
                "no_vision",
                f"the verifier ({welcome.target}) reads text only: serve a "
                "vision-language target (--mmproj) or send no images",
                sid,
            )
        if offered.get("marker") != marker:
            raise ServerError(
                "vocab_mismatch",
                f"the verifier's image marker is {offered.get('marker')}, the "
                f"draft's {marker}: not the same vision-language pair",
                sid,
            )
        try:  # the verifier's own bounds, before anything is sent
            check_offered(self.images, offered)
        except ImageError as e:
            raise ServerError("bad_image", str(e), sid) from None
        if self.image_bytes:
            return list(self.images)
        return [PromptImage(im.at, im.sha256) for im in self.images]
