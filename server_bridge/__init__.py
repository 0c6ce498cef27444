"""The verifier: the target behind an engine, sessions, the SLO-aware batcher and the websocket server."""

from runtime.native import load_llama_first

load_llama_first()  # llama.cpp's native libraries before numpy's: see runtime/native.py
