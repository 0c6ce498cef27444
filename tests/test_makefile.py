"""`make setup-robot`: the robot's install only, and a llama.cpp wheel keyed by its build flags (checked with
`make -n`, which prints the recipe without running it)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make not installed")


def dry_run(target: str, tmp_path: Path, **variables: str) -> str:
    args = [f"{k}={v}" for k, v in {"VENV": str(tmp_path / "venv"), "HOME": str(tmp_path), **variables}.items()]
    proc = subprocess.run(["make", "-n", target, *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def wheelhouse(recipe: str) -> str:
    return re.search(r"-w (\S+) llama-cpp-python", recipe).group(1)


def test_setup_robot_installs_no_verifier_and_converts_no_target(tmp_path):
    recipe = dry_run("setup-robot", tmp_path)
    assert "'.[robot]'" in recipe and "--system-site-packages" in recipe
    for unwanted in ("torch", "transformers", "server-bridge prepare", "make_drafts", "[server", "[dev"):
        assert unwanted not in recipe, unwanted
    # the pip OpenCV only where no system one with GStreamer imports (JetPack's would be shadowed)
    assert re.search(r"GStreamer.*opencv-python-headless", recipe, re.S)
    text = (ROOT / "setup.py").read_text()
    robot = re.search(r"^ROBOT = \[(.*?)\]", text, re.M | re.S).group(1)
    assert "llama-cpp-python" in robot and "onnxruntime" in robot and "torch" not in robot and "opencv" not in robot


def test_jetson_with_nvcc_builds_llama_cpp_with_cuda_into_its_own_wheelhouse(tmp_path):
    cuda = dry_run("setup-robot", tmp_path, ARCH="aarch64", NVCC="/usr/local/cuda/bin/nvcc")
    cpu = dry_run("setup-robot", tmp_path, ARCH="aarch64", NVCC="")
    assert "-DGGML_CUDA=on" in cuda and "-DGGML_CUDA" not in cpu
    assert wheelhouse(cuda) != wheelhouse(cpu)  # a CPU wheel is never reused for CUDA
    other_flags = dry_run("setup", tmp_path, LLAMA_CMAKE_ARGS="-DGGML_NATIVE=ON")
    assert wheelhouse(other_flags) != wheelhouse(dry_run("setup", tmp_path))


def test_the_go2_sdk_and_dds_are_installed_by_setup_and_setup_robot(tmp_path):
    """`make setup` (this machine, CI): the go2 extra; `make setup-robot`: the SDK without its opencv-python
    requirement (JetPack's OpenCV stays) and PyPI's cyclonedds wheel, or Unitree's 0.10.2 built against
    CYCLONEDDS_HOME."""
    assert "go2]'" in dry_run("setup", tmp_path)
    text = (ROOT / "setup.py").read_text()
    go2 = re.search(r"^GO2 = \[(.*?)\]", text, re.M | re.S).group(1)
    assert "unitree-sdk2py-dimos==" in go2 and "cyclonedds==" in go2
    robot = dry_run("setup-robot", tmp_path)
    assert re.search(r"pip install .*--no-deps 'unitree-sdk2py-dimos==1\.0\.3'", robot)
    assert "'cyclonedds==11.0.1'" in robot
    jetson = dry_run("setup-robot", tmp_path, CYCLONEDDS_HOME="/opt/cyclonedds")
    assert "CYCLONEDDS_HOME=/opt/cyclonedds " in jetson and "'cyclonedds==0.10.2'" in jetson
