"""The server's config and its loopback-only rule (fast: no model)."""
from pathlib import Path

import pytest

from server_bridge.config import ServerConfig
from server_bridge.server import is_loopback

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("remote, ok", [
    (("127.0.0.1", 5000), True), (("127.8.9.1", 1), True), (("::1", 5000, 0, 0), True),
    (("10.0.0.5", 5000), False), (("192.168.1.20", 1), False), (("8.8.8.8", 1), False),
    (None, False), (("not-an-ip", 1), False),
])
def test_only_loopback_peers_count_as_local(remote, ok):
    assert is_loopback(remote) is ok


def test_shipped_toml_loads_and_flags_override_it():
    path = ROOT / "systemd" / "server-bridge.toml"
    cfg = ServerConfig.load(path, port=9999, token=None)
    assert cfg.port == 9999 and cfg.host == "0.0.0.0" and cfg.max_sessions == 64
    assert cfg.redacted()["token"] == ""
    assert ServerConfig.load(path, token="s3cret").redacted()["token"] == "***"


def test_bad_config_is_refused(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[server]\nprot = 1\n")
    with pytest.raises(ValueError, match="unknown server config keys"):
        ServerConfig.load(bad)
    with pytest.raises(ValueError):
        ServerConfig(port=70000)
    with pytest.raises(ValueError):
        ServerConfig(max_sessions=0)
