"""The robot's decode loop: AR (server alone), SD (draft here, verify there), FSD (SD with
early-exit verdicts and pre-drafting, agent/predraft.py) and local (draft alone).

The committed prefix is the only state that matters. Every round appends to
it only what the server committed; when the link drops, the loop reconnects
with backoff, re-opens the session with the committed prefix and redoes the
round, so no token is lost or duplicated.
"""
from __future__ import annotations

import logging
import time
import uuid
from dataclasses import asdict, dataclass, field

import numpy as np

from server_bridge import wire
from server_bridge.sampling import SamplingParams

from .drafter import Draft, Drafter
from .link import LinkLost, ServerError, VerifierLink
from .predraft import PreDrafter

log = logging.getLogger(__name__)

MODES = ("ar", "sd", "fsd", "local")


@dataclass
class Metrics:
    """Per-generation figures, named as in DESIGN.md everywhere (CLI JSON, /metrics, benchmarks)."""
    tau: float | None = None                # tokens committed per verification round
    acceptance_rate: float | None = None    # accepted draft tokens / drafted
    rounds: int = 0
    target_forward_passes: int = 0
    draft_ms: float = 0.0                   # time spent drafting (gamma * T_p per round)
    verify_ms: float = 0.0                  # server time in target forward passes (T_q per round)
    network_ms: float = 0.0                 # waiting time not explained by verify_ms (2 * T_c per round)
    wall_s: float = 0.0
    tokens_per_s: float = 0.0
    bytes_up: int = 0
    bytes_down: int = 0
    drafted: int = 0
    accepted: int = 0
    wasted_draft_tokens: int = 0            # drafted tokens the server rejected
    reconnects: int = 0                     # new connections after a lost link
    reopens: int = 0                        # sessions re-opened after the server lost them (evicted)
    prefill_ms: float = 0.0
    # FSD: a round's draft was pre-drafted (cached or in progress when the previous result came) or not
    predraft_hits: int = 0
    predraft_misses: int = 0
    predraft_miss_rate: float | None = None  # misses / (hits + misses); the first round has no predecessor
    predraft_failures: int = 0              # rounds the pre-draft worker failed; drafted afresh
    exits_received: int = 0                 # early-exit verdicts that reached the robot
    avg_exit_layer: float | None = None     # mean over rounds of the earliest exit that matched the result
    exit_layer_sum: int = 0
    exit_ms: float = 0.0                    # server time in early-exit heads (part of verify_ms)


@dataclass
class Generation:
    text: str
    token_ids: list[int]                    # generated ids only (a final stop id included)
    mode: str
    metrics: Metrics = field(default_factory=Metrics)

    def to_json(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "mode": self.mode, "metrics": asdict(self.metrics)}


@dataclass(frozen=True)
class ReconnectPolicy:
    max_attempts: int = 8                   # consecutive failures before giving up
    backoff_s: float = 0.1
    backoff_max_s: float = 2.0

    def delay(self, attempt: int) -> float:
        return min(self.backoff_max_s, self.backoff_s * 2 ** attempt)


@dataclass(frozen=True)
class FsdOptions:
    """The FSD knobs: which exits to ask for, how many branches to pre-draft at once, queue policy."""
    exits: tuple[int, ...] | None = None    # None: every exit the server has; (): none (pre-draft guesses only)
    workers: int = 1                        # branches drafted at once (sequences of one batched context)
    policy: str = "priority"                # order of early verdicts: priority | fifo | random
    n_cands: int = 8                        # draft top-K ids sent per position for the exits to score
    guesses: bool = True                    # also pre-draft the robot's own guesses
    threads: int = 1                        # llama threads of the pre-draft context


