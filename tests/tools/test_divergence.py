"""tools/bench/divergence: one-token passes against verify passes, and the near-tie bookkeeping."""

import numpy as np
import pytest

from tools.bench import divergence
from tools.logit_margin import top2


def test_ulp_is_the_dtype_spacing():
    assert divergence.ulp(1.0, "float32") == np.spacing(np.float32(1.0))
    assert divergence.ulp(20.0, "float16") == float(np.spacing(np.float16(20.0)))
    assert divergence.ulp(20.0, "bfloat16") == 0.125  # 16 <= 20 < 32, 7 mantissa bits
    assert divergence.ulp(-3.0, "bfloat16") == 2.0**-6
    assert divergence.ulp(0.0, "float32") == 0.0


def test_top2_orders_and_measures_the_margin():
    row = np.array([0.5, 3.0, 2.75, -1.0])
    assert top2(row) == (1, 2, 3.0, 0.25)


@pytest.mark.real
def test_verify_passes_follow_the_one_token_passes(target):
    ids = target.tokenizer.encode("The robot walked to the kitchen door and")
    ref = divergence.ar_reference(target, [ids, ids[:-2]], 10)
    for batched in (False, True):
        r = divergence.sd_against(target, [ids, ids[:-2]], ref, 10, 4, batched, "float32")
        assert r["compared"] + sum(10 - d["position"] - 1 for d in r["divergences"]) == 20
        assert 0 < r["noise_median"] <= r["noise_max"] < 0.1  # f16 KV rounding, never a different model
        assert all(d["near_tie"] for d in r["divergences"])
