"""The pipelined-serving planner (paper 000, Zhu et al.): batches and draft lengths for a fleet of robots.

    server-bridge plan [--fleet robots.json] [--devices 6] [--bandwidth-mhz 20] [--alpha 0.8]
                       [--estimator est.json] [--gamma-max 10] [--allow-ar] [--drafting device|shared] [--json]

"Efficient LLM Inference over Heterogeneous Edge Networks with Speculative
Decoding" serves K tasks with a two-stage pipeline: a drafter (stage 1) drafts
l tokens for batch m while the verifier (stage 2) checks batch m-1 (Fig. 4).
The total latency is the uplink time of the prompts plus the sum over decoding
steps of each step's pipeline makespan (Eqs. 15-23). The paper splits the
uplink bandwidth in closed form (Eq. 27), then chooses the batches with a
dynamic programme over tasks sorted by prompt length (Algorithm 1) and the
speculation length by enumeration (Eq. 33).

Paper -> this system:

    task k (user)              robot k: a `Device`
    SBS draft model            each robot's own drafter (drafting="device": batches draft
                               concurrently, a batch is ready when its slowest robot is);
                               the paper's one shared SBS drafter is drafting="shared"
    MBS verify model           server_bridge's target; its time per pass is a `VerifyModel`:
                               WISP's Eq. 19 estimator (`LinearVerifyModel`) or the paper's
                               FLOPs law, Eqs. 14, 17, 18 (`FlopsRuntime`)
    prompt upload (Eq. 15)     the prompt a robot sends in `open`: lambda * I_k bits over OFDMA
    memory limit (Eq. 24b)     a KV-token budget per batch (`kv_budget_tokens`, Eqs. 9-10)

What is exact and what is not: the DPs keep, for every state, every
non-dominated vector of per-step stage completion times (a Pareto set), so they
are optimal over their search space; the tests check both against exhaustive
search. `plan_consecutive` searches the paper's space (consecutive batches of
the devices sorted by prompt length, in that order); `plan_subsets` searches
every ordered partition (any grouping, any order) and is what `plan()` uses
for up to 8 robots, because the prompt-length order is not optimal once robots
draft at different speeds. The paper's Algorithm 1 keeps one vector per prefix
and can miss the optimum (`paper_algorithm1`, kept for comparison).

`server-bridge plan` plans for the operator's own robots (--fleet: a JSON file of
Devices) or for seeded example ones; tools/bench/planner.py compares the plan with
baselines and writes the report. Default coefficients are EXAMPLES (WISP's published
A100 fit, the paper's Table II), not measurements of this system: pass --estimator
(the fitted models/estimator/<target>.json of `server-bridge profile`) for real ones.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
from numpy.typing import ArrayLike

from ..config import PlanConfig

# A verify-time model: new_tokens [..., b], cached_tokens [..., b] -> ms [...].
# Member j of the batch appends new[..., j] tokens to a KV cache of cached[..., j]
# tokens; a member with new == 0 is absent (finished) and must cost nothing.
VerifyModel = Callable[[np.ndarray, np.ndarray], np.ndarray]


# ============================================================================ roles


@dataclass(frozen=True)
class Device:
    """One robot with one generation to serve: the paper's task k."""

    draft_ms_per_token: float  # its drafter's time per draft token (drafting="device")
    alpha: float  # token acceptance rate, [0, 1]
    uplink_bits_per_token: float  # lambda: bits uploaded per prompt token (Eq. 15); can be zero
    prefix_tokens: int  # I_k: prompt length
    spectral_efficiency: float  # log2(1 + p_k g_k / sigma^2), bit/s/Hz of its uplink
    output_tokens: int = 64  # O_k: tokens to generate (the paper's DP sets all to O_max)
    prefill_ms_per_token: float = 0.0  # its drafter's prompt prefill, charged in step 1 (Eq. 13)

    def __post_init__(self) -> None:
        for name in (
            "draft_ms_per_token",
            "alpha",
            "uplink_bits_per_token",
            "prefix_tokens",
            "spectral_efficiency",
            "output_tokens",
            "prefill_ms_per_token",
        ):
            v = getattr(self, name)
            if not isinstance(v, (int, float, np.integer, np.floating)) or not math.isfinite(v):
                raise ValueError(f"Device.{name} must be a finite number, got {v!r}")
        if self.draft_ms_per_token < 0 or self.uplink_bits_per_token < 0 or self.prefill_ms_per_token < 0:
            raise ValueError(f"Device times and bits must be >= 0: {self}")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"Device.alpha must be in [0, 1], got {self.alpha}")
        if self.prefix_tokens < 1 or self.output_tokens < 1:
            raise ValueError(f"Device.prefix_tokens and output_tokens must be >= 1: {self}")
        if self.spectral_efficiency <= 0:
            raise ValueError(f"Device.spectral_efficiency must be > 0 bit/s/Hz, got {self.spectral_efficiency}")

    @property
    def uplink_bits(self) -> float:
        """lambda * I_k: the prompt's size on the uplink (Eq. 15)."""
        return self.uplink_bits_per_token * self.prefix_tokens


