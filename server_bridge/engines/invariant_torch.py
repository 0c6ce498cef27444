"""The torch engine's batch-invariant mode: every row of a pass computes the logits the one-token pass computes.

At T = 0 exactness means SD commits the ids the target alone, one token per pass, would write. A
verify pass holds gamma + 1 rows of one session, or the rows of many sessions; where a kernel's
reduction order depends on the pass's shape, a row's logits round differently from the one-token
pass's, and at a near-tie the argmax flips (tools/bench/divergence.py measures it). What was
measured (docs/benchmarks/batch_invariant_cpu/, torch 2.13 CPU, oneDNN bfloat16 on AVX512-BF16):

- a bfloat16 `linear` (oneDNN's matmul) gives each row the same bits for every M >= 2 rows (2, 3,
  5, 40, 160, 300; any row position, 1 or 2 threads): its GEMM keeps the K reduction in one order.
  With M = 1 it takes another kernel (a GEMV) that sums K in another order: for K > 576 (the MLP's
  down projection, K = 1536) up to a fifth of the rows differ by an ulp, and those ulps are the whole
  divergence of the shipped target (its layer 2 MLP is the first place a verify row and a one-token
  row differ). float32 is worse: every M >= 2 differs from M = 1.
- the norms (a float32 mean over the hidden size), the softmax and the elementwise ops are per-row:
  the same bits for any number of rows (measured to 8192 wide; the vocabulary-wide mean, which
  nothing in the pass takes, is not).
- attention (SDPA's CPU flash kernel) gives a query different bits by the number of query rows in its
  block (1, 2-3 and 4 or more take different GEMM kernels) and by where the keys end (a slot cut at
  the query's last key rounds differently from one with masked keys after it). With at least 4 query
  rows in every block and the keys cut at a multiple of 64 (any multiple: masked keys add exact
  zeros), a query's bits are the same alone or among 5, 8 or 32 rows, and whatever other sessions'
  slots are padded to (tools/bench/invariant_ops.py measures all three ops).

So the mode changes every pass alike (AR included: the reference moves with it): a linear never runs
on a single row (a one-token pass's row goes through the GEMM padded to two rows, the copy's output
dropped: the kernel every multi-row pass uses), and attention always takes the padded path, each
session's queries padded (repeating its last token) so that no block of 32 holds fewer than 4 rows and
the keys cut at a multiple of 64 cells (the slots are allocated in whole 64s). A verify pass of
gamma + 1 >= 4 rows pays only the key rounding; a one-token pass pays 3 padding query rows and a
padded linear row. The guarantee is measured, not
proven for every machine: `probe` repeats the linear measurement on the engine's own shapes, device
and dtype when the engine loads, and the engine logs (and reports in its info) whether it held.

Off by default in float32 (`auto`): there MKL's GEMM changes kernels with M (every row of M = 1, 5, 40
and 160 differs from M = 2: `python -m tools.bench.invariant_ops --dtype float32`), so padding one row
buys nothing; forced `on` in float32, the probe reports it (`exact` false). Compiled passes
(compile_torch.py) round as inductor's fused kernels do: where the pass is compiled (`torch_compile`
on, or auto on CUDA) compile wins, the mode shapes only the eager passes and the engine's info says
`exact` false (`with_compile`).
On CUDA nothing here was measured (no GPU in the session that built it): the probe is what tells.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

MODES = ("auto", "on", "off")
PROBE_ROWS = (2, 3, 5, 40)  # the pass sizes the probe compares with the padded one-token row
PROBE_SINGLES = 8  # rows the probe runs one at a time
MIN_QUERIES = 4  # SDPA's CPU kernel runs a block of fewer query rows through another kernel
QUERY_SPLIT = 32  # ... and splits a session's queries into blocks of 32, 64 or 256 rows (multiples of 32)
KEY_BLOCK = 64  # keys attended, a whole number of these


def query_len(n: int) -> int:
    """The query rows a session's n are padded to, so that no block of SDPA's is left with fewer than
    MIN_QUERIES rows: n itself (a verify pass's gamma + 1 >= 4 costs nothing), unless n < 4 or n's last
    block of 32 would hold 1 to 3."""
    tail = n % QUERY_SPLIT
    return n if tail == 0 or tail >= MIN_QUERIES else n - tail + MIN_QUERIES


def key_len(n: int) -> int:
    """n keys rounded up to whole KEY_BLOCKs."""
    return -(-n // KEY_BLOCK) * KEY_BLOCK


def enabled(mode: str, dtype: torch.dtype) -> bool:
    """auto: on wherever the dtype is not float32."""
    if mode not in MODES:
        raise ValueError(f"batch_invariant must be one of {', '.join(MODES)}, got {mode!r}")
    return mode == "on" or (mode == "auto" and dtype != torch.float32)


def with_compile(mode: str, compile: str, dtype: torch.dtype, device: torch.device) -> tuple[bool, bool]:
    """(the mode on, the pass compiled). Where the pass is compiled (auto: on CUDA) compile wins: its passes
    of up to 32 tokens a session run inductor's fused kernels, which are not row-invariant, and the mode
    shapes only the eager passes (the engine's info says `exact` false). CUDA graphs are worth more on a GPU
    than a mode nobody measured there; torch_compile = "off" gives the mode every pass."""
    from . import compile_torch

    return enabled(mode, dtype), compile_torch.enabled(compile, device)


def slot_len(cells: int, on: bool) -> int:
    """A KV slot's cells: whole KEY_BLOCKs with the mode on, so that a pass's keys can always be cut at one."""
    return key_len(cells) if on else cells


def _padded_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """nn.Linear's forward, a single row [..., K] run as two (the GEMM's kernel, not the GEMV's)."""
    if x.numel() != x.shape[-1]:
        return F.linear(x, self.weight, self.bias)
    two = x.reshape(1, -1).expand(2, -1)  # [2, K]: the row and its copy
    return F.linear(two, self.weight, self.bias)[:1].reshape(*x.shape[:-1], -1)


def pad_single_rows(model: nn.Module) -> int:
    """Every nn.Linear in model runs a single row as two; how many were changed."""
    n = 0
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.forward = types.MethodType(_padded_forward, m)  # type: ignore[method-assign]
            n += 1
    return n


def probe(shapes: set[tuple[int, int]], dtype: torch.dtype, device: torch.device, seed: int = 0) -> list[str]:
    """Each linear shape (K in, N out) of the model, on this device and dtype: a padded single row against
    the same row in passes of PROBE_ROWS rows. The shapes (and row counts) whose rows differ; [] when the
    mode's guarantee held here."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    bad = []
    for k, n in sorted(shapes):
        w = (torch.randn(n, k, generator=g) * k**-0.5).to(device, dtype)
        rows = max(PROBE_ROWS)
        x = (torch.randn(rows, k, generator=g) * torch.rand(rows, 1, generator=g) * 4).to(device, dtype)
        one = torch.cat([F.linear(x[i : i + 1].expand(2, -1), w)[:1] for i in range(PROBE_SINGLES)])  # [8, N]
        off = [m for m in PROBE_ROWS if not torch.equal(F.linear(x[:m], w)[:PROBE_SINGLES], one[: min(m, 8)])]
        if off:
            bad.append(f"{k}x{n} at {','.join(map(str, off))} rows")
    return bad


def linear_shapes(model: nn.Module) -> set[tuple[int, int]]:
    """The (in, out) features of every nn.Linear in model."""
    return {(m.in_features, m.out_features) for m in model.modules() if isinstance(m, nn.Linear)}


def describe(on: bool, failed: list[str], compiled: bool) -> dict[str, Any]:
    """The engine info's entry: whether the mode is on and whether its guarantee holds on this machine."""
    return {
        "batch_invariant": on,
        "exact": on and not failed and not compiled,
        **({"invariance_failed": failed} if failed else {}),
    }
