"""The shipped target on the torch engine in bfloat16 (CPU), with and without the batch-invariant mode."""

import pytest

from server_bridge.target import load_target


@pytest.fixture(scope="session")
def bf16_target():
    """bfloat16 on the torch engine: batch-invariant (its default wherever the dtype is not float32)."""
    return load_target(engine="torch", device="cpu", dtype="bfloat16", threads=1, max_sequences=40, max_len=512)


@pytest.fixture(scope="session")
def bf16_plain_target():
    """The same with the mode off: what the rows were before it."""
    return load_target(
        engine="torch", device="cpu", dtype="bfloat16", threads=1, max_sequences=8, max_len=512, batch_invariant="off"
    )


@pytest.fixture(scope="session")
def bf16_ar(bf16_target):
    """(prompts, per prompt (AR's greedy ids, every one-token row)) on bf16_target: 16 tokens of 4 benchmark
    prompts, the 8th first: without the mode its 10th token is a near-tie that SD flips (alone and in passes of
    2 to 32: docs/benchmarks/batch_invariant_cpu/divergence/)."""
    from tools.bench.divergence import ar_reference
    from tools.bench.peer import load_prompts

    every = [p.prompt_ids for p in load_prompts(n=8).prompts]
    prompts = [every[7], every[2], every[5], every[0]]
    return prompts, ar_reference(bf16_target, prompts, 16)
