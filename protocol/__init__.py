"""The wire and the maths the robot and the server share: messages, sampling, payloads, images, grammar, names.

numpy, msgpack and the standard library only, so `agent/` imports it without torch
and without anything of `server_bridge/`; `structured.py` alone also calls LLGuidance over a llama.cpp
vocabulary (llguidance and llama-cpp-python, which both sides run), imported when a grammar is first built.
What runs llama.cpp underneath (the native libraries' order, libmtmd's images, llama.cpp's log)
is `runtime/` now, no longer here.
"""

import contextlib

# llama.cpp's native libraries before numpy's (runtime/native.py says why), without importing runtime/: protocol/
# imports nothing of the project. Importing llama_cpp again is a no-op; a bare protocol install goes without it.
with contextlib.suppress(ImportError):
    import llama_cpp  # noqa: F401
