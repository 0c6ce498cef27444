"""What one verify round did, as one immutable value (`RoundReport`).

An SD or FSD round (agent/decoding/decoder.py) drafts, sends, waits and checks the reply, and writes nothing of its
generation while it does: it returns a report of what was drafted, what the target committed (the checked reply),
what it cost (drafting, the round trip, the server's passes, the bytes on the link) and FSD's pre-draft and
early-exit figures. `Run.apply` (agent/decoding/run.py) is the one place a report is written to its generation: the
committed ids, the owed correction, FSD's next pre-draft key, the metrics and the draft policy, in one go. Two
generations whose rounds overlap (a chat answer and a navigation step sharing a draft model) each apply only their
own reports, in their own order, so their bookkeeping cannot interleave.

A target-only stream (the AR mode's, AS2's streaming phase: agent/decoding/streaming.py) commits each token as it
arrives, so a lost link keeps what came; what the stream cost is one `StreamReport`, applied by `Run.apply_stream`
when the stream ends or fails.

A round that fails (a lost link, a ServerError, a reply that breaks the protocol) is reported too, with
`committed` None: what it spent before it failed (its drafting, its bytes once a reply came, FSD's pre-draft outcome
and hints); nothing of it is committed and the draft policy is not told.
"""

from __future__ import annotations

from dataclasses import dataclass

PREDRAFT_OUTCOMES = ("", "hit", "miss", "failed")


@dataclass(frozen=True, slots=True)
class RoundReport:
    """One verify round of one generation: its draft, its checked result and its costs."""

    number: int  # the round's number in its generation (Metrics.rounds when it was sent)
    mode: str  # "sd" or "fsd" (FSD pre-drafts the next round after what this one committed)
    drafted: int  # k: draft tokens sent; can be zero
    draft_ms: float  # what the loop waited for its draft: drafting (SD, an FSD miss) or taking it (an FSD hit)
    bytes_up: int = 0  # the round's frames on the link, counted once its reply came
    bytes_down: int = 0  # the result, a split residual and FSD's exit hints
    predraft: str = ""  # hit | miss | failed (FSD's worker failed: a miss too); "": nothing was pre-drafted for it
    # (SD drafts ahead in the draft's own context during the last round's wait: agent/decoding/ahead.py)
    exits: int = 0  # FSD: early-exit hints received (and checked) before the result
    # the checked result; None: the round failed before it was checked, and nothing of it is committed
    committed: tuple[int, ...] | None = None  # draft[:accepted] + the target's next token (or the correction)
    accepted: int = 0  # draft tokens the target kept (<= drafted)
    owed: int | None = None  # split: the correction drawn here (committed[-1]), sent with the next request
    rtt_ms: float = 0.0  # from sending the draft to its result, as the loop waited
    verify_ms: float = 0.0  # server time in target forward passes
    passes: int = 0  # target forward passes the round cost the server
    exit_layer: int = 0  # FSD: the earliest exit that matched the result; 0: none did
    exit_ms: float = 0.0  # FSD: server time in early-exit heads (part of verify_ms)

    def __post_init__(self) -> None:
        if self.mode not in ("sd", "fsd") or self.predraft not in PREDRAFT_OUTCOMES:
            raise ValueError(f"a round of mode {self.mode!r} with pre-draft outcome {self.predraft!r}")
        if self.committed is not None and not (0 <= self.accepted <= self.drafted and self.committed):
            raise ValueError(f"round {self.number} accepts {self.accepted} of {self.drafted} and commits nothing")

    @property
    def verified(self) -> bool:
        """The round's result came and was checked (else it failed, and reports only what it spent)."""
        return self.committed is not None


@dataclass(frozen=True, slots=True)
class StreamReport:
    """What one target-only stream cost (its tokens are committed as they arrive): the AR mode's stream, each token
    a round, or a streaming phase of AS2 (`streamed`: tokens the target streamed while speculation was off)."""

    rounds: int = 0  # the AR mode's tokens: each one is a round
    streamed: int = 0  # AS2's streamed tokens (not rounds: tau counts the speculative rounds only)
    passes: int = 0  # target forward passes the server reported
    verify_ms: float = 0.0  # server time in them; 0 when the stream failed before it ended
    network_ms: float = 0.0  # the stream's wall time not explained by verify_ms; 0 likewise
    speculate: bool = False  # AS2 turned speculation back on during the phase (the next round is SD or FSD)
