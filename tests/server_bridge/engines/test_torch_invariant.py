"""The torch engine's batch-invariant mode (invariant_torch.py): in bfloat16 every row of a verify pass, of 1 to
32 sessions at any draft length, is the one-token pass's row at that position, bit for bit."""

import numpy as np
import pytest
import torch

from server_bridge.engines import invariant_torch
from server_bridge.target import Extension

pytestmark = pytest.mark.real


def verify_pass(target, prompts, ar, sessions: list[tuple[int, int, int]]) -> list[np.ndarray]:
    """One pass of every (prompt, offset, draft length) session: its state at prompt + AR's first `offset` ids
    (prefilled together first), drafting AR's next ids; per session its rows [draft + 1, vocab]."""
    states = [target.new_state(prompts[p] + ar[p][0][:o], prefill=False) for p, o, _ in sessions]
    target.extend([Extension(s, s.ids[:-1], 0) for s in states])  # the prefills: one pass
    for s in states:
        s.cached = len(s.ids) - 1
    exts = [
        Extension(s, s.ids[-1:] + ar[p][0][o : o + g], g + 1) for s, (p, o, g) in zip(states, sessions, strict=True)
    ]
    rows = [target.to_numpy(r) for r in target.extend(exts)]
    for s in states:
        target.free(s)
    return rows


@pytest.mark.parametrize("n", [1, 2, 8, 32])
def test_verify_rows_are_the_one_token_rows(bf16_target, bf16_ar, n):
    prompts, ar = bf16_ar
    assert bf16_target.engine.info.extra["batch_invariant"] and bf16_target.engine.info.extra["exact"]
    sessions = [(i % len(prompts), (3 * i) % 7, (i * 5 + n) % 8) for i in range(n)]  # drafts of 0 to 7
    for (p, o, g), rows in zip(sessions, verify_pass(bf16_target, prompts, ar, sessions), strict=True):
        for j in range(g + 1):
            assert np.array_equal(rows[j], ar[p][1][o + j]), f"session {p} position {o + j}: not the AR row"


def test_without_the_mode_rows_round_differently(bf16_plain_target, bf16_ar):
    """What the mode fixes: the plain bf16 pass's verify rows differ from its one-token rows."""
    from tools.bench.divergence import ar_reference

    prompts, _ = bf16_ar
    ar = ar_reference(bf16_plain_target, prompts[:2], 8)
    sessions = [(0, 0, 7), (1, 0, 7)]
    rows = verify_pass(bf16_plain_target, prompts[:2], ar, sessions)
    noise = max(
        float(np.abs(r[j] - ar[p][1][j]).max()) for (p, _, _), r in zip(sessions, rows, strict=True) for j in range(8)
    )
    assert noise > 0.0


def test_the_mode_defaults_by_dtype_and_refuses_unknown_modes():
    assert invariant_torch.enabled("auto", torch.bfloat16) and invariant_torch.enabled("auto", torch.float16)
    assert not invariant_torch.enabled("auto", torch.float32) and invariant_torch.enabled("on", torch.float32)
    assert not invariant_torch.enabled("off", torch.bfloat16)
    with pytest.raises(ValueError, match="batch_invariant"):
        invariant_torch.enabled("maybe", torch.bfloat16)


def test_the_probe_finds_a_gemv_that_is_not_the_gemm():
    """The probe's own check, on a shape where a single row's kernel differs from the GEMM's (K = 1536 here):
    unpadded single rows are what the mode replaces; padded, the shapes of the shipped target pass."""
    assert invariant_torch.probe({(1536, 576), (576, 1536)}, torch.bfloat16, torch.device("cpu")) == []
    w = torch.randn(576, 1536).bfloat16() / 40
    x = (torch.randn(40, 1536) * 4).bfloat16()
    single = torch.cat([torch.nn.functional.linear(x[i : i + 1], w) for i in range(40)])
    padded = torch.cat([torch.nn.functional.linear(x[i : i + 1].expand(2, -1), w)[:1] for i in range(40)])
    assert torch.equal(padded, torch.nn.functional.linear(x, w))
    assert not torch.equal(single, padded)  # measured on this CPU; the mode exists because of it
