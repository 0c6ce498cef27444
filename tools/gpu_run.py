"""The whole GPU run of the server in one command of at most 9 minutes, phase by phase, each phase's record in
<out>/<phase>.json as soon as the phase ends (what ran comes back even if a later phase runs out of time).

    python -m tools.gpu_run --out DIR [--payload .gpu] [--budget-s 520] [--phase PHASES|all]
                            [--device cuda|cpu] [--tiny] [--pair auto|shipped|random] [--prebuilt TREE]

  setup       unpacks the prebuilt CUDA tree of llama.cpp (tools/build_llama_cuda.sh: llama-cpp-python's libraries
              and Python package, llama-server, llama-batched-bench), installs the carried wheels offline (those
              missing), puts the carried llama.cpp converter in the cache; checks every package the phases import
              and, on cuda, that llama.cpp offloads to the GPU. Builds nothing.
  serve       `server-bridge serve` on a pair, every layer on the device, one process per engine (llamacpp; torch),
              and `edge-agent generate --mode ar|sd|fsd` on the benchmark prompts (tools/prompts/bench.jsonl): the
              three modes' ids must be identical. The pair: the shipped one where its draft is installed; else
              (the one-call GPU run: the shipped draft's 98 MB cannot travel in one call's 64 MiB) a random pair in
              the shipped vocabulary (the carried vocab.gguf), written here in seconds: a target of the shipped
              target's shape (tools/models/random_target.py SMOLLM2_135M: Q8_0 for llamacpp, a weightless recipe
              for torch) and a toy draft on the same planted path.
  engine      tools.bench.gpu_engine on the 7B-shape random target: torch (bf16, built from its config on the
              device; eager and compiled, CUDA graphs) and llamacpp (Q4_0, written as blocks: no quantizer)
              beside llama-batched-bench on the same file, 1x1, 1x5, 8x5 and 32x5 against the HBM roofline
  fleet       tools.bench.gpu_fleet: robots per GPU at 8 tok/s for SD on the engine the engine phase found faster
              at 8x5, against llama-server --parallel N streaming AR, short windows
  divergence  tools.bench.divergence: bf16 (and llamacpp) verify passes against one-token passes on the device
  vision      the test VLMs (tests/models/make_test_vlm.py) through libmtmd, the target on the device, served,
              and `edge-agent generate --image` in the three modes: identical ids

Time: --budget-s is the whole run's; each phase gets a share of what is left (SHARE below, unspent time flows on),
and every child it starts runs in its own process group, killed with all its descendants at the phase's deadline
or when the phase ends for any reason: no process, timer or thread outlives an interrupted phase. A failing phase
does not stop the next, except setup (every phase needs it). --tiny runs the same code on toy models:
`--device cpu --tiny` is the CPU rehearsal (tests/tools/test_gpu_run.py). The payload and the one call:
docs/benchmarks/gpu.md ("How to run"); tools/gpu_pack.py makes the payload.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("setup", "serve", "engine", "fleet", "divergence", "vision")
# Each phase's share of the time left when it starts (of the phases still to run): what one phase leaves unspent
# goes to the next. From the first run on an H200 (2026-11-27, docs/benchmarks/gpu.md), each phase's seconds:
# setup 5, serve 109, engine 72, fleet 83, divergence 29, vision 81 (379 of 520); with --budget-s 520 these
# shares give each at least 1.3 times that (serve, whose 18 % was 99 s, ran out on the first call).
SHARE = {"setup": 0.03, "serve": 0.27, "engine": 0.19, "fleet": 0.22, "divergence": 0.09, "vision": 0.20}
LLAMA_CPP = "0.3.36"
# What a bare CUDA image with torch and transformers lacks (tools/gpu_pack.py downloads them).
WHEELS = ("websockets", "gguf", "pyserial", "diskcache", "msgpack")
MODES = ("ar", "sd", "fsd")
SERVE_PROMPTS = 4  # of the 10 benchmark prompts: 3 modes x 2 engines x 4 = 24 edge-agent processes in serve's minute
PY = sys.executable
T0 = time.monotonic()
# The device's torch ships CUDA's runtime and cuBLAS; the prebuilt tree's RUNPATH names this folder (python3.12),
# LD_LIBRARY_PATH adds any Python's; on a CPU machine the toolkit wheels of tools/build_llama_cuda.sh stand in.
CUDA_LIB_GLOBS = (
    "/opt/torch/.venv/lib/python3.*/site-packages/nvidia/cu13/lib",
    str(Path.home() / ".cache/edgespec/cuda-toolkit-13.0-*/nvidia/cu13/lib"),
)


def say(msg: str) -> None:
    el = int(time.monotonic() - T0)
    print(f"[{el // 60:02d}:{el % 60:02d}] {msg}", flush=True)


# --------------------------------------------------------------------------- children, bounded


def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid`, from /proc (a server a tool started, its helpers)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), ()):
            found.append(c)
            todo.append(c)
    return found


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the child, its process group and every descendant (one that left the group too); then reap it."""
    pids = descendants(proc.pid)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)


