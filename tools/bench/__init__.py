"""Benchmarks: what a decoding mode, a pass, a payload or a fleet costs, side by side in one run."""
