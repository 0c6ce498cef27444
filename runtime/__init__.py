"""llama.cpp's runtime as both sides load it: the native libraries' order (`native`), a prompt's
images through libmtmd (`vision`) and llama.cpp's own log (`llamalog`). `protocol/` stays the wire
and the maths; this package is what runs llama.cpp underneath them, on the robot and on the server.
"""

from .native import load_llama_first

load_llama_first()  # llama.cpp's native libraries before numpy's: see runtime/native.py
