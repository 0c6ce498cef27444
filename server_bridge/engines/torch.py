"""The `torch` engine: any transformers causal LM, on any device, in the dtype asked for.

KV lives in slots allocated once (gpt-fast's KVCache, one row per session):
keys and values [slots, kv_heads, max_context, head_dim] per layer on the
model's device. A pass is ragged: every session's new tokens are concatenated
into one sequence [1, T] with their own position ids, so the projections and
MLPs run on exactly T tokens, no padding. Each attention layer writes the
sessions' new keys and values in place at their positions: nothing grows by
concatenation, and a rollback is only a smaller length.

The model runs through its own forward with two hooks transformers provides: a
cache object whose `update` writes into the slots, and a registered attention
function ("edgespec_slots") that reads them. Neither loops over sessions: with
more than one session in a pass, each layer writes every new key and value with
one indexed scatter, and attends with one SDPA call over the sessions' padded
queries [B, H, n_max, D] against their slots gathered to [B, kv_heads, Lmax, D],
under a causal mask (a sliding window where the layer has one) built once per
pass. A pass thus launches the same operators for 2 sessions as for 32
(tests/server_bridge/engines/test_torch_pass.py counts them with torch.profiler). One
session attends over a view of its own slot, with no mask for a single token.

Compiled (`compile="on"`, or auto on CUDA; compile_torch.py), a text pass of up to 32 new tokens a
session runs through torch.compile instead, padded to a bucket's grid (a CUDA graph on CUDA): the
layout then is a compile_torch.Grid, handed to the attention layers with the model's kwargs.

Batch-invariant (`batch_invariant`, on by default wherever the dtype is not float32;
invariant_torch.py): every row of a pass, of any number of sessions and any draft length, has the bits
the one-token pass at that position has, so SD at T = 0 commits exactly AR's ids. It holds because the
pass never takes a kernel whose reduction order depends on its shape, as measured on the CPU
(docs/benchmarks/batch_invariant_cpu/): a single row runs through the linear GEMM as two, attention
always takes the padded path with no SDPA query block under 4 rows and keys cut at a multiple of 64;
the one-token pass runs the same way (AR is the reference and changes with it). The engine probes its
linear shapes at load and says in its info (`exact`) whether the guarantee held on this device.

Images (a vision-language model: Idefics3 / SmolVLM, Qwen2-VL, Qwen2.5-VL, Qwen3-VL;
server_bridge/engines/vision_torch.py): the decoder the slots serve is the VLM's text model. A
pass's image marker at text index t becomes the image's C cells (slot rows), its
layout's embeddings written through the same slots in one pass of that sequence alone
(opens are rare; text passes stay batched), and advances the sequence's position by
the image's N positions. Each sequence keeps its images as (t, C - 1, N - 1), so
`start`, `keep`, `truncate` and a sequence's `length` go on counting text ids while
the slot holds cells and the rotary embedding reads positions:
    cell(t) = t + sum(C_i - 1 for images before t)     where text index t's KV is written
    pos(t)  = t + sum(N_i - 1 for images before t)     its position (`kv_pos`), as in the llamacpp engine
A truncation or rollback to t cuts both there. For 1-D positions (Idefics3) N = C. For
M-RoPE (the Qwen-VLs) an image's cells take the 3-D positions pos(t) + its layout's
(time, row, column) offsets from the model's own get_rope_index, and N = max(rows, cols)
< C, so the text after it sits at pos(t) = cell(t) + rope_delta (the model's
`max position + 1 - length`, kept per sequence in its images, never in the model's own
`rope_deltas`, which robots sharing the model would overwrite). Every pass of such a
model hands the rotary embedding its positions explicitly, [3, 1, T] (the same on all
three axes for text), so sessions with and without images batch as before.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from protocol import modelfiles
from protocol.images import PromptImage
from runtime.vision import MARKERS

from . import compile_torch, invariant_torch, random_init, vision_torch
from .types import EngineFull, EngineInfo, Pass, Sequence, SequenceIds, check_batch, image_extra

log = logging.getLogger(__name__)

ATTENTION = "edgespec_slots"
LAYOUT = "edgespec_layout"  # the model kwarg that hands the pass's layout to its attention layers
_current = threading.local()  # the pass being run: its layout, read by the attention function


class _Layout:
    """Where a pass's tokens go, built once per pass and read by every layer.

    rows: (slot, start, n, offset into T) per session. With one session the layers use views of
    its slot (no gather, no mask for a single token). With more, every tensor below is built here
    once, so each layer launches the same operators whatever the number of sessions:
    tok_slot, tok_pos [T]: the slot and position each token's keys and values are written to;
    slots [B]: the sessions' slots; q_index [B * n_max]: each padded query row's token (padding
    repeats a session's last token); back [T]: each token's padded row; kpos [Lmax] and qpos
    [B, n_max, 1]: the positions the causal mask is built from (per sliding window, cached).
    """

    def __init__(
        self, rows: list[tuple[int, int, int, int]], pool: "_SlotPool", device: torch.device, invariant: bool = False
    ):
        self.rows = rows
        self.pool = pool
        self.single = len(rows) == 1 and not invariant
        self.k_len = max(start + n for _, start, n, _ in rows)  # Lmax: the longest session's KV
        self._masks: dict[int, torch.Tensor] = {}
        if self.single:
            return
        n_max = max(n for _, _, n, _ in rows)
        if invariant:  # every SDPA call one shape class (invariant_torch.py): queries in 4s, keys in 64s
            n_max = invariant_torch.query_len(n_max)
            self.k_len = min(invariant_torch.key_len(self.k_len), pool.max_len)
        tok_slot: list[int] = []
        tok_pos: list[int] = []
        q_index: list[int] = []
        back: list[int] = []
        qpos: list[list[int]] = []
        for b, (slot, start, n, off) in enumerate(rows):
            tok_slot += [slot] * n
            tok_pos += range(start, start + n)
            q_index += [off + min(i, n - 1) for i in range(n_max)]
            back += range(b * n_max, b * n_max + n)
            qpos.append([start + min(i, n - 1) for i in range(n_max)])
        as_long = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
        self.n_max = n_max
        self.tok_slot, self.tok_pos = as_long(tok_slot), as_long(tok_pos)
        self.slots = as_long([slot for slot, *_ in rows])
        self.q_index, self.back = as_long(q_index), as_long(back)
        self.qpos = as_long(qpos)[:, :, None]  # [B, n_max, 1]
        self.kpos = torch.arange(self.k_len, device=device)[None, None, :]

    def mask(self, sliding_window: int | None) -> torch.Tensor:
        """[B, 1, n_max, Lmax] bool: a query sees its own session's keys up to its position (and window)."""
        key = sliding_window or 0
        if key not in self._masks:
            m = self.kpos <= self.qpos
            if sliding_window:
                m &= self.kpos > self.qpos - sliding_window
            self._masks[key] = m[:, None]
        return self._masks[key]

    def write(self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """key_states, value_states [1, kv_heads, T, head_dim] into the slots at the rows' cells."""
        k, v = self.pool.k[layer], self.pool.v[layer]
        if self.single:
            slot, start, n, _ = self.rows[0]
            k[slot, :, start : start + n].copy_(key_states[0])
            v[slot, :, start : start + n].copy_(value_states[0])
        else:  # one indexed scatter for every session
            k[self.tok_slot, :, self.tok_pos] = key_states[0].transpose(0, 1)  # [T, kv_heads, D]
            v[self.tok_slot, :, self.tok_pos] = value_states[0].transpose(0, 1)

    def attend(
        self, layer: int, query: torch.Tensor, scaling: float | None, sliding_window: int | None
    ) -> torch.Tensor:
        """query [1, H, T, D] holds the pass's ragged tokens -> [1, T, H, D]. One session attends over a view of
        its slot; several are padded to [B, H, n_max, D] against their slots gathered to [B, kv_heads, Lmax, D]
        under one mask, and their rows taken back out: no loop over sessions."""
        k_pool, v_pool = self.pool.k[layer], self.pool.v[layer]
        if self.single:
            slot, start, n, _ = self.rows[0]
            lo = 0 if not sliding_window else max(0, start + 1 - sliding_window)  # the first query's window
            k, v = k_pool[slot : slot + 1, :, lo : start + n], v_pool[slot : slot + 1, :, lo : start + n]
            mask = None
            if n > 1 or lo:
                mask = _single_mask(start, n, lo, sliding_window, query.device)
            out = F.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scaling, enable_gqa=True)
            return out.transpose(1, 2)  # [1, T, H, D]
        heads, d = query.shape[1], query.shape[3]
        b = len(self.rows)
        q = query[0].index_select(1, self.q_index).view(heads, b, self.n_max, d).transpose(0, 1)
        k = k_pool[:, :, : self.k_len].index_select(0, self.slots)  # [B, kv_heads, Lmax, D]
        v = v_pool[:, :, : self.k_len].index_select(0, self.slots)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=self.mask(sliding_window), scale=scaling, enable_gqa=True
        )  # [B, H, n_max, D]
        out = out.transpose(0, 1).reshape(heads, b * self.n_max, d).index_select(1, self.back)  # [H, T, D]
        return out.transpose(0, 1)[None]  # [1, T, H, D]