class EdgeDecoder:
    def __init__(self, drafter: Drafter, url: str | None = None, token: str = "",
                 reconnect: ReconnectPolicy = ReconnectPolicy(), recv_timeout_s: float = 30.0,
                 fsd: FsdOptions = FsdOptions()):
        self.drafter = drafter
        self.url = url
        self.token = token
        self.reconnect = reconnect
        self.recv_timeout_s = recv_timeout_s
        self.fsd = fsd
        self.link: VerifierLink | None = None
        self.predrafter: PreDrafter | None = None
        self._last_round: tuple[int, tuple[int, ...]] | None = None   # FSD: whose next draft is pre-drafted
        self._bytes_base = (0, 0)

    def close(self) -> None:
        if self.link is not None:
            self.link.close()
            self.link = None
        if self.predrafter is not None:
            self.predrafter.close()
            self.predrafter = None

    def stop_ids(self) -> set[int]:
        ids = set(self.drafter.eos_ids)
        if self.link is not None and self.link.welcome is not None:
            ids |= set(self.link.welcome.eos_ids)
        return ids

    # ------------------------------------------------------------------ entry point

    def generate(self, prompt_ids: list[int], *, mode: str = "sd", max_tokens: int = 64,
                 params: SamplingParams = SamplingParams(), gamma: int = 4) -> Generation:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if max_tokens < 1 or gamma < 0:
            raise ValueError("max_tokens must be >= 1 and gamma >= 0")
        m = Metrics()
        t0 = time.perf_counter()
        if mode == "local":
            out = self._generate_local(prompt_ids, max_tokens, params, m)
        else:
            out = self._generate_remote(prompt_ids, mode, max_tokens, params, gamma, m)
        m.wall_s = time.perf_counter() - t0
        m.tokens_per_s = len(out) / m.wall_s if m.wall_s > 0 else 0.0
        if m.drafted:
            m.acceptance_rate = m.accepted / m.drafted
        if m.rounds:
            m.tau = len(out) / m.rounds
        if m.predraft_hits + m.predraft_misses:
            m.predraft_miss_rate = m.predraft_misses / (m.predraft_hits + m.predraft_misses)
        if mode == "fsd" and m.rounds:
            m.avg_exit_layer = m.exit_layer_sum / m.rounds
        text = self.drafter.detokenize(out, skip=self.stop_ids())
        return Generation(text, out, mode, m)

    # ------------------------------------------------------------------ local (offline)

    def _generate_local(self, prompt_ids, max_tokens, params, m) -> list[int]:
        rng = np.random.default_rng(params.seed)
        committed, out, stops = list(prompt_ids), [], self.stop_ids()
        while len(out) < max_tokens:
            t1 = time.perf_counter()
            token = self.drafter.next_token(committed, params, rng)
            m.draft_ms += (time.perf_counter() - t1) * 1e3
            committed.append(token)
            out.append(token)
            if token in stops:
                break
        return out

    # ------------------------------------------------------------------ remote (AR, SD)

    def _generate_remote(self, prompt_ids, mode, max_tokens, params, gamma, m) -> list[int]:
        sid = uuid.uuid4().hex
        rng = np.random.default_rng(params.seed)
        committed = list(prompt_ids)
        n_prompt = len(prompt_ids)
        is_open = False
        failures = 0
        self._last_round = None
        if mode == "fsd" and self.predrafter is None:
            self.predrafter = PreDrafter(self.drafter, workers=self.fsd.workers, policy=self.fsd.policy,
                                         n_cands=self.fsd.n_cands, threads=self.fsd.threads,
                                         guesses=self.fsd.guesses)
        try:
            while True:
                out = committed[n_prompt:]
                stops = self.stop_ids()
                stop = next((i for i, t in enumerate(out) if t in stops), None)
                if stop is not None:            # SD can commit tokens past a stop id in one round
                    return out[:stop + 1]
                if len(out) >= max_tokens:
                    return out
                try:
                    if self.link is None:
                        self._connect()
                    if not is_open:
                        self._open(sid, committed, params, m, exits=mode == "fsd")
                        is_open = True
                    if mode == "sd":
                        self._sd_round(sid, committed, max_tokens - len(out), params, gamma, rng, m)
                    elif mode == "fsd":
                        self._fsd_round(sid, committed, max_tokens - len(out), params, gamma, rng, m)
                    else:
                        self._ar_stream(sid, committed, max_tokens - len(out), m)
                    failures = 0
                except LinkLost as e:
                    failures += 1
                    if failures > self.reconnect.max_attempts:
                        raise
                    delay = self.reconnect.delay(failures - 1)
                    log.warning("link lost (%s); reconnect %d/%d in %.2fs with %d committed tokens", e,
                                failures, self.reconnect.max_attempts, delay, len(committed))
                    self._fold_bytes(m)
                    if self.link is not None:
                        self.link.close()
                        self.link = None
                    is_open = False
                    self._forget_predraft()
                    m.reconnects += 1
                    time.sleep(delay)
                except ServerError as e:
                    failures += 1
                    if not e.recoverable or failures > self.reconnect.max_attempts:
                        raise
                    log.info("server lost our session (%s); re-opening with %d committed tokens", e.code,
                             len(committed))
                    is_open = False
                    self._forget_predraft()
                    m.reopens += 1
        finally:
            self._forget_predraft()
            if self.link is not None and is_open:
                try:
                    self.link.send(wire.Close(sid))
                except LinkLost:
                    pass
            self._fold_bytes(m)

    def _connect(self) -> None:
        if self.url is None:
            raise ValueError("no verifier URL: pass --verifier ws://HOST:PORT or use --local")
        link = VerifierLink(self.url, token=self.token, vocab_hash=self.drafter.vocab_hash,
                            vocab_size=self.drafter.vocab_size, recv_timeout_s=self.recv_timeout_s)
        link.connect()
        self.link = link
        self._bytes_base = (0, 0)

    def _fold_bytes(self, m: Metrics) -> None:
        """Add the link's bytes since the last fold to m (the link outlives one generation)."""
        if self.link is not None:
            m.bytes_up += self.link.bytes_up - self._bytes_base[0]
            m.bytes_down += self.link.bytes_down - self._bytes_base[1]
            self._bytes_base = (self.link.bytes_up, self.link.bytes_down)

    def _forget_predraft(self) -> None:
        self._last_round = None
        if self.predrafter is not None:
            self.predrafter.cancel()

    def _open(self, sid, committed, params, m, exits: bool = False) -> None:
        layers: list[int] = []
        if exits:
            offered = self.link.welcome.exits
            layers = list(offered) if self.fsd.exits is None else [l for l in self.fsd.exits if l in offered]
            if self.fsd.exits and len(layers) < len(self.fsd.exits):
                log.warning("the verifier has exits at %s; asked for %s, using %s", offered, self.fsd.exits, layers)
        msg = wire.Open(sid, list(committed), {"temperature": params.temperature, "top_k": params.top_k,
                                               "seed": params.seed}, exits=layers)
        reply, rtt = self.link.request(msg)
        if not isinstance(reply, wire.Opened) or reply.n_committed != len(committed):
            raise LinkLost(f"bad reply to open: {reply}")
        m.prefill_ms += reply.timing.get("prefill_ms", 0.0)
        m.target_forward_passes += reply.timing.get("passes", 0)

    def _sd_round(self, sid, committed, remaining, params, gamma, rng, m) -> None:
        limit = self.link.welcome.limits["max_draft_len"]
        k = min(gamma, remaining - 1, limit)         # a round commits at most k + 1 tokens
        draft = self.drafter.propose(committed, k, params, rng)
        m.draft_ms += draft.ms
        q = {"kind": "none"} if draft.q is None else {"kind": "full", "probs": draft.q}
        msg = wire.Verify(sid, m.rounds, len(committed), draft.ids, q)
        reply, rtt = self.link.request(msg)
        self._commit_round(committed, draft.ids, reply, rtt, m)

    def _fsd_round(self, sid, committed, remaining, params, gamma, rng, m) -> None:
        """An SD round whose draft was (ideally) drafted during the previous round's verification."""
        limit = self.link.welcome.limits["max_draft_len"]
        k = min(gamma, remaining - 1, limit)
        draft: Draft | None = None
        if self._last_round is not None:
            t1 = time.perf_counter()
            draft, hit = self.predrafter.take(*self._last_round)
            self._last_round = None
            m.draft_ms += (time.perf_counter() - t1) * 1e3      # what the loop waited for its draft
            if draft is None:
                m.predraft_failures += 1
            if hit:
                m.predraft_hits += 1
            else:
                m.predraft_misses += 1
        if draft is None or len(draft.ids) < k:
            draft = self.drafter.propose(committed, k, params, rng, n_cands=self.fsd.n_cands)
            m.draft_ms += draft.ms
        draft = draft.head(k)
        q = {"kind": "none"} if draft.q is None else {"kind": "full", "probs": draft.q}
        number = m.rounds
        t0 = time.perf_counter()
        self.link.send(wire.Verify(sid, number, len(committed), draft.ids, q, draft.cands))
        self.predrafter.begin(number, committed, draft, gamma, params, params.seed, self.stop_ids())
        while True:                          # exits (hints) until the result of this round
            reply = self.link.recv(sid=sid)
            if not isinstance(reply, wire.Exit):
                break
            m.exits_received += 1
            if reply.round == number:
                self.predrafter.offer(number, reply.layer, reply.tokens, reply.confidence)
        rtt = (time.perf_counter() - t0) * 1e3
        new = self._commit_round(committed, draft.ids, reply, rtt, m)
        self._last_round = (number, tuple(new))
        m.exit_layer_sum += int(reply.timing.get("exit_layer") or 0)
        m.exit_ms += float(reply.timing.get("exit_ms", 0.0))

    def _commit_round(self, committed, draft_ids, reply, rtt, m) -> list[int]:
        """Check the reply to verify round m.rounds and commit it; returns the committed tokens."""
        k = len(draft_ids)
        if not isinstance(reply, wire.Result) or reply.round != m.rounds or reply.accepted > k:
            raise LinkLost(f"unexpected reply to verify round {m.rounds}: {reply}")
        new = draft_ids[:reply.accepted] + [reply.token]
        committed.extend(new)
        if reply.n_committed != len(committed):
            raise ServerError("desync", f"server has {reply.n_committed} tokens after the round, we have "
                              f"{len(committed)}")
        m.rounds += 1
        m.drafted += k
        m.accepted += reply.accepted
        m.wasted_draft_tokens += k - reply.accepted
        m.verify_ms += reply.timing.get("verify_ms", 0.0)
        m.network_ms += max(0.0, rtt - reply.timing.get("verify_ms", 0.0))
        m.target_forward_passes += reply.timing.get("passes", 1)
        return new

    def _ar_stream(self, sid, committed, remaining, m) -> None:
        """Target-only tokens streamed by the server; each is committed as it arrives."""
        t0 = time.perf_counter()
        verify_ms = 0.0
        self.link.send(wire.Ar(sid, remaining, sorted(self.stop_ids())))
        while True:
            reply = self.link.recv(sid=sid)
            if not isinstance(reply, wire.Token):
                raise LinkLost(f"unexpected message in the ar stream: {reply}")
            committed.append(reply.token)
            m.rounds += 1
            verify_ms += reply.timing.get("verify_ms", 0.0)
            m.target_forward_passes += reply.timing.get("passes", 1)
            if reply.done:
                break
        m.verify_ms += verify_ms
        m.network_ms += max(0.0, (time.perf_counter() - t0) * 1e3 - verify_ms)
