"""Collect rejection-predictor traces: real SD rounds, one JSON line per judged draft token.

    python -m tools.train.collect_traces [--drafts smollm2-q4_1,smollm2-q2_k] [--gamma 8] [--max-tokens 96]
                                   [--temperature 0] [--out build/traces]

Runs the training prompts (tools/prompts/predictor_train.jsonl; the benchmark's
prompts are kept out) through a local verifier with a fixed draft length, the
verifier on its own core. Each draft token that reached a verdict becomes one
line of <out>/<draft>__<target>.jsonl with agent/decoding/predictor.py's FEATURES and
its label. tools/train/predictor.py reads them.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

from agent.decoding import DecoderSettings, open_decoder
from protocol.sampling import SamplingParams
from server_bridge.ops.fleet import LocalVerifier, pin_cores

PROMPTS = Path(__file__).resolve().parents[1] / "prompts" / "predictor_train.jsonl"
TARGET = "smollm2-f32"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafts", default="smollm2-q4_1,smollm2-q2_k")
    ap.add_argument("--gamma", type=int, default=8, help="fixed draft length (positions 0..gamma-1 get traced)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--prompts", type=int, default=0, help="use the first N prompts (0: all)")
    ap.add_argument("--out", default="build/traces")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    rows = rows[: args.prompts] if args.prompts else rows
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    agent_cpus, server_cpus = pin_cores()
    params = SamplingParams(temperature=args.temperature)
    with LocalVerifier(target=TARGET, cpus=server_cpus, threads=len(server_cpus)) as server:
        os.sched_setaffinity(0, agent_cpus)
        for name in args.drafts.split(","):
            drafter = open_decoder(DecoderSettings(draft=name, threads=len(agent_cpus))).drafter
            path = out / f"{name}__{TARGET}.jsonl"
            path.unlink(missing_ok=True)
            decoder = open_decoder(DecoderSettings(verifier=server.url, trace=str(path)), drafter)
            t0 = time.perf_counter()
            drafted = accepted = 0
            try:
                for i, row in enumerate(rows):
                    ids = drafter.tokenize(row["prompt"], chat=row["chat"])
                    gen = decoder.generate(ids, mode="sd", max_tokens=args.max_tokens, params=params, gamma=args.gamma)
                    drafted += gen.metrics.drafted
                    accepted += gen.metrics.accepted
                    print(
                        f"\r{name}: prompt {i + 1}/{len(rows)}, {decoder.trace.rows} trace rows, acceptance "
                        f"{accepted / max(drafted, 1):.3f}, {time.perf_counter() - t0:.0f}s",
                        end="",
                        flush=True,
                    )
            finally:
                decoder.close()
            print(f"\n{name}: wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
