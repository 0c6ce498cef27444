"""The verification maths on the torch engine's device: what protocol/sampling.py does in numpy.

Tensors in, verdicts out. A round's logits rows [k + 1, V] stay on the device;
the host gets back only what the decision and the wire need: the k target
probabilities of the drafted tokens (p_i(x_i)), one sampled token id, and, after
a split rejection, the one row p_j the robot resamples from. The random
numbers come from the session's numpy generator in the same order as
protocol.sampling draws them, so a seed replays the same way on either path;
protocol.sampling stays the reference these functions are tested against
(tests/server_bridge/engines/test_devmath.py).

    probs  = temperature, top-k (ties at the k-th value kept), softmax,
             top-p nucleus (ties at the edge kept) when top_p < 1           [n, V]
    accept x_i with probability min(1, p_i(x_i) / q_i(x_i))
    at the first rejection draw from norm(max(0, p_i - q_i)); if none, draw from p_k
"""

from __future__ import annotations

import numpy as np
import torch

from protocol.sampling import RESIDUAL, SamplingError, SamplingParams, Verdict


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Logits [..., V] (any float dtype) -> float32 probabilities [..., V] at params (T > 0)."""
    if params.greedy:
        raise SamplingError("probs_from_logits needs temperature > 0; use argmax when greedy")
    x = logits.float() / params.temperature
    if not bool(torch.isfinite(x).all()):
        raise SamplingError("logits contain NaN or infinity")
    if 0 < params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, -torch.inf)
    p = torch.softmax(x, dim=-1)
    return p if params.top_p >= 1.0 else nucleus(p, params.top_p)


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """probs [..., V] -> the top-p nucleus of each row [..., V], renormalised: protocol.sampling.nucleus's rule.

    n is the smallest count of the largest probabilities whose sum reaches top_p * sum(p); every token at
    least as likely as the n-th is kept (ties at the edge kept), the rest get 0.
    """
    desc = torch.sort(probs, dim=-1, descending=True).values  # [..., V]
    reach = top_p * desc.sum(dim=-1, keepdim=True)  # [..., 1]
    n = (torch.cumsum(desc, dim=-1) < reach).sum(dim=-1, keepdim=True).clamp(max=probs.shape[-1] - 1)  # [..., 1]
    edge = torch.gather(desc, -1, n)  # [..., 1]: the n-th largest probability, zero-based
    out = probs.masked_fill(probs < edge, 0.0)
    return out / out.sum(dim=-1, keepdim=True)


def sample(probs: torch.Tensor, rng: np.random.Generator) -> int:
    """One draw from probs [V] by inverse CDF with one host uniform (as protocol.sampling.sample)."""
    cdf = torch.cumsum(probs.double(), dim=0)
    u = rng.random() * float(cdf[-1])
    return int(
        min(
            int(torch.searchsorted(cdf, torch.tensor([u], dtype=cdf.dtype, device=cdf.device), right=True)),
            probs.shape[0] - 1,
        )
    )


def _accept_loop(ratio: np.ndarray, rng: np.random.Generator) -> int:
    """The first i whose uniform fails min(1, ratio_i), or k: the same draws as protocol.sampling."""
    for i, r in enumerate(ratio):
        if not rng.random() < min(1.0, r):
            return i
    return len(ratio)


def verify_sampled(draft_ids: list[int], q: np.ndarray, p: torch.Tensor, rng: np.random.Generator) -> Verdict:
    """draft_ids [k], q [k, V] (host, the draft's distributions), p [k + 1, V] on the device."""
    k = len(draft_ids)
    if q.shape[0] != k or p.shape[0] != k + 1 or q.shape[1] != p.shape[1]:
        raise SamplingError(f"shape mismatch: draft [{k}], q {q.shape}, p {tuple(p.shape)}")
    x = np.asarray(draft_ids, dtype=np.int64)
    qx = q[np.arange(k), x]
    if np.any(qx <= 0.0):
        i = int(np.flatnonzero(qx <= 0.0)[0])
        raise SamplingError(f"draft token {int(x[i])} at position {i} has zero draft probability")
    px = p[torch.arange(k, device=p.device), torch.as_tensor(x, device=p.device)].double().cpu().numpy()  # k floats
    i = _accept_loop(px / qx, rng)
    if i == k:
        return Verdict(accepted=k, token=sample(p[k], rng))
    qi = torch.as_tensor(q[i], dtype=torch.float64, device=p.device)
    r = torch.clamp(p[i].double() - qi, min=0.0)
    mass = float(r.sum())
    return Verdict(accepted=i, token=sample(p[i] if mass <= 0.0 else r / mass, rng))


def verify_split(draft_ids: list[int], qx: np.ndarray, p: torch.Tensor, rng: np.random.Generator) -> Verdict:
    """Split (DSSD): qx [k] = q_i(x_i) only; a rejection is (j, RESIDUAL) and the caller sends p_j down."""
    k = len(draft_ids)
    if len(qx) != k or p.shape[0] != k + 1:
        raise SamplingError(f"shape mismatch: draft [{k}], qx [{len(qx)}], p {tuple(p.shape)}")
    bad = [(i, float(v)) for i, v in enumerate(qx) if not 0.0 < float(v) <= 1.0]
    if bad:
        raise SamplingError(
            f"q(x) of draft token {draft_ids[bad[0][0]]} at position {bad[0][0]} is {bad[0][1]}, not in (0, 1]"
        )
    x = torch.as_tensor(np.asarray(draft_ids, dtype=np.int64), device=p.device)
    px = p[torch.arange(k, device=p.device), x].double().cpu().numpy()
    i = _accept_loop(px / np.asarray(qx, dtype=np.float64), rng)
    if i == k:
        return Verdict(accepted=k, token=sample(p[k], rng))
    return Verdict(accepted=i, token=RESIDUAL)
