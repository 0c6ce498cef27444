"""The test-model builders (tiny random VLMs, llama.cpp's converter) and their tests."""
