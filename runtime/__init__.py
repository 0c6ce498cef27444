"""What both processes run underneath: llama.cpp's runtime as both sides load it (the native libraries'
order, `native`; a prompt's images through libmtmd, `vision`; llama.cpp's own log, `llamalog`) and the
configuration machinery both configs are derived with (`settings`: flags, TOML reader, errors and the
reference page from one dataclass tree). `protocol/` stays the wire and the maths; `agent/` and
`server_bridge/` never import each other, so what they share underneath lives here.
"""

from .native import load_llama_first

load_llama_first()  # llama.cpp's native libraries before numpy's: see runtime/native.py