@dataclass(frozen=True)
class LinearVerifyModel:
    """WISP Eq. 19: T = a*N_linear + b_c*N_interactions + b_r*N_cached + c   [ms].

    N_linear = sum_j new_j, N_interactions = sum_j (cached_j + new_j) * new_j (Eq. 18),
    N_cached = sum_j cached_j; c is paid once per pass. Same keys and units as
    server_bridge/estimator.py's JSON (ms per token / interaction / cached token).
    """

    a: float
    b_c: float
    b_r: float
    c: float
    source: str = ""  # where the coefficients come from

    def __post_init__(self) -> None:
        if not all(math.isfinite(v) and v >= 0 for v in (self.a, self.b_c, self.b_r, self.c)):
            raise ValueError(f"verify-model coefficients must be finite and >= 0: {self}")

    def __call__(self, new: np.ndarray, cached: np.ndarray) -> np.ndarray:  # [..., b] -> [...]
        new, cached = np.asarray(new, float), np.asarray(cached, float)
        return self.a * new.sum(-1) + self.b_c * ((cached + new) * new).sum(-1) + self.b_r * cached.sum(-1) + self.c

    @classmethod
    def load(cls, path: str | Path) -> "LinearVerifyModel":
        """The estimator JSON another tool writes: {"a", "b_c", "b_r", "c"} in ms per unit."""
        from ..estimator import VerifyTimeModel  # the server's loader and its checks

        m = VerifyTimeModel.load(path)
        return cls(
            float(m.a),
            float(m.b_c),
            float(m.b_r),
            float(m.c),
            source=f"{path} ({m.target or '?'} on {m.device or '?'})",
        )


# EXAMPLE, not measured here: WISP's OLS fit for Qwen3-32B on an A100 (WISP Appendix, Table 12:
# a = 33.14 us/token, b_c = 0.0345 us/interaction, b_r = 4.62 us/cached token, c = 14.86 ms).
WISP_A100_EXAMPLE = LinearVerifyModel(
    a=0.03314, b_c=3.45e-5, b_r=0.00462, c=14.86, source="EXAMPLE: WISP Table 12 (Qwen3-32B, A100), not measured here"
)


@dataclass(frozen=True)
class FlopsRuntime:
    """The paper's runtime law for a decoder-only model, Eqs. 11-14, 17-19   [ms].

    One forward pass appending `new` tokens to a KV cache of `cached` tokens costs,
    per task (Eq. 14, both cases; Eq. 13 is the same with new = I_m or 1):
        F(new, cached) = 4 J h1 new (2 h1 + h2 + cached + new)      FLOPs
    and a batch of b padded tasks takes T = c1 F b + c2 (Eq. 17), i.e. c1 sum_j F_j + c2.
    """

    c1: float  # s per FLOP
    c2: float  # s per pass
    layers: int  # J
    hidden: int  # h1
    ffn: int  # h2

    def flops(self, new: np.ndarray, cached: np.ndarray) -> np.ndarray:
        new, cached = np.asarray(new, float), np.asarray(cached, float)
        return 4.0 * self.layers * self.hidden * new * (2 * self.hidden + self.ffn + cached + new)

    def __call__(self, new: np.ndarray, cached: np.ndarray) -> np.ndarray:  # [..., b] -> [...]
        return 1e3 * (self.c1 * self.flops(new, cached).sum(-1) + self.c2)


# EXAMPLES from the paper's Tables I-II (RTX 4500 verifier, RTX 3080 drafter).
LLAMA_7B_VERIFY = FlopsRuntime(c1=2.08e-14, c2=1.28e-2, layers=32, hidden=4096, ffn=11008)
LLAMA_68M_DRAFT = FlopsRuntime(c1=4.11e-13, c2=0.56e-3, layers=2, hidden=768, ffn=3072)


@dataclass(frozen=True)
class Drafting:
    """Where stage 1 runs.

    shared=False: every robot drafts on its own hardware, so all batches draft at once
      and a batch is ready after max_k (gamma * t_k [+ I_k * prefill_k in step 1]).
    shared=True: the paper's SBS, one drafter that drafts the batches one after another
      (C^d_{n,m} = sum_{i<=m} T^d_{n,i}), each batch taking Eq. 19 with `runtime`.
    """

    shared: bool = False
    runtime: FlopsRuntime | None = None  # the shared drafter's runtime law (shared=True only)

    def __post_init__(self) -> None:
        if self.shared and self.runtime is None:
            raise ValueError("Drafting(shared=True) needs the shared drafter's runtime")


ON_DEVICE = Drafting(shared=False)


@dataclass(frozen=True)
class Plan:
    """A schedule and what the latency model predicts for it."""

    batches: tuple[tuple[int, ...], ...]  # device indices per batch, in pipeline order
    gammas: tuple[int, ...]  # speculation length per batch (all equal under the paper's single l)
    bandwidth_hz: np.ndarray  # [n] uplink bandwidth per device; sums to the total
    steps: int  # N = max_m n_m (Eq. 8)
    t_com_ms: float  # Eq. 16: the last prompt's arrival
    t_inf_ms: float  # Eq. 22: sum of the steps' pipeline makespans
    tokens: float  # sum_k O_k committed tokens
    exact: bool = True  # False if the DP had to drop Pareto labels (max_labels)
    label: str = "dp"

    @property
    def total_ms(self) -> float:  # Eq. 23
        return self.t_com_ms + self.t_inf_ms

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / (self.total_ms / 1e3)

    @property
    def ms_per_token(self) -> float:
        return self.total_ms / self.tokens

    def to_json(self) -> dict:
        d = asdict(self)
        d["bandwidth_hz"] = [float(x) for x in self.bandwidth_hz]
        d.update(total_ms=self.total_ms, tokens_per_s=self.tokens_per_s, ms_per_token=self.ms_per_token)
        return d


