"""The step's answer from the verifier, or without it: the link's state (`LinkState`: up or down, probed with
backoff while down) and the generation (`Answerer`: speculative and verified while the link is up; offline, the
configured policy: hold, which waits and resumes from the committed tokens, or local, the draft alone).
agent/app/navigator.py's module docstring says what each offline policy does for the robot."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Sequence

from agent.decoding.decoder import EdgeDecoder, Generation
from agent.decoding.link import LinkLost, ServerError
from agent.robot.actions import STOP, answer_grammar, complete
from agent.robot.control import ControlLoop
from agent.robot.feasible import every_allowed
from protocol.grammar import GrammarError
from protocol.images import PromptImage
from protocol.sampling import SamplingParams

from .config import Config
from .step import Step

log = logging.getLogger(__name__)


class LinkState:
    """The verifier's link as the navigator sees it: up, down or unknown (no probe yet); while down, probed again
    with a backoff (link.reconnect_backoff_s, doubling to link.reconnect_backoff_max_s)."""

    def __init__(
        self,
        decoder: EdgeDecoder,
        config: Config,
        emit: Callable[[dict], None],
        on_mode: Callable[[str], None],
        clock: Callable[[], float],
    ):
        self.decoder = decoder
        self.cfg = config
        self.emit = emit
        self.on_mode = on_mode
        self.clock = clock
        self.state = "unknown"  # up | down | unknown (no step yet)
        self.backoff = config.link.reconnect_backoff_s
        self.next_probe = 0.0

    def check(self) -> bool:
        """Probe the verifier now (at start, and while offline when the backoff allows)."""
        if self.decoder.url is None:
            self.mark("down", "no verifier configured")
            return False
        if self.decoder.connect():
            self.mark("up", "verifier answered")
            return True
        self.mark("down", "verifier unreachable")
        return False

    def probe_if_due(self) -> bool:
        if self.state != "down":
            return True
        if self.clock() < self.next_probe:
            return False
        ok = self.check()
        if not ok:
            self.next_probe = self.clock() + self.backoff
            self.backoff = min(self.cfg.link.reconnect_backoff_max_s, self.backoff * 2)
        return ok

    def mark(self, state: str, why: str) -> None:
        if state == self.state:
            return
        previous, self.state = self.state, state
        if state == "up":
            self.backoff = self.cfg.link.reconnect_backoff_s
            if previous == "down":
                log.warning("verifier is back: verified mode (%s)", why)
        else:
            self.next_probe = self.clock() + self.backoff
            log.warning("verifier lost (%s): offline mode, policy %s", why, self.cfg.offline.policy)
        mode = "verified" if state == "up" else "offline"
        self.on_mode(mode)
        self.emit({"event": "mode", "mode": mode, "offline_policy": self.cfg.offline.policy, "why": why})


class Answerer:
    """A step's answer on its record: verified while the link is up, else the offline policy (offline.policy)."""

    def __init__(
        self,
        decoder: EdgeDecoder,
        link: LinkState,
        control: ControlLoop,
        config: Config,
        params: SamplingParams,
        session: str,
        grammar: str | None,
        max_tokens: int,
        hold_wait_s: float,
        clock: Callable[[], float],
    ):
        self.decoder = decoder
        self.drafter = decoder.drafter
        self.link = link
        self.control = control
        self.cfg = config
        self.params = params
        self.session = session
        self.grammar = grammar
        self.max_tokens = max_tokens
        self.hold_wait_s = hold_wait_s
        self.clock = clock

    def until(self, prefix: list[int]) -> Callable[[list[int]], bool]:
        stops = self.decoder.stop_ids()
        return lambda out: complete(self.drafter.detokenize(prefix + out, skip=stops))

    def decide(
        self, ids: list[int], images: list[PromptImage], rec: Step, frame_t: float, cancel: threading.Event | None
    ) -> bool:
        """Fill rec.text (and mode, tokens, decode metrics); False when the robot must hold. `images`: the
        prompt's (its camera image, perception "vlm"), sent with every generation of the step."""
        committed: list[int] = []
        if self.link.probe_if_due():
            try:
                gen = self.decoder.generate(
                    ids,
                    mode=self.cfg.agent.mode,
                    max_tokens=self.max_tokens,
                    params=self.params,
                    gamma=self.cfg.agent.gamma,
                    until=self.until([]),
                    session=self.session,
                    grammar=self.grammar,
                    images=images,
                )
                self.link.mark("up", "generation verified")
                self._take(rec, gen)
                return True
            except (LinkLost, ServerError) as e:
                self.control.halt("link_lost")  # stop at once; decide what next below
                committed = list(e.token_ids)
                self.link.mark("down", str(e))
                rec.reason = (
                    f"verifier lost mid-answer after {len(committed)} committed tokens: {e}"
                    if committed
                    else f"verifier unreachable: {e}"
                )
        else:
            rec.reason = "verifier unreachable"
        rec.mode = "offline"
        if self.cfg.offline.policy == "local":
            return self._finish_locally(ids, images, committed, rec)
        return self._hold(ids, images, committed, rec, frame_t, cancel)

    def _finish_locally(self, ids: list[int], images: list[PromptImage], committed: list[int], rec: Step) -> bool:
        """Offline local: the draft alone finishes the answer from the committed tokens (unverified)."""
        gen = self.decoder.generate(
            ids + committed,
            mode="local",
            params=self.params,
            max_tokens=max(1, self.max_tokens - len(committed)),
            until=self.until(committed),
            grammar=self.grammar,
            grammar_from=len(ids),
            images=images,
        )
        rec.verified_tokens, rec.unverified_tokens = len(committed), len(gen.token_ids)
        rec.text = self.drafter.detokenize(committed + gen.token_ids, skip=self.decoder.stop_ids())
        rec.decode = {"mode": "local", "tokens": len(gen.token_ids), "tokens_per_s": round(gen.metrics.tokens_per_s, 2)}
        rec.reason = (rec.reason + "; " if rec.reason else "") + "offline local: the draft model alone, unverified"
        return True

    def _hold(
        self,
        ids: list[int],
        images: list[PromptImage],
        committed: list[int],
        rec: Step,
        frame_t: float,
        cancel: threading.Event | None,
    ) -> bool:
        """Stay stopped; resume the same answer if the link returns while the frame is still fresh."""
        while self.clock() - frame_t < self.cfg.agent.max_plan_age_s - self.cfg.link.verify_timeout_s:
            if cancel is not None and cancel.is_set():
                break
            if self.link.probe_if_due():
                try:
                    gen = self.decoder.generate(
                        ids + committed,
                        mode=self.cfg.agent.mode,
                        params=self.params,
                        max_tokens=max(1, self.max_tokens - len(committed)),
                        gamma=self.cfg.agent.gamma,
                        until=self.until(committed),
                        session=self.session,
                        grammar=self.grammar,
                        grammar_from=len(ids),
                        images=images,
                    )
                except (LinkLost, ServerError) as e:
                    committed += list(e.token_ids)
                    self.link.mark("down", str(e))
                    continue
                self._take(rec, gen, prefix=committed)
                rec.reason += f"; resumed from {len(committed)} committed tokens when the verifier came back"
                return True
            time.sleep(min(self.hold_wait_s, max(0.0, self.link.next_probe - self.clock())))
        rec.action, rec.action_text, rec.parse = str(STOP), STOP.text, "refused"
        rec.reason = (rec.reason + "; " if rec.reason else "") + "offline hold: stopped, waiting for the verifier"
        rec.verified_tokens = len(committed)
        rec.text = self.drafter.detokenize(committed, skip=self.decoder.stop_ids())
        return False

    def _take(self, rec: Step, gen: Generation, prefix: Sequence[int] = ()) -> None:
        """rec from a verified generation (after `prefix`, tokens the target committed before a resume)."""
        rec.mode = "verified"  # every token of the answer was committed by the target
        rec.text = self.drafter.detokenize(list(prefix) + gen.token_ids, skip=self.decoder.stop_ids())
        rec.verified_tokens = len(prefix) + len(gen.token_ids)
        m = gen.metrics
        rec.decode = {
            "mode": gen.mode,
            "tokens": len(gen.token_ids),
            "rounds": m.rounds,
            "tau": m.tau,
            "acceptance_rate": m.acceptance_rate,
            "tokens_per_s": round(m.tokens_per_s, 2),
            "draft_ms": round(m.draft_ms, 1),
            "verify_ms": round(m.verify_ms, 1),
            "network_ms": round(m.network_ms, 1),
            "bytes_up": m.bytes_up,
            "bytes_down": m.bytes_down,
            "reconnects": m.reconnects,
            "replicas": list(m.replicas),
        }


def compile_answer_grammars(drafter: Any, grammar: str | None, feasibility: Any) -> None:
    """The answer grammars a step may need (agent/robot/feasible.py: at most four), compiled on the robot's side
    now rather than during a task, where a compile that waits (a busy machine) would fail the step."""
    grammars = getattr(drafter, "grammars", None)
    if grammar is None or grammars is None:
        return
    narrowed = feasibility.min_clearance_m > 0
    for text in [answer_grammar(allowed=a) for a in every_allowed()] if narrowed else [grammar]:
        try:
            grammars.compile("gbnf", text)
        except GrammarError as e:  # the step compiles it again when it needs it
            log.warning("answer grammar not compiled ahead: %s", e)
