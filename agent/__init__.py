"""The robot: drafting, decoding against the verifier, and the robot daemon (edge-agent)."""

from runtime.native import load_llama_first

load_llama_first()  # llama.cpp's native libraries before numpy's: see runtime/native.py
