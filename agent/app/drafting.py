"""The robot's draft model as one service: the Drafter, the navigation's decoder over it, the model's lock and
its queue, navigation first; the chat endpoint's client (api.openai_listen) shares all three.

    drafts = DraftService.open(cfg, token)     built once from the config (agent/app/daemon.py's start)
    with drafts.navigation():                  a navigation step's generation: ahead of every chat request
        ...
    client = drafts.chat_client()              the OpenAI endpoint's Client: its generations take the model
                                               only when no navigation step waits, and give it back at their
                                               next round when one does (ModelTurns.yield_turn)

The weights are loaded once; navigation and chat each draft in a llama.cpp context (KV cache) of their own
(`Drafter.sibling`), and take turns at the model. So a chat answer between two steps leaves the navigation
prompt's KV where it was: a step re-prefills only what its prompt added (about 50 tokens), not the whole prompt
(about 1,100, over 3 s on one core) after every chat answer, as it did while one context served both. A chat
answer that yields between two rounds goes on from its committed tokens afterwards, exactly. Its server-side
session is its own and waits meanwhile.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator

from agent.decoding import DecoderSettings, open_decoder
from agent.decoding.decoder import EdgeDecoder
from agent.decoding.link import default_robot_id

from .config import Config

if TYPE_CHECKING:
    from agent.client import Client


class ModelTurns:
    """The draft model's lock with a queue: navigation first, chat generations behind it.

    A navigation step waits only for the generation that holds the model to reach its next round (a chat
    generation calls `yield_turn` between rounds); a chat generation never starts while a step waits.
    `with turns:` (or acquire/release) is a chat generation's turn, as a threading.Lock's is (agent/client.py).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._held: str | None = None  # "navigation" | "chat" | None
        self._nav_waiting = 0
        self.chat_yields = 0  # chat generations that gave the model to a waiting step between two rounds
        self.nav_wait_s = 0.0  # navigation steps' total wait for the model

    @contextmanager
    def navigation(self) -> Iterator[None]:
        """A navigation step's generation: ahead of every chat generation that has not started."""
        t0 = time.monotonic()
        with self._cond:
            self._nav_waiting += 1
            try:
                self._cond.wait_for(lambda: self._held is None)
            finally:
                self._nav_waiting -= 1
            self._held = "navigation"
        self.nav_wait_s += time.monotonic() - t0
        try:
            yield
        finally:
            self._release()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        """A chat generation's turn: once the model is free and no navigation step waits for it."""
        with self._cond:
            free = lambda: self._held is None and self._nav_waiting == 0  # noqa: E731
            if not blocking:
                ok = free()
            else:
                ok = self._cond.wait_for(free, None if timeout < 0 else timeout)
            if ok:
                self._held = "chat"
            return ok

    def release(self) -> None:
        self._release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self._release()

    def _release(self) -> None:
        with self._cond:
            self._held = None
            self._cond.notify_all()

    @property
    def navigation_waiting(self) -> bool:
        return self._nav_waiting > 0

    def yield_turn(self, drafter: Any = None) -> bool:
        """Between two rounds of a chat generation (its holder): when a navigation step waits, let it run, then
        take the model back (with the draft's images as they were: the step may have shown it its own).
        True when it yielded."""
        if self._nav_waiting == 0:  # read without the lock: a step that starts waiting now is seen next round
            return False
        images = list(getattr(drafter, "images", []) or [])
        self._release()
        self.acquire()
        self.chat_yields += 1
        if drafter is not None and hasattr(drafter, "use_images"):
            drafter.use_images(images)
        return True


class DraftService:
    """The draft model, the navigation's decoder over it, and its turns (see the module's doc)."""

    def __init__(self, decoder: EdgeDecoder, offline_policy: str) -> None:
        self.decoder = decoder
        self.turns = ModelTurns()
        self.offline_policy = offline_policy
        self._chat_drafter: Any = None  # the chat's context over the same model (chat_client)

    @classmethod
    def open(cls, cfg: Config, token: str, drafter: Any = None) -> DraftService:
        """Load the draft (or use `drafter`, already loaded) and make the navigation's decoder from the config."""
        return cls(open_decoder(decoder_settings(cfg, token), drafter), cfg.offline.policy)

    @property
    def drafter(self) -> Any:
        return self.decoder.drafter

    def navigation(self) -> Any:
        """The model's turn for one navigation step's generation (a context manager), ahead of chat."""
        return self.turns.navigation()

    def chat_client(self) -> Client:
        """The OpenAI endpoint's Client: this draft model in a context of its own (made at the first call, shared
        by every chat client after it), its own link to the same verifier, and the turns."""
        from agent.client import Client

        if self._chat_drafter is None:
            self._chat_drafter = self.drafter.sibling()
        return Client(
            self.decoder.settings,
            drafter=self._chat_drafter,
            offline="local" if self.offline_policy == "local" else "refuse",
            lock=self.turns,
        )

    def close(self) -> None:
        self.decoder.close()


def decoder_settings(cfg: Config, token: str) -> DecoderSettings:
    """The decoding client's settings: [agent] and [link] are its parts (they inherit them), taken by their
    fields; the token (read from link.token_env) and the robot id when none is configured added here."""
    return DecoderSettings.of(cfg.agent, cfg.link, token=token, robot_id=cfg.link.robot_id or default_robot_id())
