"""runtime/llamalog: C-level output (file descriptors 1 and 2) goes to a log file around a call, then back.
(Python's own prints and llama.cpp's log callback reach the same descriptors in a process of its own, not
under pytest's capture: tests/tools/test_make_drafts.py checks those.)"""

import ctypes
import os

import pytest

from runtime import llamalog


def c_write(fd: int, text: str) -> None:
    """What C code does: write(2) on the descriptor, below Python's sys.stdout/sys.stderr."""
    libc = ctypes.CDLL(None)
    data = text.encode()
    assert libc.write(fd, data, len(data)) == len(data)


def test_c_output_goes_to_the_log_and_comes_back(tmp_path, capfd):
    pytest.importorskip("llama_cpp")
    log = tmp_path / "quantize.log"
    with llamalog.c_output_to(log):
        c_write(1, "[   1/ 272] token_embd.weight - from C's stdout\n")
        c_write(2, "[   2/ 272] output_norm.weight - from C's stderr\n")
    c_write(2, "after\n")
    out, err = capfd.readouterr()
    assert out == "" and err == "after\n"
    text = log.read_text()
    assert "token_embd.weight" in text and "output_norm.weight" in text
    assert llamalog.tail(log, 1) == "[   2/ 272] output_norm.weight - from C's stderr"


def test_the_descriptors_come_back_after_an_exception(tmp_path, capfd):
    pytest.importorskip("llama_cpp")
    with pytest.raises(RuntimeError, match="boom"):
        with llamalog.c_output_to(tmp_path / "x.log"):
            raise RuntimeError("boom")
    c_write(1, "stdout is back\n")
    assert capfd.readouterr().out == "stdout is back\n"


def test_verbose_follows_the_environment_and_the_flag(monkeypatch):
    monkeypatch.delenv(llamalog.ENV, raising=False)
    assert not llamalog.verbose() and not llamalog.want_verbose(False)
    monkeypatch.setenv(llamalog.ENV, "0")
    assert not llamalog.verbose()
    assert llamalog.want_verbose(True) and os.environ[llamalog.ENV] == "1"
