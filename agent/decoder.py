"""The robot's decode loop: AR (server alone), SD (draft here, verify there) and local (draft alone).

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

from .drafter import Drafter
from .link import LinkLost, ServerError, VerifierLink

log = logging.getLogger(__name__)

MODES = ("ar", "sd", "local")


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


class EdgeDecoder:
    def __init__(self, drafter: Drafter, url: str | None = None, token: str = "",
                 reconnect: ReconnectPolicy = ReconnectPolicy(), recv_timeout_s: float = 30.0):
        self.drafter = drafter
        self.url = url
        self.token = token
        self.reconnect = reconnect
        self.recv_timeout_s = recv_timeout_s
        self.link: VerifierLink | None = None
        self._bytes_base = (0, 0)

    def close(self) -> None:
        if self.link is not None:
            self.link.close()
            self.link = None

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
                        self._open(sid, committed, params, m)
                        is_open = True
                    if mode == "sd":
                        self._sd_round(sid, committed, max_tokens - len(out), params, gamma, rng, m)
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
                    self.close()
                    is_open = False
                    m.reconnects += 1
                    time.sleep(delay)
                except ServerError as e:
                    failures += 1
                    if not e.recoverable or failures > self.reconnect.max_attempts:
                        raise
                    log.info("server lost our session (%s); re-opening with %d committed tokens", e.code,
                             len(committed))
                    is_open = False
                    m.reopens += 1
        finally:
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

    def _open(self, sid, committed, params, m) -> None:
        msg = wire.Open(sid, list(committed), {"temperature": params.temperature, "top_k": params.top_k,
                                               "seed": params.seed})
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
        if not isinstance(reply, wire.Result) or reply.round != m.rounds or reply.accepted > k:
            raise LinkLost(f"unexpected reply to verify round {m.rounds}: {reply}")
        new = draft.ids[:reply.accepted] + [reply.token]
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
