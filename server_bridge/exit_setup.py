"""Which early exits a server runs: the layers a llamacpp engine must tap (`exit_taps`) and the heads the
config names, loaded for the engine that serves (`load_exits`): numpy heads over the GGUF on llamacpp, the
trained modules on the torch engine's device."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, cast

from protocol import modelfiles

from .config import ServerConfig
from .exits import ExitConfig, ExitScorer, NumpyExitHeads
from .target import Target

if TYPE_CHECKING:
    from .engines.exits_torch import TorchExitScorer
    from .engines.llamacpp import LlamaCppEngine
    from .engines.torch import TorchEngine

log = logging.getLogger(__name__)


def exit_taps(config: ServerConfig, target_name: str) -> list[int]:
    """The layers a llamacpp engine must tap for the exits the config names ([]: no eval callback).

    Only adapters named outright: with exits "auto" a llamacpp server runs none. Measured, they
    save nothing there: FSD 28.7 tok/s with exits, 28.6 without at RTT 0, 22.8 and 23.3 at 50 ms
    (docs/exits/fsd), while they add 12 ms to an accepted 65 ms pass (docs/exits).
    """
    if config.exits == "auto":
        return []
    path = modelfiles.resolve_exits(config.exits, target_name)
    return [] if path is None else ExitConfig.load(path).pick(config.exit_layers or None)


def load_exits(config: ServerConfig, target: Target) -> ExitScorer | None:
    """The early-exit heads the config names (config.exits, config.exit_layers), or None for none.

    On the torch engine the trained modules run on the model's device and dtype; on the llamacpp
    engine the same adapters run in numpy over the GGUF's own norm and LM head, fed by the
    engine's eval callback, which must tap their layers (load the engine with
    `tap_layers=exit_taps(config, name)`, as `server.target_from_config` does).
    """
    path = modelfiles.resolve_exits(config.exits, target.name)
    if path is None:
        log.info("early exits off (exits=%r, target %s)", config.exits, target.name)
        return None
    engine = target.engine
    scorer: TorchExitScorer | NumpyExitHeads | None
    if engine.info.engine == "torch":
        scorer = _torch_heads(path, config, target)
    else:
        scorer = _numpy_heads(path, config, target)
        if scorer is None:
            return None
    hidden = engine.hidden_size
    if scorer.config.hidden != hidden or scorer.layers[-1] > target.n_layers:
        raise ValueError(
            f"exit adapters at {path} (hidden {scorer.config.hidden}, layers {scorer.layers}) do not "
            f"fit the target {target.name} (hidden {hidden}, {target.n_layers} layers)"
        )
    if scorer.config.target and scorer.config.target != target.name:
        log.warning(
            "exit adapters at %s were trained for %s, the target is %s", path, scorer.config.target, target.name
        )
    log.info("early exits at layers %s from %s on the %s engine", scorer.layers, path, engine.info.engine)
    return scorer


def _torch_heads(path: Path, config: ServerConfig, target: Target) -> TorchExitScorer:
    """The trained modules on the torch engine's device and dtype."""
    from .engines.exits_torch import ExitHeads, TorchExitScorer

    engine = cast("TorchEngine", target.engine)
    heads = ExitHeads.load(path, config.exit_layers or None)
    heads.to(device=engine.device, dtype=engine.dtype)
    heads.n_vocab = target.vocab_size  # the agreed vocabulary: a padded head's [PAD] rows never name a token
    return TorchExitScorer(heads, engine.model)


def _numpy_heads(path: Path, config: ServerConfig, target: Target) -> NumpyExitHeads | None:
    """The adapters in numpy over the llamacpp engine's GGUF, fed by its eval callback; None (exits "auto")
    or ValueError (exits named) when the engine does not tap their layers."""
    engine = cast("LlamaCppEngine", target.engine)
    need = ExitConfig.load(path).pick(config.exit_layers or None)
    if not set(need) <= set(engine.tapped):
        why = (
            f"the llamacpp engine taps layers {engine.tapped}, the exits need {need}: load it with "
            "tap_layers=exit_taps(config, name)"
        )
        if config.exits != "auto":
            raise ValueError(why)
        log.info("early exits off on this llamacpp engine (name them with --exits PATH to run them): %s", why)
        return None
    scorer = NumpyExitHeads.load(path, engine.path, need)
    scorer.head = scorer.head[: target.vocab_size]  # a view: a padded head's [PAD] rows never name a token
    return scorer
