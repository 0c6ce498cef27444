"""The target (large) model on the server: transformers + torch, with a per-session KV cache.

A `TargetState` holds the committed prefix of one session and the KV cache of
all but its last token (the last one is fed with the next draft, so its logits
come out of the same forward pass). A round forwards only the new tokens; the
rejected ones are cropped off the cache.

`TargetModel.extend` runs several sessions in one forward pass. Each row of
the batch is one session: its cache left-padded to the longest cache in the
batch, its new tokens right-padded to the longest run, an attention mask that
hides every pad, and position ids that count from the session's own length.
A row therefore attends to exactly the keys it would alone, at the positions
it would have alone, and batching changes no session's tokens (the test:
tests/server_bridge/test_batching.py). After the pass each session's cache is
copied back out of the batch's without the pads. Both copies are the price of
a padded batch on a dense cache: the estimator's b_r term (cached tokens read)
carries it.
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

from protocol import modelfiles

log = logging.getLogger(__name__)


@dataclass
class Extension:
    """One session's part of a forward pass."""
    state: "TargetState"
    new_ids: list[int]                  # appended after state.cached: uncached committed ids, then the draft
    keep: int                           # logits rows wanted: the last `keep` of new_ids (0: KV only)
    taps: Mapping[int, Callable[[torch.Tensor], None]] | None = None   # see TargetModel.score

    @property
    def member(self) -> tuple[int, int]:
        """(L_cached, L_new) for the verification-time estimator."""
        return self.state.cached, len(self.new_ids)


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
        cfg = self.model.config
        self.kv_heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        # KV of one token in every layer, float32: what a session's cache costs (the memory budget's unit)
        self.kv_bytes_per_token = 2 * self.n_layers * self.kv_heads * self.head_dim * 4
        # Padded batches need plain full-attention caches; a sliding-window layer (Gemma 3) keeps only
        # its window, so such a target runs a batch's sessions one pass each (same tokens, no speed-up).
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        self.batchable = all(type(layer) is DynamicLayer for layer in DynamicCache(config=cfg).layers)
        log.info("target %s loaded from %s in %.1fs (%d layers, vocab %d, torch threads %d)", self.name,
                 model_dir, time.perf_counter() - t0, self.n_layers, self.vocab_size, torch.get_num_threads())

    def new_state(self, prompt_ids: list[int], prefill: bool = True) -> TargetState:
        """A state for prompt_ids; with prefill, all but the last prompt token are forwarded now.

        Without it the cache starts empty and the first `extend` forwards the prompt
        (the server batches prefills with other sessions' rounds).
        """
        from transformers import DynamicCache

        state = TargetState(ids=list(prompt_ids), cache=DynamicCache(config=self.model.config))
        if prefill and len(prompt_ids) > 1:
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
        pending = state.ids[state.cached:]
        return self.extend([Extension(state, pending + list(draft_ids), len(draft_ids) + 1, taps)])[0]

    def extend(self, batch: list[Extension]) -> list[np.ndarray]:
        """One forward pass over every session in batch; per session its logits [keep, vocab] (float32).

        Each state's cache grows by its new_ids (state.cached is the caller's to
        advance, by `commit`). If the pass raises, every cache is cropped back to
        state.cached and the error re-raised. A state may appear once.
        """
        if len({id(e.state) for e in batch}) != len(batch):
            raise ValueError("a session can be in a batch only once")
        for e in batch:
            if not e.new_ids or not 0 <= e.keep <= len(e.new_ids):
                raise ValueError(f"an extension needs new ids and 0 <= keep <= {len(e.new_ids)}, got {e.keep}")
        if len(batch) > 1 and not self.batchable:
            return [self.extend([e])[0] for e in batch]
        handles = []
        try:
            for layer in sorted({l for e in batch for l in (e.taps or {})}):
                if not 1 <= layer <= self.n_layers:
                    raise ValueError(f"no decoder block {layer} to tap (the target has {self.n_layers})")
                targets = [(row, e.taps[layer], len(e.new_ids), e.keep) for row, e in enumerate(batch)
                           if e.taps and layer in e.taps]
                handles.append(self.model.model.layers[layer - 1].register_forward_hook(_tap_hook(targets)))
            if len(batch) > 1:
                return self._forward_batch(batch)
            e = batch[0]                # one session: its own cache, no padding, no copies
            logits = self._forward(e.state, e.new_ids, keep=max(1, e.keep)).numpy()
            return [logits[len(logits) - e.keep:]]
        except BaseException:
            for e in batch:             # blocks before the failure appended KV, later ones did not
                _crop(e.state.cache, e.state.cached)
            raise
        finally:
            for h in handles:
                h.remove()

    @torch.inference_mode()
    def _forward_batch(self, batch: list[Extension]) -> list[np.ndarray]:
        """The padded pass: rows [pad..., cache_b | new_b, pad...]; see the module docstring."""
        from transformers import DynamicCache

        n_rows = len(batch)
        past = max(e.state.cached for e in batch)                     # L: the longest cache
        width = max(len(e.new_ids) for e in batch)                    # N: the longest run of new tokens
        dev = self.model.device
        x = torch.zeros((n_rows, width), dtype=torch.long, device=dev)
        mask = torch.zeros((n_rows, past + width), dtype=torch.long, device=dev)
        pos = torch.zeros((n_rows, width), dtype=torch.long, device=dev)
        for row, e in enumerate(batch):
            n, c = len(e.new_ids), e.state.cached
            x[row, :n] = torch.tensor(e.new_ids, device=dev)
            mask[row, past - c:past + n] = 1
            pos[row] = torch.arange(c, c + width, device=dev)
        cache = DynamicCache(config=self.model.config)
        if past:
            for layer in range(self.n_layers):
                keys, values = zip(*(self._padded_kv(e.state, layer, past) for e in batch))
                cache.update(torch.cat(keys), torch.cat(values), layer)
        # logits only at the columns some row keeps (the same columns for every row: a pass's LM head
        # runs on [rows, columns], so a prefill row beside drafts costs no extra vocabulary rows)
        cols = sorted({j for e in batch for j in range(len(e.new_ids) - e.keep, len(e.new_ids))}) or [0]
        out = self.model(input_ids=x, attention_mask=mask, position_ids=pos, past_key_values=cache,
                         use_cache=True, logits_to_keep=torch.tensor(cols, device=dev))
        logits = out.logits.float()                                   # [rows, len(cols), vocab]
        where = {j: i for i, j in enumerate(cols)}
        result = []
        for row, e in enumerate(batch):
            n, c = len(e.new_ids), e.state.cached
            _set_kv(e.state.cache, cache, row, past - c, past + n)
            e.state.passes += 1
            result.append(logits[row, [where[j] for j in range(n - e.keep, n)]].cpu().numpy())
        return result

    def _padded_kv(self, state: TargetState, layer: int, past: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One session's keys and values at `layer`, left-padded with zeros to `past` positions [1, H, past, D]."""
        have = state.cached
        if not have:
            pad = torch.zeros((1, self.kv_heads, past, self.head_dim), dtype=self.model.dtype, device=self.model.device)
            return pad, pad
        src = state.cache.layers[layer]
        keys, values = src.keys[:, :, :have], src.values[:, :, :have]
        if have == past:
            return keys, values
        pad = torch.zeros((1, self.kv_heads, past - have, self.head_dim), dtype=keys.dtype, device=keys.device)
        return torch.cat([pad, keys], dim=2), torch.cat([pad, values], dim=2)

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


def _tap_hook(targets: list[tuple[int, Callable[[torch.Tensor], None], int, int]]):
    """A forward hook on a decoder block passing each tapped row's kept positions to its fn.

    targets: (batch row, fn, new tokens of the row, rows kept). fn gets the block's
    output at that row's last kept positions, hidden [keep, hidden]. Returns None,
    so the block's output goes on unchanged.
    """
    def hook(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output     # [B, T, hidden]
        for row, fn, n, keep in targets:
            fn(hidden[row, n - keep:n])                                  # [keep, hidden]
    return hook


def _set_kv(cache, batch_cache, row: int, start: int, stop: int) -> None:
    """Give a session its row of a batch's cache, positions [start, stop).

    A copy, not a view: a view would keep the whole batch's KV alive for as long as
    any of its sessions waits for its next round (sessions x batch size x context).
    """
    for layer, src in enumerate(batch_cache.layers):
        keys = src.keys[row:row + 1, :, start:stop].clone()
        values = src.values[row:row + 1, :, start:stop].clone()
        if layer < len(cache.layers) and cache.layers[layer].get_seq_length() > 0:
            cache.layers[layer].keys, cache.layers[layer].values = keys, values
        else:                                   # a cold session's first KV
            cache.update(keys, values, layer)


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
