"""What a decoder is opened with, declared once: `DecoderSettings`, plain settings in four parts.

    DraftModelSettings  the draft model: its file, vision projector, threads, GPU layers
    DraftingSettings    how rounds draft: mode, gamma, the draft policy's kind, the payload, the SLO class
    TuningSettings      the finer knobs: the predictor policy's, AS2's, FSD's, the trace
    LinkSettings        the verifier's link: its URL, TLS, keepalive, timeouts, reconnects

Every field is one flag (`--draft-policy`) and one TOML key; the robot's [agent] and [link] sections and
`edge-agent generate`'s and `serve`'s options inherit these parts (agent/app/config.py) instead of copying
them, and `DecoderSettings.of(*sources)` takes one out of them by the parts' fields. The decoder
reads the grouped objects it works with (`policy`, `payload_spec`, `fsd`, `reconnect`), made from them here.

`open_decoder(settings)` (agent/decoding/__init__.py) loads the draft model these name and builds the
EdgeDecoder over it; the CLI, the daemon, the Python API, the tools and the tests all go through it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, is_dataclass
from functools import cached_property
from typing import Any

from protocol import modelfiles
from protocol.payload import DEFAULT_KIND, DEFAULT_TOPK, PayloadSpec
from protocol.payload import KINDS as PAYLOAD_KINDS
from runtime.settings import setting

from .draftlen import As2Config
from .policy import POLICIES, DraftPolicy
from .session import ReconnectPolicy

__all__ = [
    "DecoderSettings",
    "DraftModelSettings",
    "DraftingSettings",
    "FsdOptions",
    "LinkSettings",
    "TuningSettings",
]

DECODE_MODES = ("ar", "sd", "fsd", "local")
QUEUE_POLICIES = ("priority", "fifo", "random")


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
class DraftModelSettings:
    """The draft model a decoder loads."""

    draft: str = setting(
        modelfiles.DEFAULT_DRAFT, help=f"The draft model: a name ({', '.join(modelfiles.DRAFTS)}) or a GGUF path."
    )
    draft_mmproj: str = setting(
        "",
        help="The draft's vision projector (GGUF, libmtmd): a vision-language draft (image prompts, perception.kind "
        '"vlm"); "" = a text draft.',
    )
    threads: int = setting(2, help="llama.cpp threads for the draft; leave cores for the control loop.")
    n_gpu_layers: int = setting(
        -1,
        help="Draft layers on the GPU: -1 all when llama.cpp can offload (a CUDA build on the Orin), else none; "
        "0 keeps the draft on the CPU.",
    )


@dataclass(frozen=True)
class DraftingSettings:
    """How a generation's rounds draft and what they send."""

    mode: str = setting(
        "sd",
        choices=DECODE_MODES,
        help="How a generation decodes unless it says: ar (the target alone), sd (speculative), fsd (SD with early "
        "exits and pre-drafting) or local (the draft alone, unverified).",
    )
    gamma: int = setting(4, help="Draft tokens per round: the fixed policy's length, the others' cap.")
    draft_policy: str = setting(
        "fixed",
        choices=POLICIES,
        help="How long each round drafts: fixed (gamma every round); predictor (stop at the first predicted "
        "rejection); optimal (gamma* by Lambert W, and target-only streaming while speculation cannot win: AS2).",
    )
    payload: str = setting(
        DEFAULT_KIND,
        choices=PAYLOAD_KINDS,
        help="What the uplink carries of the draft's distributions at temperature > 0: topk (the K ids and "
        "probabilities the draft sampled from), split (q(x) only; p comes down on a rejection), full (fp16 q) or "
        "none. Temperature 0 always sends ids only.",
    )
    topk: int = setting(DEFAULT_TOPK, metavar="K", help="K of payload topk.")
    slo_tokens_per_s: float = setting(
        0.0,
        help="The verifier's SLO class: tokens/s this robot needs; it is scheduled by the deadlines this sets and "
        'shed ("overloaded": retried as reconnect_attempts allows, then the offline answer) when it cannot be met. '
        "0 = best effort.",
    )


