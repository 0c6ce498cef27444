"""The robot trusts nothing it receives: every verifier reply is checked here before the decoder
commits any of it or hands one of its token ids to llama.cpp (DESIGN.md, Trust).

protocol/wire.py has already checked each field's type and bounds (ids >= 0, a residual's byte
layout). What only the robot knows is checked here: the vocabulary the handshake agreed (the
welcome's and the draft's own, `vocab`) and what was asked (the round, the draft, how many tokens an
`ar` asked for). A reply that fails raises ProtocolViolation, a LinkLost: the decoder drops the link
and goes on exactly as for a lost one (reconnect, re-open with the committed prefix, in the end the
robot's offline mode). Nothing of a bad reply is committed; a malformed reply is never a crash.

Pure functions over wire messages (and one small stream tracker), no I/O.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Iterable

import numpy as np

from protocol import wire

from .link import ProtocolViolation

MAX_MS = 3.6e6  # a timing figure beyond an hour is no measurement
MAX_PASSES = 1 << 20
# the figures the decoder reads from a reply's timing, with their upper bounds (exit_layer may also be None)
TIMING = {"verify_ms": MAX_MS, "prefill_ms": MAX_MS, "exit_ms": MAX_MS, "passes": MAX_PASSES, "exit_layer": 1 << 12}


def check_ids(ids: Iterable[int], vocab: int, what: str) -> None:
    """Every id in [0, vocab); ProtocolViolation names the first that is not."""
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise ProtocolViolation(f"{what} holds token id {bad}, outside the vocabulary of {vocab}")


def check_timing(timing: dict[str, Any], what: str) -> None:
    """The figures the decoder adds up (verify_ms, passes, ...): finite, non-negative and bounded when present."""
    for key, hi in TIMING.items():
        v = timing.get(key)
        if v is None and (key == "exit_layer" or key not in timing):
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0 <= v <= hi:
            raise ProtocolViolation(f"{what}: timing.{key} must be a number in [0, {hi:g}], got {v!r}")


def check_opened(reply: wire.Message, sid: str, n_committed: int) -> wire.Opened:
    """The reply to `open` of `sid` with n_committed tokens: the server holds exactly those."""
    if not isinstance(reply, wire.Opened) or reply.sid != sid:
        raise ProtocolViolation(f"expected opened for session {sid}, got {_name(reply)}")
    if reply.n_committed != n_committed:
        raise ProtocolViolation(f"opened says {reply.n_committed} committed tokens, the open sent {n_committed}")
    check_timing(reply.timing, "opened")
    return reply


def check_result(
    reply: wire.Message, number: int, draft_ids: list[int], n_committed: int, vocab: int, split: bool
) -> wire.Result:
    """The reply to verify round `number` of draft_ids [k], sent with n_committed tokens (any fix included).

    accepted <= k; the token in the vocabulary, or (split only, at a rejection) a usable residual
    instead; the server's committed length is ours plus what the round commits (a split correction
    is drawn here, so it counts only from the next round on).
    """
    if not isinstance(reply, wire.Result):
        raise ProtocolViolation(f"expected the result of round {number}, got {_name(reply)}")
    what = f"result of round {number}"
    if reply.round != number:
        raise ProtocolViolation(f"a result for round {reply.round}, the robot waits for round {number}")
    k = len(draft_ids)
    if reply.accepted > k:
        raise ProtocolViolation(f"{what} accepts {reply.accepted} tokens of {k} drafted")
    if reply.residual is None:
        check_ids([reply.token], vocab, what)
    elif not split or reply.accepted >= k:
        raise ProtocolViolation(
            f"{what} carries a residual, which it cannot have ({'split' if split else 'not a split payload'}, "
            f"{reply.accepted}/{k} accepted)"
        )
    else:
        check_residual(reply.residual, vocab, what)
    want = n_committed + reply.accepted + (reply.residual is None)
    if reply.n_committed != want:
        raise ProtocolViolation(
            f"{what} says the server holds {reply.n_committed} tokens; {n_committed} + {reply.accepted} accepted"
            f"{' + 1' if reply.residual is None else ''} is {want}"
        )
    check_timing(reply.timing, what)
    return reply


def check_residual(residual: dict[str, Any], vocab: int, what: str) -> None:
    """A split rejection's p_j: float32 logits [vocab], or [n] at n distinct ids of the vocabulary; all finite."""
    logits, ids = residual["logits"], residual["ids"]  # [n] float32, [n] int32 or None
    if ids is None and len(logits) != vocab:
        raise ProtocolViolation(f"{what}: residual logits cover {len(logits)} tokens, the vocabulary has {vocab}")
    if ids is not None:
        if len(ids) != len(logits) or not len(ids) or len(ids) > vocab:
            raise ProtocolViolation(f"{what}: a sparse residual of {len(ids)} ids for {len(logits)} logits")
        if ids.min() < 0 or ids.max() >= vocab:
            raise ProtocolViolation(f"{what}: residual ids leave the vocabulary of {vocab}")
        if len(np.unique(ids)) != len(ids):
            raise ProtocolViolation(f"{what}: residual ids repeat")
    if not np.all(np.isfinite(logits)):
        raise ProtocolViolation(f"{what}: residual logits hold NaN or infinity")


