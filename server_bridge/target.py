"""The target (large) model on the server: transformers + torch, with a per-session KV cache.

A `TargetState` holds the committed prefix of one session and the KV cache of
all but its last token (the last one is fed with the next draft, so its logits
come out of the same forward pass). A round forwards only the new tokens; the
rejected ones are cropped off the cache.
"""
from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from . import modelfiles

log = logging.getLogger(__name__)


@dataclass
class TargetState:
    ids: list[int]                      # the committed prefix, prompt included
    cache: object                       # transformers DynamicCache over ids[:cached]
    cached: int = 0                     # tokens in the cache; < len(ids), except == while a split
                                        # rejection waits for the robot's correction (see Verifier.fix)
    passes: int = 0                     # forward passes spent on this session


def _crop(cache, n: int) -> None:
    """Keep the first n positions of a DynamicCache.

    Layer by layer: transformers 5 crops every layer by one count to drop, but
    after a pass that died midway the blocks before the failure hold more
    positions than those after it.
    """
    for layer in cache.layers:
        drop = layer.get_seq_length() - n
        if drop > 0:
            layer.crop(-drop)


class TargetModel:
    """Loads a causal LM in float32 and runs forward passes over session states.

    Not thread-safe: the server calls it from one executor thread.
    """

    def __init__(self, name_or_path: str = modelfiles.DEFAULT_TARGET, threads: int = 0):
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        if threads > 0:
            torch.set_num_threads(threads)
        src = modelfiles.resolve_target(name_or_path)
        t0 = time.perf_counter()
        model_dir = _cached_conversion(src) if src.suffix == ".gguf" else src
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.name = name_or_path if name_or_path in modelfiles.TARGETS else src.name
        self.vocab_size = int(self.model.config.vocab_size)
        pieces = self.tokenizer.convert_ids_to_tokens(list(range(self.vocab_size)))
        self.vocab_hash = modelfiles.vocab_hash(p.encode("utf-8") for p in pieces)
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = sorted({eos} if isinstance(eos, int) else set(eos or ()))
        self.n_layers = int(self.model.config.num_hidden_layers)
        log.info("target %s loaded from %s in %.1fs (%d layers, vocab %d, torch threads %d)", self.name,
                 model_dir, time.perf_counter() - t0, self.n_layers, self.vocab_size, torch.get_num_threads())

    def new_state(self, prompt_ids: list[int]) -> TargetState:
        """Prefill all but the last prompt token; returns the state ready for its first round."""
        from transformers import DynamicCache

        state = TargetState(ids=list(prompt_ids), cache=DynamicCache(config=self.model.config))
        if len(prompt_ids) > 1:
            self._forward(state, prompt_ids[:-1], keep=1)       # only the KV is needed
            state.cached = len(prompt_ids) - 1
        return state

    @torch.inference_mode()
    def _forward(self, state: TargetState, new_ids: list[int], keep: int) -> torch.Tensor:
        """Append new_ids to the cache; float32 logits [keep, vocab] for the last `keep` positions.

        The LM head (49,152 x 576) is computed only for the rows used, not for a re-fed prefix.
        """
        x = torch.tensor([new_ids], dtype=torch.long)
        out = self.model(input_ids=x, past_key_values=state.cache, use_cache=True, logits_to_keep=keep)
        state.passes += 1
        return out.logits[0].float()

    def score(self, state: TargetState, draft_ids: list[int],
              taps: Mapping[int, Callable[[torch.Tensor], None]] | None = None) -> np.ndarray:
        """One verification pass: logits [k + 1, vocab] for the positions after each draft prefix.

        Row i is the target's distribution for the token after ids + draft[:i].
        The cache now covers ids + draft; call `commit` to crop the rejected part.

        taps: {layer: fn}, each called during this pass (and only this one: the
        hooks are removed after it) with the residual stream after decoder block
        `layer` (1-based) at the k + 1 draft rows, hidden [k + 1, hidden]. The
        early exits read it there. A tap must not modify it, and should not raise:
        a pass that raises midway is dropped from the cache and re-raised.
        """
        rows = len(draft_ids) + 1
        handles = []
        try:
            for layer, fn in (taps or {}).items():
                if not 1 <= layer <= self.n_layers:
                    raise ValueError(f"no decoder block {layer} to tap (the target has {self.n_layers})")
                handles.append(self.model.model.layers[layer - 1].register_forward_hook(_tap_hook(fn, rows)))
            pending = state.ids[state.cached:]
            return self._forward(state, pending + list(draft_ids), keep=rows).numpy()
        except BaseException:
            _crop(state.cache, state.cached)    # blocks before the failure appended KV, later ones did not
            raise
        finally:
            for h in handles:
                h.remove()

    def rewind(self, state: TargetState, ids: list[int]) -> None:
        """Re-point a state at another committed prefix, keeping the KV of the part both share."""
        keep = min(state.cached, _common_prefix(state.ids, ids), len(ids) - 1)
        state.ids = list(ids)
        state.cached = keep
        _crop(state.cache, keep)

    def commit(self, state: TargetState, new_ids: list[int], n_valid_in_cache: int) -> None:
        """Extend the committed prefix; keep only the cache positions still on it.

        Normally the last committed token is not in the cache (it is fed with the next
        draft). A split rejection commits only the accepted draft, all of it cached, and
        the robot's correction comes next; so the cache may cover every committed id.
        """
        state.ids.extend(new_ids)
        state.cached = min(n_valid_in_cache, len(state.ids))
        _crop(state.cache, state.cached)


def _tap_hook(fn: Callable[[torch.Tensor], None], rows: int):
    """A forward hook on a decoder block passing its output's last `rows` positions to fn.

    Returns None, so the block's output goes on unchanged.
    """
    def hook(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output     # [1, T, hidden]
        fn(hidden[0, -rows:])                                            # [rows, hidden]
    return hook


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def _cached_conversion(gguf: Path) -> Path:
    """Dequantize a GGUF to a float32 HF directory once; later starts load it in under a second."""
    out = modelfiles.target_cache_dir(gguf)
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    log.info("converting %s to float32 (first start only, ~1 min) -> %s", gguf, out)
    hf_logging.enable_progress_bar()                # the one slow step: show its progress
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    finally:
        hf_logging.disable_progress_bar()
    # The weights are plain float32 now; transformers still marks the model as
    # "gguf-quantized" and refuses to save it, so drop the marker first.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(out)                     # atomic: a crash mid-save never leaves a half cache
    return out
