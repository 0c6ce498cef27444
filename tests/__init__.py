"""Tests mirror the packages; real-model tests are marked `real`."""

from runtime.native import load_llama_first

load_llama_first()  # llama.cpp's native libraries before numpy's: see runtime/native.py