class _SlotPool:
    """The KV slots: per layer keys and values [slots, kv_heads, max_len, head_dim], allocated once."""

    def __init__(
        self,
        n_layers: int,
        slots: int,
        kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        shape = (slots, kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.max_len = max_len


class _SlotCache:
    """What the model's attention layers call `cache.update` on: a write into the slots."""

    is_compileable = False

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        _layout_of(kwargs.get("kwargs") or {}).write(layer_idx, key_states, value_states)
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


def _layout_of(kwargs: dict) -> Any:
    """The pass's layout (a _Layout, or a compiled pass's compile_torch.Grid): handed down with the model's
    kwargs (transformers passes them to the attention function and, since 5.x, to `cache.update`), else the
    one this thread's eager pass set."""
    layout = kwargs.get(LAYOUT)
    return layout if layout is not None else _current.layout


def slot_attention(
    module: Any,  # the attention layer calling (its layer_idx)
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Every session's queries against its own slot's keys, in one SDPA call per layer (the layout's
    `attend`): query [1, H, T, D] -> [1, T, H, D], as transformers expects."""
    return _layout_of(kwargs).attend(module.layer_idx, query, scaling, sliding_window), None


def _single_mask(start: int, n: int, lo: int, sliding_window: int | None, device: torch.device) -> torch.Tensor:
    qpos = torch.arange(start, start + n, device=device)[:, None]
    kpos = torch.arange(lo, start + n, device=device)[None, :]
    mask = kpos <= qpos  # causal from the session's own start
    if sliding_window:
        mask &= kpos > qpos - sliding_window
    return mask


def _register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, slot_attention)


def resolve_device_dtype(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    """auto: CUDA and bfloat16 where a GPU is present, else the CPU and float32."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device} asked for, but this torch has no CUDA device")
    if dtype == "auto":
        dtype = "bfloat16" if dev.type == "cuda" else "float32"
    return dev, {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def _vocab_identity(tokenizer: Any, vocab_size: int) -> tuple[str, int]:
    """(vocab_hash, vocab_real) of the tokenizer's vocabulary ("" and vocab_size without a tokenizer)."""
    if tokenizer is None:
        return "", vocab_size
    pieces = tokenizer.convert_ids_to_tokens(list(range(vocab_size)))
    # ids past the tokenizer's (Qwen pads its embeddings): named as llama.cpp's converter names them
    pieces = [(p if p is not None else f"[PAD{i}]").encode("utf-8") for i, p in enumerate(pieces)]
    # the hash is over the real part (a [PAD] tail is not hashed); vocab_real: the ids verification may produce
    return modelfiles.vocab_hash(pieces), modelfiles.real_vocab_size(pieces)


class TorchEngine:
    def __init__(
        self,
        path: Path,
        name: str,
        device: str = "auto",
        dtype: str = "auto",
        threads: int = 0,
        max_sequences: int = 64,
        kv_tokens: int = 0,
        max_len: int = 2048,
        model: Any = None,  # a transformers model built by the caller (None: loaded from path)
        compile: str = "off",  # the text pass through torch.compile (compile_torch.py): on, off, auto = on CUDA
        batch_invariant: str = "auto",  # every row as the one-token pass computes it (invariant_torch.py)
    ):
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        if threads > 0:
            torch.set_num_threads(threads)
        self.device, self.dtype = resolve_device_dtype(device, dtype)
        self.path = Path(path)  # a GGUF's vocabulary serves grammars (target.py)
        t0 = time.perf_counter()
        if model is None:
            model, self.tokenizer, self.vision = _load(path, self.dtype, self.device)
        else:  # a model built here (tools/bench/gpu_engine.py)
            self.tokenizer, self.vision = None, None
        _register_attention()
        self.model = model.to(self.device).eval()
        self.text = self.model.get_decoder()  # the decoder the slots serve (a VLM's text model)
        self.head = self.model.get_output_embeddings()
        cfg = self.text.config  # a VLM's text_config; its vision tower keeps its own
        cfg._attn_implementation = ATTENTION
        # the cache argument's name: `cache` in recent transformers, `past_key_values` before (gone in 5.40)
        self._cache_arg = "cache" if "cache" in inspect.signature(self.text.forward).parameters else "past_key_values"
        self.name = name
        self.vocab_size = int(cfg.vocab_size)
        self.vocab_hash, self.vocab_real = _vocab_identity(self.tokenizer, self.vocab_size)
        self.image_token_id = self.vision.image_token_id if self.vision else _marker_id(self.tokenizer)
        self.mrope = bool(self.vision and self.vision.mrope)  # 3-D positions (Qwen-VL) for every pass
        self._images: dict[int, list[tuple[int, int, int]]] = {}  # slot -> [(text index, extra cells, extra positions)]
        eos = getattr(self.model.generation_config, "eos_token_id", None)
        self.eos_ids = sorted({eos} if isinstance(eos, int) else set(eos or ()))
        self.n_layers = int(cfg.num_hidden_layers)
        self.hidden_size = int(cfg.hidden_size)
        kv_heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.kv_bytes_per_token = 2 * self.n_layers * kv_heads * head_dim * self.dtype.itemsize
        self.max_len = max_len
        self.max_sequences = max(1, (kv_tokens // max_len) if kv_tokens else max_sequences)
        self.kv_capacity = self.max_sequences * max_len
        self.invariant, compiled = invariant_torch.with_compile(batch_invariant, compile, self.dtype, self.device)
        # compiled: one slot more (the padding's scratch slot) and one cell more per slot (compile_torch.py);
        # invariant: slots of whole KEY_BLOCKs (invariant_torch.py)
        slots, cells = self.max_sequences + compiled, invariant_torch.slot_len(max_len + compiled, self.invariant)
        self.pool = _SlotPool(self.n_layers, slots, kv_heads, cells, head_dim, self.dtype, self.device)
        self.compiled = (
            compile_torch.CompiledPass(self._decode_grid, self.pool, max_len, self.device) if compiled else None
        )
        self.batchable, self.packed = True, False  # one pass for a batch, padded to one rectangle
        self.ids = SequenceIds(self.max_sequences)
        self._cache = _SlotCache()
        self._half_head = self.dtype == torch.float16
        if self._half_head:
            # fp16 logits overflow past 65504 (an inf row would make NaN verdicts): the LM head runs in
            # float32 on a float32 copy of its weight, so logits are finite for any hidden state
            self._head32 = self.head.weight.detach().float()
        self.info = EngineInfo(
            "torch",
            str(self.device),
            str(self.dtype).removeprefix("torch."),
            {
                "threads": torch.get_num_threads(),
                "slots": self.max_sequences,
                "slot_len": max_len,
                "vision": self.vision is not None,
                "compiled": compiled,
            },
        )
        self.info.extra.update(self._make_invariant(compiled))
        self._log_loaded(time.perf_counter() - t0)

    def _make_invariant(self, compiled: bool) -> dict[str, Any]:
        """Turn the batch-invariant mode on where it is asked for and probe its guarantee here: the engine
        info's entry (invariant_torch.describe)."""
        if not self.invariant:
            return invariant_torch.describe(False, [], compiled)
        invariant_torch.pad_single_rows(self.text)
        invariant_torch.pad_single_rows(self.head)
        shapes = invariant_torch.linear_shapes(self.text) | invariant_torch.linear_shapes(self.head)
        failed = invariant_torch.probe(shapes, self.dtype, self.device)
        if failed:
            log.warning(
                "torch engine: batch-invariant mode on, but on this %s a linear's rows depend on the pass's size "
                "(%s): verify rows may round differently from the one-token pass",
                self.device,
                "; ".join(failed),
            )
        if compiled:
            log.warning("torch engine: compiled passes round as fused kernels do, not as the one-token pass")
        return invariant_torch.describe(True, failed, compiled)

    def _log_loaded(self, seconds: float) -> None:
        log.info(
            "torch engine: %s on %s in %s (%.1fs; %d layers, vocab %d, %d KV slots of %d tokens, %.0f MiB, images %s)",
            self.name,
            self.device,
            self.info.dtype,
            seconds,
            self.n_layers,
            self.vocab_size,
            self.max_sequences,
            self.max_len,
            self.kv_bytes_per_token * self.kv_capacity / 2**20,
            f"through {type(self.model).__name__}" if self.vision else "no",
        )

    @contextlib.contextmanager
    def plain_attention(self) -> Iterator[nn.Module]:
        """transformers' own SDPA attention, for code that runs the model itself (generate, training)."""
        self.text.config._attn_implementation = "sdpa"
        try:
            yield self.model
        finally:
            self.text.config._attn_implementation = ATTENTION

    # ------------------------------------------------------------------ sequences

    def new_sequence(self) -> Sequence:
        return Sequence(self.ids.take(self._clear))  # a freed slot is simply overwritten

    def free(self, seq: Sequence) -> None:
        self.ids.release(seq.id)

    def _clear(self, slot: int) -> None:
        self._images.pop(slot, None)

    def truncate(self, seq: Sequence, n: int) -> None:
        """Roll back to the first n text ids; images at n or later go with them."""
        seq.length = min(seq.length, n)
        images = self._images.get(seq.id)
        if images and images[-1][0] >= n:  # in text order: the last is the latest
            kept = [image for image in images if image[0] < n]
            if kept:
                self._images[seq.id] = kept
            else:
                del self._images[seq.id]

    def kv_pos(self, seq: Sequence, t: int) -> int:
        """The position of text index t: t plus the extra positions of the images before it."""
        images = self._images.get(seq.id)
        return t + sum(extra for i, _, extra in images if i < t) if images else t

    def _cell(self, seq: Sequence, t: int) -> int:
        """The slot row text index t's KV is written at: t plus the extra cells of the images before it."""
        images = self._images.get(seq.id)
        return t + sum(extra for i, extra, _ in images if i < t) if images else t

    @property
    def kv_used(self) -> int:
        return self.ids.in_use() * self.max_len

    def to_numpy(self, rows: torch.Tensor) -> np.ndarray:
        return rows.cpu().numpy()

    # ------------------------------------------------------------------ the pass

    @torch.inference_mode()
    def forward(self, batch: list[Pass]) -> list[torch.Tensor]:
        """One ragged pass over the text passes, then each pass with images on its own; per session its
        logits [keep, vocab] (float32, on the device). If a pass fails, every sequence is cut back to its
        pass's start and the error raised."""
        check_batch(batch)
        extra = self._check_images(batch)  # before anything is written: bad bytes raise here
        for p, e in zip(batch, extra, strict=True):
            self.truncate(p.seq, p.start)  # images at or past start go: the pass overwrites them
            end = self._cell(p.seq, p.start) + len(p.new_ids) + e
            if end > self.max_len:
                raise EngineFull(f"a session's KV slot holds {self.max_len} tokens, the pass needs {end}")
        seeing = [p for p in batch if p.images]
        text = [p for p in batch if not p.images] if seeing else batch
        try:
            rows = self._forward_text(text) if text else []
            by_pass = {id(p): self._forward_images(p) for p in seeing}  # opens: rare, one at a time
        except BaseException:
            for p in batch:
                self.truncate(p.seq, p.start)
            raise
        if not seeing:
            return rows
        rest = iter(rows)
        return [by_pass[id(p)] if p.images else next(rest) for p in batch]

    def _forward_text(self, batch: list[Pass]) -> list[torch.Tensor]:
        """The text passes in one ragged decoder pass, each at its sequence's KV positions."""
        rows: list[tuple[int, int, int, int]] = []  # (slot, first cell, new ids, offset in the pass)
        ids: list[int] = []
        pos: list[int] = []
        keep_at: list[int] = []
        for p in batch:
            off, at = len(ids), self.kv_pos(p.seq, p.start)
            rows.append((p.seq.id, self._cell(p.seq, p.start), len(p.new_ids), off))
            ids.extend(p.new_ids)
            pos.extend(range(at, at + len(p.new_ids)))  # for M-RoPE: cell + rope_delta, on all three axes
            keep_at.extend(range(off + len(p.new_ids) - p.keep, off + len(p.new_ids)))
        hidden = self._compiled_hidden(batch, rows, ids, pos)
        if hidden is None:  # eager: no compile asked for, a prefill, taps, or a failed compile
            x = torch.tensor([ids], dtype=torch.long, device=self.device)
            positions = torch.tensor([pos], dtype=torch.long, device=self.device)  # [1, T]
            hidden = self._decode(batch, rows, positions, input_ids=x)
        for p in batch:
            p.seq.length = p.start + len(p.new_ids)
        return self._logits(hidden, keep_at, [p.keep for p in batch])

    def _forward_images(self, p: Pass) -> torch.Tensor:
        """One sequence's pass with images, in one decoder pass over its cells: the text ids' embeddings with
        each marker's replaced by its image's layout [C, hidden]; logits [keep, vocab], a marker's row the one
        after its image's last cell."""
        embed = self.text.get_input_embeddings()
        n, a, t = len(p.new_ids), 0, 0  # t: the pass's cells so far
        pos = self.kv_pos(p.seq, p.start)  # the position of the next cell
        marked, vision = p.images, self.vision
        assert marked and vision is not None  # forward sends only passes with images here, after its checks
        parts: list[torch.Tensor] = []
        last: list[int] = []  # last[j]: the pass's row of text index j (a marker: its image's last)
        images: list[tuple[int, int, int]] = []
        rope, visual, deep = [], [], []  # [3, cells] positions, [cells] image tokens, per image its deepstack
        for i in sorted(marked) + [n]:
            if i > a:  # the text ids a..i-1
                parts.append(embed(torch.tensor(p.new_ids[a:i], dtype=torch.long, device=self.device)))
                last.extend(range(t, t + i - a))
                rope.append(torch.arange(pos, pos + i - a, device=self.device).expand(3, -1))
                visual.append(torch.zeros(i - a, dtype=torch.bool, device=self.device))
                t, pos = t + i - a, pos + i - a
            if i == n:
                break
            image = vision.embed(marked[i])
            cells = len(image.embeds)
            parts.append(image.embeds)
            offsets = image.rope if image.rope is not None else torch.arange(cells).expand(3, -1)
            rope.append(pos + offsets.to(self.device))
            visual.append(image.visual)
            deep.append(image.deepstack)
            t += cells
            last.append(t - 1)
            images.append((p.start + i, cells - 1, image.positions - 1))
            pos += image.positions
            a = i + 1
        positions = torch.cat(rope, dim=1)  # [3, t]
        positions = positions[:, None] if self.mrope else positions[:1]  # [3, 1, t] or [1, t]
        extra = {}
        if any(d is not None for d in deep):  # Qwen3-VL: the tower's features added after the first layers
            visual_at = torch.cat(visual)[None]  # [1, t]
            extra = dict(
                visual_pos_masks=visual_at, deepstack_visual_embeds=[torch.cat(f) for f in zip(*deep, strict=True)]
            )
        at = self._cell(p.seq, p.start)
        hidden = self._decode(
            [p], [(p.seq.id, at, t, 0)], positions, inputs_embeds=torch.cat(parts)[None], **extra
        )  # [1, t, hidden]
        self._images.setdefault(p.seq.id, []).extend(images)
        p.seq.length = p.start + n
        return self._logits(hidden, last[n - p.keep :], [p.keep])[0]

    def _decode(self, batch: list[Pass], rows: list[tuple[int, int, int, int]], positions: torch.Tensor, **inputs):
        """The decoder over the rows' tokens (input_ids or inputs_embeds [1, T, ...]) at positions [1, T] (1-D
        or the same on every M-RoPE axis) or [3, 1, T], writing their keys and values into the slots at the
        rows' cells; hidden [1, T, hidden], final norm applied."""
        if self.mrope and positions.dim() == 2:
            positions = positions[None].expand(3, -1, -1)  # explicit: the model never infers (or keeps) its own
        handles = self._tap_hooks(batch, rows)
        _current.layout = _Layout(rows, self.pool, self.device, self.invariant)
        try:
            return self.text(
                **inputs, position_ids=positions, use_cache=True, **{self._cache_arg: self._cache}
            ).last_hidden_state
        finally:
            _current.layout = None
            for h in handles:
                h.remove()

    def _compiled_hidden(
        self, batch: list[Pass], rows: list[tuple[int, int, int, int]], ids: list[int], pos: list[int]
    ) -> torch.Tensor | None:
        """hidden [1, T, hidden] of the text passes through the compiled pass, padded to its bucket and the
        padding's rows dropped; None where the pass runs eagerly (taps are forward hooks: eager)."""
        compiled = self.compiled
        if compiled is None or any(p.taps for p in batch) or (shape := compiled.shape(rows)) is None:
            return None
        g_ids, g_pos, grid, real = compiled.grid(rows, ids, pos, shape)
        hidden = compiled.run(g_ids, g_pos, grid, shape)
        return None if hidden is None else hidden.index_select(1, real)

    def _decode_grid(self, ids: torch.Tensor, positions: torch.Tensor, grid: compile_torch.Grid) -> torch.Tensor:
        """What compile_torch compiles: the decoder over a padded grid of tokens ids [1, T] at positions [1, T],
        the grid handed to the attention layers with the model's kwargs; hidden [1, T, hidden]."""
        if self.mrope:
            positions = positions[None].expand(3, -1, -1)
        out = self.text(
            input_ids=ids, position_ids=positions, use_cache=True, **{self._cache_arg: self._cache, LAYOUT: grid}
        )
        return out.last_hidden_state

    @torch.inference_mode()
    def warm(self) -> None:
        """Compile the text pass now (a server, before it serves) rather than on its first verify pass."""
        if self.compiled is not None:
            t0 = time.perf_counter()
            self.compiled.warm()
            log.info("torch engine: the pass compiled in %.1fs (%s)", time.perf_counter() - t0, self.compiled.status())

    def _logits(self, hidden: torch.Tensor, keep_at: list[int], keeps: list[int]) -> list[torch.Tensor]:
        """Per pass its logits [keep, vocab] float32, from hidden [1, T, hidden] at rows keep_at."""
        kept = hidden[0, torch.tensor(keep_at, dtype=torch.long, device=self.device)]  # [rows kept, hidden]
        if self._half_head:
            one = self.invariant and len(kept) == 1  # a single row through the GEMM too (invariant_torch.py)
            logits = (kept.expand(2, -1).float() @ self._head32.T)[:1] if one else kept.float() @ self._head32.T
        else:
            logits = self.head(kept).float()  # [rows kept, vocab]
        cap = getattr(self.text.config, "final_logit_softcapping", None)
        if cap:  # Gemma 2/3
            logits = torch.tanh(logits / cap) * cap
        return list(torch.split(logits, keeps))

    def _tap_hooks(self, batch: list[Pass], rows: list[tuple[int, int, int, int]]) -> list:
        """Forward hooks on the tapped decoder blocks handing each pass its kept rows [keep, hidden]."""
        handles = []
        for layer in sorted({l for p in batch for l in (p.taps or {})}):
            if not 1 <= layer <= self.n_layers:
                raise ValueError(f"no decoder block {layer} to tap (the target has {self.n_layers})")
            targets = [
                (p.taps[layer], off + n - p.keep, off + n)
                for p, (_, _, n, off) in zip(batch, rows, strict=True)
                if p.taps and layer in p.taps
            ]

            def hook(
                module: nn.Module,
                args: Any,
                output: Any,
                targets: list[tuple[Callable[[Any], None], int, int]] = targets,
            ) -> None:
                h = output[0] if isinstance(output, tuple) else output  # [1, T, hidden]
                for fn, lo, hi in targets:
                    fn(h[0, lo:hi])

            handles.append(self.text.layers[layer - 1].register_forward_hook(hook))
        return handles

    # ------------------------------------------------------------------ images

    def image_positions(self, image: PromptImage) -> int:
        """Positions the image's marker advances a sequence by (fewer than its cells for M-RoPE). ValueError:
        no image, or a text-only target; vision.UnknownImage: only its sha256 came and it is not cached."""
        return self._seeing().positions(image)

    def resolve(self, image: PromptImage) -> PromptImage:
        """The image with its bytes (from the cache when only its sha256 came; UnknownImage if not held)."""
        return self._seeing().resolve(image)

    def _seeing(self) -> vision_torch.Vision:
        if self.vision is None:
            raise ValueError(
                f"the torch engine's target {self.name} reads text only: images need a "
                f"vision-language model ({', '.join(vision_torch.VISIONS)}) or the llamacpp "
                "engine with --mmproj"
            )
        return self.vision

    def _check_images(self, batch: list[Pass]) -> list[int]:
        """Each pass's extra KV cells for its images, once types.image_extra found them all readable."""
        return image_extra(batch, self.image_token_id, self._seeing)


def _load(path: Path, dtype: torch.dtype, device: torch.device):
    """(model, tokenizer, its vision or None: text only) from a GGUF (converted once) or a Hugging Face
    directory. A vision-language model loads with its processor (local files only). A directory whose weights
    are a recipe (random_init.py: a GPU benchmark's random target) is built from its config on `device`."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    model_dir = _cached_conversion(path) if Path(path).suffix == ".gguf" else Path(path)
    if random_init.is_recipe(model_dir):
        return random_init.build(model_dir, device, dtype), AutoTokenizer.from_pretrained(model_dir), None
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    vlm = vision_torch.is_vlm(config)
    vision = vision_torch.vision_for(config) if vlm else None  # raises for an M-RoPE model it cannot place
    if vision is None:
        if vlm:
            log.warning(
                "%s is a %s vision-language model: the torch engine reads images of %s models only, "
                "this one serves text",
                model_dir,
                config.model_type,
                ", ".join(vision_torch.VISIONS),
            )
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype), tokenizer, None
    from transformers import AutoModelForImageTextToText

    processor = vision_torch.load_processor(model_dir, config)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=dtype, local_files_only=True)
    return model, processor.tokenizer, vision(model, processor)  # it reads the model's device when it runs


def _marker_id(tokenizer: Any) -> int | None:
    """The id of an image marker (SmolVLM's `<image>`) in a text model's vocabulary; None if it has none."""
    if tokenizer is None:
        return None
    vocab = tokenizer.get_vocab()
    return next((vocab[m] for m in MARKERS if m in vocab), None)


def _cached_conversion(gguf: Path) -> Path:
    """Load a GGUF into a Hugging Face directory once (transformers' GGUF loader); later starts read it."""
    out = modelfiles.target_cache_dir(gguf)
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    log.info("converting %s to a float32 model directory (first start only) -> %s", gguf, out)
    hf_logging.enable_progress_bar()  # the one slow step: show its progress
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model: Any = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    finally:
        hf_logging.disable_progress_bar()
    # The weights are plain float32 now; transformers still marks the model as
    # "gguf-quantized" and refuses to save it, so drop the marker first.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")  # this process's own: two servers may convert at once
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    try:
        tmp.rename(out)  # atomic: a crash mid-save never leaves a half cache
    except OSError:  # another process renamed its complete copy first: keep that one
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / "model.safetensors").exists():
            raise
    return out
