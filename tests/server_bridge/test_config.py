"""The server's config and its loopback-only rule (fast: no model)."""

from pathlib import Path

import pytest

from server_bridge.admission import is_loopback
from server_bridge.config import ServerConfig

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "remote, ok",
    [
        (("127.0.0.1", 5000), True),
        (("127.8.9.1", 1), True),
        (("::1", 5000, 0, 0), True),
        (("10.0.0.5", 5000), False),
        (("192.168.1.20", 1), False),
        (("8.8.8.8", 1), False),
        (None, False),
        (("not-an-ip", 1), False),
    ],
)
def test_only_loopback_peers_count_as_local(remote, ok):
    assert is_loopback(remote) is ok


def test_shipped_toml_loads_and_flags_override_it():
    path = ROOT / "systemd" / "server-bridge.toml"
    cfg = ServerConfig.load(path, port=9999, token=None)
    assert cfg.port == 9999 and cfg.host == "0.0.0.0" and cfg.max_sessions == 256
    assert cfg.redacted()["token"] == ""
    assert ServerConfig.load(path, token="s3cret").redacted()["token"] == "***"


def test_bad_config_is_refused(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[server]\nprot = 1\n")
    with pytest.raises(ValueError, match=r"\[server\] has no field\(s\) \['prot'\]"):
        ServerConfig.load(bad)
    bad.write_text('[server]\nport = "8765"\n')
    with pytest.raises(ValueError, match="server.port must be int, got '8765'"):
        ServerConfig.load(bad)
    with pytest.raises(ValueError, match="not found"):
        ServerConfig.load(tmp_path / "missing.toml")
    with pytest.raises(ValueError):
        ServerConfig(port=70000)
    with pytest.raises(ValueError):
        ServerConfig(max_sessions=0)


def test_exit_settings_are_checked():
    cfg = ServerConfig.load(ROOT / "systemd" / "server-bridge.toml")
    assert (cfg.exits, cfg.exit_layers, cfg.exit_policy, cfg.exit_queue, cfg.exit_bonus_candidates) == (
        "auto",
        [],
        "priority",
        64,
        16,
    )
    for bad in (
        {"exit_layers": [26, 12]},
        {"exit_layers": [0]},
        {"exit_layers": [12, 12]},
        {"exit_policy": "lifo"},
        {"exit_queue": 0},
        {"exit_bonus_candidates": 0},
    ):
        with pytest.raises(ValueError):
            ServerConfig(**bad)


def test_cli_flags_override_the_exit_settings(monkeypatch):
    from server_bridge import cli, server

    seen = []

    async def fake_run(config):
        seen.append(config)

    monkeypatch.setattr(server, "run", fake_run)
    assert (
        cli.main(
            [
                "serve",
                "--exits",
                "",
                "--exit-layers",
                "22,26",
                "--exit-policy",
                "fifo",
                "--exit-queue",
                "8",
                "--exit-bonus-candidates",
                "4",
            ]
        )
        == 0
    )
    assert (
        seen[0].exits,
        seen[0].exit_layers,
        seen[0].exit_policy,
        seen[0].exit_queue,
        seen[0].exit_bonus_candidates,
    ) == ("", [22, 26], "fifo", 8, 4)
    assert cli.main(["serve", "--exit-layers", "all"]) == 0
    assert seen[1].exits == "auto" and seen[1].exit_layers == []
    assert cli.main(["serve", "--exit-layers", "26,12"]) == 2  # refused by the config, not a traceback


def test_exit_adapters_are_found_by_target_name(tmp_path):
    from protocol import modelfiles

    assert modelfiles.resolve_exits("", "smollm2-f32") is None
    assert modelfiles.resolve_exits("auto", "no-such-target") is None
    shipped = modelfiles.resolve_exits("auto", "smollm2-f32")
    assert shipped == modelfiles.models_dir() / "exits" / "smollm2-f32"
    assert modelfiles.resolve_exits(str(shipped), "anything") == shipped
    with pytest.raises(modelfiles.ModelNotFound, match="train them"):
        modelfiles.resolve_exits(str(tmp_path / "missing"), "smollm2-f32")


def test_every_field_is_a_flag_and_a_flag_overrides_the_file(monkeypatch, tmp_path):
    """The flags are derived from ServerConfig's fields: each one has its flag (--max-sessions-per-client
    once had none), typed as the field is; a flag not given leaves the file's value."""
    from dataclasses import fields

    from runtime import settings
    from server_bridge import cli, server

    parser = cli._parser()
    for f in fields(ServerConfig):
        assert settings.help_of(f), f"{f.name} has no help"
    seen = []

    async def fake_run(config):
        seen.append(config)

    monkeypatch.setattr(server, "run", fake_run)
    monkeypatch.delenv("VERIFIER_TOKEN", raising=False)
    toml = tmp_path / "server.toml"
    toml.write_text("[server]\nmax_sessions = 5\nmax_sessions_per_client = 3\n")
    argv = ["serve", "--config", str(toml), "--max-sessions-per-client", "2", "--no-trust-loopback"]
    assert cli.main([*argv, "--token", "t" * 16, "--trusted-proxies", "10.0.0.0/8, 127.0.0.1/32"]) == 0
    cfg = seen[-1]
    assert (cfg.max_sessions, cfg.max_sessions_per_client, cfg.trust_loopback) == (5, 2, False)
    assert cfg.trusted_proxies == ["10.0.0.0/8", "127.0.0.1/32"]
    monkeypatch.setenv("VERIFIER_TOKEN", "from-the-environment")
    assert cli.main(["serve", "--max-frame-bytes", "70000"]) == 0
    assert seen[-1].token == "from-the-environment" and seen[-1].max_frame_bytes == 70000
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--max-batch", "many"])
    assert cli.main(["serve", "--engine", "auto", "--kv-unified", "on", "--max-batch", "-1"]) == 2
    assert cli.main(["serve", "--max-batch", "0"]) == 0 and seen[-1].max_batch == 0  # 0: the engine's sequences


def test_a_target_given_by_the_path_of_its_built_file_keeps_its_name(tmp_path, monkeypatch):
    """`--target models/build/SmolLM2-135M-Instruct.F32.gguf` is smollm2-f32: its exits and its estimator
    (looked up by name) are the ones `--target smollm2-f32` gets; any other file goes by its file name."""
    from protocol import modelfiles

    monkeypatch.setenv("EDGESPEC_MODELS", str(tmp_path))
    built = tmp_path / "build" / modelfiles.TARGETS["smollm2-f32"]
    built.parent.mkdir()
    built.write_bytes(b"GGUF")
    (tmp_path / "estimator").mkdir()
    fitted = tmp_path / "estimator" / "smollm2-f32.json"
    fitted.write_text("{}")
    link = tmp_path / "target.gguf"
    link.symlink_to(built)
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF")
    for given in ("smollm2-f32", str(built), str(link)):
        assert modelfiles.target_name(given) == "smollm2-f32", given
    assert modelfiles.resolve_estimator("auto", modelfiles.target_name(str(built))) == fitted
    assert modelfiles.target_name(str(other)) == "other.gguf" and modelfiles.target_name("no/such.gguf") == "such.gguf"
