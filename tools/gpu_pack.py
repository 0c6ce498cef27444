"""The payload of the one-call GPU run (tools/gpu_run.py), made here on the CPU: one folder that travels in the
`run` call's `carry` beside the checkout, 64 MiB at most together.

    python -m tools.gpu_pack [--out .gpu] [--prebuilt TARBALL] [--no-build]

  llama-cuda-*.tar.xz     llama.cpp built with CUDA for compute capability 9.0 (tools/build_llama_cuda.sh; about an
                          hour on 2 cores the first time, cached after): llama-cpp-python's libraries and package,
                          llama-server, llama-batched-bench
  wheels/                 what the device's image lacks (gpu_run.WHEELS), for CPython 3.12 on x86-64, the versions
                          installed here
  vocab.gguf              the shipped draft's vocabulary alone (the draft is 98 MB: it cannot travel in one call)
  llama-convert-0.3.36/   llama.cpp's HF-to-GGUF converter, for the test VLMs (tests/models/llama_convert.py)
  MANIFEST.json           what is here, its sizes, and the checkout's

It adds `/<out>/` to the repository's info/exclude, so the folder travels only when `carry` names it. The command
to run there and the carry list: docs/benchmarks/gpu.md ("How to run").
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import shutil
import subprocess
import sys
from pathlib import Path

from tools.gpu_run import LLAMA_CPP, WHEELS

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 64 * 2**20  # the run tool's working tree and carry, together
DEVICE_HAS = ("msgpack",)  # in the device's image already (docs/benchmarks/gpu.md)
PLATFORM = [
    "--python-version",
    "3.12",
    "--implementation",
    "cp",
    *[f"--platform={p}" for p in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")],
    "--platform=manylinux1_x86_64",
]


def size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def checkout_bytes() -> int:
    """What the run tool sends besides `carry`: tracked files and untracked ones git does not ignore."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout
    return sum((ROOT / name).stat().st_size for name in out.decode().split("\0") if name and (ROOT / name).is_file())


def exclude(out: Path) -> None:
    info = Path(
        subprocess.run(
            ["git", "rev-parse", "--git-path", "info/exclude"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    )
    info = info if info.is_absolute() else ROOT / info
    line = f"/{out.resolve().relative_to(ROOT)}/"
    if line not in (info.read_text().splitlines() if info.exists() else []):
        info.parent.mkdir(parents=True, exist_ok=True)
        with info.open("a") as f:
            f.write(line + "\n")


def prebuilt(given: str | None, build: bool) -> Path:
    if given:
        return Path(given)
    if not build:
        raise SystemExit("gpu_pack: --no-build and no --prebuilt")
    print("gpu_pack: the CUDA build of llama.cpp (tools/build_llama_cuda.sh; cached after the first time)", flush=True)
    r = subprocess.run(["bash", str(ROOT / "tools" / "build_llama_cuda.sh")], stdout=subprocess.PIPE, text=True)
    if r.returncode != 0:
        raise SystemExit(f"gpu_pack: tools/build_llama_cuda.sh failed ({r.returncode})")
    return Path(r.stdout.strip().splitlines()[-1])


def wheels(into: Path) -> list[str]:
    into.mkdir(parents=True, exist_ok=True)
    pins = [f"{w}=={importlib.metadata.version(w)}" for w in WHEELS if w not in DEVICE_HAS]
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", *PLATFORM]
    subprocess.run([*cmd, "-d", str(into), *pins], check=True)
    return pins


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / ".gpu"))
    ap.add_argument("--prebuilt", default=None, help="the tree's .tar.xz (default: built or found in the cache)")
    ap.add_argument("--no-build", action="store_true", help="fail rather than build llama.cpp")
    args = ap.parse_args(argv)
    from tests.models.llama_convert import converter_dir
    from tools.models import random_target

    out = Path(args.out)
    if out.resolve().is_relative_to(ROOT):
        exclude(out)
    out.mkdir(parents=True, exist_ok=True)
    tree = prebuilt(args.prebuilt, not args.no_build)
    for old in out.glob("llama-cuda-*.tar.xz"):
        old.unlink()
    shutil.copy2(tree, out / tree.name)
    pins = wheels(out / "wheels")
    random_target.vocab_gguf(out / "vocab.gguf")
    convert = out / f"llama-convert-{LLAMA_CPP}"
    shutil.rmtree(convert, ignore_errors=True)
    shutil.copytree(
        converter_dir(log=lambda m: print(m, flush=True)), convert, ignore=shutil.ignore_patterns("__pycache__")
    )
    parts = {p.name: size(p) for p in sorted(out.iterdir()) if p.name != "MANIFEST.json"}
    total = sum(parts.values()) + checkout_bytes()
    manifest = {"parts": parts, "wheels": pins, "checkout_bytes": checkout_bytes(), "total_bytes": total}
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=1))
    for name, n in parts.items():
        print(f"  {name}: {n / 2**20:.1f} MiB")
    print(f"gpu_pack: {out} and the checkout: {total / 2**20:.1f} MiB of the run tool's {LIMIT // 2**20} MiB")
    if total > LIMIT:
        print("gpu_pack: over the limit: the call would be refused", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
