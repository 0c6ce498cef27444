"""The robot's decode loop: AR (server alone), SD (draft here, verify there), FSD (SD with
early-exit verdicts and pre-drafting, agent/decoding/fsd.py) and local (draft alone).

A generation reads top to bottom in `_generate_remote`: open the session (agent/decoding/session.py),
rounds (SD / FSD / a target-only stream, agent/decoding/streaming.py) that each commit what the server
committed, close. Its state lives in a `Run` (agent/decoding/run.py) made for it; the EdgeDecoder
keeps only what spans generations.

How long each SD round drafts, and whether to speculate at all, is the draft
policy's (agent/decoding/policy.py: `plan()` before a round, `observe()` after it): fixed,
the rejection predictor, gamma* by Lambert W, and AS2's switch to target-only streaming
when speculation cannot win.

The committed prefix is the only state that matters. Every round appends to
it only what the server committed; when the link drops, the loop reconnects
with backoff, re-opens the session with the committed prefix and redoes the
round, so no token is lost or duplicated.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from protocol import payload, sampling, wire
from protocol.images import PromptImage
from protocol.payload import PayloadSpec
from protocol.sampling import SamplingParams

from . import replies, streaming
from .ahead import Ahead, draft_ahead
from .drafter import Draft, Drafter
from .draftlen import As2, CostEstimator
from .fsd import FsdDrafts
from .link import LinkLost, ProtocolViolation, ServerError, VerifierLink
from .metrics import Generation, Metrics
from .policy import DraftController
from .predictor import RejectionPredictor, TraceWriter, predictor_path
from .report import RoundReport
from .run import GrammarWalk, Run
from .session import ReconnectPolicy, Sessions
from .settings import DecoderSettings, FsdOptions

__all__ = ["DecoderSettings", "EdgeDecoder", "FsdOptions", "Generation", "Metrics", "MODES", "ReconnectPolicy"]

log = logging.getLogger(__name__)

MODES = ("ar", "sd", "fsd", "local")


class EdgeDecoder:
    """The decoding client: `generate()` runs one generation; the drafter, the verifier's link and sessions,
    the cost estimates and the pre-drafter outlive it."""

    def __init__(self, drafter: Drafter, settings: DecoderSettings = DecoderSettings()) -> None:
        self.settings = settings
        self.drafter = drafter
        self.sessions = Sessions(self._new_link, settings.reconnect)  # the link, session names, resume secrets
        self.trace = TraceWriter(settings.trace) if settings.trace else None
        self.estimator = CostEstimator()  # the link's and the pair's, across generations
        self.as2 = As2(settings.policy.as2_config)  # likewise: a slow link starts the next generation streaming
        self.fsd = FsdDrafts(drafter, settings.fsd, settings.verify_timeout_s)  # its pre-drafter outlives runs
        self._ahead: Ahead | None = None  # SD's next draft, made during the last round's wait (agent/decoding/ahead.py)
        self._predictors: dict[str, RejectionPredictor] = {}

    @property
    def url(self) -> str | None:
        return self.settings.url

    @property
    def payload(self) -> PayloadSpec:
        return self.settings.payload_spec

    @property
    def link(self) -> VerifierLink | None:
        """The verifier link when one is up."""
        return self.sessions.link

    def connect(self) -> bool:
        """Make sure the verifier link is up (the offline mode's probe); False when it cannot be."""
        return self.sessions.connect()

    def close(self) -> None:
        self.sessions.drop_link()
        self.fsd.close()
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
        mode: str | None = None,
        max_tokens: int = 64,
        params: SamplingParams = SamplingParams(),
        gamma: int | None = None,
        until: Callable[[list[int]], bool] | None = None,
        session: str | None = None,
        grammar: str | dict[str, str] | None = None,
        grammar_from: int | None = None,
        images: list[PromptImage] | None = None,
    ) -> Generation:
        """Generate up to max_tokens after prompt_ids.

        `mode` and `gamma` (the draft policy's starting length, the fixed policy's only one) default to the
        settings'.

        `until(ids)` ends the generation at the shortest output for which it is true (the
        navigation loop's "a whole action sentence is out"); every mode cuts at the same
        token, so the ids stay the target's own. A LinkLost or ServerError raised here
        carries `token_ids`: what the target committed before the failure, to go on from.

        `session` names a server session kept open after this generation: the next
        generation with the same name re-opens it, and the server keeps the KV of the
        prefix both prompts share (a navigation prompt's long few-shot part is prefilled
        once, not every step). Without it every generation is a fresh, closed session.

        `grammar` constrains the output on both sides (protocol/structured.py, LLGuidance): one of
        protocol.wire.GRAMMAR_KINDS with its text ({"json_schema": text}, {"lark": text}, {"gbnf": text}; a bare
        string is GBNF). The draft drafts under it and the server masks the target with it, so every mode's ids
        are the target's own under the grammar. It applies from prompt_ids[grammar_from:] on (default: the
        generated part only); the ids already there must be allowed by it.

        `images` (a vision-language pair: the draft loaded with its mmproj, a target that reads images):
        the prompt's images, each on its image marker in prompt_ids (PromptImage.of(bytes, at)). Both
        sides prefill them with their own vision encoder; drafting and verification stay over text.
        The first open sends their bytes, a re-open their sha256 (the bytes again if the server lost them).
        """
        mode = self.settings.mode if mode is None else mode
        gamma = self.settings.gamma if gamma is None else gamma
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if mode == "fsd" and self.settings.policy.uses_predictor:
            raise ValueError("fsd pre-drafts whole drafts in the background; use --draft-policy fixed or optimal")
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if max_tokens < 1 or gamma < 0:
            raise ValueError("max_tokens must be >= 1 and gamma >= 0")
        t0 = time.perf_counter()
        run = Run(prompt_ids, mode, max_tokens, params, gamma, session, until, self.payload.for_params(params))
        self._ahead = None  # made for another generation's prompt and images
        if grammar is not None:
            start = len(prompt_ids) if grammar_from is None else grammar_from
            wired = {"gbnf": grammar} if isinstance(grammar, str) else grammar
            run.grammar = GrammarWalk(wired, start, prompt_ids, self.drafter.grammars)
        run.images = self._use_images(images or [], prompt_ids)
        out = self._generate_local(run) if mode == "local" else self._generate_remote(run)
        run.m.finish(len(out), mode, time.perf_counter() - t0)
        return Generation(self.drafter.detokenize(out, skip=self.stop_ids()), out, mode, run.m)

    def _use_images(self, images: list[PromptImage], prompt_ids: list[int]) -> list[PromptImage]:
        """This generation's images: checked on their markers and prefilled by the draft when it drafts."""
        marker = getattr(self.drafter, "image_marker", None)
        for i, image in enumerate(images):
            if not 0 <= image.at < len(prompt_ids) or prompt_ids[image.at] != marker:
                raise ValueError(f"images[{i}] must sit on an image marker of the prompt (index {image.at})")
        if hasattr(self.drafter, "use_images"):  # a drafter without it (a text-only stand-in) reads no images
            self.drafter.use_images(images)
        return list(images)

    # ------------------------------------------------------------------ local (offline)

    def _generate_local(self, run: Run) -> list[int]:
        stops = self.stop_ids()
        while len(run.committed) - run.n_prompt < run.max_tokens:
            t1 = time.perf_counter()
            token = self.drafter.next_token(run.committed, run.params, run.rng, run.grammar_at())
            run.m.draft_ms += (time.perf_counter() - t1) * 1e3
            run.committed.append(token)
            if token in stops:
                break
            out = run.generated()
            cut = run.cut(out)
            if cut is not None:
                return out[:cut]
        return run.generated()

    # ------------------------------------------------------------------ remote (AR, SD, FSD)

    def _generate_remote(self, run: Run) -> list[int]:
        """Open the session, run rounds until the generation is over, close it (a named session stays open).

        A lost link or a lost session is recovered by the session (agent/decoding/session.py): reconnect with
        backoff, re-open with the committed prefix, and the round is done again.
        """
        attempt = self.sessions.begin(run.session, run.m)
        if run.mode == "fsd":
            self.fsd.ready()
        try:
            while (out := run.finished(self.stop_ids())) is None:
                try:
                    attempt.ensure_open(lambda sid, resume: self._open(sid, resume, run))
                    self._round(run, attempt.sid)
                    attempt.succeeded()
                except (LinkLost, ServerError) as e:
                    e.token_ids = run.generated()  # what the target committed: to go on from, when raised
                    self.fsd.forget(run)
                    attempt.recover(e, len(run.committed))  # raises e when going on cannot help
                    if isinstance(e, ServerError) and e.code == "unknown_image":
                        run.image_bytes = True  # the server no longer holds the images: bytes again
            return out
        finally:
            self.fsd.forget(run)
            if run.controller is not None:
                run.controller.fold(run.m)
            attempt.end(close=run.session is None)

    def _round(self, run: Run, sid: str) -> None:
        """One round of the generation's mode; SD and FSD ask the draft policy whether to speculate."""
        if run.mode == "ar":
            run.apply_stream(
                streaming.ar_stream(run, self._connected()[0], sid, sorted(self.stop_ids()), self._vocab())
            )
            return
        if run.controller is None:
            run.controller = self._make_controller(sid, run)
        if not run.controller.speculating:
            link, stops, chunk = self._connected()[0], sorted(self.stop_ids()), self.settings.policy.stream_chunk
            phase = streaming.stream_phase(run, run.controller, link, sid, stops, self._vocab(), self.drafter, chunk)
            run.apply_stream(phase)
            return
        ctl = run.controller
        report = self._sd_round(run, ctl, sid) if run.mode == "sd" else self._fsd_round(run, ctl, sid)
        if run.apply(report, self.stop_ids()):  # AS2 has turned speculation off: no pre-drafted next round
            self.fsd.forget(run)

    def _new_link(self) -> VerifierLink:
        c = self.settings
        if c.url is None:
            raise ValueError("no verifier URL: pass --verifier ws://HOST:PORT or use --local")
        return VerifierLink(
            c.url,
            token=c.token,
            vocab_hash=self.drafter.vocab_hash,
            vocab_size=self.drafter.vocab_size,
            recv_timeout_s=c.verify_timeout_s,
            keepalive_s=c.keepalive_s,
            ca_file=c.ca_file,
            allow_insecure=c.allow_insecure,
            robot_id=c.robot_id,
        )

    def _connected(self) -> tuple[VerifierLink, wire.Welcome]:
        """The link and its welcome (the round loop connects before any round)."""
        link = self.sessions.link
        if link is None or link.welcome is None:
            raise LinkLost("not connected")
        return link, link.welcome

    def _vocab(self) -> int:
        """The vocabulary the handshake agreed: every token id a reply carries lies below it."""
        return min(self._connected()[1].vocab_size, self.drafter.vocab_real)

    def _open(self, sid: str, resume: str, run: Run) -> wire.Opened:
        """Open session `sid` (again) with everything committed so far; returns the checked reply."""
        link, welcome = self._connected()
        layers = self.fsd.exit_layers(welcome) if run.mode == "fsd" else []
        # a verifier that predates grammar_kinds decodes GBNF alone
        kinds = welcome.limits.get("grammar_kinds", ["gbnf"]) if welcome.limits.get("grammar") else []
        kinds = kinds if isinstance(kinds, list) else []
        if run.grammar is not None and run.grammar.kind not in kinds:
            raise ServerError(
                "no_grammar",
                f"the verifier ({welcome.target}) does not decode under a {run.grammar.kind} "
                "grammar: its output would not be the constrained target's",
                sid,
            )
        p, slo = run.params, self.settings.slo_tokens_per_s
        if p.top_p < 1.0 and not p.greedy and not welcome.limits.get("top_p"):
            raise ServerError(
                "no_top_p",
                f"the verifier ({welcome.target}) predates top_p: it would sample the whole distribution",
                sid,
            )
        images = run.open_images(welcome, getattr(self.drafter, "image_marker", None), sid)
        msg = wire.Open(
            sid,
            list(run.committed),
            p.to_wire(),
            exits=layers,
            payload=run.spec.to_wire(),
            slo={"tokens_per_s": slo} if slo else {},
            grammar=None if run.grammar is None else run.grammar.wire,
            images=images,
            resume=resume,
        )
        run.owed = None  # the prefix re-sent here includes any correction
        # the prefill grows with the prompt: allow it ~20 ms a token on top of the reply timeout (a dead
        # link still shows within two keepalives)
        reply, _ = link.request(
            msg,
            timeout_s=self.settings.verify_timeout_s + 0.02 * len(run.committed),
            meanwhile=None if run.mode == "ar" else lambda: self._prefill_draft(run),
        )
        opened = replies.check_opened(reply, sid, len(run.committed))
        run.exit_layers = layers
        run.image_bytes = False  # the server holds them now: a re-open names them by sha256
        run.m.prefill_ms += opened.timing.get("prefill_ms", 0.0)
        run.m.target_forward_passes += opened.timing.get("passes", 0)
        return opened

    def _prefill_draft(self, run: Run) -> None:
        """The draft prefills the prompt while the server prefills its own (the open's round trip), so the first
        round drafts from a warm KV: a step's two prefills (about 50 new tokens each on the robot's navigation
        prompt) overlap instead of following each other. The draft's KV is what the first round would make
        itself (Drafter._logits_after), so the draft is the same; a failure here is the first round's to say."""
        warm = getattr(self.drafter, "next_logits", None)
        if warm is None:
            return
        try:
            warm(run.committed)
        except Exception as e:  # the first round's propose meets it again and raises it where it is handled
            log.debug("the draft's prefill during the open failed: %s", e)

    # ------------------------------------------------------------------ rounds

    def _sd_round(self, run: Run, ctl: DraftController, sid: str) -> RoundReport:
        """Draft the policy's length (or take the draft made ahead during the last round's wait, when the reply
        proved its guess right: agent/decoding/ahead.py), send it, draft the next one ahead while the server
        verifies, and report what the server accepted plus its next token. draft_ms is the drafting the round
        waited for (0 when its draft was made ahead)."""
        link, _ = self._connected()
        ahead, self._ahead = self._ahead, None
        k, watch, grammar = ctl.plan(run.remaining()), ctl.watch(), run.grammar_at()
        if ahead is not None and watch is None and k > 0 and ahead.fits(run.committed):
            draft, draft_ms, predraft = ahead.draft.head(k), 0.0, "hit"
        else:
            draft = self.drafter.propose(
                run.committed, k, run.params, run.rng, watch=watch, payload=run.spec, grammar=grammar
            )
            draft_ms, predraft = draft.ms, "" if ahead is None else "miss"
        number, sent = run.m.rounds, (0, 0)  # the round's bytes up and down, once its reply came
        msg = wire.Verify(sid, number, len(run.committed), draft.ids, draft.wire_q(), fix=run.owed)
        up, down = link.bytes_up, link.bytes_down
        stops, committed = self.stop_ids(), list(run.committed)

        def meanwhile() -> None:
            if watch is None:
                self._ahead = draft_ahead(self.drafter, committed, draft, k, run.params, run.spec, grammar, stops)

        try:
            reply, rtt = link.request(msg, meanwhile=meanwhile)
            sent = (link.bytes_up - up, link.bytes_down - down)
            return self._checked(
                run, draft, reply, rtt, number=number, mode="sd", draft_ms=draft_ms, sent=sent, predraft=predraft
            )
        except (LinkLost, ServerError):  # what the failed round spent; nothing of it is committed
            self._ahead = None
            run.apply(RoundReport(number, "sd", len(draft.ids), draft_ms, *sent, predraft), self.stop_ids())
            raise

    def _fsd_round(self, run: Run, ctl: DraftController, sid: str) -> RoundReport:
        """An SD round whose draft was (ideally) drafted during the previous round's verification."""
        link, _ = self._connected()
        predrafter = self.fsd.ready()
        draft, waited, predraft = self.fsd.draft(run, predrafter, ctl.plan(run.remaining()))
        number, sent, exits = run.m.rounds, (0, 0), 0  # exits: hints received
        t0 = time.perf_counter()
        up, down = link.bytes_up, link.bytes_down
        cands = draft.cands if run.exit_layers else None
        try:
            link.send(
                wire.Verify(sid, number, len(run.committed), draft.ids, draft.wire_q(), fix=run.owed, cands=cands)
            )
            # the next round's draft after each way this one may end, at the length the policy plans now
            stops = self.stop_ids()
            predrafter.begin(
                number, run.committed, draft, ctl.plan(), run.params, run.params.seed, stops, run.spec, run.grammar_at()
            )
            deadline, vocab = self.fsd.deadline(), self._vocab()
            while isinstance(
                reply := self.fsd.next_reply(run, link, predrafter, sid, number, draft, vocab, deadline), wire.Exit
            ):
                exits += 1
            rtt = (time.perf_counter() - t0) * 1e3
            sent = (link.bytes_up - up, link.bytes_down - down)
            return self._checked(
                run,
                draft,
                reply,
                rtt,
                number=number,
                mode="fsd",
                draft_ms=waited,
                sent=sent,
                predraft=predraft,
                exits=exits,
            )
        except (LinkLost, ServerError):  # what the failed round spent; nothing of it is committed
            run.apply(RoundReport(number, "fsd", len(draft.ids), waited, *sent, predraft, exits), self.stop_ids())
            raise

    def _checked(
        self,
        run: Run,
        draft: Draft,
        reply: wire.Message,
        rtt: float,
        *,
        number: int,
        mode: str,
        draft_ms: float,
        sent: tuple[int, int],
        predraft: str = "",
        exits: int = 0,
    ) -> RoundReport:
        """The report of round `number` (drafted in draft_ms, `sent` bytes up and down) once its reply is checked:
        what it commits and what the server spent on it.

        A split rejection comes with the target's p_j instead of a token: the correction is
        drawn here from norm(max(0, p_j - q_j)) and owed to the server with the next request.
        """
        split = run.spec.kind == "split"
        # ProtocolViolation (a lost link) before anything of a bad reply is committed or drawn from
        result = replies.check_result(reply, number, draft.ids, len(run.committed), self._vocab(), split)
        owed = None
        if result.residual is not None:
            owed = self._correction(run, draft, number, result.accepted, result.residual)
        timing, fsd = result.timing, mode == "fsd"
        return RoundReport(
            number,
            mode,
            len(draft.ids),
            draft_ms,
            *sent,
            predraft,
            exits,
            committed=(*draft.ids[: result.accepted], result.token if owed is None else owed),
            accepted=result.accepted,
            owed=owed,
            rtt_ms=rtt,
            verify_ms=timing.get("verify_ms", 0.0),
            passes=timing.get("passes", 1),
            exit_layer=int(timing.get("exit_layer") or 0) if fsd else 0,
            exit_ms=float(timing.get("exit_ms", 0.0)) if fsd else 0.0,
        )

    def _correction(self, run: Run, draft: Draft, number: int, accepted: int, residual: dict[str, Any]) -> int:
        """A split rejection at `accepted` in round `number`: the token drawn here from norm(max(0, p_j - q_j))."""
        if draft.q is None:
            raise ProtocolViolation(f"a residual for round {number}, whose draft sent no q")
        try:
            token = payload.correction(residual["logits"], residual["ids"], draft.q.row(accepted), run.params, run.rng)
        except sampling.SamplingError as e:
            raise ProtocolViolation(f"unusable residual for round {number}: {e}") from None
        replies.check_ids([token], self._vocab(), f"the correction drawn in round {number}")
        return token

    # ------------------------------------------------------------------ draft policy

    def _make_controller(self, sid: str, run: Run) -> DraftController:
        _, welcome = self._connected()
        policy = self.settings.policy
        predictor = self._predictor(welcome.target) if policy.uses_predictor else None
        return DraftController(
            policy,
            run.gamma,
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
        policy = self.settings.policy
        path = str(predictor_path(self.drafter.name, target) if policy.predictor == "auto" else policy.predictor)
        if path not in self._predictors:
            self._predictors[path] = RejectionPredictor(path, policy.threshold)
            log.info("rejection predictor %s (threshold %.3f)", path, self._predictors[path].threshold)
        return self._predictors[path]
