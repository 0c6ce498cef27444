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

ROOT = Path(__file__).resolve().parents[2]
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
    import agent.spec.drafter

    monkeypatch.setattr(agent.spec.drafter, "Drafter", WalkingDrafter)
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
    import agent.spec.drafter

    monkeypatch.setattr(agent.spec.drafter, "Drafter", WalkingDrafter)
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