def check_exit(reply: wire.Exit, number: int, draft_ids: list[int], vocab: int, layers: list[int]) -> None:
    """An early-exit hint while round `number` of draft_ids is verified: that round, an exit asked for, and
    tokens that are a prefix of the draft plus one next token (at most k + 1), all in the vocabulary."""
    what = f"exit hint of layer {reply.layer} for round {reply.round}"
    if reply.round != number:
        raise ProtocolViolation(f"{what}: the robot waits for round {number}")
    if reply.layer not in layers:
        raise ProtocolViolation(f"{what}: the session asked for exits at {layers}")
    check_ids(reply.tokens, vocab, what)
    n = len(reply.tokens)
    if n > len(draft_ids) + 1 or reply.tokens[:-1] != draft_ids[: n - 1]:
        raise ProtocolViolation(f"{what}: {n} tokens that are not a prefix of the {len(draft_ids)} drafted plus one")


class StreamCheck:
    """What `ar` streams may send: for each request in order, tokens seq 0, 1, ... in the vocabulary, the
    one at max_tokens - 1 marked done, an earlier one done only on a stop id."""

    def __init__(self, vocab: int, stop_ids: Iterable[int]) -> None:
        self.vocab = vocab
        self.stop_ids = frozenset(stop_ids)
        self.sizes: deque[int] = deque()  # max_tokens of each request not finished yet, oldest first
        self.seq = 0  # the next token's seq in the oldest request

    def asked(self, max_tokens: int) -> None:
        self.sizes.append(max_tokens)

    def check(self, reply: wire.Message) -> wire.Token:
        if not isinstance(reply, wire.Token):
            raise ProtocolViolation(f"expected a streamed token, got {_name(reply)}")
        if not self.sizes:
            raise ProtocolViolation(f"a streamed token (seq {reply.seq}) that no ar asked for")
        what = f"streamed token seq {reply.seq}"
        if reply.seq != self.seq:
            raise ProtocolViolation(f"{what}: the stream is at seq {self.seq}")
        check_ids([reply.token], self.vocab, what)
        check_timing(reply.timing, what)
        last = self.seq + 1 == self.sizes[0]
        if last and not reply.done:
            raise ProtocolViolation(f"{what} is the last of {self.sizes[0]} asked for and not marked done")
        if reply.done and not last and reply.token not in self.stop_ids:
            raise ProtocolViolation(f"{what} ends the stream early on {reply.token}, not a stop id")
        if reply.done:
            self.sizes.popleft()
            self.seq = 0
        else:
            self.seq += 1
        return reply


def _name(msg: wire.Message) -> str:
    return getattr(msg, "TYPE", type(msg).__name__)
