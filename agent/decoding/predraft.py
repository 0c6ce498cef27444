"""Pre-drafting (FSD): draft the next round's draft while the server is still verifying this one.

Per round, the decode loop sends a draft and hands it to the `PreDrafter`.
Its worker thread guesses how the round will end and drafts the next draft
after each guess into a bounded cache, keyed by the continuation (the tokens
the round would commit):

- guesses the robot can make alone: "all accepted, plus the draft's own next
  token" and "rejected at j, corrected to the draft's second choice at j";
- early-exit verdicts streamed by the server (`exit` messages), ordered among
  themselves by the queue policy (`priority`: highest confidence first;
  `fifo`; `random`, for the ablation).

The two compete on calibrated odds of being the round's outcome, learned
online from how rounds really end: a guess's from the measured acceptance
rate (the draft's own probabilities are far less confident than its
agreement with a near-identical target), an exit verdict's from how often
that exit layer's verdict was the outcome. A better candidate takes over the
slot of the worst running branch; candidates below `min_odds` are not
drafted at all.

Up to `workers` branches are drafted at once, as sequences of one llama
context advancing together in one batch (agent/decoding/branches.py). When the
`result` arrives, `take(key)` returns the cached draft (a hit), or waits for
the branch still in progress for that key (a hit that finishes), or drafts the
key on its own (a miss). Any failure in the worker makes `take` return None
and the decode loop drafts afresh with its own context: pre-drafting can only
save time, never stall or change a generation.

Everything is bounded: the verdict queue (`queue_size`), the cache
(`cache_size` entries, emptied every round) and the branches (`workers`).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np

from protocol.payload import PayloadSpec
from protocol.sampling import SamplingParams
from protocol.structured import ConstraintState

from .branches import Branch, BranchDrafter
from .drafter import Draft, Drafter

log = logging.getLogger(__name__)

POLICIES = ("priority", "fifo", "random")
_Item = tuple[float, int, tuple[int, ...], int]  # a queued verdict: (confidence, arrival, key, layer)


class VerdictQueue:
    """Bounded queue of continuation keys; pop order by policy. When full, the least valuable is dropped."""

    def __init__(self, maxlen: int, policy: str = "priority", rng: np.random.Generator | None = None):
        if policy not in POLICIES:
            raise ValueError(f"queue policy must be one of {POLICIES}, got {policy!r}")
        if maxlen < 1:
            raise ValueError("maxlen must be >= 1")
        self.maxlen = maxlen
        self.policy = policy
        self.rng = rng or np.random.default_rng()
        self._items: list[_Item] = []
        self._arrival = itertools.count()
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._items)

    def _value(self, item: _Item) -> float:
        score, arrival = item[:2]
        return score if self.policy == "priority" else -arrival if self.policy == "fifo" else 0.0

    def push(self, key: tuple[int, ...], score: float, layer: int = 0) -> None:
        self.push_back((score, next(self._arrival), key, layer))

    def push_back(self, item: _Item) -> None:
        """Re-queue an item from `pop` in its old place in line."""
        self._items.append(item)
        if len(self._items) > self.maxlen:
            if self.policy == "random":
                victim = int(self.rng.integers(len(self._items)))
            else:
                victim = min(range(len(self._items)), key=lambda i: self._value(self._items[i]))
            self._items.pop(victim)
            self.dropped += 1

    def pop(self) -> _Item | None:
        """The next item by policy: (confidence, arrival, key, layer), or None when empty."""
        if not self._items:
            return None
        if self.policy == "random":
            i = int(self.rng.integers(len(self._items)))
        else:
            i = max(range(len(self._items)), key=lambda j: self._value(self._items[j]))
        return self._items.pop(i)


@dataclass
class _Round:
    number: int
    committed: list[int]
    draft: Draft
    gamma: int
    params: SamplingParams
    seed: int
    stop_ids: frozenset[int]
    exits: VerdictQueue
    payload: PayloadSpec = field(default_factory=PayloadSpec)
    grammar: ConstraintState | None = None  # the generation's grammar after committed (the worker's own copy)
    guesses: list[tuple[float, tuple[int, ...]]] = field(default_factory=list)  # max-heap by -score
    seen: set[tuple[int, ...]] = field(default_factory=set)  # keys queued, drafting or drafted
    drafting: dict[tuple[int, ...], float] = field(default_factory=dict)  # active branch keys -> estimate
    verdicts: dict[int, tuple[int, ...]] = field(default_factory=dict)  # layer -> its last verdict
    guess_odds: dict[tuple[int, ...], float] = field(default_factory=dict)  # the robot's own guesses
    cache: dict[tuple[int, ...], Draft] = field(default_factory=dict)
    wanted: tuple[int, ...] | None = None  # set by take(): the only key still worth drafting
    t0: float = field(default_factory=time.perf_counter)
    log: list[Any] = field(default_factory=list)  # (ms since begin, event) for --log-level DEBUG
    failed: bool = False
    ended: bool = False


@dataclass
class PreDraftStats:
    exits_received: int = 0
    exits_ignored: int = 0  # inconsistent with the draft, for an old round, or already known
    branches_started: int = 0
    branches_done: int = 0
    branches_preempted: int = 0
    failures: int = 0


class PreDrafter:
    def __init__(
        self,
        drafter: Drafter,
        workers: int = 1,
        policy: str = "priority",
        queue_size: int = 16,
        cache_size: int = 16,
        n_cands: int = 8,
        threads: int = 1,
        n_ctx: int = 4096,
        guesses: bool = True,
        min_odds: float = 0.05,
    ):
        if workers < 1:
            raise ValueError("workers must be >= 1")
        self.workers = workers
        self.policy = policy
        self.queue_size = queue_size
        self.cache_size = cache_size
        self.guesses = guesses
        # Branches less likely than this to be the outcome are not drafted: on a robot
        # every idle step saves battery (and on a shared machine, memory bandwidth).
        self.min_odds = min_odds
        self.stats = PreDraftStats()
        self.branches = BranchDrafter(drafter, slots=workers, n_ctx=n_ctx, threads=threads, n_cands=n_cands)
        VerdictQueue(queue_size, policy)  # validate the policy now, not in the worker
        self._cv = threading.Condition()
        self._round: _Round | None = None
        self._reuse: tuple[int, ...] | None = None  # the key whose draft went out; its branch KV is reused
        self._accepted = self._trials = 0  # calibration: see _learn
        self._exit_odds: dict[int, tuple[int, int]] = {}
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="predraft", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ decode-loop side

    def begin(
        self,
        number: int,
        committed: list[int],
        draft: Draft,
        gamma: int,
        params: SamplingParams,
        seed: int,
        stop_ids: set[int],
        payload: PayloadSpec = PayloadSpec(),
        grammar: ConstraintState | None = None,
    ) -> None:
        """A draft went out for verification: start guessing how its round ends.

        `draft.cand_p` (the draft's top-K probabilities) ranks the robot's own guesses. `grammar` (its state after
        `committed`, cloned here): every branch drafts under it, and a continuation it forbids is never drafted
        (the verifier masks the target with it, so no round ends that way).
        """
        with self._cv:
            self._end_locked()
            self._round = _Round(
                number,
                list(committed),
                draft,
                gamma,
                params,
                seed,
                frozenset(stop_ids),
                VerdictQueue(self.queue_size, self.policy, np.random.default_rng([seed, number])),
                payload.for_params(params),
                grammar=None if grammar is None else grammar.clone(),
            )
            self._cv.notify_all()

    def offer(self, number: int, layer: int, tokens: list[int], confidence: float) -> bool:
        """An early-exit verdict for round `number`; False when it was ignored."""
        self.stats.exits_received += 1
        with self._cv:
            r = self._round
            key = tuple(tokens)
            if (
                r is None
                or r.number != number
                or r.ended
                or r.wanted is not None
                or not key
                or len(key) > len(r.draft.ids) + 1
                or not all(0 <= t < self.branches.vocab_size for t in key)  # the decoder checks; so does this
                or list(key[:-1]) != r.draft.ids[: len(key) - 1]
            ):
                self.stats.exits_ignored += 1
                return False
            r.verdicts[layer] = key
            if key in r.seen or any(t in r.stop_ids for t in key):
                self.stats.exits_ignored += 1
                return False
            r.exits.push(key, confidence, layer)
            self._cv.notify_all()
            return True

    # ------------------------------------------------------------------ calibration

    def _learn(self, r: _Round, key: tuple[int, ...]) -> None:
        """Update the odds behind every estimate from how the round really ended."""
        k = len(r.draft.ids)
        accepted = len(key) - 1
        self._accepted += accepted
        self._trials += min(accepted + 1, k)
        for layer, verdict in r.verdicts.items():
            hits, seen = self._exit_odds.get(layer, (0, 0))
            self._exit_odds[layer] = (hits + (verdict == key), seen + 1)

    @property
    def alpha(self) -> float:
        """The draft's acceptance rate so far, with a prior worth 8 tokens at 0.8."""
        return (self._accepted + 6.4) / (self._trials + 8)

    def exit_odds(self, layer: int) -> float:
        """How often this exit's verdict was the round's outcome, with a prior worth 2 rounds at 0.3."""
        hits, seen = self._exit_odds.get(layer, (0, 0))
        return (hits + 0.6) / (seen + 2)

    def take(self, number: int, key: tuple[int, ...], timeout_s: float = 10.0) -> tuple[Draft | None, bool]:
        """The next draft for continuation `key` of round `number`: (draft or None, was it a hit).

        A hit is a draft cached or in progress when the result arrived. Otherwise the
        worker drafts the key alone (a miss). None: the worker failed or timed out;
        the caller drafts with its own context.
        """
        deadline = time.monotonic() + timeout_s
        with self._cv:
            r = self._round
            if r is None or r.number != number or r.failed:
                return None, False
            self._learn(r, key)
            hit = key in r.drafting
            log.debug(
                "round %d result after %.0f ms: key %s (guessed %s, queued/seen %s, drafting %s, cached %d: %s)",
                number,
                (time.perf_counter() - r.t0) * 1e3,
                "cached" if key in r.cache else "drafting" if hit else "new",
                key in r.guess_odds,
                key in r.seen,
                len(r.drafting),
                len(r.cache),
                r.log,
            )
            if key in r.cache:
                draft = r.cache[key]
                self._reuse = key  # its KV seeds the next round's base sequence
                self._end_locked()
                return draft, True
            r.wanted = key
            if not hit:
                r.seen.add(key)
            self._cv.notify_all()
            while key not in r.cache and not r.failed and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    log.warning("pre-draft worker did not deliver in %.1fs; drafting afresh", timeout_s)
                    break
                self._cv.wait(left)
            found = r.cache.get(key)
            self._reuse = key if found is not None else None
            self._end_locked()
            return found, hit and found is not None

    def cancel(self) -> None:
        """The generation ended: drop the round."""
        with self._cv:
            self._end_locked()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._end_locked()
            self._cv.notify_all()
        self._thread.join(5)

    def _end_locked(self) -> None:
        if self._round is not None:
            self._round.ended = True
            self._round = None
            self._cv.notify_all()

    # ------------------------------------------------------------------ worker thread

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._closed and (self._round is None or self._round.ended):
                    self._cv.wait()
                if self._closed or self._round is None:
                    return
                r = self._round
            try:
                self._work(r)
            except Exception:
                log.exception("pre-draft worker failed in round %d; the round drafts afresh", r.number)
                self.stats.failures += 1
                with self._cv:
                    r.failed = True
                    self._cv.notify_all()
            finally:
                with self._cv:
                    while self._round is r and not self._closed:  # wait for the next round
                        self._cv.wait()

    def _work(self, r: _Round) -> None:
        with self._cv:
            reuse, self._reuse = self._reuse, None
        bonus = self.branches.base(r.committed, r.draft.ids, reuse)  # [vocab] after the whole draft
        r.log.append((round((time.perf_counter() - r.t0) * 1e3), "base", reuse is not None))
        if self.guesses:
            self._guess(r, bonus)
        active: list[Branch] = []
        n = len(r.committed)
        starts = itertools.count()
        while True:
            with self._cv:
                if r.ended:
                    break
                self._admit(r, active, n, starts)
                if not active:
                    self._cv.wait(0.05)
                    continue
            self.branches.step(active, r.params, r.payload)
            done = [b for b in active if b.done]
            with self._cv:
                for b in done:
                    r.log.append((round((time.perf_counter() - r.t0) * 1e3), "done", b.key in r.guess_odds))
                    self.stats.branches_done += 1
                    if len(r.cache) < self.cache_size or b.key == r.wanted:
                        r.cache[b.key] = self.branches.result(b, r.payload)
                    active.remove(b)
                    r.drafting.pop(b.key, None)
                    self.branches.keep(b)
                if done:
                    self._cv.notify_all()
        with self._cv:
            for b in list(active):
                self._drop(r, active, b)

    def _drop(self, r: _Round, active: list[Branch], b: Branch) -> None:
        active.remove(b)
        r.drafting.pop(b.key, None)
        self.branches.drop(b)

    def _admit(self, r: _Round, active: list[Branch], n: int, starts: Iterator[int]) -> None:
        """Fill the branch slots (caller holds the lock).

        Once the result is in, only the wanted key is drafted. Before that, the
        queue policy picks the next early verdict, and it competes with the robot's
        best guess on estimated odds of being the outcome (`exit_odds` against the
        acceptance rate `alpha`); a better candidate takes over the slot of the
        worst running branch.
        """
        if r.wanted is not None:
            for b in [b for b in active if b.key != r.wanted]:  # nothing else is worth a step now
                self._drop(r, active, b)
                self.stats.branches_preempted += 1
            if r.wanted not in r.cache and r.wanted not in r.drafting:  # what the target committed: allowed
                active.append(self._start(r, r.wanted, 1.0, n, starts, self._walk(r, r.wanted)))
            return
        while True:
            best = self._best_pending(r)
            if best is None:
                return
            estimate, key, item = best
            if len(active) >= self.workers:
                victim = min(active, key=lambda b: r.drafting[b.key])
                if r.drafting[victim.key] >= estimate:  # not worth a slot yet: back in its queue
                    if item is not None:
                        r.exits.push_back(item)
                    else:
                        heapq.heappush(r.guesses, (-estimate, key))
                    return
                self._drop(r, active, victim)
                self.stats.branches_preempted += 1
                r.seen.discard(victim.key)
                heapq.heappush(r.guesses, (-r.guess_odds.get(victim.key, 0.0), victim.key))
            r.seen.add(key)
            grammar = self._walk(r, key)
            if r.grammar is not None and grammar is None:
                continue  # the grammar forbids it: never the round's outcome
            active.append(self._start(r, key, estimate, n, starts, grammar))

    def _best_pending(self, r: _Round) -> tuple[float, tuple[int, ...], _Item | None] | None:
        """The better of the next early verdict (by queue policy) and the best guess, off their queues:
        (estimate, key, the verdict-queue item or None for a guess).

        Candidates less likely than `min_odds` are dropped.
        """
        exit_: tuple[float, _Item] | None = None
        while exit_ is None and (item := r.exits.pop()) is not None:
            odds = self.exit_odds(item[3])
            if item[2] not in r.seen and odds >= self.min_odds:
                exit_ = (odds, item)
        while r.guesses and r.guesses[0][1] in r.seen:
            heapq.heappop(r.guesses)
        if r.guesses and -r.guesses[0][0] < self.min_odds:
            r.guesses.clear()  # a heap: every other guess is less likely still
        guess = (-r.guesses[0][0], r.guesses[0][1]) if r.guesses else None
        if exit_ is not None and (guess is None or exit_[0] >= guess[0]):
            return exit_[0], exit_[1][2], exit_[1]
        if exit_ is not None:
            r.exits.push_back(exit_[1])
        if guess is None:
            return None
        heapq.heappop(r.guesses)
        return guess[0], guess[1], None

    @staticmethod
    def _walk(r: _Round, key: tuple[int, ...]) -> ConstraintState | None:
        """The grammar's state after committed + key; None without a grammar, or where it forbids a token of key."""
        if r.grammar is None:
            return None
        state = r.grammar.clone()
        return state if state.advance(key) == len(key) else None

    def _start(
        self,
        r: _Round,
        key: tuple[int, ...],
        estimate: float,
        n: int,
        starts: Iterator[int],
        grammar: ConstraintState | None,
    ) -> Branch:
        self.stats.branches_started += 1
        rng = np.random.default_rng([r.seed, r.number, next(starts), 7])
        b = self.branches.start(key, n, r.gamma, rng, grammar)
        r.drafting[key] = estimate
        return b

    def _guess(self, r: _Round, bonus: np.ndarray) -> None:
        """Continuations the robot can guess alone, with their odds of being the round's outcome.

        "All accepted, plus the draft's own next token": alpha^(k+1). "Rejected at j,
        corrected to the draft's second choice at j": alpha^j (1 - alpha) times the
        draft's probability of that choice given that its first choice is out. alpha
        is the measured acceptance rate, not the draft's own confidence, which is far
        lower than its agreement with a near-identical target.
        """
        ids, cands, cand_p = r.draft.ids, r.draft.cands, r.draft.cand_p
        a = self.alpha
        scored: list[tuple[float, tuple[int, ...]]] = [(a ** (len(ids) + 1), tuple(ids) + (int(np.argmax(bonus)),))]
        if cands is not None and cand_p is not None:  # the draft's top-K per position: [k, K] ids, [k, K] probs
            for j, tok in enumerate(ids):
                p_tok = float(cand_p[j][cands[j] == tok].sum())
                others = [(float(p), int(c)) for c, p in zip(cands[j], cand_p[j], strict=True) if c != tok]
                if others:
                    p_alt, alt = max(others)
                    scored.append((a**j * (1 - a) * p_alt / max(1e-6, 1 - p_tok), tuple(ids[:j]) + (alt,)))
        with self._cv:
            for score, key in scored:
                if not any(tok in r.stop_ids for tok in key):
                    heapq.heappush(r.guesses, (-score, key))
                    r.guess_odds[key] = score
            self._cv.notify_all()