def run_bounded(
    cmd: list[str], limit_s: float, log: Path, env: dict | None = None, echo: bool = True
) -> tuple[int | None, str]:
    """A child in its own process group, its output into `log` (and stdout when echo) by a daemon thread, killed
    with its descendants after `limit_s` or on any exit from here (an exception, a KeyboardInterrupt): (exit code,
    None when killed at the limit; output)."""
    lines: list[str] = []
    with log.open("w") as f:
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            start_new_session=True,
        )

        def pump() -> None:
            for line in proc.stdout or ():
                f.write(line)
                lines.append(line)
                if echo:
                    print("    " + line, end="", flush=True)

        reader = threading.Thread(target=pump, name=f"gpu_run-{proc.pid}", daemon=True)
        reader.start()
        rc: int | None = None
        try:
            rc = proc.wait(timeout=max(0.0, limit_s))
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            kill_tree(proc)  # a finished child's leftovers too (a server it forgot)
            reader.join(5)
    return rc, "".join(lines)


# --------------------------------------------------------------------------- one phase


class Phase:
    """One phase's record: its steps (command, wall time, exit code, log), its checks, its results; its deadline."""

    def __init__(self, name: str, args: argparse.Namespace, limit_s: float):
        self.name, self.args, self.t0 = name, args, time.perf_counter()
        self.deadline = time.monotonic() + limit_s
        self.cuda = args.device == "cuda"
        self.logs = Path(args.out) / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.rec: dict = {"phase": name, "device": args.device, "tiny": args.tiny, "steps": [], "checks": []}
        self.rec["started"] = time.strftime("%Y-%m-%d %H:%M:%S")
        self.rec["limit_s"] = round(limit_s, 1)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def ok(self, what: str, passed: object, detail: object = None) -> bool:
        self.rec["checks"].append({"what": what, "ok": bool(passed), "detail": detail})
        if not passed:
            say(f"{self.name}: FAILED: {what}: {detail}")
        return bool(passed)

    def run(self, cmd: list, env: dict | None = None, echo: bool = True, allow=(0,)) -> tuple[int | None, str]:
        """A child bounded by the phase's deadline, its output into logs/<phase>-<n>.log: (exit code, output)."""
        log = self.logs / f"{self.name}-{len(self.rec['steps'])}.log"
        cmd = [str(c) for c in cmd]
        if self.left() < 1:
            self.ok(f"time left for `{shlex.join(cmd[:4])} ...`", False, f"the phase's {self.rec['limit_s']} s ran out")
            return None, ""
        say(f"{self.name}: $ {shlex.join(cmd)}  (at most {self.left():.0f} s)")
        t0 = time.perf_counter()
        rc, out = run_bounded(cmd, self.left(), log, env, echo)
        wall = round(time.perf_counter() - t0, 1)
        self.rec["steps"].append({"cmd": shlex.join(cmd), "rc": rc, "wall_s": wall, "log": str(log)})
        if rc is None:
            self.ok(f"`{shlex.join(cmd[:4])} ...` within the phase's time", False, f"killed after {wall} s")
        elif self.ok(f"exit code of `{shlex.join(cmd[:4])} ...`", rc in allow, rc):
            say(f"{self.name}: exit code {rc} in {wall} s")
        if rc not in allow:
            say(f"{self.name}: the end of {log}:\n" + "".join(out.splitlines(keepends=True)[-25:]))
        return rc, out

    def json_of(self, path: Path) -> dict | None:
        """A tool's own JSON result, kept in the phase's record under results/<file>."""
        data = json.loads(path.read_text()) if path.exists() else None
        self.rec.setdefault("results", {})[str(path.relative_to(self.args.out))] = data
        self.ok(f"wrote {path.name}", data is not None, str(path))
        return data

    def finish(self) -> bool:
        self.rec["machine"] = machine()
        self.rec["wall_s"] = round(time.perf_counter() - self.t0, 1)
        self.rec["pass"] = bool(self.rec["checks"]) and all(c["ok"] for c in self.rec["checks"])
        (Path(self.args.out) / f"{self.name}.json").write_text(json.dumps(self.rec, indent=1, default=str))
        say(f"{self.name}: {'PASS' if self.rec['pass'] else 'FAIL'} in {self.rec['wall_s']} s")
        return self.rec["pass"]


