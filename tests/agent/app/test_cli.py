"""`edge-agent generate --json`: the last stdout line is one JSON object with the documented names."""

import json

import pytest

from agent.app import cli

pytestmark = pytest.mark.real

METRICS = {
    "tau",
    "acceptance_rate",
    "rounds",
    "target_forward_passes",
    "draft_ms",
    "verify_ms",
    "network_ms",
    "wall_s",
    "tokens_per_s",
    "bytes_up",
    "bytes_down",
}


def _run(capsys, *args):
    rc = cli.main(["generate", "--threads", "1", "--max-tokens", "8", "--json", *args])
    out = capsys.readouterr().out.strip().splitlines()
    return rc, json.loads(out[-1])


def test_json_output_for_each_mode(make_server, capsys):
    server = make_server()
    prompt = ["--prompt", "Walk forward and stop.", "--chat"]
    rc, sd = _run(capsys, "--verifier", server.url, "--mode", "sd", "--gamma", "3", *prompt)
    assert rc == 0 and sd["mode"] == "sd" and METRICS <= set(sd["metrics"])
    rc, ar = _run(capsys, "--verifier", server.url, "--mode", "ar", *prompt)
    assert rc == 0 and ar["token_ids"] == sd["token_ids"] and ar["text"] == sd["text"]
    assert ar["metrics"]["acceptance_rate"] is None and ar["metrics"]["tau"] == 1.0
    rc, fsd = _run(
        capsys,
        "--verifier",
        server.url,
        "--mode",
        "fsd",
        "--gamma",
        "3",
        "--exits",
        "22,26",
        "--predraft-workers",
        "2",
        "--queue-policy",
        "fifo",
        *prompt,
    )
    assert rc == 0 and fsd["token_ids"] == sd["token_ids"]
    assert {"predraft_hits", "predraft_misses", "avg_exit_layer"} <= set(fsd["metrics"])
    assert fsd["metrics"]["predraft_hits"] + fsd["metrics"]["predraft_misses"] == fsd["metrics"]["rounds"] - 1
    rc, local = _run(capsys, "--local", *prompt)
    assert rc == 0 and local["mode"] == "local" and local["metrics"]["bytes_up"] == 0


def test_unreachable_verifier_is_a_clear_error(capsys):
    rc = cli.main(["generate", "--verifier", "ws://127.0.0.1:9", "--prompt", "hi", "--threads", "1"])
    assert rc == 3
    assert "cannot reach verifier" in capsys.readouterr().err


def test_draft_policy_and_trace_flags(make_server, capsys, tmp_path):
    server = make_server()
    prompt = ["--verifier", server.url, "--prompt", "Walk forward and stop.", "--chat", "--max-tokens", "16"]
    trace = tmp_path / "trace.jsonl"
    rc, fixed = _run(capsys, *prompt, "--trace", str(trace))
    assert rc == 0
    rows = [json.loads(x) for x in trace.read_text().splitlines()]
    m = fixed["metrics"]
    assert sum(r["label"] for r in rows) == m["accepted"]  # every accepted token, labelled 1
    rejections = sum(1 for r in rows if r["label"] == 0)  # at most one per round, the first
    assert rejections <= m["rounds"] and (rejections > 0) == (m["wasted_draft_tokens"] > 0)
    assert {r["pair"] for r in rows} == {"smollm2-q4_1->smollm2-f32"}
    for kind in ("predictor", "optimal", "predictor+optimal"):
        rc, out = _run(capsys, *prompt, "--draft-policy", kind, "--min-draft", "1", "--max-draft", "6")
        assert rc == 0 and out["token_ids"] == fixed["token_ids"] and out["metrics"]["draft_policy"] == kind
    rc = cli.main(["generate", *prompt, "--draft-policy", "predictor", "--predictor", str(tmp_path / "none.onnx")])
    assert rc == 2 and "no rejection predictor" in capsys.readouterr().err
    rc = cli.main(["generate", *prompt, "--mode", "fsd", "--draft-policy", "predictor"])
    assert rc == 2 and "fsd" in capsys.readouterr().err


def test_under_systemd_log_lines_carry_their_syslog_priority():
    import subprocess
    import sys

    code = (
        "import logging; from agent.app.cli import _setup_logging; _setup_logging('INFO'); "
        "logging.getLogger('x').warning('careful'); logging.getLogger('x').info('fine')"
    )
    import os

    env = {**os.environ, "JOURNAL_STREAM": "8:1234"}
    err = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stderr
    assert err.splitlines() == ["<4>x: careful", "<6>x: fine"]
