"""How much a verify pass slows when the draft model decodes on the other core of this machine.

    python -m tools.bench.contention [--server-core 1] [--draft-core 0] [--repeats 12]

On one 2-vCPU box the robot's pre-drafting (FSD) runs while the server
verifies; the two share memory bandwidth. This times a 4-token verify pass of
the target (1 torch thread) alone and with the draft model decoding non-stop
in a child process on the other core, medians of --repeats. It prints one JSON
line; the README quotes it next to the FSD benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SPIN = """
import numpy as np
from agent.decoding import DecoderSettings, open_decoder
from protocol.sampling import SamplingParams
d = open_decoder(DecoderSettings(threads=1)).drafter
ids = d.tokenize("Hello there, how are you doing today?")
while True:
    d.propose(ids, 8, SamplingParams(), np.random.default_rng(0))
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server-core", type=int, default=1)
    ap.add_argument("--draft-core", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=12)
    args = ap.parse_args(argv)
    os.sched_setaffinity(0, {args.server_core})
    from server_bridge.target import load_target

    target = load_target(threads=1, max_sequences=4, kv_tokens=4096)
    prompt = list(range(100, 160))

    def verify_ms() -> float:
        state = target.new_state(prompt)
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            target.score(state, [5, 6, 7, 8])
            times.append((time.perf_counter() - t0) * 1e3)
            target.rewind(state, prompt)
        return statistics.median(times)

    alone = verify_ms()
    spinner = subprocess.Popen(
        [sys.executable, "-c", SPIN],
        stderr=subprocess.DEVNULL,
        preexec_fn=lambda: os.sched_setaffinity(0, {args.draft_core}),
    )
    try:
        time.sleep(5)  # let it load and start decoding
        busy = verify_ms()
    finally:
        spinner.kill()
    print(
        json.dumps(
            {
                "verify_ms_alone": round(alone, 1),
                "verify_ms_draft_busy": round(busy, 1),
                "slowdown": round(busy / alone, 2),
                "server_core": args.server_core,
                "draft_core": args.draft_core,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
