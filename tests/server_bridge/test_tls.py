"""TLS on the link: server-bridge serves wss:// with --tls-cert/--tls-key, the robot checks it against
link.ca_file, and a wrong CA or a plain ws:// client gets nowhere (certificates made in the test)."""

import json
import ssl
import urllib.request

import pytest

from agent.decoding.link import LinkLost, ServerError, VerifierLink
from server_bridge import cli
from tests.tlscerts import make_cert, needs_openssl

pytestmark = needs_openssl


def _link(url, target, **kw):
    return VerifierLink(url, token="secret", vocab_hash=target.vocab_hash, vocab_size=target.vocab_size, **kw)


@pytest.mark.real
def test_robot_connects_over_wss_with_its_ca_file(make_server, target, tmp_path):
    cert, key = make_cert(tmp_path)
    server = make_server(token="secret", tls_cert=str(cert), tls_key=str(key))
    link = _link(f"wss://127.0.0.1:{server.port}", target, ca_file=str(cert))
    try:
        assert link.connect().target == target.name
    finally:
        link.close()
    ctx = ssl.create_default_context(cafile=str(cert))
    with urllib.request.urlopen(f"https://127.0.0.1:{server.port}/healthz", context=ctx, timeout=10) as r:
        assert json.loads(r.read())["status"] == "ok"
    other, _ = make_cert(tmp_path, "impostor")  # a CA that did not sign the server's certificate
    with pytest.raises(ServerError, match="TLS verification") as e:
        _link(f"wss://127.0.0.1:{server.port}", target, ca_file=str(other)).connect()
    assert e.value.code == "tls" and not e.value.recoverable
    with pytest.raises(LinkLost):  # plain ws:// to a TLS port: no handshake
        _link(f"ws://127.0.0.1:{server.port}", target).connect()


def test_serve_refuses_a_bad_certificate_before_loading_the_model(tmp_path, capsys):
    cert, key = make_cert(tmp_path)
    other_cert, _ = make_cert(tmp_path, "other")
    assert cli.main(["serve", "--port", "0", "--tls-cert", str(other_cert), "--tls-key", str(key)]) == 2
    assert "tls_cert/tls_key" in capsys.readouterr().err
    assert cli.main(["serve", "--port", "0", "--tls-cert", str(cert)]) == 2  # a key is needed too
    assert "tls_cert and tls_key go together" in capsys.readouterr().err
