"""`server-bridge profile`, `train-exits` and `fleet` as commands: their flags, one-line refusals before anything
loads, and (marked real) a small profile of the shipped target. The planner's and the load test's commands are
tested beside their modules (test_planner.py, test_loadtest.py); the fleet's run in tests/tools/test_cluster.py,
the exits' training on a VLM in test_train_exits_vlm.py."""

from __future__ import annotations

import json

import pytest

from server_bridge import cli
from server_bridge.estimator import VerifyTimeModel
from server_bridge.ops import train_exits


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize(
    "command, flags",
    [
        ("profile", ["--shapes", "--batches", "--cached", "--report"]),
        ("train-exits", ["--layers", "--rank", "--images", "--prompts"]),
        ("fleet", ["--replicas", "--haproxy", "--server-arg"]),
        ("plan", ["--fleet", "--json", "--estimator"]),
        ("loadtest", ["--trace", "--url", "--classes", "--json"]),
    ],
)
def test_every_subcommand_has_help_with_its_flags(capsys, command, flags):
    with pytest.raises(SystemExit) as e:
        cli.main([command, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert all(f in out for f in flags), out


@pytest.mark.parametrize(
    "argv, match",
    [
        (["profile", "--batches", "3"], "batches must be 12-100000"),
        (["profile", "--cached", ""], "cached and prompts must be non-empty"),
        (["train-exits", "--layers", "5,3"], "layers must be increasing"),
        (["train-exits", "--lr", "2"], "lr in (0, 1)"),
        (["fleet", "--replicas", "0"], "replicas must be 1-64"),
        (["fleet", "--haproxy", "/nonexistent/haproxy"], "no executable haproxy at '/nonexistent/haproxy'"),
    ],
)
def test_bad_flags_are_one_line_and_exit_2(capsys, argv, match):
    assert cli.main(argv) == 2
    err = one_line_error(capsys)
    assert err.startswith(f"server-bridge {argv[0]}: ") and match in err


def test_a_bad_prompt_file_is_refused_before_the_model_loads(tmp_path, capsys, monkeypatch):
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"chat": true, "prompt": "fine"}\n{"prompt": 3}\n')
    assert cli.main(["train-exits", "--prompts", str(bad), "--target", "/nonexistent/model"]) == 2
    assert f"{bad}:2: expected" in one_line_error(capsys)  # the target was never looked for
    bad.write_text("not json\n")
    assert cli.main(["train-exits", "--prompts", str(bad), "--target", "/nonexistent/model"]) == 2
    assert "not JSON" in one_line_error(capsys)
    monkeypatch.setattr(train_exits, "MAX_PROMPT_FILE_BYTES", 4)
    assert cli.main(["train-exits", "--target", "/nonexistent/model"]) == 2
    assert "too big for a prompt file" in one_line_error(capsys)


def test_the_shipped_prompts_load():
    config = train_exits.TrainExitsConfig()
    train, held = train_exits.prompt_sets(config)
    assert len(train) >= 10 and len(held) >= 5
    assert all(isinstance(p["chat"], bool) and p["prompt"] for p in train + held)


@pytest.mark.real
def test_profile_fits_a_model_the_server_loads(tmp_path, capsys):
    out, report = tmp_path / "est.json", tmp_path / "report"
    argv = ["profile", "--shapes", "fleet", "--cached", "16,32", "--prompts", "8,16", "--max-batch", "4"]
    argv += ["--batches", "16", "--bootstrap", "20", "--out", str(out), "--report", str(report)]
    assert cli.main(argv) == 0
    fit = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    model = VerifyTimeModel.load(out)
    assert model.fitted and model.target == "smollm2-f32"
    assert [model.a, model.b_c, model.b_r, model.c] == [fit["coefficients"][t] for t in ("a", "b_c", "b_r", "c")]
    assert min(fit["coefficients"].values()) >= 0 and fit["test"]["n"] + fit["train"]["n"] == 16
    assert model.report["command"].startswith("server-bridge profile --shapes fleet")
    rows = json.loads((report / "estimator.json").read_text())["batches"]
    assert len(rows) == 16 and all(r["ms"] > 0 for r in rows)
    md = (report / "estimator.md").read_text()
    assert "| test (held out) |" in md and "| a |" in md and "| b_c |" in md
