"""The robot: drafting, decoding against the verifier, and the robot daemon (edge-agent)."""

from runtime.native import load_llama_first

load_llama_first()  # llama.cpp's native libraries before numpy's: see runtime/native.py


def __getattr__(name: str) -> object:
    """`from agent import Client`: the Python API (agent/client.py), imported on first use."""
    if name in ("Client", "Completion", "Stream", "RequestError", "VerifierUnavailable"):
        from . import client

        return getattr(client, name)
    raise AttributeError(f"module 'agent' has no attribute {name!r}")
