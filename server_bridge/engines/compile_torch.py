"""The torch engine's text pass compiled (`torch.compile`): one graph instead of one Python op per layer piece.

The eager pass (torch.py) is ragged: T tokens, B sessions, each attending over the longest
session's Lmax keys, every size whatever the batch brings. Eager, each of those is a launch;
on a GPU the pass is launch-bound (10x the HBM roofline for 1 x 5 tokens on an H100). Compiled,
inductor fuses the pieces, and on CUDA (`mode="reduce-overhead"`) replays the whole pass as one
CUDA graph, which needs its shapes fixed. So the batch is padded to a bucket:

    sessions   B    -> B_p = the next power of two, at least 2      [B_p]
    tokens     n_b  -> n_p = the next power of two >= max n_b, >= 2 every session n_p rows: a grid [1, B_p * n_p]
    keys       Lmax -> L_p = the next power of two >= Lmax, >= 64, at most the slot's length

and the padding is masked out: a session's padding rows repeat its last token at its last position
(their queries see what that token sees), write their keys and values into a scratch slot past the
sessions' (the engine allocates one more: no session's KV is touched), and are dropped from the
output; a padding session attends to the scratch slot's first row only. The engine also gives each
slot one cell past max_len, so that a bucket of max_len keys is never a slot's whole length (a
slice to the full length is one the compiler specializes on: it would cost a second compile).
Every real row computes what it computes eagerly, up to the rounding of fused kernels: the logits
agree within float32 tolerance, not bit for bit (tests/server_bridge/engines/test_torch_compile.py).

The sizes are marked dynamic, so one compile serves every bucket (the 0/1 specialization is
avoided by the floor of 2); the buckets bound the distinct shapes CUDA graphs are recorded for
(`MAX_SHAPES`; past it, new shapes run eagerly). A pass over more than `MAX_TOKENS` tokens per
session (a prefill) or with taps (hooks the exits read) runs eagerly. A compile that fails (no
C++ compiler, an operator inductor cannot lower) logs one warning and the engine runs eagerly
from then on: it never fails a pass.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from .types import COMPILE_MODES

log = logging.getLogger(__name__)

MAX_TOKENS = 32  # new tokens per session a compiled pass takes (a verify round: gamma + 1); more: eager
MAX_SHAPES = 64  # distinct padded shapes (CUDA graphs recorded); new ones past it run eagerly
MIN_KEYS = 64


def enabled(mode: str, device: torch.device) -> bool:
    """auto: on CUDA (CUDA graphs take the launches away), off on the CPU, where it does not pay (measured:
    docs/benchmarks/torch_compile_cpu/)."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"torch_compile must be one of {', '.join(COMPILE_MODES)}, got {mode!r}")
    return mode == "on" or (mode == "auto" and device.type == "cuda")


def bucket(n: int, floor: int = 2, cap: int | None = None) -> int:
    """The next power of two >= n (and >= floor), at most cap."""
    p = max(floor, 1 << max(0, n - 1).bit_length())
    return p if cap is None else min(p, cap)