# ============================================================================ the math (pure)


def expected_tokens(alpha: ArrayLike, gamma: ArrayLike) -> np.ndarray:
    """Eq. 7: committed tokens per verification round, L = (1 - alpha^(gamma+1)) / (1 - alpha).

    gamma drafts, each accepted with probability alpha until the first rejection,
    plus the bonus token (correction or reward): E = sum_{i=0}^{gamma} alpha^i.
    alpha = 1 gives gamma + 1; gamma = 0 is autoregressive decoding (1 token).
    """
    a = np.asarray(alpha, dtype=float)
    g = np.asarray(gamma)
    if np.any(~np.isfinite(a)) or np.any((a < 0) | (a > 1)):
        raise ValueError(f"alpha must be in [0, 1], got {alpha!r}")
    if np.any(g < 0) or np.any(g != np.round(g)):
        raise ValueError(f"gamma must be a non-negative integer, got {gamma!r}")
    near_one = a > 1.0 - 1e-6  # the closed form cancels badly here: sum the series
    safe = np.where(near_one, 0.5, a)
    i = np.arange(int(g.max()) + 1)  # [gamma_max + 1]
    series = (np.expand_dims(a, -1) ** i * (i <= np.expand_dims(g, -1))).sum(-1)
    return np.where(near_one, series, (1.0 - safe ** (g + 1)) / (1.0 - safe))


def decoding_steps(output_tokens: ArrayLike, alpha: ArrayLike, gamma: ArrayLike) -> np.ndarray:
    """Eq. 8: n = ceil(O / L) decoding steps to commit O tokens."""
    return np.ceil(np.asarray(output_tokens, float) / expected_tokens(alpha, gamma) - 1e-9).astype(int)


def bandwidth_split(bits: np.ndarray, spectral_efficiency: np.ndarray, total_hz: float) -> np.ndarray:
    """Eqs. 26-27: the uplink bandwidth per device that minimises the last arrival, [n] -> [n] Hz.

    Device k uploads bits_k at rate r_k = w_k B s_k (s_k = log2(1 + p_k g_k / sigma^2)),
    so T_k = bits_k / (w_k B s_k) falls as w_k grows. The max over k is minimised when
    all finish together (else the early ones could give bandwidth to the last one):
        w_k = bits_k / (t* B s_k),  sum_k w_k = 1
        => t* = sum_k bits_k / (B s_k),   w_k = (bits_k / s_k) / sum_j (bits_j / s_j).
    (The extraction prints t* with "p_k / g_k sigma^2" inside the log; summing Eq. 26
    gives p_k g_k / sigma^2, as in Eq. 27.) Devices with nothing to send get 0 Hz.
    """
    bits = _vector(bits, "bits")  # [n]
    se = _vector(spectral_efficiency, "spectral_efficiency")  # [n]
    if bits.shape != se.shape:
        raise ValueError(f"bits {bits.shape} and spectral_efficiency {se.shape} must have the same shape")
    if np.any(se <= 0):
        raise ValueError(f"spectral_efficiency must be > 0 bit/s/Hz, got {se}")
    if not (isinstance(total_hz, (int, float, np.integer, np.floating)) and math.isfinite(total_hz) and total_hz > 0):
        raise ValueError(f"total_hz must be a positive finite number, got {total_hz!r}")
    need = bits / se  # [n] Hz*s each would need alone
    if need.sum() <= 0:
        return np.full(bits.shape, total_hz / len(bits))  # nothing to send: any split is optimal
    return total_hz * need / need.sum()


def upload_ms(bits: np.ndarray, spectral_efficiency: np.ndarray, bandwidth_hz: np.ndarray) -> np.ndarray:
    """Eq. 15: T_k,com = bits_k / (w_k B s_k), in ms, [n]. Zero bits take 0 ms; bits on 0 Hz take inf."""
    bits = _vector(bits, "bits")
    rate = _vector(spectral_efficiency, "spectral_efficiency") * _vector(bandwidth_hz, "bandwidth_hz")
    if not bits.shape == rate.shape:
        raise ValueError(f"bits {bits.shape}, spectral_efficiency and bandwidth_hz must have the same shape")
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(bits > 0, 1e3 * bits / rate, 0.0)


def pipeline_ms(draft: np.ndarray, verify: np.ndarray, shared_drafter: bool, pipelined: bool = True) -> float:
    """Eqs. 20-22: T_inf = sum_n C_{n,M} of stage times draft, verify [N, M] (ms, 0 = inactive).

    Batches run in column order. Stage 1 of batch m ends at C^d_{n,m} = sum_{i<=m} T^d_{n,i}
    with one shared drafter, or at T^d_{n,m} when every robot drafts itself; then
        C_{n,m} = max(C^d_{n,m}, C_{n,m-1}) + T^v_{n,m},   C_{n,0} = 0   (Eq. 20)
    Each step starts when the previous one ends (the paper's per-step barrier).
    pipelined=False is the paper's "SD w/o pipeline": C_{n,m} = C_{n,m-1} + T^d + T^v.
    """
    d = np.asarray(draft, float)
    v = np.asarray(verify, float)
    if d.ndim != 2 or d.shape != v.shape:
        raise ValueError(f"draft and verify must both be [steps, batches], got {d.shape} and {v.shape}")
    ready = np.cumsum(d, axis=1) if shared_drafter else d  # [N, M] C^d_{n,m}
    done = np.zeros(d.shape[0])  # [N]    C_{n,m-1}
    for m in range(d.shape[1]):
        done = done + d[:, m] + v[:, m] if not pipelined else np.maximum(ready[:, m], done) + v[:, m]
    return float(done.sum())


