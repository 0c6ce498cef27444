"""tools/models/make_drafts (what `make setup` runs): quiet by default, llama.cpp's line per tensor with --verbose.

Each run re-quantizes the shipped Q4_1 GGUF to Q2_K (~2 s) into tmp_path (EDGESPEC_MODELS), in a process
of its own so what reaches the terminal is what a user sees: C's file descriptors as well as Python's."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from protocol import modelfiles

ROOT = Path(__file__).resolve().parents[2]
PER_TENSOR = re.compile(r"^\[\s*\d+/\s*\d+\]", re.M)  # "[  12/ 272]  blk.0.attn_q.weight - ..."

pytestmark = pytest.mark.real


def make_drafts(models: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "EDGESPEC_VERBOSE"}
    env["EDGESPEC_MODELS"] = str(models)
    proc = subprocess.run(
        [sys.executable, "-m", "tools.models.make_drafts", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def test_quiet_by_default_and_the_log_kept(tmp_path):
    proc = make_drafts(tmp_path)
    out = proc.stdout + proc.stderr
    assert not PER_TENSOR.search(out) and "llama_model_loader" not in out, out[:2000]
    assert len(out.splitlines()) == 2 and "re-quantizing" in out and "MiB" in out, out
    draft = tmp_path / "build" / modelfiles.DRAFTS["smollm2-q2_k"]
    assert draft.stat().st_size > 0
    log = Path(str(draft) + ".log").read_text()
    assert len(PER_TENSOR.findall(log)) > 100  # the quantizer's lines, kept for a failure


def test_verbose_shows_llama_cpp_per_tensor_lines(tmp_path):
    proc = make_drafts(tmp_path, "--verbose")  # EDGESPEC_VERBOSE=1 the same (tests/protocol/test_llamalog.py)
    assert len(PER_TENSOR.findall(proc.stdout + proc.stderr)) > 100