class Grid:
    """Where a compiled pass's B_p x n_p grid of tokens goes, every tensor sized by its bucket.

    slots [B_p]: each session's slot (padding: the scratch slot); tok_slot, tok_pos [B_p * n_p]: the slot
    and cell each row's keys and values are written to; qpos [B_p, n_p, 1]: each row's cell, which its
    causal mask is built from; kpos [L_p]: the key cells attended. What the attention function and the
    cache read (torch.py's slot_attention, _SlotCache), as they read the eager pass's _Layout.
    """

    def __init__(
        self,
        pool: Any,
        slots: torch.Tensor,
        tok_slot: torch.Tensor,
        tok_pos: torch.Tensor,
        qpos: torch.Tensor,
        kpos: torch.Tensor,
    ):
        self.pool = pool
        self.slots, self.tok_slot, self.tok_pos, self.qpos, self.kpos = slots, tok_slot, tok_pos, qpos, kpos

    def tensors(self) -> list[torch.Tensor]:
        return [self.slots, self.tok_slot, self.tok_pos, self.qpos, self.kpos]

    def write(self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """key_states, value_states [1, kv_heads, B_p * n_p, head_dim] into the slots, one indexed scatter."""
        self.pool.k[layer][self.tok_slot, :, self.tok_pos] = key_states[0].transpose(0, 1)
        self.pool.v[layer][self.tok_slot, :, self.tok_pos] = value_states[0].transpose(0, 1)

    def attend(
        self, layer: int, query: torch.Tensor, scaling: float | None, sliding_window: int | None
    ) -> torch.Tensor:
        """query [1, H, B_p * n_p, D] against each session's slot: [1, B_p * n_p, H, D]."""
        heads, d = query.shape[1], query.shape[3]
        b, n, keys = self.qpos.shape[0], self.qpos.shape[1], self.kpos.shape[0]
        q = query[0].view(heads, b, n, d).transpose(0, 1)  # [B_p, H, n_p, D]
        k = self.pool.k[layer][:, :, :keys].index_select(0, self.slots)  # [B_p, kv_heads, L_p, D]
        v = self.pool.v[layer][:, :, :keys].index_select(0, self.slots)
        mask = self.kpos <= self.qpos  # [B_p, n_p, L_p]
        if sliding_window:
            mask &= self.kpos > self.qpos - sliding_window
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=scaling, enable_gqa=True)
        return out.transpose(0, 1).reshape(heads, b * n, d).transpose(0, 1)[None]  # [1, B_p * n_p, H, D]