def batch_stage_ms(
    devices: Sequence[Device],
    members: Sequence[int],
    gamma: int,
    horizon: int,
    verify: VerifyModel,
    drafting: Drafting = ON_DEVICE,
    padded: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """Per-step stage times of one batch, draft [H] and verify [H] in ms, 0 once it is done.

    Member k commits L_k = Eq. 7 tokens a step and needs n_k = Eq. 8 steps; the batch runs
    n_m = max_k n_k steps and drops members as they finish. In step n the verifier appends
        n = 1: new = I + gamma,  cached = 0                  (prefill + drafts, Eq. 14 case 1)
        n > 1: new = 1 + gamma,  cached = I + (n-1) L_k - 1  (bonus + drafts, Eq. 14 case 2)
    with I = I_m = max_k I_k when padded (the paper pads to the longest prompt), else I_k;
    a padded batch runs as a rectangle, so every live row costs the widest row.
    """
    if horizon < 1:
        raise ValueError(f"horizon must be >= 1, got {horizon}")
    if not members or not all(0 <= k < len(devices) for k in members):
        raise ValueError(f"members must be a non-empty list of device indices 0..{len(devices) - 1}, got {members}")
    devs = [devices[k] for k in members]
    prefix = np.array([d.prefix_tokens for d in devs], float)  # [b]
    ell = expected_tokens([d.alpha for d in devs], gamma)  # [b]
    n_k = decoding_steps([d.output_tokens for d in devs], [d.alpha for d in devs], gamma)  # [b]
    if n_k.max() > horizon:
        raise ValueError(f"horizon {horizon} < the {n_k.max()} steps this batch needs")
    step = np.arange(1, horizon + 1)[:, None]  # [H, 1]
    live = step <= n_k  # [H, b]
    width = np.full_like(prefix, prefix.max()) if padded else prefix  # [b]
    first = step == 1

    def rows(
        new: np.ndarray, cached: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:  # mask finished members; pad live rows to the widest
        if padded:
            new = np.where(live, new, 0).max(-1, keepdims=True) * np.ones_like(live)
            cached = np.where(live, cached, 0).max(-1, keepdims=True) * np.ones_like(live)
        return np.where(live, new, 0.0), np.where(live, cached, 0.0)

    kv = np.maximum(width + (step - 1) * ell - 1, 0)  # [H, b] committed KV before the step
    new, cached = rows(np.where(first, width + gamma, 1.0 + gamma), np.where(first, 0.0, kv))
    t_verify = np.where(live.any(-1), verify(new, cached), 0.0)  # [H]

    if gamma == 0:  # autoregressive: no drafter
        t_draft = np.zeros(horizon)
    elif not drafting.shared:
        per = gamma * np.array([d.draft_ms_per_token for d in devs]) + first * prefix * np.array(
            [d.prefill_ms_per_token for d in devs]
        )  # [H, b]
        t_draft = np.where(live, per, 0.0).max(-1)
    else:  # Eq. 19: sum of the gamma passes; step 1's first is the prefill (Eq. 13)
        t_draft, runtime = np.zeros(horizon), drafting.runtime
        assert runtime is not None  # Drafting(shared=True) has one
        for i in range(1, gamma + 1):
            prefill = first & (i == 1)
            new_i, cached_i = rows(np.where(prefill, width, 1.0), np.where(prefill, 0.0, kv + i - 1))
            t_draft += np.where(live.any(-1), runtime(new_i, cached_i), 0.0)
    return t_draft, t_verify


def kv_tokens(devices: Sequence[Device], members: Sequence[int], padded: bool = True) -> float:
    """Eq. 10 / (4 J h1): the batch's peak KV tokens, sum_k (I_m + O_m) (padded) or sum_k (I_k + O_k)."""
    devs = [devices[k] for k in members]
    if padded:
        return len(devs) * (max(d.prefix_tokens for d in devs) + max(d.output_tokens for d in devs))
    return float(sum(d.prefix_tokens + d.output_tokens for d in devs))


def kv_budget_tokens(memory_bytes: float, layers: int, hidden: int, ffn: int) -> float:
    """Eqs. 9-10, 24b: the KV tokens a drafter with `memory_bytes` can hold beside its FP16 weights.

    Gamma_p = J (8 h1^2 + 4 h1 h2) bytes of weights; each cached token costs 4 J h1 bytes.
    """
    return (memory_bytes - layers * (8 * hidden**2 + 4 * hidden * ffn)) / (4 * layers * hidden)


def paper_order(devices: Sequence[Device]) -> list[int]:
    """Algorithm 1, line 3: devices by prompt length, ascending (ties by index)."""
    return sorted(range(len(devices)), key=lambda k: (devices[k].prefix_tokens, k))


# ============================================================================ schedules


@dataclass(frozen=True)
class Problem:
    """Everything but the decisions: the devices, the uplink and the stage models."""

    devices: tuple[Device, ...]
    total_bandwidth_hz: float
    verify: VerifyModel = WISP_A100_EXAMPLE
    drafting: Drafting = ON_DEVICE
    padded: bool = True  # pad each batch to its longest prompt (the paper)
    kv_budget_tokens: float = math.inf  # Eq. 24b as a KV-token budget per batch
    gammas: tuple[int, ...] = tuple(range(1, 11))  # 1..l_max (Eq. 24f)

    def __post_init__(self) -> None:
        if not self.devices:
            raise ValueError("Problem needs at least one device")
        if not all(isinstance(d, Device) for d in self.devices):
            raise ValueError("Problem.devices must be Device instances")
        if not (math.isfinite(self.total_bandwidth_hz) and self.total_bandwidth_hz > 0):
            raise ValueError(f"total_bandwidth_hz must be positive and finite, got {self.total_bandwidth_hz}")
        if not self.gammas or any(int(g) != g or g < 0 for g in self.gammas):
            raise ValueError(f"gammas must be non-negative integers, got {self.gammas}")
        worst = max(kv_tokens(self.devices, [k], self.padded) for k in range(len(self.devices)))
        if worst > self.kv_budget_tokens:
            raise ValueError(f"a device alone needs {worst} KV tokens > budget {self.kv_budget_tokens}")

    def horizon(self, gammas: Sequence[int]) -> int:
        """Steps long enough for any batch at any of these gammas: max_k n_k at the smallest gamma."""
        g = min(gammas)
        return int(max(decoding_steps(d.output_tokens, d.alpha, g) for d in self.devices))

    def stages(self, members: Sequence[int], gamma: int, horizon: int) -> tuple[np.ndarray, np.ndarray]:
        return batch_stage_ms(self.devices, members, gamma, horizon, self.verify, self.drafting, self.padded)

    def feasible(self, members: Sequence[int]) -> bool:
        return kv_tokens(self.devices, members, self.padded) <= self.kv_budget_tokens


def evaluate(
    problem: Problem,
    batches: Sequence[Sequence[int]],
    gammas: Sequence[int],
    bandwidth_hz: np.ndarray | None = None,
    pipelined: bool = True,
    label: str = "",
) -> Plan:
    """The latency model of one schedule, Eqs. 15-23: T = T_com + sum_n C_{n,M}.

    batches: device indices per batch in pipeline order (a partition of the devices);
    gammas: one speculation length per batch; bandwidth_hz [n]: Eq. 27 if None.
    """
    devs = problem.devices
    flat = sorted(k for b in batches for k in b)
    if flat != list(range(len(devs))) or any(len(b) == 0 for b in batches):
        raise ValueError(f"batches must partition devices 0..{len(devs) - 1} into non-empty batches: {batches}")
    if len(gammas) != len(batches):
        raise ValueError(f"{len(batches)} batches but {len(gammas)} gammas")
    bits = np.array([d.uplink_bits for d in devs])  # [n]
    se = np.array([d.spectral_efficiency for d in devs])  # [n]
    bw = (
        bandwidth_split(bits, se, problem.total_bandwidth_hz)
        if bandwidth_hz is None
        else _vector(bandwidth_hz, "bandwidth_hz")
    )
    horizon = problem.horizon(gammas)
    stages = [problem.stages(b, g, horizon) for b, g in zip(batches, gammas, strict=True)]
    draft = np.stack([s[0] for s in stages], axis=1)  # [H, M]
    verify = np.stack([s[1] for s in stages], axis=1)  # [H, M]
    return Plan(
        batches=tuple(tuple(int(k) for k in b) for b in batches),
        gammas=tuple(int(g) for g in gammas),
        bandwidth_hz=bw,
        steps=int((verify > 0).any(1).sum()),
        t_com_ms=float(upload_ms(bits, se, bw).max()),
        t_inf_ms=pipeline_ms(draft, verify, problem.drafting.shared, pipelined),
        tokens=float(sum(d.output_tokens for d in devs)),
        label=label or "schedule",
    )


# ============================================================================ the dynamic programme


def _extend(
    ready: np.ndarray, done: np.ndarray, t_draft: np.ndarray, t_verify: np.ndarray, shared: bool
) -> tuple[np.ndarray, np.ndarray]:
    """Append one batch to a prefix (Eqs. 20, 31-32), per step: (C^d, C) [H] -> (C^d', C') [H]."""
    if shared:
        ready = ready + t_draft  # Eq. 31: the drafter is busy until here
        return ready, np.maximum(ready, done) + t_verify  # Eq. 32
    return ready, np.maximum(t_draft, done) + t_verify  # own drafters: ready when its robots are


def _pareto(keys: np.ndarray, cap: int) -> tuple[np.ndarray, bool]:
    """Indices of the non-dominated rows of keys [C, d] (smaller is better), lowest sum first."""
    kept: list[int] = []
    for c in np.argsort(keys.sum(1), kind="stable"):
        if kept and np.all(keys[kept] <= keys[c], axis=1).any():
            continue  # a kept row is no worse at every step: drop c
        kept.append(int(c))
    return np.array(kept[:cap]), len(kept) > cap


Label = tuple[np.ndarray, np.ndarray, tuple | None]  # (C^d [H], C [H], back-pointer)


@dataclass(frozen=True)
class Solution:
    """What a batching DP returns."""

    batches: list[tuple[int, ...]]  # device indices per batch, in pipeline order
    gammas: list[int]  # one per batch
    t_inf_ms: float  # Eq. 22 of this schedule
    exact: bool  # optimal over its search space (False: a Pareto set was cut,
    # or the paper's one-label Algorithm 1)

    @property
    def found(self) -> bool:  # False: nothing within the bound the DP was given
        return bool(self.batches)


def _keep(pool: list[Label], shared: bool, cap: int, bound: float) -> tuple[list[Label], bool]:
    """The Pareto set of a state's labels (on C^d and C with a shared drafter, else on C alone).

    Labels with sum_n C_n > bound go first: appending batches only adds, so they cannot
    finish below a plan already known to reach `bound`.
    """
    pool = [lab for lab in pool if lab[1].sum() <= bound]
    if not pool:
        return [], False
    keys = np.array([np.concatenate([r, d]) if shared else d for r, d, _ in pool])
    kept, dropped = _pareto(keys, cap)
    return [pool[c] for c in kept], dropped


def plan_consecutive(
    problem: Problem,
    gammas: Sequence[int],
    order: Sequence[int] | None = None,
    max_labels: int = 4096,
    bound: float = math.inf,
) -> Solution:
    """Exact DP over the paper's search space: consecutive batches of `order`, run in that order.

    `order` defaults to Algorithm 1's sort by prompt length. State after the first i devices:
    the per-step completion vectors of both stages (C^d_n, C_n), n = 1..H. Appending batch
    order[j:i] maps them by Eqs. 31-32, non-decreasing in both, and the objective sum_n C_n
    (Eq. 22) is non-decreasing too; so a label no better at every step than another can go,
    and keeping all the others (a Pareto set, up to max_labels) is exact. Algorithm 1 keeps
    only the label with the least sum_n C_n, which can miss the optimum (paper_algorithm1).
    O(K^2 |gammas| labels H). Finds nothing (Solution.found False) if no plan has T_inf <= bound.
    """
    order = list(paper_order(problem.devices) if order is None else order)
    horizon = problem.horizon(gammas)
    shared = problem.drafting.shared
    zero = np.zeros(horizon)
    labels: list[list[Label]] = [[(zero, zero, None)]]  # labels[i]: after order[:i]
    exact = True
    for i in range(1, len(order) + 1):
        pool: list[Label] = []
        for j in range(i):  # the last batch is order[j:i]
            if not labels[j] or not problem.feasible(order[j:i]):
                continue
            for g in gammas:
                t_draft, t_verify = problem.stages(order[j:i], g, horizon)
                for idx, (ready, done, _) in enumerate(labels[j]):
                    pool.append((*_extend(ready, done, t_draft, t_verify, shared), (j, g, idx)))
        kept, dropped = _keep(pool, shared, max_labels, bound)
        labels.append(kept)
        exact &= not dropped
    if not labels[-1]:
        return Solution([], [], math.inf, exact)
    best = min(range(len(labels[-1])), key=lambda c: labels[-1][c][1].sum())
    batches, gs, i, c = [], [], len(order), best
    while i > 0:  # backtrack (Algorithm 1, lines 24-26)
        back = labels[i][c][2]
        assert back is not None  # only the empty prefix's label has none
        j, g, c_prev = back
        batches.append(tuple(order[j:i]))
        gs.append(g)
        i, c = j, c_prev
    return Solution(batches[::-1], gs[::-1], float(labels[-1][best][1].sum()), exact)


def plan_subsets(problem: Problem, gammas: Sequence[int], max_labels: int = 4096, bound: float = math.inf) -> Solution:
    """Exact DP over every ordered partition of the devices (any grouping, any batch order).

    The same labels as plan_consecutive, indexed by the set S of devices already batched
    (a bitmask) instead of a prefix: the next batch is any feasible subset T of the rest,
    S -> S | T. S | T > S as integers, so masks in increasing order see every predecessor
    first. O(3^K |gammas| labels H): for the small fleets one server verifies (K <= ~10).
    The paper's prompt-length order is not optimal once robots differ in drafting speed
    or acceptance rate; this search does not assume it.
    """
    n = len(problem.devices)
    full = (1 << n) - 1
    horizon = problem.horizon(gammas)
    shared = problem.drafting.shared
    zero = np.zeros(horizon)
    stages: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
    pools: dict[int, list[Label]] = {0: [(zero, zero, None)]}
    labels: dict[int, list[Label]] = {}
    exact = True
    for mask in range(full + 1):
        if mask not in pools:
            continue
        labels[mask], dropped = _keep(pools.pop(mask), shared, max_labels, bound)
        exact &= not dropped
        rest = full & ~mask
        sub = rest
        while sub:  # every non-empty subset of the rest
            members = [k for k in range(n) if sub >> k & 1]
            if problem.feasible(members):
                for g in gammas:
                    if (sub, g) not in stages:
                        stages[sub, g] = problem.stages(members, g, horizon)
                    t_draft, t_verify = stages[sub, g]
                    pool = pools.setdefault(mask | sub, [])
                    for idx, (ready, done, _) in enumerate(labels[mask]):
                        pool.append((*_extend(ready, done, t_draft, t_verify, shared), (mask, sub, g, idx)))
            sub = (sub - 1) & rest
    if not labels.get(full):
        return Solution([], [], math.inf, exact)
    best = min(range(len(labels[full])), key=lambda c: labels[full][c][1].sum())
    batches, gs, mask, c = [], [], full, best
    while mask:
        back = labels[mask][c][2]
        assert back is not None  # only the empty set's label has none
        prev, sub, g, c = back
        batches.append(tuple(k for k in range(n) if sub >> k & 1))
        gs.append(g)
        mask = prev
    return Solution(batches[::-1], gs[::-1], float(labels[full][best][1].sum()), exact)


def paper_algorithm1(problem: Problem, gamma: int) -> Solution:
    """Algorithm 1 as published: one state per prefix, the boundary j* with the least sum_n C_n.

    Line 15 / Eq. 29 print max{Y[j-1,n,0], Y[j-1,n,1] + T^d} + T^v; that adds the draft time
    to the wrong stage. Eqs. 20, 31 and 32 give max{Y[j-1,n,0] + T^d, Y[j-1,n,1]} + T^v, used here.
    Line 20 breaks ties (>=) towards the later boundary, as printed.
    """
    order = paper_order(problem.devices)
    horizon = problem.horizon([gamma])
    zero = np.zeros(horizon)
    ups = [(zero, zero)]  # Y[i, :, 0], Y[i, :, 1]
    cut = [0] * (len(order) + 1)  # S[i]
    for i in range(1, len(order) + 1):
        best = None
        for j in range(i):
            if not problem.feasible(order[j:i]):
                continue
            t_draft, t_verify = problem.stages(order[j:i], gamma, horizon)
            ready, done = _extend(*ups[j], t_draft, t_verify, problem.drafting.shared)
            if best is None or done.sum() <= best[1].sum():
                best, cut[i] = (ready, done), j
        assert best is not None  # every device alone is feasible (Problem checks)
        ups.append(best)
    batches, i = [], len(order)
    while i > 0:
        batches.append(tuple(order[cut[i] : i]))
        i = cut[i]
    return Solution(batches[::-1], [gamma] * len(batches), float(ups[-1][1].sum()), exact=False)


# plan(search="auto") searches every ordered partition up to this many devices (one gamma; gamma per batch)
SUBSET_LIMIT = (8, 6)


def plan(problem: Problem, per_batch_gamma: bool = False, search: str = "auto", max_labels: int = 4096) -> Plan:
    """Problem P (Eq. 24): Eq. 27 for the bandwidth, a DP for the batches, gamma by enumeration.

    The bandwidth only moves T_com and the batches and gamma only T_inf (Sec. III-A/B), so
    they are solved apart. The paper uses one l for all batches (Eq. 33: try l = 1..l_max);
    per_batch_gamma lets the DP choose one per batch instead. search: "consecutive" (the
    paper's space, plan_consecutive), "subsets" (every ordered partition, plan_subsets) or
    "auto" (subsets up to SUBSET_LIMIT devices).
    """
    if search == "auto":
        search = "subsets" if len(problem.devices) <= SUBSET_LIMIT[per_batch_gamma] else "consecutive"
    if search not in ("subsets", "consecutive"):
        raise ValueError(f"search must be 'auto', 'subsets' or 'consecutive', got {search!r}")
    solve = plan_subsets if search == "subsets" else plan_consecutive
    best = Solution([], [], math.inf, True)
    exact = True
    for g in problem.gammas:  # Eq. 33; each run only needs to beat the best so far
        sol = solve(problem, [g], max_labels=max_labels, bound=best.t_inf_ms)
        exact &= sol.exact
        if sol.t_inf_ms < best.t_inf_ms:
            best = sol
    if per_batch_gamma:  # bounded by the one-gamma optimum, which it contains
        sol = solve(problem, problem.gammas, max_labels=max_labels, bound=best.t_inf_ms)
        exact &= sol.exact
        best = sol if sol.found else best
    label = f"dp ({'all partitions' if search == 'subsets' else 'consecutive'}{', gamma per batch' * per_batch_gamma})"
    return replace(evaluate(problem, best.batches, best.gammas, label=label), exact=exact)


def _vector(x: ArrayLike, name: str) -> np.ndarray:
    """A finite, non-negative float vector [n], n >= 1, or a ValueError naming `name`."""
    a = np.asarray(x, dtype=float) if not isinstance(x, str) else np.array([np.nan])
    if a.ndim != 1 or a.size == 0:
        raise ValueError(f"{name} must be a non-empty 1-D array, got shape {a.shape}")
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{name} must be finite (no NaN or inf), got {a}")
    if np.any(a < 0):
        raise ValueError(f"{name} must be >= 0, got {a}")
    return a


def example_devices(
    n: int,
    alpha: Sequence[float],
    seed: int = 0,
    output_tokens: int = 64,
    uplink_bits_per_token: float = 16 * (576 + 576),
) -> list[Device]:
    """EXAMPLE robots, drawn from a seed (nothing here is measured).

    Prompts 64-512 tokens; drafters 3-10 ms/token and 0.5-1.5 ms/token prefill (a
    Jetson-Orin-class GPU; DESIGN.md measures SmolLM2-135M Q4_1 at 8 ms/token on this
    2-core CPU); uplink SNR 5-30 dB, so
    log2(1 + SNR) = 2.1-10 bit/s/Hz; lambda = 16 (h1_d + h1_v) bits per prompt token
    (the paper's embedding upload, Eq. 15) with SmolLM2's h1 = 576 on both sides.
    """
    rng = np.random.default_rng(seed)
    snr_db = rng.uniform(5, 30, n)
    return [
        Device(
            draft_ms_per_token=float(rng.uniform(3, 10)),
            alpha=float(alpha[k % len(alpha)]),
            uplink_bits_per_token=float(uplink_bits_per_token),
            prefix_tokens=int(rng.integers(64, 513)),
            spectral_efficiency=float(np.log2(1 + 10 ** (snr_db[k] / 10))),
            output_tokens=output_tokens,
            prefill_ms_per_token=float(rng.uniform(0.5, 1.5)),
        )
        for k in range(n)
    ]


# ============================================================================ `server-bridge plan`

MAX_FLEET_BYTES = 256 * 1024  # a fleet file is read only this far: the robot count is capped anyway
MAX_ROBOTS = 64  # the consecutive DP is O(K^2) in robots; the subsets one stops at SUBSET_LIMIT
REQUIRED = ("draft_ms_per_token", "alpha", "prefix_tokens")


def load_fleet(path: str | Path, output_tokens: int, uplink_bits_per_token: float) -> list[Device]:
    """The operator's robots from a JSON file: a list of Device fields (or {"robots": [...]}), bounded in bytes
    before it is parsed and in robots after; ValueError names the file, the robot and what is wrong."""
    with open(path, "rb") as f:
        data = f.read(MAX_FLEET_BYTES + 1)
    if len(data) > MAX_FLEET_BYTES:
        raise ValueError(f"{path}: over {MAX_FLEET_BYTES // 1024} KiB, too big for a fleet file")
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not JSON: {e}") from None
    robots = doc.get("robots") if isinstance(doc, dict) else doc
    if not isinstance(robots, list) or not 1 <= len(robots) <= MAX_ROBOTS:
        raise ValueError(f'{path}: expected a list of 1-{MAX_ROBOTS} robots (or {{"robots": [...]}})')
    known = set(Device.__dataclass_fields__)
    defaults = {"output_tokens": output_tokens, "uplink_bits_per_token": uplink_bits_per_token}
    out = []
    for i, robot in enumerate(robots):
        if not isinstance(robot, dict) or set(REQUIRED) - set(robot) or set(robot) - known:
            raise ValueError(
                f"{path}: robot {i} must be an object with {', '.join(REQUIRED)} and only Device's fields "
                f"({', '.join(sorted(known))}), got {str(robot)[:200]}"
            )
        try:
            out.append(Device(**{**defaults, "spectral_efficiency": 5.0, **robot}))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}: robot {i}: {e}") from None
    return out


def problem_from(config: PlanConfig) -> Problem:
    """The problem `config` describes: its fleet file's robots (or seeded examples), uplink and stage models."""
    if config.fleet:
        devices = load_fleet(config.fleet, config.output_tokens, config.uplink_bits_per_token)
    else:
        devices = example_devices(
            config.devices, config.alpha, config.seed, config.output_tokens, config.uplink_bits_per_token
        )
    verify = LinearVerifyModel.load(config.estimator) if config.estimator else WISP_A100_EXAMPLE
    return Problem(
        tuple(devices),
        config.bandwidth_mhz * 1e6,
        verify,
        Drafting(shared=True, runtime=LLAMA_68M_DRAFT) if config.drafting == "shared" else ON_DEVICE,
        padded=config.pad,
        kv_budget_tokens=config.kv_budget_tokens or math.inf,
        gammas=tuple(range(0 if config.allow_ar else 1, config.gamma_max + 1)),
    )


def describe(problem: Problem, best: Plan) -> list[str]:
    """The plan in lines a person reads: each batch, its robots and draft length; each robot's bandwidth."""
    verify = problem.verify
    lines = [
        f"{len(problem.devices)} robots; verify model: {getattr(verify, 'source', '') or verify}; "
        f"drafting: {'shared' if problem.drafting.shared else 'device'}; padded: {problem.padded}",
        f"{best.label}: total {best.total_ms:.1f} ms (uplink {best.t_com_ms:.1f} + pipeline {best.t_inf_ms:.1f}), "
        f"{best.tokens_per_s:.1f} tokens/s over {best.steps} steps{'' if best.exact else ' (not proven optimal)'}",
    ]
    for m, (batch, gamma) in enumerate(zip(best.batches, best.gammas, strict=True)):
        lines.append(f"  batch {m}: robots {','.join(map(str, batch))}, draft length {gamma}")
    lines += [f"  robot {k}: {hz / 1e6:.3f} MHz of uplink" for k, hz in enumerate(best.bandwidth_hz)]
    return lines


def run(config: PlanConfig, as_json: bool = False) -> int:
    """`server-bridge plan`: the plan on stdout (text, or one JSON object)."""
    problem = problem_from(config)
    best = plan(problem, per_batch_gamma=config.per_batch_gamma, search=config.search)
    if as_json:
        robots = [asdict(d) for d in problem.devices]
        verify = getattr(problem.verify, "source", "")
        print(json.dumps({"config": asdict(config), "verify_model": verify, "robots": robots, "plan": best.to_json()}))
    else:
        print("\n".join(describe(problem, best)))
    return 0
