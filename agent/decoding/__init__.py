"""The decoding client: a draft model on the robot and the verifier's link, nothing of the robot.

    open_decoder(settings)  the one way to a decoder: the draft model `settings` names, loaded, and an
                            EdgeDecoder over it (or over a `drafter` already loaded, to share it)
    settings    DecoderSettings: everything a decoder is opened with, declared once

    drafter     the draft model (llama.cpp): tokens, logits, top-K candidates, images
    decoder     EdgeDecoder: open, rounds of draft -> verify -> commit (SD, FSD, AR stream), close
    run         one generation's state (committed ids, grammar walk, images, payload), made per generate()
    metrics     what a generation returns: Generation and its Metrics
    session     the link's sessions: connect, reconnect with backoff, sids, session_taken, resume, re-open
    link        the websocket to the verifier: TLS, hello/welcome, send and receive messages
    replies     every verifier reply checked before anything commits it
    policy      how many tokens to draft next: plan() / observe() (draftlen: the optimal length; predictor: stop early)
    streaming   target-only streams: the AR mode's, and AS2's streaming phase of SD and FSD
    fsd         FSD's side of a round: the exits asked for, the draft (pre-drafted or not), early-exit hints
    predraft    drafting the next round while the verifier checks this one (FSD)
    branches    the pre-drafted branches

It imports only `protocol/` and `runtime/` (tests/test_import_graph.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .settings import DecoderSettings

if TYPE_CHECKING:
    from .decoder import EdgeDecoder
    from .drafter import Drafter

__all__ = ["DecoderSettings", "open_decoder"]


def open_decoder(settings: DecoderSettings = DecoderSettings(), drafter: Drafter | None = None) -> EdgeDecoder:
    """An EdgeDecoder with `settings`, over `drafter` when given (one loaded draft model shared by several
    decoders), else over the draft model the settings name, loaded here (llama.cpp: seconds). The only
    place a Drafter or an EdgeDecoder is made (tests/test_code_shape.py)."""
    from .decoder import EdgeDecoder

    if drafter is None:
        from .drafter import Drafter

        drafter = Drafter(
            settings.draft,
            threads=settings.threads,
            n_gpu_layers=settings.n_gpu_layers,
            mmproj=settings.draft_mmproj or None,
        )
    return EdgeDecoder(drafter, settings)
