"""Benchmarks, training, evaluation and the cluster launcher; run as `python -m tools.NAME`."""
from protocol.native import load_llama_first

load_llama_first()          # llama.cpp's native libraries before numpy's: see protocol/native.py