@dataclass(frozen=True)
class TuningSettings:
    """The finer knobs of the draft policies, AS2 and FSD, and the predictor's trace."""

    min_draft: int = setting(1, help="The predictor never stops a draft shorter.")
    max_draft: int | None = setting(None, help="The longest draft (default: gamma; for optimal the server's limit).")
    predictor: str = setting("auto", help="The rejection predictor .onnx (auto: the one shipped for this pair).")
    predictor_threshold: float | None = setting(
        None, help="Stop below this acceptance probability (default: the model's own)."
    )
    as2: bool = setting(True, help="optimal: switch to target-only streaming while speculation cannot win.")
    as2_return_above: float = setting(1.1, help="optimal: speculate again once the expected speedup is above this.")
    trace: str | None = setting(
        None, metavar="FILE", help="Append one JSON line per judged draft token (predictor features and label)."
    )
    exits: str = setting("all", help='fsd: early-exit layers to ask for, e.g. 18,26; all, or "" for none.')
    predraft_workers: int = setting(1, help="fsd: branches pre-drafted at once.")
    predraft_threads: int = setting(1, help="fsd: llama threads of the pre-draft context.")
    queue_policy: str = setting(
        "priority", choices=QUEUE_POLICIES, help="fsd: the order early verdicts are pre-drafted in."
    )
    guesses: bool = setting(True, help="fsd: also pre-draft from the robot's own guesses, not only early exits.")
    n_cands: int = setting(8, help="fsd: draft top-K ids sent per position for the exits to score.")


@dataclass(frozen=True)
class LinkSettings:
    """The verifier's link, less its credential (the robot keeps that out of its config file)."""

    verifier: str | None = setting(
        None,
        flag="--verifier",
        help='wss://HOST:PORT of server-bridge (ws:// on loopback); unset or "": offline, the draft alone.',
    )
    ca_file: str = setting(
        "", help="wss://: the CA (PEM) that signed the server's certificate; \"\" = the system's CAs."
    )
    allow_insecure: bool = setting(
        False, help="Send the token over plain ws:// to another host (a lab network only, never a shared Wi-Fi)."
    )
    robot_id: str = setting(
        "",
        help="X-Robot-Id in the handshake, which a balancer hashes to keep this robot on one replica; edge-agent's "
        '"" = robot-<hash of /etc/machine-id>, stable across reboots (the Python API\'s: none).',
    )
    keepalive_s: float = setting(2.0, help="Websocket ping interval and timeout (websockets' 20 s is too late).")
    verify_timeout_s: float = setting(30.0, help="A verify answer later than this counts as a lost link (s).")
    reconnect_attempts: int = setting(
        8,
        help="Consecutive reconnect failures, or requests the verifier shed (overloaded, retried after the same "
        "backoff), before the link counts as lost.",
    )
    reconnect_backoff_s: float = setting(0.1, help="The first reconnect delay; it grows after each failure ...")
    reconnect_backoff_max_s: float = setting(2.0, help="... up to this (s).")


@dataclass(frozen=True)
class DecoderSettings(TuningSettings, DraftingSettings, DraftModelSettings, LinkSettings):
    """Everything a decoder is opened with: the draft model, how rounds draft, the verifier's link."""

    token: str = setting(
        "", help='The verifier\'s bearer token, sent in hello (edge-agent generate and serve: "" = $VERIFIER_TOKEN).'
    )

    @classmethod
    def of(cls, *sources: Any, **values: Any) -> DecoderSettings:
        """The settings out of objects that inherit some of their parts (a config section, a command's options):
        each part's fields taken by name from the source that inherits it; `values` set the rest and win."""
        taken: dict[str, Any] = {}
        for source in sources:
            for part in (*cls.__mro__[1:], cls):
                if is_dataclass(part) and isinstance(source, part):
                    taken.update({f.name: getattr(source, f.name) for f in fields(part)})
        return cls(**{**taken, **values})

    @property
    def url(self) -> str | None:
        """The verifier's URL; None: offline."""
        return self.verifier or None

    @cached_property
    def policy(self) -> DraftPolicy:
        """The draft policy these settings describe (agent/decoding/policy.py)."""
        return DraftPolicy(
            self.draft_policy,
            min_len=self.min_draft,
            max_len=self.max_draft,
            predictor=self.predictor,
            threshold=self.predictor_threshold,
            as2=self.as2,
            as2_config=As2Config(return_above=self.as2_return_above),
        )

    @cached_property
    def payload_spec(self) -> PayloadSpec:
        """The uplink's payload mode, as a session's `open` declares it."""
        return PayloadSpec.parse(self.payload, self.topk)

    @cached_property
    def fsd(self) -> FsdOptions:
        """FSD's knobs (agent/decoding/fsd.py); ValueError when exits is not all, "" or layer numbers."""
        try:
            exits = None if self.exits == "all" else tuple(int(x) for x in self.exits.split(",") if x.strip())
        except ValueError:
            raise ValueError(f'exits must be all, "" or layer numbers like 18,26, got {self.exits!r}') from None
        return FsdOptions(
            exits=exits,
            workers=self.predraft_workers,
            policy=self.queue_policy,
            n_cands=self.n_cands,
            guesses=self.guesses,
            threads=self.predraft_threads,
        )

    @property
    def reconnect(self) -> ReconnectPolicy:
        """How the link reconnects (agent/decoding/session.py)."""
        return ReconnectPolicy(self.reconnect_attempts, self.reconnect_backoff_s, self.reconnect_backoff_max_s)
