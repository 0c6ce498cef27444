"""`edge-agent run --controller sim --scene FILE --start I --instruction ... --exit-when-done --json`: the robot runs
the instruction in the scene and the last stdout line says how it went."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from agent.app import cli

ROOT = Path(__file__).resolve().parents[3]
KEYS = {
    "reached",
    "steps",
    "distance_m",
    "collisions",
    "verified_steps",
    "offline_steps",
    "scene",
    "start",
    "path_m",
    "shortest_m",
    "spl",
    "end",
    "target",
}

# A 4 x 3 m room: the red box 2.2 m straight ahead of start 0, behind the robot at start 1; a red ball beside it.
SCENE = {
    "size_m": [4.0, 3.0],
    "objects": [
        {"name": "red box", "kind": "box", "x": 3.4, "y": 1.5, "color_bgr": [0, 0, 220]},
        {"name": "red ball", "kind": "ball", "x": 3.4, "y": 0.5, "size_m": 0.3, "height_m": 0.3},
    ],
    "starts": [[1.0, 1.5, 0.0], [1.0, 1.5, 3.141592653589793]],
}


class WalkingDrafter:
    """A draft model for the CLI path without a model: one byte a token, and the answer the scripted policy's
    distance rule gives for what the camera shows ahead (forward 75/50/25 cm, stop within reach)."""

    name, vocab_size, vocab_hash, eos_ids, chat_template = "walking", 256, "walking", {0}, None
    offload = {"device": "cpu", "n_gpu_layers": 0}
    END = "\n<answer>\n"

    def __init__(self, *args, **kwargs):
        pass

    def apply_chat_template(self, messages):
        return "\n".join(m["content"] for m in messages) + self.END

    def tokenize(self, text, chat=False):
        return list(text.encode())

    def detokenize(self, ids, skip=frozenset()):
        return bytes(i for i in ids if i not in skip).decode("utf-8", "replace")

    def next_logits(self, committed):
        return np.zeros(self.vocab_size, np.float32)

    def answer(self, camera: str) -> str:
        if "within reach" in camera:
            return "The next action is stop."
        m = re.search(r"(\d+(?:\.\d+)?) m away", camera)
        if not m:
            return "The next action is turn left 45 degree."
        d = float(m.group(1))
        return f"The next action is move forward {75 if d > 1.6 else 50 if d > 1.1 else 25} cm."

    def next_token(self, committed, params, rng, grammar=None):  # nav.grammar=false: fixed answers
        prompt, _, said = self.detokenize(committed).rpartition(self.END)
        camera = prompt.rsplit("Camera: ", 1)[-1]
        want = self.answer(camera)
        return ord(want[len(said)]) if len(said) < len(want) else 0


def _run(capsys, *args) -> tuple[int, dict, str]:
    with tempfile.TemporaryDirectory(prefix="api-") as folder:  # the local API's Unix socket, one per run
        rc = cli.main(["run", "--listen", f"unix:{folder}/api.sock", "--telemetry", "", *args])
    out = capsys.readouterr()
    lines = out.out.strip().splitlines()
    return rc, (json.loads(lines[-1]) if lines else {}), out.err


def test_run_exit_when_done_json_in_a_scene_file(tmp_path, capsys, monkeypatch):
    import agent.decoding.drafter

    monkeypatch.setattr(agent.decoding.drafter, "Drafter", WalkingDrafter)
    scene = tmp_path / "ahead.json"
    scene.write_text(json.dumps(SCENE))
    rc, out, err = _run(
        capsys,
        "--controller",
        "sim",
        "--scene",
        str(scene),
        "--start",
        "0",
        "--offline",
        "local",
        "--instruction",
        "go to the red box",
        "--exit-when-done",
        "--json",
        "--max-steps",
        "12",
        "--set",
        "nav.grammar=false",
    )  # the fake draft writes fixed answers, no llama.cpp
    assert rc == 0, err
    assert KEYS <= set(out)
    assert out["reached"] and out["end"] == "done" and out["target"] == "red box"  # not the red ball
    assert out["scene"] == "ahead" and out["start"] == 0 and out["scene_file"] == str(scene)
    moved = out["steps"] - out["parses"]["refused"]  # (a step before the camera's first frame)
    assert out["collisions"] == 0 and out["verified_steps"] == 0 and out["offline_steps"] == moved
    assert 3 <= moved <= 10 and out["distance_m"] <= 0.6  # offline steps may be shortened
    assert out["shortest_m"] == pytest.approx(1.6, abs=0.06)  # 2.2 m less the reach 0.6
    assert out["path_m"] >= out["shortest_m"] - 0.05 and 0.8 < out["spl"] <= 1.0


def test_run_with_a_start_facing_away_reports_max_steps(tmp_path, capsys, monkeypatch):
    import agent.decoding.drafter

    monkeypatch.setattr(agent.decoding.drafter, "Drafter", WalkingDrafter)
    scene = tmp_path / "behind.json"
    scene.write_text(json.dumps(SCENE))
    rc, out, _ = _run(
        capsys,
        "--controller",
        "sim",
        "--scene",
        str(scene),
        "--start",
        "1",
        "--offline",
        "local",
        "--instruction",
        "go to the red ball",
        "--exit-when-done",
        "--json",
        "--max-steps",
        "1",
        "--set",
        "nav.grammar=false",
    )
    assert rc == 0 and out["end"] == "max_steps" and out["steps"] - out["parses"]["refused"] == 1
    assert not out["reached"]
    assert out["target"] == "red ball" and out["start"] == 1 and out["spl"] == 0.0


def test_run_flags_are_checked(tmp_path, capsys):
    rc, _, err = _run(capsys, "--controller", "sim", "--scene", str(tmp_path / "none.json"))
    assert rc == 2 and "not found" in err
    rc, _, err = _run(capsys, "--controller", "sim", "--scene", "red_box", "--start", "9")
    assert rc == 2 and "start 9 out of range" in err
    rc, _, err = _run(capsys, "--json", "--instruction", "go to the red box")
    assert rc == 2 and "--exit-when-done" in err
    rc, _, err = _run(capsys, "--controller", "serial", "--camera", "0", "--perception", "color", "--scene", "red_box")
    assert rc == 2 and "simulator's" in err


@pytest.mark.real
def test_run_json_with_the_real_draft_in_a_subprocess(tmp_path):
    scene = tmp_path / "ahead.json"
    scene.write_text(json.dumps(SCENE))
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "agent.app.cli",
            "run",
            "--controller",
            "sim",
            "--scene",
            str(scene),
            "--start",
            "0",
            "--offline",
            "local",
            "--listen",
            f"unix:{tmp_path / 'api.sock'}",
            "--telemetry",
            "",
            "--set",
            "agent.threads=1",
            "--instruction",
            "go to the red box",
            "--max-steps",
            "3",
            "--exit-when-done",
            "--json",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "VERIFIER_TOKEN": ""},
    )
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    moved = out["steps"] - out["parses"]["refused"]
    assert KEYS <= set(out) and 1 <= moved <= 3 and out["offline_steps"] == moved
    assert out["target"] == "red box" and out["shortest_m"] == pytest.approx(1.6, abs=0.06)


def test_one_key_of_a_table_field_can_be_set():
    from agent.app import config

    cfg = config.load(None, ["robot.options={max_vx=0.5}", 'robot.options.scene="red_box"', "robot.options.start=2"])
    assert cfg.robot.options == {"max_vx": 0.5, "scene": "red_box", "start": 2}
    with pytest.raises(config.ConfigError, match="not a table"):
        config.load(None, ["robot.options=1", 'robot.options.scene="red_box"'])


# ------------------------------------------------------------------ the first hour (issue 35)


def _walking(monkeypatch):
    import agent.decoding.drafter

    monkeypatch.setattr(agent.decoding.drafter, "Drafter", WalkingDrafter)


def test_run_prints_a_line_per_step_and_quiet_prints_none(tmp_path, capsys, monkeypatch):
    _walking(monkeypatch)
    scene = tmp_path / "ahead.json"
    scene.write_text(json.dumps(SCENE))
    args = ["--controller", "sim", "--scene", str(scene), "--start", "0", "--offline", "local"]
    args += ["--instruction", "go to the red box", "--exit-when-done", "--json", "--max-steps", "12"]
    args += ["--set", "nav.grammar=false"]
    rc, out, err = _run(capsys, *args)
    assert rc == 0 and out["reached"], err
    assert "prefilling the prompt" in err  # the progress line before the model loads
    with tempfile.TemporaryDirectory(prefix="api-") as folder:
        assert cli.main(["run", "--listen", f"unix:{folder}/api.sock", "--telemetry", "", *args]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    steps = [line for line in lines if re.match(r"\[ ?\d+\] (OFFLINE/local|VERIFIED|HALTED) ", line)]
    listened = json.loads(lines[-1])  # the JSON is still the last line; this run's own count (a loaded
    moved = listened["steps"] - listened["parses"]["refused"]  # machine may hold a step the first run did not)
    assert len(steps) == listened["steps"] and moved >= 3  # every step, the held ones too
    assert any("sees: red box" in line for line in steps) and any("action: forward" in line for line in lines)
    rc, quiet, _ = _run(capsys, *args, "--quiet")
    assert rc == 0 and quiet["reached"]
    assert capsys.readouterr().out == ""  # (_run read it: only the JSON line was there)


def test_an_instruction_naming_nothing_in_the_scene_is_refused_before_anything_loads(capsys, monkeypatch):
    import agent.decoding.drafter

    def no_model(*a, **k):
        raise AssertionError("the draft model must not load")

    monkeypatch.setattr(agent.decoding.drafter, "Drafter", no_model)
    rc, _, err = _run(
        capsys, "--controller", "sim", "--scene", "two_rooms", "--instruction", "go to the blue ball", "--json",
        "--exit-when-done",
    )  # fmt: skip
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err
    assert "names no object in the scene 'two_rooms'" in lines[0] and "blue box, green ball" in lines[0]


def test_every_shipped_scene_is_taken_by_name(capsys, monkeypatch):
    from agent.robot.scene import builtin_scenes, load_scene

    names = builtin_scenes()
    assert {"red_box", "two_rooms", "cluttered", "blue_ball_corridor"} <= set(names) and len(names) >= 8
    monkeypatch.setattr("agent.decoding.drafter.Drafter", lambda *a, **k: pytest.fail("no model"))
    for name in names:
        objects = ", ".join(o.name for o in load_scene(name).objects)
        rc, _, err = _run(capsys, "--controller", "sim", "--scene", name, "--instruction", "go to the purple elephant")
        assert rc == 2 and f"scene {name!r}; its objects: {objects}" in err, err


def test_a_verifier_that_never_answers_ends_exit_when_done_at_once(capsys, monkeypatch):
    import socket
    import time

    _walking(monkeypatch)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    rc, _, err = _run(
        capsys, "--controller", "sim", "--scene", "red_box", "--verifier", f"ws://127.0.0.1:{port}",
        "--instruction", "go to the red box", "--exit-when-done", "--max-steps", "3", "--quiet",
    )  # fmt: skip
    assert rc == 3 and time.monotonic() - t0 < 30
    last = err.strip().splitlines()[-1]
    assert (
        last.startswith(f"edge-agent: the verifier at ws://127.0.0.1:{port} did not answer")
        and "--offline local" in last
    )


def test_held_steps_are_bounded_by_max_wait_s_and_the_log_agrees(capsys, monkeypatch, caplog):
    """Held steps (the link down, offline 'hold') make no plan and do not count toward --max-steps: --max-wait-s
    (agent.task_timeout_s) ends the task, and the log's count is the JSON's."""
    import logging

    _walking(monkeypatch)
    monkeypatch.setattr(cli, "_never_answered", lambda daemon, args: "")  # (as if it had answered once)
    caplog.set_level(logging.INFO, logger="agent.app.daemon")
    rc, out, _ = _run(
        capsys, "--controller", "sim", "--scene", "red_box", "--verifier", "ws://127.0.0.1:9",
        "--instruction", "go to the red box", "--exit-when-done", "--json", "--max-steps", "2", "--max-wait-s", "1.5",
        "--quiet",
    )  # fmt: skip
    assert rc == 0 and out["end"] == "timeout" and out["reached"] is False
    assert out["steps"] == out["parses"]["refused"] >= 1  # every step held (each waits for the link a while)
    ended = [r.getMessage() for r in caplog.records if "after" in r.getMessage() and "held" in r.getMessage()]
    assert ended and f"timeout after {out['steps']} steps (0 moving, {out['steps']} held" in ended[-1]


def test_telemetry_goes_under_the_state_directory(tmp_path, monkeypatch):
    from agent.app.daemon import state_directory, telemetry_path

    monkeypatch.delenv("STATE_DIRECTORY", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    assert telemetry_path("telemetry.jsonl") == tmp_path / "xdg" / "edge-agent" / "telemetry.jsonl"
    monkeypatch.setenv("STATE_DIRECTORY", f"{tmp_path / 'unit'}:/var/lib/other")  # systemd's StateDirectory=
    assert state_directory() == tmp_path / "unit"
    assert telemetry_path(str(tmp_path / "t.jsonl")) == tmp_path / "t.jsonl" and telemetry_path("") is None
    monkeypatch.delenv("STATE_DIRECTORY")
    monkeypatch.delenv("XDG_STATE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert state_directory() == tmp_path / "home" / ".local" / "state" / "edge-agent"


class ForwardDrafter(WalkingDrafter):
    """Always "move forward 75 cm", whatever the camera shows (the model that invents an elephant to the left)."""

    def answer(self, camera: str) -> str:
        return "The next action is move forward 75 cm."


@pytest.mark.parametrize("drafter,steps", [(ForwardDrafter, 1), (WalkingDrafter, 2)])
def test_a_camera_that_sees_nothing_named_never_walks_and_ends_not_seen(capsys, monkeypatch, drafter, steps):
    """Perception "color" (a real detector, here on the simulator's renders) finds no purple elephant: a step
    forward becomes a stop at once; a turn to look is allowed once, the next is a stop; the task ends not_seen."""
    import agent.decoding.drafter

    monkeypatch.setattr(agent.decoding.drafter, "Drafter", drafter)
    rc, out, err = _run(
        capsys, "--controller", "sim", "--scene", "red_box", "--camera", "sim", "--perception", "color",
        "--offline", "local", "--instruction", "go to the purple elephant", "--exit-when-done", "--json",
        "--max-steps", "6", "--set", "nav.grammar=false", "--quiet",
    )  # fmt: skip
    assert rc == 0, err
    assert out["end"] == "not_seen" and out["steps"] - out["parses"]["refused"] == steps
    assert out["path_m"] < 0.01  # turned in place at most, never walked
