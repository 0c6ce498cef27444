"""What the decoding benchmarks share: the prompts, a verifier on cores apart from the drafts' behind an
emulated link, and one summary of a set of decoder runs.

    with link.served(target) as s:          # verifier pinned to half the cores, this process to the rest
        drafter = s.drafter("smollm2-q4_1")
        s.link.set_profile(LinkProfile.from_rtt(20))
        open_decoder(DecoderSettings(verifier=s.link.url()), drafter).generate(...)

The latency model assumes the robot and the server are separate machines: here they are separate cores.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from agent.decoding import DecoderSettings, open_decoder
from agent.decoding.drafter import Drafter
from server_bridge.ops.fleet import LocalVerifier, pin_cores
from tools.cluster.netem import LinkProfile, NetemProxy

PROMPTS = Path(__file__).resolve().parents[1] / "prompts" / "bench.jsonl"
TARGET = "smollm2-f32"


def load_prompts(n: int) -> list[dict]:
    """The first n benchmark prompts: {"prompt", "chat", "category"}."""
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    return rows[:n]


@dataclass
class Served:
    """A running verifier, the emulated link in front of it, and which cores each side has."""

    server: LocalVerifier
    link: NetemProxy
    agent_cpus: set[int]
    server_cpus: set[int]

    def drafter(self, name: str) -> Drafter:
        return open_decoder(DecoderSettings(draft=name, threads=len(self.agent_cpus))).drafter

    def cores(self) -> dict:
        return {"agent_cpus": sorted(self.agent_cpus), "server_cpus": sorted(self.server_cpus)}

    def metrics_tail(self) -> list[str]:
        return self.server.metrics().splitlines()[-6:]


@contextmanager
def served(
    target: str | None = TARGET, profile: LinkProfile | None = None, extra_args: list[str] = ()
) -> Iterator[Served]:
    """A verifier on half the cores and a link to it; this process on the other half until the block ends."""
    agent_cpus, server_cpus = pin_cores()
    every_cpu = os.sched_getaffinity(0)
    with (
        LocalVerifier(target=target, cpus=server_cpus, threads=len(server_cpus), extra_args=extra_args) as server,
        NetemProxy("127.0.0.1", server.port, profile or LinkProfile()) as link,
    ):
        os.sched_setaffinity(0, agent_cpus)
        try:
            yield Served(server, link, agent_cpus, server_cpus)
        finally:
            os.sched_setaffinity(0, every_cpu)


def _sum(runs: list[dict], key: str) -> float:
    return sum(r["metrics"][key] for r in runs)


def _per(a: float, b: float) -> float | None:
    return a / b if b else None


def summarize(runs: list[dict]) -> dict:
    """One row over decoder runs (DecodeResult.to_json() each, with "exact" set against the reference's)."""
    m = [r["metrics"] for r in runs]
    tokens = sum(len(r["token_ids"]) for r in runs)
    wall, rounds, drafted = _sum(runs, "wall_s"), _sum(runs, "rounds"), _sum(runs, "drafted")
    streamed = sum(x.get("streamed_tokens", 0) for x in m)
    stars = [x["gamma_star"] for x in m if x.get("gamma_star") is not None]
    speed = [x["expected_speedup"] for x in m if x.get("expected_speedup") is not None]
    row = {
        "runs": len(runs),
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall if wall else 0.0,
        "tau": _per(tokens - streamed, rounds),  # tokens a round, less those the target streamed alone (AS2)
        "acceptance_rate": _per(_sum(runs, "accepted"), drafted),
        "mean_draft_len": _per(drafted, rounds),
        "wasted_per_round": _per(sum(x.get("wasted_draft_tokens", 0) for x in m), rounds),
        "gamma_star": float(np.mean(stars)) if stars else None,
        "expected_speedup": float(np.mean(speed)) if speed else None,
        "predictor_stops": sum(x.get("predictor_stops", 0) for x in m),
        "as2_switches": sum(len(x.get("as2_switches", [])) for x in m),
        "streamed_share": streamed / tokens if tokens else 0.0,
        "predicted_s": sum(r.get("predicted_s", 0.0) for r in runs),
        "target_forward_passes": _sum(runs, "target_forward_passes"),
        "bytes_up": _sum(runs, "bytes_up"),
        "bytes_down": _sum(runs, "bytes_down"),
        "verify_ms_per_round": _per(_sum(runs, "verify_ms"), rounds),
        "draft_ms_per_round": _per(_sum(runs, "draft_ms"), rounds),
        "exact": all(r.get("exact", True) for r in runs),
    }
    if runs and runs[0]["mode"] == "fsd":
        hits, misses = _sum(runs, "predraft_hits"), _sum(runs, "predraft_misses")
        row |= {
            "predraft_hits": hits,
            "predraft_misses": misses,
            "predraft_miss_rate": _per(misses, hits + misses),
            "predraft_failures": _sum(runs, "predraft_failures"),
            "avg_exit_layer": _per(_sum(runs, "exit_layer_sum"), rounds),
            "exit_ms_per_round": _per(_sum(runs, "exit_ms"), rounds),
            "exits_received": _sum(runs, "exits_received"),
        }
    return row