def machine() -> dict:
    """The benchmarks' machine_info (GPU, driver, versions); the bare platform where it cannot be imported."""
    try:
        from tools.bench.gpu_fleet import machine_info

        return machine_info()
    except Exception as e:  # websockets not yet installed, say
        return {"platform": platform.platform(), "python": platform.python_version(), "error": str(e)}


def last_json(out: str) -> dict:
    """The last line of a tool's output that is a JSON object (llama.cpp may log after it, on the same stream)."""
    return json.loads(next(line for line in reversed(out.splitlines()) if line.startswith("{")))


def installed() -> dict:
    names = (*WHEELS, "llama-cpp-python", "torch", "transformers")
    found = {}
    for name in names:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


# --------------------------------------------------------------------------- setup


def unpack_prebuilt(src: Path, into: Path) -> Path:
    """The prebuilt tree (a folder, or its .tar.xz unpacked under `into`): the folder that holds BUILD_INFO."""
    if src.is_file():
        into.mkdir(parents=True, exist_ok=True)
        with tarfile.open(src) as tar:
            if hasattr(tarfile, "data_filter"):  # 3.10.12+, 3.11.4+: no links or paths out of `into`
                tar.extractall(into, filter="data")
            else:  # pragma: no cover - an older 3.10
                tar.extractall(into)  # noqa: S202  (our own tarball, made by tools/build_llama_cuda.sh)
        src = into
    infos = sorted(src.glob("BUILD_INFO")) or sorted(src.glob("*/BUILD_INFO"))
    if not infos:
        raise FileNotFoundError(f"no prebuilt tree (a BUILD_INFO) in {src}")
    return infos[0].parent


