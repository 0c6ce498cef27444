"""The robot never sends its token in clear to another machine: wss:// (with link.ca_file), loopback, or
link.allow_insecure; a daemon configured otherwise refuses to start before it moves anything."""

import pytest

from agent.app import config
from agent.app.daemon import Daemon
from agent.decoding.link import InsecureLink, tls_context
from tests.tlscerts import make_cert, needs_openssl


@pytest.mark.parametrize("url", ["ws://10.0.0.5:8765", "ws://verifier.local:8765", "ws://[2001:db8::1]:8765"])
def test_token_over_plain_ws_to_another_host_is_refused(url):
    with pytest.raises(InsecureLink, match="in clear"):
        tls_context(url, token="secret")
    assert tls_context(url, token="secret", allow_insecure=True) is None  # a lab network, said so
    assert tls_context(url, token="") is None  # nothing to give away


@pytest.mark.parametrize("url", ["ws://127.0.0.1:8765", "ws://localhost:8765", "ws://[::1]:8765"])
def test_loopback_may_use_plain_ws(url):
    assert tls_context(url, token="secret") is None


@needs_openssl
def test_wss_checks_the_server_against_ca_file(tmp_path):
    cert, _ = make_cert(tmp_path)
    ctx = tls_context("wss://verifier.local:8765", token="secret", ca_file=str(cert))
    assert ctx.verify_mode == ctx.verify_mode.CERT_REQUIRED and ctx.check_hostname
    with pytest.raises(ValueError, match="link.ca_file"):
        tls_context("wss://verifier.local:8765", token="secret", ca_file=str(tmp_path / "missing.pem"))


def test_daemon_refuses_a_token_in_clear_before_it_moves(monkeypatch):
    from agent.robot.controllers.sim import SimController

    monkeypatch.setenv("VERIFIER_TOKEN", "secret")
    cfg = config.load(None, ['link.verifier="ws://10.0.0.5:8765"', 'telemetry.path=""'])
    controller = SimController()
    with pytest.raises(InsecureLink):
        Daemon(cfg, drafter=object(), controller=controller).start()
    assert not controller.connected
    with pytest.raises(config.ConfigError, match="ca_file is for a wss"):
        config.load(None, ['link.verifier="ws://10.0.0.5:8765"', 'link.ca_file="/etc/ca.pem"'])