class CompiledPass:
    """The decoder's text pass compiled once, run on buckets.

    decode(ids [1, T], positions [1, T] or [3, 1, T], grid) -> hidden [1, T, hidden]: the model's own
    forward with the grid handed to its attention layers. pool: the engine's slots, one past the sessions' and
    each one cell longer than max_len, the longest a session's KV may be.
    """

    def __init__(self, decode: Callable[..., torch.Tensor], pool: Any, max_len: int, device: torch.device):
        self.pool, self.max_len, self.device = pool, max_len, device
        self.scratch = len(pool.k[0]) - 1  # the padding's slot: the pool's last
        if pool.max_len <= max_len:
            raise ValueError(f"the compiled pass needs slots of more than {max_len} cells, got {pool.max_len}")
        self.cuda = device.type == "cuda"
        if self.cuda:  # the KV slots are written in place by every replay: never copied into a graph's inputs
            for t in (*pool.k, *pool.v):
                torch._dynamo.mark_static_address(t)
            import torch._inductor.config as inductor

            # a CUDA graph per bucket is the design, not the accident inductor warns of past 8 sizes
            if (limit := inductor.triton.cudagraph_dynamic_shape_warn_limit) is not None:  # None: never warns
                inductor.triton.cudagraph_dynamic_shape_warn_limit = max(limit, MAX_SHAPES)
        self._compiled = torch.compile(decode, mode="reduce-overhead" if self.cuda else None, fullgraph=True)
        self.shapes: set[tuple[int, int, int]] = set()  # (B_p, n_p, L_p) run so far
        self.failed: str | None = None  # why the compile failed: eager from then on
        self.full_logged = False

    def shape(self, rows: list[tuple[int, int, int, int]]) -> tuple[int, int, int] | None:
        """The bucket of a pass's rows (slot, first cell, new ids, offset), None where it runs eagerly."""
        n_max = max(n for _, _, n, _ in rows)
        if self.failed or n_max > MAX_TOKENS:
            return None
        keys = max(start + n for _, start, n, _ in rows)
        shape = (bucket(len(rows)), bucket(n_max), bucket(keys, MIN_KEYS, self.max_len))
        if shape not in self.shapes and len(self.shapes) >= MAX_SHAPES:
            if not self.full_logged:
                log.info("torch compile: %d shapes compiled, %s and later new shapes run eagerly", MAX_SHAPES, shape)
                self.full_logged = True
            return None
        return shape

    def grid(
        self, rows: list[tuple[int, int, int, int]], ids: list[int], pos: list[int], shape: tuple[int, int, int]
    ) -> tuple[torch.Tensor, torch.Tensor, Grid, torch.Tensor]:
        """(ids [1, B_p * n_p], positions [1, B_p * n_p], the grid, real [T]: the grid row of each of the pass's
        tokens, in the pass's order)."""
        b_p, n_p, l_p = shape
        slot, cell, n, off = (np.array(c, dtype=np.int64) for c in zip(*rows, strict=True))
        i = np.arange(n_p)
        real = i[None, :] < n[:, None]  # [B, n_p]
        src = off[:, None] + np.minimum(i[None, :], n[:, None] - 1)  # padding repeats the session's last token
        qpos = cell[:, None] + np.minimum(i[None, :], n[:, None] - 1)
        row = np.arange(b_p * n_p).reshape(b_p, n_p)
        pad = b_p - len(rows)  # padding sessions: token 0 at position 0, into the scratch slot's first cell
        g_ids = np.pad(np.asarray(ids, dtype=np.int64)[src], ((0, pad), (0, 0)))
        g_pos = np.pad(np.asarray(pos, dtype=np.int64)[src], ((0, pad), (0, 0)))
        g_qpos = np.pad(qpos, ((0, pad), (0, 0)))
        g_real = np.pad(real, ((0, pad), (0, 0)))
        tok_slot = np.where(g_real, np.pad(slot, (0, pad))[:, None], self.scratch)
        tok_pos = np.where(g_real, g_qpos, row % self.max_len)  # padding: scratch cells, each row its own
        slots = np.pad(slot, (0, pad), constant_values=self.scratch)
        dev = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(self.device)  # noqa: E731
        grid = Grid(
            self.pool,
            dev(slots),
            dev(tok_slot.reshape(-1)),
            dev(tok_pos.reshape(-1)),
            dev(g_qpos).unsqueeze(-1),  # [B_p, n_p, 1], strides as warm() makes them (no recompile)
            torch.arange(l_p, device=self.device),
        )
        return dev(g_ids.reshape(1, -1)), dev(g_pos.reshape(1, -1)), grid, dev(np.flatnonzero(g_real))

    def run(
        self, ids: torch.Tensor, positions: torch.Tensor, grid: Grid, shape: tuple[int, int, int]
    ) -> torch.Tensor | None:
        """hidden [1, B_p * n_p, hidden] of the compiled pass; None if it failed to compile (the caller runs
        the eager pass: any keys and values it wrote are written again, padding's went to the scratch slot)."""
        for t in (ids, positions, *grid.tensors()):
            for dim in range(t.dim()):
                if t.shape[dim] > 1:  # every bucketed size; a floor of 2 keeps 1 out of them
                    torch._dynamo.maybe_mark_dynamic(t, dim)
        if self.cuda:
            torch.compiler.cudagraph_mark_step_begin()  # the previous replay's outputs were copied out
        try:
            hidden = self._compiled(ids, positions, grid)
        except Exception as e:  # noqa: BLE001 (a compiler's failure must not fail the pass)
            self.failed = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            log.warning("torch compile failed (%s): the torch engine runs its passes eagerly", self.failed)
            return None
        self.shapes.add(shape)
        return hidden

    def warm(self) -> None:
        """Compile now, on a pass of padding alone (2 sessions x 2 tokens into the scratch slot): no session's
        KV is touched. Every later bucket reuses the compiled code (on CUDA, its graph is recorded on first use)."""
        shape = (2, 2, min(MIN_KEYS, self.max_len))
        zeros = torch.zeros((1, 4), dtype=torch.long, device=self.device)
        scratch = torch.full((4,), self.scratch, dtype=torch.long, device=self.device)
        grid = Grid(
            self.pool,
            scratch[:2].clone(),
            scratch,
            torch.arange(4, device=self.device),
            torch.zeros((2, 2, 1), dtype=torch.long, device=self.device),
            torch.arange(min(MIN_KEYS, self.max_len), device=self.device),
        )
        self.run(zeros, zeros.clone(), grid, shape)

    def status(self) -> str:
        """One line for the log and the benchmarks."""
        if self.failed:
            return f"failed, eager: {self.failed}"
        return f"compiled, shapes run: {len(self.shapes)}" + (" (CUDA graphs)" if self.cuda else "")