def use_prebuilt(tree: Path) -> dict:
    """Put the prebuilt llama_cpp first on the path of this process and of every child; find CUDA's libraries;
    give the package the metadata importlib reads (its version) when it came without. The tree's BUILD_INFO."""
    pkg = tree / "python"
    dist = pkg / f"llama_cpp_python-{LLAMA_CPP}.dist-info"
    if not dist.is_dir():
        dist.mkdir()
        (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: llama_cpp_python\nVersion: {LLAMA_CPP}\n")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (str(pkg), os.environ.get("PYTHONPATH"))))
    sys.path.insert(0, str(pkg))
    importlib.invalidate_caches()
    libs = [str(p) for g in CUDA_LIB_GLOBS for p in sorted(Path("/").glob(g.lstrip("/")))]
    if libs:
        os.environ["LD_LIBRARY_PATH"] = os.pathsep.join([*libs, *filter(None, [os.environ.get("LD_LIBRARY_PATH")])])
    info = dict(line.split("=", 1) for line in (tree / "BUILD_INFO").read_text().splitlines() if "=" in line)
    return {"tree": str(tree), "cuda_libs": libs, **info}


def setup(ph: Phase) -> None:
    args = ph.args
    payload = Path(args.payload) if args.payload else None
    prebuilt = args.prebuilt or (next(iter(sorted(payload.glob("llama-cuda-*.tar.xz"))), None) if payload else None)
    if prebuilt:
        tree = unpack_prebuilt(Path(prebuilt), Path(args.out) / "prebuilt")
        ph.rec["prebuilt"] = info = use_prebuilt(tree)
        args.llama_bin = tree / "bin"
        say(f"setup: the prebuilt tree {tree} ({info.get('cmake_args', '')[-60:]}); CUDA libraries {info['cuda_libs']}")
    if payload and (payload / "wheels").is_dir():
        have = installed()
        if missing := [w for w in WHEELS if not have[w]]:
            files = [str(f) for f in sorted((payload / "wheels").glob("*.whl")) if _wheel_name(f) in missing]
            ph.run([PY, "-m", "pip", "install", "--no-index", "--no-deps", "--no-compile", *files], echo=False)
    if payload and (payload / f"llama-convert-{LLAMA_CPP}").is_dir():  # the VLMs' converter (tests/models)
        cache = Path.home() / ".cache" / "edgespec" / f"llama-convert-{LLAMA_CPP}"
        if not cache.is_dir():
            shutil.copytree(payload / f"llama-convert-{LLAMA_CPP}", cache)
    if payload and (payload / "vocab.gguf").is_file() and not os.environ.get("EDGESPEC_VOCAB_GGUF"):
        os.environ["EDGESPEC_VOCAB_GGUF"] = str((payload / "vocab.gguf").resolve())
    ph.rec["installed"] = have = installed()
    needed = [n for n, v in have.items() if v is None]
    ph.ok("every package the phases import is installed", not needed, needed or have)
    offload = [PY, "-c", "import llama_cpp; print(llama_cpp.llama_supports_gpu_offload())"]
    rc, out = ph.run(offload)
    ph.rec["gpu_offload"] = "True" in out
    ph.ok("llama.cpp loads", rc == 0, out.strip()[-300:])
    ph.ok("llama.cpp offloads to the GPU", ph.rec["gpu_offload"] or not ph.cuda, out.strip()[-200:])


def _wheel_name(path: Path) -> str:
    return path.name.split("-")[0].lower().replace("_", "-")


# --------------------------------------------------------------------------- the phases


def served(ph: Phase, label: str, args: list[str], generations: list[tuple[str, list[str]]]) -> None:
    """`server-bridge serve ARGS` on a free port, checked to run on the device, then each (label, `edge-agent
    generate` flags) of `generations` in every mode against it; a server that does not start fails its check."""
    from server_bridge.ops.fleet import LocalVerifier, health, serve_command

    t0 = time.perf_counter()
    try:
        start_s = max(1.0, ph.left())
        with LocalVerifier(threads=4 if ph.cuda else 1, extra_args=args, start_timeout_s=start_s) as srv:
            h = health(srv.port, timeout=10.0)[1]
            cmd = shlex.join(serve_command(srv.port, *srv.args))
            rec = {"label": label, "cmd": cmd, "start_s": round(time.perf_counter() - t0, 1), "health": h}
            ph.rec.setdefault("servers", []).append(rec)
            say(f"{ph.name}: {label}: up in {rec['start_s']} s on {h.get('device')} ({h.get('dtype')}): {cmd}")
            ph.ok(f"{label} runs on the {ph.args.device}", (h.get("device") != "cpu") == ph.cuda, h.get("device"))
            for name, flags in generations:
                same_ids(ph, name, srv.url, flags)
    except Exception as e:
        ph.ok(f"{label}: served to the end", False, "".join(traceback.format_exception(e))[-3000:])


def same_ids(ph: Phase, label: str, url: str, generate_args: list[str]) -> None:
    """`edge-agent generate` in each mode against one server: the same ids in all three."""
    ids, metrics = {}, {}
    for mode in MODES:
        cmd = [PY, "-m", "agent.app.cli", "generate", "--verifier", url, "--mode", mode, "--json", *generate_args]
        rc, out = ph.run(cmd + ([] if ph.cuda else ["--threads", "1"]), echo=False)
        ids[mode], metrics[mode] = (last_json(out)["token_ids"], last_json(out)["metrics"]) if rc == 0 else (None, None)
    ph.rec.setdefault("generations", []).append({"label": label, "ids": ids, "metrics": metrics})
    agree = bool(ids["ar"]) and ids["ar"] == ids["sd"] == ids["fsd"]
    ph.ok(f"{label}: ar, sd and fsd give the same ids", agree, {m: (v or [])[:12] for m, v in ids.items()})


def shipped_draft() -> bool:
    from protocol import modelfiles

    try:
        return modelfiles.shipped_gguf().is_file()
    except modelfiles.ModelNotFound:
        return False


def random_pair(ph: Phase) -> dict:
    """The random pair in the shipped vocabulary, written by a child (bounded): {target, recipe, draft}."""
    shape = "tiny" if ph.args.tiny else "smollm2-135m"
    cmd = [PY, "-m", "tools.models.random_target", "pair", "--shape", shape, "--dtype", "q8_0"]
    rc, out = ph.run(cmd, echo=False)
    if rc != 0:
        raise RuntimeError(f"the random pair was not written (exit {rc})")
    return last_json(out)


def serve(ph: Phase) -> None:
    lines = (ROOT / "tools" / "prompts" / "bench.jsonl").read_text().splitlines()
    prompts = [json.loads(line) for line in lines if line.strip()][: 1 if ph.args.tiny else SERVE_PROMPTS]
    pair = ph.args.pair if ph.args.pair != "auto" else "shipped" if shipped_draft() else "random"
    ph.rec["pair"] = pair
    targets: dict[str, list[str]] = {"llamacpp": [], "torch": []}
    draft: list[str] = []
    if pair == "random":
        made = ph.rec["random_pair"] = random_pair(ph)
        targets = {"llamacpp": ["--target", made["target"]], "torch": ["--target", made["recipe"]]}
        draft = ["--draft", made["draft"]]
    on_device = {
        "llamacpp": ["--engine", "llamacpp", "--n-gpu-layers", "-1" if ph.cuda else "0"],
        "torch": ["--engine", "torch", "--device", ph.args.device, "--dtype", "float32"],
    }
    tokens = ["--max-tokens", "12" if ph.args.tiny else "48"]
    flags = [[*draft, "--prompt", p["prompt"], *tokens] + ["--chat"] * p["chat"] for p in prompts]
    for engine, args in on_device.items():
        gens = [(f"{engine}, prompt {i}", f) for i, f in enumerate(flags)]
        served(ph, engine, [*targets[engine], *args], gens)


def engine(ph: Phase) -> None:
    out = Path(ph.args.out) / "engine"
    dtype = "bfloat16" if ph.cuda else "float32"
    cmd = [PY, "-m", "tools.bench.gpu_engine", "--device", ph.args.device, "--dtype", dtype, "--out", out]
    # on CUDA the torch engine twice: eager, and compiled as `serve` runs it there (CUDA graphs)
    cmd += ["--gguf-dtype", "q4_0", "--engines", "torch,torch-compiled,llamacpp" if ph.cuda else "torch,llamacpp"]
    if ph.args.tiny:
        cmd += ["--tiny", "--sessions", "1,3", "--tokens", "1,2", "--iters", "2", "--cache", "8", "--threads", "1"]
    else:
        cmd += ["--sessions", "1,8,32", "--tokens", "1,5", "--iters", "5"]
    bench = getattr(ph.args, "llama_bin", None)
    if bench and (Path(bench) / "llama-batched-bench").exists():
        cmd += ["--batched-bench", Path(bench) / "llama-batched-bench"]
    ph.run(cmd)
    if result := ph.json_of(out / "gpu_engine.json"):
        measured = {r["engine"] for r in result["rows"]}
        ph.ok("every engine measured", {"torch", "llamacpp"} <= measured, sorted(measured))
        ph.rec["faster"] = faster_engine(result)


def faster_engine(result: dict) -> str:
    """The engine whose largest measured batch (8x5 on the GPU run) is the quicker: the fleet phase's. The torch
    engine's figure is its compiled pass's where it was measured (what `serve` runs on CUDA)."""
    compiled = any(r["engine"] == "torch-compiled" for r in result["rows"])
    torch_rows = "torch-compiled" if compiled else "torch"
    rows = [
        {**r, "engine": "torch"} if r["engine"] == torch_rows else r
        for r in result["rows"]
        if r["engine"] in (torch_rows, "llamacpp")
    ]
    n = max(r["sessions"] for r in rows)
    k = max(r["tokens"] for r in rows if r["sessions"] == n)
    at = {r["engine"]: r["pass_ms"] for r in rows if (r["sessions"], r["tokens"]) == (min(n, 8), k)} or {
        r["engine"]: r["pass_ms"] for r in rows if (r["sessions"], r["tokens"]) == (n, k)
    }
    return min(at, key=at.__getitem__)


def fleet(ph: Phase) -> None:
    out = Path(ph.args.out) / "fleet"
    cmd = [PY, "-m", "tools.bench.gpu_fleet", "--device", ph.args.device, "--out", out, "--dtype", "q4_0"]
    if ph.args.tiny:  # both engines: the rehearsal covers each one's path
        cmd += ["--tiny", "--n", "1,2", "--classes", "8,2", "--window-s", "2", "--warmup-s", "1"]
    else:
        faster = (ph.args.faster or "llamacpp") if ph.cuda else "llamacpp"
        cmd += ["--engines", faster, "--n", "8,32,128", "--classes", "8", "--window-s", "5", "--warmup-s", "2"]
        cmd += ["--estimator", ""]  # the default coefficients: no profile pass inside the phase's minutes
    peer = getattr(ph.args, "llama_bin", None)
    if ph.cuda and peer and (Path(peer) / "llama-server").exists():
        cmd += ["--peer-binary", Path(peer) / "llama-server"]
    else:
        cmd += ["--no-peer"]
    ph.run(cmd)
    if result := ph.json_of(out / "gpu_fleet.json"):
        systems = result["systems"]
        ph.ok("every system ran", all(not s.get("skipped") for s in systems.values()), list(systems))
        ph.ok("every point exact", result.get("exact") and all(s.get("points") for s in systems.values()))


def divergence(ph: Phase) -> None:
    out = Path(ph.args.out) / "divergence"
    configs = "torch:bfloat16" if ph.args.tiny else "torch:bfloat16,llamacpp"
    cmd = [PY, "-m", "tools.bench.divergence", "--configs", configs, "--device", ph.args.device, "--core", "-1"]
    if made := ph.args.random_pair:  # the serve phase's random target: no shipped one here
        cmd += ["--target", made["target"], "--torch-target", made["recipe"]]
    tiny = ["--prompts", "2", "--tokens", "8"] if ph.args.tiny else ["--prompts", "3", "--tokens", "24"]
    rc, _ = ph.run([*cmd, "--out", out, *tiny], allow=(0, 1))
    ph.rec["near_ties_only"] = rc == 0  # divergence exits 1 where a divergence was not a near-tie: a finding
    if result := ph.json_of(out / "divergence.json"):
        devices = [c["engine"]["device"] for c in result["configs"]]
        ph.ok("every config on the device", all((d != "cpu") == ph.cuda for d in devices), devices)


def vision(ph: Phase) -> None:
    import numpy as np
    from PIL import Image

    frame = Path(ph.args.out) / "vision-frame.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (96, 128, 3), dtype=np.uint8)).save(frame)
    for family in ("smolvlm",) if ph.args.tiny else ("smolvlm", "qwen2vl"):
        rc, out = ph.run([PY, "-m", "tests.models.make_test_vlm", "--family", family], echo=False)
        if rc:
            continue
        vlm = last_json(out)
        args = ["--target", vlm["target"], "--mmproj", vlm["target_mmproj"], "--max-context", "1024"]
        draft = ["--draft", vlm["draft"], "--draft-mmproj", vlm["draft_mmproj"], "--image", str(frame)]
        gen = [*draft, "--prompt", "Describe the scene.", "--chat", "--max-tokens", "16"]
        served(ph, family, [*args, "--n-gpu-layers", "-1" if ph.cuda else "0"], [(family, gen)])


RUN: dict[str, Callable[[Phase], None]] = {
    "setup": setup,
    "serve": serve,
    "engine": engine,
    "fleet": fleet,
    "divergence": divergence,
    "vision": vision,
}


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="the folder for <phase>.json, logs/ and each tool's output")
    ap.add_argument("--phase", default="all", help=f"comma-separated, in this order: {','.join(PHASES)}; or all")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--tiny", action="store_true", help="toy models and the smallest grids (checks the script)")
    ap.add_argument("--budget-s", type=float, default=520.0, help="the whole run's seconds, shared by its phases")
    ap.add_argument("--payload", default=None, help="the carried folder (tools/gpu_pack.py): wheels, tree, vocab")
    ap.add_argument("--prebuilt", default=None, help="the prebuilt tree or its .tar.xz (default: the payload's)")
    ap.add_argument("--pair", default="auto", choices=("auto", "shipped", "random"), help="serve's pair (see above)")
    args = ap.parse_args(argv)
    args.phases = PHASES if args.phase == "all" else tuple(p for p in PHASES if p in args.phase.split(","))
    if unknown := set(args.phase.split(",")) - set(PHASES) - {"all"}:
        ap.error(f"unknown phases {sorted(unknown)}: choose from {', '.join(PHASES)}")
    if args.budget_s <= 0:
        ap.error("--budget-s must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    args.llama_bin, args.faster, args.random_pair = None, None, None
    Path(args.out).mkdir(parents=True, exist_ok=True)
    build_dir = ROOT / "models" / "build"
    if build_dir.is_symlink() and not build_dir.exists():  # a worktree's link to a folder not carried here
        build_dir.unlink()
    end = time.monotonic() + args.budget_s
    say(
        f"gpu_run: phases {', '.join(args.phases)} on {args.device}{' (tiny)' if args.tiny else ''} into {args.out},"
        f" {args.budget_s:.0f} s in all"
    )
    passed: dict[str, bool] = {}
    for i, name in enumerate(args.phases):
        left = end - time.monotonic()
        limit = left * SHARE[name] / sum(SHARE[p] for p in args.phases[i:])
        ph = Phase(name, args, limit)
        ph.rec["command"] = "python -m tools.gpu_run " + shlex.join(sys.argv[1:] if argv is None else argv)
        if limit < 5:
            ph.ok("time left in the budget", False, f"{left:.0f} s of {args.budget_s:.0f} s left")
        elif passed.get("setup") is False:
            ph.ok("setup passed (every phase needs it)", False, "skipped")
        else:
            try:
                RUN[name](ph)
            except Exception as e:  # recorded; the next phase still runs
                ph.ok(f"{name} ran to its end", False, "".join(traceback.format_exception(e))[-3000:])
        args.faster = ph.rec.get("faster", args.faster)
        args.random_pair = ph.rec.get("random_pair", args.random_pair)
        passed[name] = ph.finish()
    say("gpu_run: " + ", ".join(f"{n} {'pass' if ok else 'FAIL'}" for n, ok in passed.items()))
    return 0 if all(passed.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
