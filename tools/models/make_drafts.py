"""Build the weaker draft(s) from the shipped Q4_1 GGUF, so benchmarks report a realistic pair too.

  smollm2-q2_k: llama.cpp's quantizer re-quantizes Q4_1 -> Q2_K (allow_requantize).
    A lower-precision draft of the same model; ~74 % greedy agreement with the f32 target
    was measured when this project started (re-measure with tools/bench/decoding.py).

Runs in seconds; `make setup` calls it. Nothing is downloaded. Quiet: llama.cpp's line per tensor
goes to the draft's .log beside it (--verbose or EDGESPEC_VERBOSE=1: on the terminal).
"""

from __future__ import annotations

import argparse
import sys
import time

from protocol import modelfiles
from runtime import llamalog
from server_bridge.engines.llamacpp import requantize


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--force", action="store_true", help="rebuild even if the file exists")
    ap.add_argument(
        "--verbose", action="store_true", help="llama.cpp's own log on the terminal (also EDGESPEC_VERBOSE=1)"
    )
    args = ap.parse_args(argv)
    verbose = llamalog.want_verbose(args.verbose)
    src = modelfiles.shipped_gguf()
    out = modelfiles.build_dir() / modelfiles.DRAFTS["smollm2-q2_k"]
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists() and not args.force:
        print(f"smollm2-q2_k: {out} exists")
        return 0
    print(f"smollm2-q2_k: re-quantizing {src.name} to Q2_K with llama.cpp's quantizer (a few seconds) ...", flush=True)
    t0 = time.perf_counter()
    requantize(str(src), str(out), verbose=verbose)
    print(
        f"smollm2-q2_k: {src.name} -> {out} ({out.stat().st_size / 2**20:.1f} MiB) in {time.perf_counter() - t0:.1f}s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
