"""What a decoder is opened with, declared once: `DecoderSettings` (and the FSD knobs it holds).

`open_decoder(settings)` (agent/decoding/__init__.py) loads the draft model these name and builds the
EdgeDecoder over it; the CLI, the daemon, the Python API, the tools and the tests all go through it.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol import modelfiles
from protocol.payload import PayloadSpec
from runtime.settings import setting

from .policy import DraftPolicy
from .session import ReconnectPolicy

__all__ = ["DecoderSettings", "FsdOptions"]


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
class DecoderSettings:
    """Everything a decoder is opened with: the draft model, the verifier's link, how rounds draft."""

    draft: str = setting(modelfiles.DEFAULT_DRAFT, help="The draft model: a name of models/ or a GGUF path.")
    draft_mmproj: str = setting("", help='The draft\'s vision projector (GGUF): a vision-language draft; "" = text.')
    threads: int = setting(2, help="llama.cpp threads for the draft; leave cores for the control loop.")
    n_gpu_layers: int = setting(
        -1, help="Draft layers on the GPU: -1 all when llama.cpp can offload, 0 keeps the draft on the CPU."
    )
    url: str | None = setting(None, help="The verifier (ws:// or wss://); unset: offline, local drafting only.")
    token: str = setting("", help="The verifier's bearer token, sent in hello.")
    ca_file: str = setting("", help="wss://: the CA of the verifier's certificate (\"\" = the system's).")
    allow_insecure: bool = setting(False, help="Send the token over plain ws:// to another host.")
    robot_id: str = setting("", help='X-Robot-Id in the handshake, a balancer\'s hash key ("" = none).')
    keepalive_s: float = setting(2.0, help="Websocket ping interval and timeout (not websockets' 20 s).")
    verify_timeout_s: float = setting(30.0, help="A verify reply later than this drops the link (s).")
    reconnect: ReconnectPolicy = setting(ReconnectPolicy(), help="Reconnect attempts and their backoff.")
    mode: str = setting("sd", help="How a generation decodes unless it says: ar, sd, fsd or local.")
    gamma: int = setting(4, help="Draft tokens per round: the fixed policy's length, the others' cap.")
    policy: DraftPolicy = setting(DraftPolicy(), help="How long each round drafts (agent/decoding/policy.py).")
    trace: str | None = setting(None, help="Write the rejection predictor's training rows (JSONL) here.")
    payload: PayloadSpec = setting(PayloadSpec(), help="What the uplink carries of q at temperature > 0.")
    slo: float = setting(0.0, help="Tokens/s this robot needs (the verifier's SLO class); 0 = none.")
    fsd: FsdOptions = setting(FsdOptions(), help="FSD's exits and pre-drafting.")
