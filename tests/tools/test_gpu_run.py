"""The GPU run (tools/gpu_run.py) rehearsed on the CPU: every phase but setup's build and llama.cpp's, on toy models
(`--device cpu --tiny`), through the code the GPU run executes. The figures mean nothing; the checks do.

The rehearsal's engine and fleet phases are the end-to-end runs of tools/bench/gpu_engine.py and gpu_fleet.py on a
toy model (their former tests here, moved), checked as those tests checked them."""

import json
from pathlib import Path

import pytest

from protocol import modelfiles
from tools import gpu_run
from tools.models import random_target

REHEARSED = ("serve", "engine", "fleet", "divergence", "vision")


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_run")
    rc = gpu_run.main(["--out", str(out), "--device", "cpu", "--tiny", "--phase", ",".join(REHEARSED)])
    return rc, out, {p: json.loads((out / f"{p}.json").read_text()) for p in REHEARSED}


@pytest.mark.real
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
def test_the_shipped_pair_gives_the_same_ids_in_every_mode_on_each_engine(rehearsal):
    serve = rehearsal[2]["serve"]
    assert [(s["health"]["engine"], s["health"]["device"]) for s in serve["servers"]] == [
        ("llamacpp", "cpu"),
        ("torch", "cpu"),
    ]
    assert "--n-gpu-layers 0" in serve["servers"][0]["cmd"] and "--dtype float32" in serve["servers"][1]["cmd"]
    assert all(s["start_s"] > 0 for s in serve["servers"])
    assert [g["label"] for g in serve["generations"]] == ["llamacpp, prompt 0", "torch, prompt 0"]
    for g in serve["generations"]:
        ids = g["ids"]
        assert len(ids["ar"]) > 1 and ids["ar"] == ids["sd"] == ids["fsd"]
        assert g["metrics"]["ar"]["tau"] == 1.0 and g["metrics"]["sd"]["tau"] >= 1.0  # generate's own figures
    modes = [s["cmd"].split("--mode ")[1].split()[0] for s in serve["steps"]]
    assert modes == ["ar", "sd", "fsd"] * 2  # one edge-agent process per mode, engine and prompt


@pytest.mark.real
def test_the_engine_phase_runs_both_engines_and_q4_k_m(rehearsal):
    """Each engine in its own process: a toy torch Llama, and the toy random GGUF on llama.cpp (F16 and Q4_K_M)."""
    _, out, phases = rehearsal
    results = phases["engine"]["results"]
    f16, q4 = results["engine/f16/gpu_engine.json"], results["engine/q4_k_m/gpu_engine.json"]
    assert f16 == json.loads((out / "engine" / "f16" / "gpu_engine.json").read_text())
    for result, engines in ((f16, ("torch", "llamacpp")), (q4, ("llamacpp",))):
        for engine in engines:
            rows = [r for r in result["rows"] if r["engine"] == engine]
            assert [(r["sessions"], r["tokens"]) for r in rows] == [(1, 1), (1, 2), (3, 1), (3, 2)]
            assert all(r["pass_ms"] > 0 and r["x_roofline"] > 0 for r in rows)
        assert result["bandwidth_gbs"] > 0
    runs = {run["engine"]: run for run in f16["runs"]}
    assert runs["llamacpp"]["dtype"] == "float16" and runs["torch"]["dtype"] == "float32"
    (q4_run,) = q4["runs"]
    assert q4_run["dtype"] == "q4_k_m" and q4_run["weight_bytes"] < runs["llamacpp"]["weight_bytes"]
    for gguf in ("f16", "q4_k_m"):
        md = (out / "engine" / gguf / "gpu_engine.md").read_text()
        assert (out / "engine" / gguf / "gpu_engine.png").stat().st_size > 0 and "x roofline" in md
        assert "| llamacpp | 3 | 2 |" in md


@pytest.mark.real
def test_the_fleet_phase_runs_the_tiny_fleet_end_to_end_on_both_engines(rehearsal):
    _, out, phases = rehearsal
    result = phases["fleet"]["results"]["fleet/gpu_fleet.json"]
    shipped = random_target.gguf_vocab_hash(modelfiles.shipped_gguf())
    assert result["trace"]["gguf_vocab_hash"] == shipped == result["trace"]["vocab_hash"]
    assert set(result["systems"]) == {"llamacpp", "torch"}  # no llama-server on the CPU rehearsal (--no-peer)
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
    (config,) = phase["results"]["divergence/divergence.json"]["configs"]
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


def test_setup_on_the_cpu_checks_what_is_installed_and_builds_nothing(tmp_path):
    assert gpu_run.main(["--out", str(tmp_path), "--device", "cpu", "--phase", "setup"]) == 0
    setup = json.loads((tmp_path / "setup.json").read_text())
    assert setup["pass"] and setup["build"].startswith("skipped: --device cpu")
    assert all(setup["installed"].values()) and setup["gpu_offload"] is False
    (step,) = setup["steps"]  # the offload check alone: nothing installed, nothing built
    assert "llama_supports_gpu_offload()" in step["cmd"] and step["rc"] == 0
    assert not (tmp_path / "build.json").exists()


def test_files_carried_in_pieces_are_joined(tmp_path):
    whole = bytes(range(256)) * 1000
    for i, suffix in enumerate(("aa", "ab", "ac")):
        (tmp_path / f"big.whl.part-{suffix}").write_bytes(whole[i * 100_000 : (i + 1) * 100_000])
    gpu_run.join_parts(tmp_path)
    assert (tmp_path / "big.whl").read_bytes() == whole


def test_phases_are_named_and_ordered(capsys):
    assert gpu_run.parse(["--out", "x", "--phase", "vision,serve"]).phases == ("serve", "vision")
    assert gpu_run.parse(["--out", "x"]).phases == gpu_run.PHASES
    with pytest.raises(SystemExit):
        gpu_run.parse(["--out", "x", "--phase", "serve,gpu"])
    assert "unknown phases ['gpu']" in capsys.readouterr().err
