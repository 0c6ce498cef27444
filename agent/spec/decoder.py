"""The robot's decode loop: AR (server alone), SD (draft here, verify there), FSD (SD with
early-exit verdicts and pre-drafting, agent/spec/predraft.py) and local (draft alone).

How long each SD round drafts, and whether to speculate at all, is the draft
policy's (agent/spec/policy.py): fixed, the rejection predictor, gamma* by Lambert W,
and AS2's switch to target-only streaming when speculation cannot win.

The committed prefix is the only state that matters. Every round appends to
it only what the server committed; when the link drops, the loop reconnects
with backoff, re-opens the session with the committed prefix and redoes the
round, so no token is lost or duplicated.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np

from protocol import payload, sampling, wire
from protocol.grammar import GrammarState
from protocol.images import ImageError, PromptImage, check_offered
from protocol.payload import PayloadSpec
from protocol.sampling import SamplingParams

from . import replies
from .drafter import Draft, Drafter
from .draftlen import As2, CostEstimator
from .link import TAKEN, LinkLost, ProtocolViolation, ServerError, VerifierLink
from .policy import DraftController, DraftPolicy
from .predictor import RejectionPredictor, TraceWriter, predictor_path
from .predraft import PreDrafter

log = logging.getLogger(__name__)

MODES = ("ar", "sd", "fsd", "local")
MAX_REPLICAS_SEEN = 16  # Metrics.replicas: the replicas a generation was served by, in order
MAX_SWITCHED_NAMES = 64  # session names remembered with the fresh sid they switched to (LRU)
MAX_RESUME_SECRETS = 64  # sessions whose resume secret (Opened.resume) is kept for their re-opens (LRU)


@dataclass
class Metrics:
    """Per-generation figures, named as in DESIGN.md everywhere (CLI JSON, /metrics, benchmarks)."""

    tau: float | None = None  # tokens committed per verification round
    acceptance_rate: float | None = None  # accepted draft tokens / drafted
    rounds: int = 0
    target_forward_passes: int = 0
    draft_ms: float = 0.0  # time spent drafting (gamma * T_p per round)
    verify_ms: float = 0.0  # server time in target forward passes (T_q per round)
    network_ms: float = 0.0  # waiting time not explained by verify_ms (2 * T_c per round)
    wall_s: float = 0.0
    tokens_per_s: float = 0.0
    bytes_up: int = 0
    bytes_down: int = 0
    # the uplink payload (protocol/payload.py) and what the verify rounds cost on the link
    payload: str = "none"  # none | full | topk(K=256) | split; none when greedy, ar or local
    bytes_up_per_round: float | None = None  # verify frames, mean over rounds
    bytes_down_per_round: float | None = None  # result frames (split residuals included) and exits
    round_bytes_up: int = 0
    round_bytes_down: int = 0
    residuals: int = 0  # split rejections: p_j came down and the correction was drawn here
    drafted: int = 0
    accepted: int = 0
    wasted_draft_tokens: int = 0  # drafted tokens the server rejected
    reconnects: int = 0  # new connections after a lost link
    protocol_violations: int = 0  # of those lost links, replies that broke the protocol (agent/spec/replies.py),
    # dropped with their link and nothing of them committed
    restarts: int = 0  # of those, after the server closed on purpose (a replica draining:
    # 1012), made at once without backing off
    replicas: list = field(default_factory=list)  # the replicas that held the session, in order (<= 16)
    reconnect_ms: float = 0.0  # from each lost link to the session re-opened on the next, summed
    reopens: int = 0  # sessions re-opened after the server lost them (evicted)
    session_switches: int = 0  # opens refused (session_taken) and redone at once under a fresh sid
    prefill_ms: float = 0.0
    # FSD: a round's draft was pre-drafted (cached or in progress when the previous result came) or not
    predraft_hits: int = 0
    predraft_misses: int = 0
    predraft_miss_rate: float | None = None  # misses / (hits + misses); the first round has no predecessor
    predraft_failures: int = 0  # rounds the pre-draft worker failed; drafted afresh
    exits_received: int = 0  # early-exit verdicts that reached the robot
    avg_exit_layer: float | None = None  # mean over rounds of the earliest exit that matched the result
    exit_layer_sum: int = 0
    exit_ms: float = 0.0  # server time in early-exit heads (part of verify_ms)
    # draft policy (agent/spec/policy.py)
    draft_policy: str = "fixed"
    draft_lengths: dict = field(default_factory=dict)  # str(k) -> rounds that drafted k tokens
    predictor_stops: int = 0  # rounds the rejection predictor ended early
    predictor_calls: int = 0
    predictor_ms: float = 0.0  # onnxruntime time, all calls
    feature_ms: float = 0.0  # computing the predictor's features from the logits
    gamma_star: int | None = None  # the optimal draft length by the last estimates
    expected_speedup: float | None = None  # S(gamma*) * rho over target-only streaming, last estimate
    estimates: dict = field(default_factory=dict)  # the cost model's last inputs (alpha, L, rho, ...)
    streamed_tokens: int = 0  # tokens the target streamed alone while AS2 had speculation off
    as2_switches: list = field(default_factory=list)  # {token, to, expected_speedup, ...}, at most 64


@dataclass
class Generation:
    text: str
    token_ids: list[int]  # generated ids only (a final stop id included)
    mode: str
    metrics: Metrics = field(default_factory=Metrics)

    def to_json(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "mode": self.mode, "metrics": asdict(self.metrics)}


@dataclass(frozen=True)
class ReconnectPolicy:
    max_attempts: int = 8  # consecutive failures before giving up
    backoff_s: float = 0.1
    backoff_max_s: float = 2.0

    def delay(self, attempt: int) -> float:
        return min(self.backoff_max_s, self.backoff_s * 2**attempt)


@dataclass(frozen=True)
class FsdOptions:
    """The FSD knobs: which exits to ask for, how many branches to pre-draft at once, queue policy."""

    exits: tuple[int, ...] | None = None  # None: every exit the server has; (): none (pre-draft guesses only)
    workers: int = 1  # branches drafted at once (sequences of one batched context)
    policy: str = "priority"  # order of early verdicts: priority | fifo | random
    n_cands: int = 8  # draft top-K ids sent per position for the exits to score
    guesses: bool = True  # also pre-draft the robot's own guesses
    threads: int = 1  # llama threads of the pre-draft context


@dataclass(frozen=True)
class DecoderConfig:
    """Everything an EdgeDecoder is built from but its draft model: the CLI, the daemon (from its TOML),
    the tools and the tests all build one of these and hand it to `EdgeDecoder(drafter, config)`."""

    url: str | None = None  # the verifier (ws:// or wss://); None: offline, local drafting only
    token: str = ""  # the verifier's bearer token, sent in hello
    reconnect: ReconnectPolicy = ReconnectPolicy()
    recv_timeout_s: float = 30.0  # a verify reply later than this drops the link
    fsd: FsdOptions = FsdOptions()
    policy: DraftPolicy = DraftPolicy()
    trace: str | None = None  # write the rejection predictor's training rows (JSONL) here
    keepalive_s: float = 2.0  # websocket ping interval and timeout (not websockets' 20 s)
    payload: PayloadSpec = PayloadSpec()  # what the uplink carries of q at T > 0 (--payload)
    slo: float = 0.0  # tokens/s this robot needs (the verifier's SLO class); 0 = none
    ca_file: str = ""  # wss://: the CA of the verifier's certificate ("" = the system's)
    allow_insecure: bool = False  # a token over plain ws:// to another host
    robot_id: str = ""  # X-Robot-Id in the handshake ("" = none): a balancer's hash key


class EdgeDecoder:
    def __init__(self, drafter: Drafter, config: DecoderConfig = DecoderConfig()) -> None:
        c = config
        self.config = c
        url, token, reconnect, recv_timeout_s, fsd, policy, trace = (
            c.url,
            c.token,
            c.reconnect,
            c.recv_timeout_s,
            c.fsd,
            c.policy,
            c.trace,
        )
        keepalive_s, payload, slo, ca_file, allow_insecure, robot_id = (
            c.keepalive_s,
            c.payload,
            c.slo,
            c.ca_file,
            c.allow_insecure,
            c.robot_id,
        )
        self.drafter = drafter
        self.robot_id = robot_id  # X-Robot-Id in the handshake ("" = none): a balancer's hash key
        self.ca_file = ca_file  # wss://: the CA of the verifier's certificate ("" = the system's)
        self.allow_insecure = allow_insecure  # a token over plain ws:// to another host
        self.slo = slo  # tokens/s this robot needs (the verifier's SLO class); 0 = none
        self.payload = payload  # what the uplink carries of q at T > 0 (--payload)
        self.keepalive_s = keepalive_s  # websocket ping interval and timeout (not websockets' 20 s)
        self.url = url
        self.token = token
        self.reconnect = reconnect
        self.recv_timeout_s = recv_timeout_s
        self.fsd = fsd
        self.policy = policy
        self.trace = TraceWriter(trace) if trace else None
        self._predictors: dict[str, RejectionPredictor] = {}
        self.controller: DraftController | None = None  # the current generation's
        self.estimator = CostEstimator()  # the link's and the pair's, across generations
        self.as2 = As2(policy.as2_config)
        self.link: VerifierLink | None = None
        self.predrafter: PreDrafter | None = None
        self._last_round: tuple[int, tuple[int, ...]] | None = None  # FSD: whose next draft is pre-drafted
        self._bytes_base = (0, 0)
        self._spec = PayloadSpec("none")  # this generation's payload (none when greedy)
        # session name -> the sid it uses now: the name itself until an open of it is refused with
        # session_taken (its old connection still holds it), then a fresh one; bounded, least recent out
        self._sids: OrderedDict[str, str] = OrderedDict()
        # sid -> the resume secret of its last `opened`: every re-open of that session sends it back, so the
        # robot back on a new link takes its session over from the old link the server may still think open
        self._resume: OrderedDict[str, str] = OrderedDict()
        self._owed: int | None = None  # split: the correction drawn here and not yet sent
        self._exits_on = False  # the session asked for early exits: send them candidates
        self._exit_layers: list[int] = []  # the exits the session asked for (hints from others break the protocol)
        self._grammar: dict | None = None  # this generation's Open.grammar ({gbnf, from}); None: free
        self._gstate: GrammarState | None = None  # the draft's walk of it, over committed[:_gpos]
        self._gpos = 0
        self._images: list[PromptImage] = []  # this generation's prompt images
        self._image_bytes = True  # the next open sends their bytes (else their sha256)

    def close(self) -> None:
        if self.link is not None:
            self.link.close()
            self.link = None
        if self.predrafter is not None:
            self.predrafter.close()
            self.predrafter = None
        if self.trace is not None:
            self.trace.close()
            self.trace = None

    def stop_ids(self) -> set[int]:
        ids = set(self.drafter.eos_ids)
        if self.link is not None and self.link.welcome is not None:
            ids |= set(self.link.welcome.eos_ids)
        return ids

    # ------------------------------------------------------------------ entry point

    def generate(
        self,
        prompt_ids: list[int],
        *,
        mode: str = "sd",
        max_tokens: int = 64,
        params: SamplingParams = SamplingParams(),
        gamma: int = 4,
        until: Callable[[list[int]], bool] | None = None,
        session: str | None = None,
        grammar: str | None = None,
        grammar_from: int | None = None,
        images: list[PromptImage] | None = None,
    ) -> Generation:
        """Generate up to max_tokens after prompt_ids.

        `until(ids)` ends the generation at the shortest output for which it is true (the
        navigation loop's "a whole action sentence is out"); every mode cuts at the same
        token, so the ids stay the target's own. A LinkLost or ServerError raised here
        carries `token_ids`: what the target committed before the failure, to go on from.

        `session` names a server session kept open after this generation: the next
        generation with the same name re-opens it, and the server keeps the KV of the
        prefix both prompts share (a navigation prompt's long few-shot part is prefilled
        once, not every step). Without it every generation is a fresh, closed session.

        `grammar` (GBNF text) constrains the output on both sides (protocol/grammar.py): the draft
        drafts under it and the server masks the target with it, so every mode's ids are the
        target's own under the grammar. It applies from prompt_ids[grammar_from:] on (default: the
        generated part only); the ids already there must be allowed by it.

        `images` (a vision-language pair: the draft loaded with its mmproj, a target that reads images):
        the prompt's images, each on its image marker in prompt_ids (PromptImage.of(bytes, at)). Both
        sides prefill them with their own vision encoder; drafting and verification stay over text.
        The first open sends their bytes, a re-open their sha256 (the bytes again if the server lost them).
        """
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if mode == "fsd" and self.policy.uses_predictor:
            raise ValueError("fsd pre-drafts whole drafts in the background; use --draft-policy fixed or optimal")
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if max_tokens < 1 or gamma < 0:
            raise ValueError("max_tokens must be >= 1 and gamma >= 0")
        m = Metrics()
        t0 = time.perf_counter()
        self._until, self._checked = until, 0
        self._set_grammar(grammar, len(prompt_ids) if grammar_from is None else grammar_from, prompt_ids)
        self._set_images(images or [], prompt_ids)
        self._spec = self.payload.for_params(params)
        m.payload = str(self._spec) if mode in ("sd", "fsd") else "none"  # ar and local send no q
        if mode == "local":
            out = self._generate_local(prompt_ids, max_tokens, params, m)
        else:
            out = self._generate_remote(prompt_ids, mode, max_tokens, params, gamma, m, session)
        m.wall_s = time.perf_counter() - t0
        m.tokens_per_s = len(out) / m.wall_s if m.wall_s > 0 else 0.0
        if m.drafted:
            m.acceptance_rate = m.accepted / m.drafted
        if m.rounds:
            m.tau = (len(out) - m.streamed_tokens) / m.rounds
            if mode != "ar":
                m.bytes_up_per_round = m.round_bytes_up / m.rounds
                m.bytes_down_per_round = m.round_bytes_down / m.rounds
        if m.predraft_hits + m.predraft_misses:
            m.predraft_miss_rate = m.predraft_misses / (m.predraft_hits + m.predraft_misses)
        if mode == "fsd" and m.rounds:
            m.avg_exit_layer = m.exit_layer_sum / m.rounds
        text = self.drafter.detokenize(out, skip=self.stop_ids())
        return Generation(text, out, mode, m)

    # ------------------------------------------------------------------ local (offline)

    def _set_grammar(self, gbnf: str | None, start: int, prompt_ids: list[int]) -> None:
        """This generation's grammar: compiled over the draft's vocabulary, walked over the prompt's
        constrained part (GrammarError when those ids leave it)."""
        self._grammar = None
        if gbnf is None:
            return
        if not 0 <= start <= len(prompt_ids):
            raise ValueError(f"grammar_from {start} lies outside the prompt of {len(prompt_ids)} tokens")
        self._grammar = {"gbnf": gbnf, "from": start}
        self._gstate = self.drafter.grammars.get(gbnf).walk(prompt_ids[start:])
        self._gpos = len(prompt_ids)

    def _set_images(self, images: list[PromptImage], prompt_ids: list[int]) -> None:
        """This generation's images: checked on their markers and prefilled by the draft when it drafts."""
        for i, image in enumerate(images):
            if not 0 <= image.at < len(prompt_ids) or prompt_ids[image.at] != getattr(
                self.drafter, "image_marker", None
            ):
                raise ValueError(f"images[{i}] must sit on an image marker of the prompt (index {image.at})")
        if hasattr(self.drafter, "use_images"):  # a drafter without it (a text-only stand-in) reads no images
            self.drafter.use_images(images)
        self._images = list(images)
        self._image_bytes = True  # the first open of a generation sends them whole

    def _grammar_at(self, committed: list[int]) -> GrammarState | None:
        """The grammar's state after `committed` (which only grows within a generation), walked on from
        where it was. A token the grammar forbids means the verifier did not apply it: GrammarError."""
        if self._grammar is None:
            return None
        for t in committed[self._gpos :]:
            self._gstate.accept(t)
        self._gpos = len(committed)
        return self._gstate

    def _generate_local(self, prompt_ids, max_tokens, params, m) -> list[int]:
        rng = np.random.default_rng(params.seed)
        committed, out, stops = list(prompt_ids), [], self.stop_ids()
        while len(out) < max_tokens:
            t1 = time.perf_counter()
            token = self.drafter.next_token(committed, params, rng, self._grammar_at(committed))
            m.draft_ms += (time.perf_counter() - t1) * 1e3
            committed.append(token)
            out.append(token)
            if token in stops:
                break
            cut = self._cut(out)
            if cut is not None:
                return out[:cut]
        return out

    def _cut(self, out: list[int]) -> int | None:
        """The shortest length at which `until` holds, checking only lengths not checked before."""
        if self._until is None:
            return None
        for n in range(self._checked + 1, len(out) + 1):
            if self._until(out[:n]):
                return n
        self._checked = len(out)
        return None

    # ------------------------------------------------------------------ remote (AR, SD)

    def _generate_remote(self, prompt_ids, mode, max_tokens, params, gamma, m, session=None) -> list[int]:
        sid = self._sid_for(session) if session else secrets.token_urlsafe(6)  # short: it rides in every round
        switched = False  # this open already moved to a fresh sid (at most once)
        rng = np.random.default_rng(params.seed)
        committed = list(prompt_ids)
        n_prompt = len(prompt_ids)
        is_open = False
        failures = 0
        lost_at: float | None = None  # when the link was lost, until the session is re-opened
        self._last_round = None
        self.controller = None
        if mode == "fsd" and self.predrafter is None:
            self.predrafter = PreDrafter(
                self.drafter,
                workers=self.fsd.workers,
                policy=self.fsd.policy,
                n_cands=self.fsd.n_cands,
                threads=self.fsd.threads,
                guesses=self.fsd.guesses,
            )
        try:
            while True:
                out = committed[n_prompt:]
                stops = self.stop_ids()
                stop = next((i for i, t in enumerate(out) if t in stops), None)
                if stop is not None:  # SD can commit tokens past a stop id in one round
                    out = out[: stop + 1]
                cut = self._cut(out)
                if cut is not None:
                    return out[:cut]
                if stop is not None:
                    return out
                if len(out) >= max_tokens:
                    return out[:max_tokens]
                try:
                    if self.link is None:
                        self._connect()
                    if not is_open:
                        self._open(sid, committed, params, m, exits=mode == "fsd")
                        is_open, switched = True, False
                        if lost_at is not None:
                            m.reconnect_ms += (time.perf_counter() - lost_at) * 1e3
                            lost_at = None
                    if mode in ("sd", "fsd") and self.controller is None:
                        self.controller = self._make_controller(sid, gamma, m)
                    if mode in ("sd", "fsd") and not self.controller.speculating:
                        self._stream_phase(sid, committed, max_tokens - len(out), params, m)
                    elif mode == "sd":
                        self._sd_round(sid, committed, max_tokens - len(out), params, rng, m)
                    elif mode == "fsd":
                        self._fsd_round(sid, committed, max_tokens - len(out), params, rng, m)
                    else:
                        self._ar_stream(sid, committed, max_tokens - len(out), m)
                    failures = 0
                except LinkLost as e:
                    failures += 1
                    lost_at = time.perf_counter() if lost_at is None else lost_at
                    if isinstance(e, ProtocolViolation):  # a lost link like any other, and said as such
                        m.protocol_violations += 1
                        log.error("the verifier broke the protocol: %s; dropping the link, nothing of it committed", e)
                    if failures > self.reconnect.max_attempts:
                        e.token_ids = committed[n_prompt:]
                        raise
                    # a replica that drains closes on purpose: another one serves now, go at once
                    delay = 0.0 if e.restart else self.reconnect.delay(failures - 1)
                    m.restarts += e.restart
                    log.warning(
                        "link lost (%s); reconnect %d/%d in %.2fs with %d committed tokens",
                        e,
                        failures,
                        self.reconnect.max_attempts,
                        delay,
                        len(committed),
                    )
                    self._fold_bytes(m)
                    if self.link is not None:
                        self.link.close()
                        self.link = None
                    is_open = False
                    self._forget_predraft()
                    m.reconnects += 1
                    time.sleep(delay)
                except ServerError as e:
                    if e.code == TAKEN and not is_open and not switched:
                        # another connection holds sid (ours, before the link dropped, most likely) and
                        # this prompt is not its prefix: nothing to wait for, a fresh sid costs one prefill
                        switched = True
                        old, sid = sid, self._switch_sid(session, sid)
                        self._resume.pop(old, None)  # that session is another's now
                        log.info(
                            "session %s is held by another connection (%s); re-opening as %s with %d committed tokens",
                            old,
                            e.code,
                            sid,
                            len(committed),
                        )
                        self._forget_predraft()
                        m.session_switches += 1
                        continue
                    failures += 1
                    if not e.recoverable or failures > self.reconnect.max_attempts:
                        e.token_ids = committed[n_prompt:]
                        raise
                    if e.code == "unknown_image":  # the server no longer holds the images: bytes again
                        self._image_bytes = True
                    log.info(
                        "server lost our session (%s); re-opening with %d committed tokens", e.code, len(committed)
                    )
                    is_open = False
                    self._forget_predraft()
                    m.reopens += 1
        finally:
            self._forget_predraft()
            self._fold_policy(m)
            if self.link is not None and is_open and session is None:
                try:
                    self.link.send(wire.Close(sid))
                except LinkLost:
                    pass
            if session is None:  # an unnamed session is never opened again
                self._resume.pop(sid, None)
            self._fold_bytes(m)

    def _sid_for(self, name: str) -> str:
        """The sid a named session uses now: the name, or the fresh sid it switched to."""
        sid = self._sids.get(name, name)
        if name in self._sids:
            self._sids.move_to_end(name)
        return sid

    def _switch_sid(self, name: str | None, old: str) -> str:
        """A fresh sid for `name` (remembered for its later generations) or for an unnamed session."""
        base = (name or "s")[:48]
        sid = f"{base}.{secrets.token_urlsafe(6)}"  # 1-64 of [A-Za-z0-9-_.] as the wire wants
        if name is not None:
            self._sids[name] = sid
            self._sids.move_to_end(name)
            while len(self._sids) > MAX_SWITCHED_NAMES:
                self._sids.popitem(last=False)
        return sid

    def _keep_resume(self, sid: str, secret: str) -> None:
        """Remember the session's resume secret for its re-opens ("": the server gave none, forget any)."""
        if not secret:
            self._resume.pop(sid, None)
            return
        self._resume[sid] = secret
        self._resume.move_to_end(sid)
        while len(self._resume) > MAX_RESUME_SECRETS:
            self._resume.popitem(last=False)

    def connect(self) -> bool:
        """Make sure the verifier link is up (the offline mode's probe); False when it cannot be."""
        if self.link is not None and self.link.ws is not None:
            return True
        try:
            self._connect()
            return True
        except (LinkLost, ServerError) as e:
            log.info("verifier still unreachable: %s", e)
            self.link = None
            return False

    def _connect(self) -> None:
        if self.url is None:
            raise ValueError("no verifier URL: pass --verifier ws://HOST:PORT or use --local")
        link = VerifierLink(
            self.url,
            token=self.token,
            vocab_hash=self.drafter.vocab_hash,
            vocab_size=self.drafter.vocab_size,
            recv_timeout_s=self.recv_timeout_s,
            keepalive_s=self.keepalive_s,
            ca_file=self.ca_file,
            allow_insecure=self.allow_insecure,
            robot_id=self.robot_id,
        )
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
        if self._grammar is not None and not self.link.welcome.limits.get("grammar"):
            raise ServerError(
                "no_grammar",
                f"the verifier ({self.link.welcome.target}) does not decode under a "
                "grammar: its output would not be the constrained target's",
                sid,
            )
        images = self._open_images(sid)
        msg = wire.Open(
            sid,
            list(committed),
            {"temperature": params.temperature, "top_k": params.top_k, "seed": params.seed},
            exits=layers,
            payload=self._spec.to_wire(),
            slo={"tokens_per_s": self.slo} if self.slo else {},
            grammar=self._grammar,
            images=images,
            resume=self._resume.get(sid, ""),
        )
        self._owed = None  # the prefix re-sent here includes any correction
        self._exits_on = bool(layers)
        # the prefill grows with the prompt: allow it ~20 ms a token on top of the reply timeout (a dead
        # link still shows within two keepalives)
        reply, rtt = self.link.request(msg, timeout_s=self.recv_timeout_s + 0.02 * len(committed))
        replies.check_opened(reply, sid, len(committed))
        self._exit_layers = layers
        self._keep_resume(sid, reply.resume)
        self._image_bytes = False  # the server holds them now: a re-open names them by sha256
        m.prefill_ms += reply.timing.get("prefill_ms", 0.0)
        m.target_forward_passes += reply.timing.get("passes", 0)
        replica = reply.replica or self.link.welcome.replica
        if replica and (not m.replicas or m.replicas[-1] != replica) and len(m.replicas) < MAX_REPLICAS_SEEN:
            m.replicas.append(replica)

    def _open_images(self, sid: str) -> list[PromptImage]:
        """The images as this open sends them; ServerError before sending when the verifier cannot read them."""
        if not self._images:
            return []
        offered = self.link.welcome.limits.get("images")
        if not isinstance(offered, dict):
            raise ServerError(
                "no_vision",
                f"the verifier ({self.link.welcome.target}) reads text only: serve a "
                "vision-language target (--mmproj) or send no images",
                sid,
            )
        if offered.get("marker") != self.drafter.image_marker:
            raise ServerError(
                "vocab_mismatch",
                f"the verifier's image marker is {offered.get('marker')}, the "
                f"draft's {self.drafter.image_marker}: not the same vision-language pair",
                sid,
            )
        try:  # the verifier's own bounds, before anything is sent
            check_offered(self._images, offered)
        except ImageError as e:
            raise ServerError("bad_image", str(e), sid) from None
        if self._image_bytes:
            return list(self._images)
        return [PromptImage(im.at, im.sha256) for im in self._images]

    def _sd_round(self, sid, committed, remaining, params, rng, m) -> None:
        ctl = self.controller
        k = min(ctl.length(), remaining - 1)  # a round commits at most k + 1 tokens
        draft = self.drafter.propose(
            committed, k, params, rng, watch=ctl.watch(), payload=self._spec, grammar=self._grammar_at(committed)
        )
        m.draft_ms += draft.ms
        msg = wire.Verify(sid, m.rounds, len(committed), draft.ids, draft.wire_q(), fix=self._owed)
        up, down = self.link.bytes_up, self.link.bytes_down
        reply, rtt = self.link.request(msg)
        self._owed = None
        m.round_bytes_up += self.link.bytes_up - up
        m.round_bytes_down += self.link.bytes_down - down
        self._commit_round(committed, draft, reply, rtt, m, params, rng)
        self._after_round(len(draft.ids), reply, draft.ms, rtt, committed, m)

    def _fsd_round(self, sid, committed, remaining, params, rng, m) -> None:
        """An SD round whose draft was (ideally) drafted during the previous round's verification."""
        k = min(self.controller.length(), remaining - 1)
        waited = m.draft_ms
        draft: Draft | None = None
        if self._last_round is not None:
            t1 = time.perf_counter()
            draft, hit = self.predrafter.take(*self._last_round)
            self._last_round = None
            m.draft_ms += (time.perf_counter() - t1) * 1e3  # what the loop waited for its draft
            if draft is None:
                m.predraft_failures += 1
            if hit:
                m.predraft_hits += 1
            else:
                m.predraft_misses += 1
        grammar = self._grammar_at(committed)
        if draft is not None and grammar is not None:
            # pre-drafted without the grammar: a prefix of a draft is a valid draft (its tokens were drawn from
            # the q sent with them), and at T = 0 the allowed prefix is what the masked draft would have drafted
            draft = draft.head(grammar.clone().advance(draft.ids))
        if draft is None or len(draft.ids) < k:
            draft = self.drafter.propose(
                committed, k, params, rng, n_cands=self.fsd.n_cands, payload=self._spec, grammar=grammar
            )
            m.draft_ms += draft.ms
        draft = draft.head(k)
        waited = m.draft_ms - waited  # a hit costs the loop ~nothing: T_p as the loop sees it
        number = m.rounds
        t0 = time.perf_counter()
        up, down = self.link.bytes_up, self.link.bytes_down
        self.link.send(
            wire.Verify(
                sid,
                number,
                len(committed),
                draft.ids,
                draft.wire_q(),
                fix=self._owed,
                cands=draft.cands if self._exits_on else None,
            )
        )
        self._owed = None
        self.predrafter.begin(
            number, committed, draft, max(k, self.controller.length()), params, params.seed, self.stop_ids(), self._spec
        )
        deadline = time.monotonic() + self.recv_timeout_s  # for the result, however many hints come first
        while True:  # exits (hints) until the result of this round
            reply = self.link.recv(sid=sid, timeout_s=max(0.0, deadline - time.monotonic()))
            if not isinstance(reply, wire.Exit):
                break
            replies.check_exit(reply, number, draft.ids, self._vocab(), self._exit_layers)
            m.exits_received += 1
            self.predrafter.offer(number, reply.layer, reply.tokens, reply.confidence)
        rtt = (time.perf_counter() - t0) * 1e3
        m.round_bytes_up += self.link.bytes_up - up
        m.round_bytes_down += self.link.bytes_down - down
        new = self._commit_round(committed, draft, reply, rtt, m, params, rng)
        self._last_round = (number, tuple(new))
        self._after_round(len(draft.ids), reply, waited, rtt, committed, m)
        m.exit_layer_sum += int(reply.timing.get("exit_layer") or 0)
        m.exit_ms += float(reply.timing.get("exit_ms", 0.0))

    def _commit_round(self, committed, draft: Draft, reply, rtt, m, params, rng) -> list[int]:
        """Check the reply to verify round m.rounds and commit it; returns the committed tokens.

        A split rejection comes with the target's p_j instead of a token: the correction is
        drawn here from norm(max(0, p_j - q_j)) and owed to the server with the next request.
        """
        k = len(draft.ids)
        # ProtocolViolation (a lost link) before anything of a bad reply is committed or drawn from
        replies.check_result(reply, m.rounds, draft.ids, len(committed), self._vocab(), self._spec.kind == "split")
        token = reply.token
        if reply.residual is not None:
            try:
                token = payload.correction(
                    reply.residual["logits"], reply.residual["ids"], draft.q.row(reply.accepted), params, rng
                )
            except sampling.SamplingError as e:
                raise ProtocolViolation(f"unusable residual for round {m.rounds}: {e}") from None
            replies.check_ids([token], self._vocab(), f"the correction drawn in round {m.rounds}")
        new = draft.ids[: reply.accepted] + [token]
        self._check_grammar(committed, new, f"the tokens committed by round {m.rounds}")
        if reply.residual is not None:
            self._owed = token
            m.residuals += 1
        committed.extend(new)
        m.rounds += 1
        m.drafted += k
        m.accepted += reply.accepted
        m.wasted_draft_tokens += k - reply.accepted
        m.verify_ms += reply.timing.get("verify_ms", 0.0)
        m.network_ms += max(0.0, rtt - reply.timing.get("verify_ms", 0.0))
        m.target_forward_passes += reply.timing.get("passes", 1)
        return new

    def _vocab(self) -> int:
        """The vocabulary the handshake agreed: every token id a reply carries lies below it."""
        return min(self.link.welcome.vocab_size, self.drafter.vocab_real)

    def _check_grammar(self, committed: list[int], new: list[int], what: str) -> None:
        """Under a grammar, `new` (to follow committed) must be what it allows: the verifier masks the target
        with it. Walks the grammar's state on past them (up to a stop id, where the generation ends), or
        raises ProtocolViolation and leaves it as it was."""
        if self._grammar is None:
            return
        state = self._grammar_at(committed)
        stops = self.stop_ids()
        end = next((i + 1 for i, t in enumerate(new) if t in stops), len(new))
        walk = state.clone() if end > 1 else state  # accept() leaves the state as it was when it refuses
        if walk.advance(new[:end]) < end:
            raise ProtocolViolation(f"{what} leave the grammar the session is constrained by: {new[:end]}")
        self._gstate, self._gpos = walk, len(committed) + end

    # ------------------------------------------------------------------ draft policy

    def _make_controller(self, sid: str, gamma: int, m: Metrics) -> DraftController:
        welcome = self.link.welcome
        predictor = self._predictor(welcome.target) if self.policy.uses_predictor else None
        m.draft_policy = self.policy.kind
        return DraftController(
            self.policy,
            gamma,
            welcome.limits["max_draft_len"],
            predictor,
            self.trace,
            session=sid,
            pair=f"{self.drafter.name}->{welcome.target}",
            estimator=self.estimator,
            as2=self.as2,
        )

    def _predictor(self, target: str) -> RejectionPredictor:
        """The policy's predictor, or the one trained for this draft and target; loaded once."""
        path = str(
            predictor_path(self.drafter.name, target) if self.policy.predictor == "auto" else self.policy.predictor
        )
        if path not in self._predictors:
            self._predictors[path] = RejectionPredictor(path, self.policy.threshold)
            log.info("rejection predictor %s (threshold %.3f)", path, self._predictors[path].threshold)
        return self._predictors[path]

    def _after_round(self, k, reply, draft_ms, rtt, committed, m) -> None:
        m.draft_lengths[str(k)] = m.draft_lengths.get(str(k), 0) + 1
        verify_ms = reply.timing.get("verify_ms", 0.0)
        if self.controller.after_round(m.rounds - 1, k, reply.accepted, draft_ms, verify_ms, rtt - verify_ms):
            self._switched(m, committed, "ar")
            self._forget_predraft()

    def _switched(self, m: Metrics, committed: list[int], to: str) -> None:
        ctl = self.controller
        record = {"to": to, "round": m.rounds, "committed": len(committed), **ctl.summary()}
        bound = self.policy.as2_config.leave_below if to == "ar" else self.policy.as2_config.return_above
        record["reason"] = (
            f"speculation's expected speedup over the target alone {ctl.expected_speedup:.2f} "
            f"{'<=' if to == 'ar' else '>'} {bound} (acceptance {record['alpha']:.2f}, round trip "
            f"{record.get('network_ms_0', 0):.0f} ms, target {record.get('verify_ms_0', 0):.0f} ms "
            f"+ {record.get('verify_ms_per_token', 0):.1f} ms/position, draft "
            f"{record.get('t_draft_ms', 0):.1f} ms/token)"
        )
        log.info("AS2: %s: %s", "target-only streaming" if to == "ar" else "speculating again", record["reason"])
        if len(m.as2_switches) < 64:
            m.as2_switches.append(record)

    def _fold_policy(self, m: Metrics) -> None:
        ctl = self.controller
        if ctl is None:
            return
        m.gamma_star = ctl.gamma_star
        m.expected_speedup = ctl.expected_speedup
        m.estimates = ctl.summary()
        m.predictor_stops = ctl.stops
        m.feature_ms = ctl.feature_ms
        if ctl.predictor is not None:
            m.predictor_calls = ctl.predictor.calls
            m.predictor_ms = ctl.predictor.ms

    def _stream_phase(self, sid, committed, remaining, params, m) -> None:
        """AS2 has speculation off: the target streams alone until speculation would win again.

        Tokens come in chunks of `stream_chunk`; the next chunk is asked for when
        the current one starts arriving, so no round trip opens between chunks. The
        robot is idle meanwhile, so its draft follows along: its agreement with each
        streamed token (min(1, q/p) at T > 0, the chance the token would have been
        accepted) keeps acceptance estimated, and a ping per chunk keeps the round trip.
        """
        ctl = self.controller
        stops = sorted(self.stop_ids())
        stream = replies.StreamCheck(self._vocab(), stops)
        asked = min(self.policy.stream_chunk, remaining)
        self.link.send(wire.Ar(sid, asked, stops, fix=self._owed))
        stream.asked(asked)
        self._owed = None
        chunks = 1  # asked for and not finished
        back = False
        latency = self.link.latency_ms
        self.link.ping()
        t0 = time.perf_counter()
        verify_sum = 0.0
        while chunks:
            reply = stream.check(self.link.recv(sid=sid))
            self._check_grammar(committed, [reply.token], f"streamed token seq {reply.seq}")
            t1 = time.perf_counter()
            logits = self.drafter.next_logits(committed)
            draft_ms = (time.perf_counter() - t1) * 1e3
            committed.append(reply.token)
            verify_ms = reply.timing.get("verify_ms", 0.0)
            m.streamed_tokens += 1
            verify_sum += verify_ms
            m.target_forward_passes += reply.timing.get("passes", 1)
            ctl.after_streamed(_agreement(logits, reply, params), draft_ms, verify_ms)
            if reply.seq == 0:  # a chunk starts: decide whether to ask for another
                if self.link.latency_ms != latency:
                    latency = self.link.latency_ms
                    ctl.after_latency(latency)
                    self.link.ping()
                if not back:
                    back = ctl.decide_streaming()
                if not back and chunks == 1 and asked < remaining:
                    n = min(self.policy.stream_chunk, remaining - asked)
                    self.link.send(wire.Ar(sid, n, stops))
                    stream.asked(n)
                    asked += n
                    chunks += 1
            if reply.done:
                chunks -= 1
                if reply.token in stops:
                    break
        m.verify_ms += verify_sum
        m.network_ms += max(0.0, (time.perf_counter() - t0) * 1e3 - verify_sum)
        if back:
            self._switched(m, committed, "sd")

    def _ar_stream(self, sid, committed, remaining, m) -> None:
        """Target-only tokens streamed by the server; each is committed as it arrives."""
        t0 = time.perf_counter()
        verify_ms = 0.0
        stops = sorted(self.stop_ids())
        stream = replies.StreamCheck(self._vocab(), stops)
        self.link.send(wire.Ar(sid, remaining, stops))
        stream.asked(remaining)
        while True:
            reply = stream.check(self.link.recv(sid=sid))
            self._check_grammar(committed, [reply.token], f"streamed token seq {reply.seq}")
            committed.append(reply.token)
            m.rounds += 1
            verify_ms += reply.timing.get("verify_ms", 0.0)
            m.target_forward_passes += reply.timing.get("passes", 1)
            if reply.done:
                break
        m.verify_ms += verify_ms
        m.network_ms += max(0.0, (time.perf_counter() - t0) * 1e3 - verify_ms)


def _agreement(logits: np.ndarray, reply: wire.Token, params: SamplingParams) -> float:
    """P(accept) had the draft proposed here: 1[argmax q = x] when greedy, min(1, q(x)/p(x)) for x ~ p.

    For x drawn from the target's p, E[min(1, q(x)/p(x))] = sum_x min(p, q), the acceptance rate.
    """
    if params.greedy:
        return float(int(np.argmax(logits)) == reply.token)
    q = float(sampling.probs_from_logits(logits, params)[reply.token])
    p = reply.p if reply.p else 1.0
    return min(1.0, q / p)
