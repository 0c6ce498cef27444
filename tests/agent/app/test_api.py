"""The local API is closed by default: a 0600 Unix socket, TCP only with a token (and off loopback only when
the config allows it), browsers' Origins refused, a reset that needs a credential of its own, and bad
requests answered with an error on a connection that stays open, an image bounded and refused while busy
before any decoder runs. The daemon is the sim robot with a stub draft (no model)."""

from __future__ import annotations

import asyncio
import base64
import grp
import json
import logging
import os
import socket
import stat
import struct
import zlib

import pytest
from websockets.exceptions import InvalidStatus

from agent.app import api as local_api
from agent.app import config, daemon
from agent.app.api import LocalApi
from agent.app.config import ConfigError
from agent.app.daemon import Daemon
from tests.agent.app.test_go2_daemon import Api, RecordingNotifier, StubDrafter

TOKEN = "api-token-of-the-tests-0123"
RESET = "reset-token-of-the-tests-4567"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


# an 8 x 8 RGB PNG whose header is sound and whose pixel data is not zlib: passes the header checks, fails to decode
BROKEN_PNG = (
    PNG_MAGIC
    + png_chunk(b"IHDR", struct.pack(">IIBBBBB", 8, 8, 8, 2, 0, 0, 0))
    + png_chunk(b"IDAT", b"\xde\xad\xbe\xef" * 16)
    + png_chunk(b"IEND", b"")
)


@pytest.fixture
def make():
    """make(*sets) -> (daemon, Api): a started sim daemon (perception color, so images are taken) and its API
    on a Unix socket; both closed after the test."""
    made = []

    def make(*sets, listen=None, token=""):
        cfg = config.load(None, ['telemetry.path=""', 'perception.kind="color"', *sets])
        d = Daemon(cfg, drafter=StubDrafter(), notifier=RecordingNotifier()).start()
        made.append(d)
        api = Api(d, listen, token)
        made.append(api)
        return d, api

    yield make
    for thing in reversed(made):
        thing.close()


def refused_status(api: Api, **kw) -> int:
    with pytest.raises(InvalidStatus) as e:
        api.connect(**kw)
    return e.value.response.status_code


@pytest.mark.parametrize(
    "sets,msg",
    [
        (['api.listen="0.0.0.0:8770"'], "allow_remote"),
        (['api.listen="192.168.1.20:8770"', f'api.token="{TOKEN}"'], "allow_remote"),
        (['api.listen="0.0.0.0:8770"', "api.allow_remote=true"], "token"),
        (['api.listen="127.0.0.1:8770"'], "token"),
        (['api.listen="127.0.0.1:8770"', 'api.token="short"'], "16 characters"),
        ([f'api.token="{TOKEN}"', f'api.reset_token="{TOKEN}"'], "differ"),
        (['api.listen="unix:relative.sock"'], "absolute"),
        (['api.allowed_origins=["*"]'], "allowed_origins"),
    ],
)
def test_a_remote_or_tokenless_tcp_listen_is_refused_at_config_time(sets, msg):
    with pytest.raises(ConfigError, match=msg):
        config.load(None, sets)


def test_remote_listen_is_taken_only_with_allow_remote_and_a_token_file(tmp_path):
    secret = tmp_path / "api.token"
    secret.write_text(TOKEN + "\n")
    secret.chmod(0o644)
    cfg = config.load(None, ['api.listen="0.0.0.0:8770"', "api.allow_remote=true", f'api.token_file="{secret}"'])
    with pytest.raises(ConfigError, match="readable by every user"):
        cfg.api.secrets()
    secret.chmod(0o600)
    assert cfg.api.secrets() == (TOKEN, "")
    assert config.load(None, [f'api.token="{TOKEN}"']).to_dict()["api"]["token"] == "<set>"  # not in the log


def test_the_default_is_a_unix_socket_of_mode_0600(make, tmp_path, monkeypatch):
    monkeypatch.delenv("RUNTIME_DIRECTORY", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    d, api = make(listen="")
    path = tmp_path / "edge-agent" / "api.sock"
    assert api.api.address == f"unix:{path}" and local_api.default_socket() == str(path)
    mode = os.stat(path).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
    assert api.call(op="status")["ok"]
    api.close()
    assert not path.exists()  # removed on close


def test_a_socket_group_makes_it_0660_with_that_group(make):
    group = grp.getgrgid(os.getgid()).gr_name
    d, api = make(f'api.socket_group="{group}"')
    st = os.stat(api.api.path)
    assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == os.getgid()


def test_a_second_daemon_does_not_take_over_a_live_socket(make):
    d, api = make()
    with pytest.raises(ConfigError, match="already listens"):
        asyncio.run(LocalApi(d, api.api.address).start())
    assert api.call(op="status")["ok"]


def test_a_browser_origin_is_refused_with_403(make, caplog):
    d, api = make()
    with caplog.at_level(logging.WARNING, "agent.app.api"):
        assert refused_status(api, additional_headers={"Origin": "http://evil.example"}) == 403
    assert "Origin" in caplog.text and "pid" in caplog.text
    assert api.call(op="status")["ok"]  # no Origin: a robot process


def test_an_origin_the_config_lists_is_let_in(make):
    d, api = make('api.allowed_origins=["https://ui.robot.lan"]')
    ws = api.connect(additional_headers={"Origin": "https://ui.robot.lan"})
    ws.send(json.dumps({"op": "status"}))
    assert json.loads(ws.recv(5))["ok"]
    ws.close()
    assert refused_status(api, additional_headers={"Origin": "https://ui.robot.lan.evil.example"}) == 403


def test_with_a_token_every_connection_presents_it(make):
    d, api = make(f'api.token="{TOKEN}"', listen="127.0.0.1:0", token=TOKEN)
    assert api.api.address.startswith("ws://127.0.0.1:")
    assert refused_status(api) == 401
    assert refused_status(api, token="not-the-token-of-the-tests") == 401
    assert refused_status(api, token=TOKEN, additional_headers={"Origin": "http://evil.example"}) == 403
    assert api.call(op="status")["ok"]  # the client the Api helper opened with the token


def upgrade_status(address: str, host: str, token: str = TOKEN) -> int:
    """A websocket upgrade sent by hand (a client library would write its own Host) -> the answer's status."""
    port = int(address.rsplit(":", 1)[1])
    key = base64.b64encode(os.urandom(16)).decode()
    head = (
        f"GET / HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\nAuthorization: Bearer {token}\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(head.encode())
        return int(s.recv(4096).split(b" ")[1])


def test_over_tcp_a_host_that_is_not_the_apis_is_refused(make, caplog):
    """DNS rebinding: a page that rebinds its own name to 127.0.0.1 reaches the API's port with that name as
    its Host (and, without an Origin check, with whatever it learnt of the token): 421 before the token."""
    d, api = make(f'api.token="{TOKEN}"', listen="127.0.0.1:0", token=TOKEN)
    port = api.api.address.rsplit(":", 1)[1]
    with caplog.at_level(logging.WARNING, "agent.app.api"):
        for host in ("evil.example", f"evil.example:{port}", "127.0.0.2", "robot.lan"):
            assert upgrade_status(api.api.address, host) == 421, host
    assert "Host" in caplog.text
    for host in (f"127.0.0.1:{port}", "127.0.0.1", f"localhost:{port}"):
        assert upgrade_status(api.api.address, host) == 101, host
    assert upgrade_status(api.api.address, "127.0.0.1", token="not-the-token-of-the-tests") == 401
    assert api.call(op="status")["ok"]


def test_over_tcp_a_host_name_the_config_lists_is_let_in(make):
    d, api = make(f'api.token="{TOKEN}"', 'api.allowed_hosts=["robot.lan"]', listen="127.0.0.1:0", token=TOKEN)
    assert upgrade_status(api.api.address, "robot.lan") == 101
    assert upgrade_status(api.api.address, "robot.lan.evil.example") == 421
    with pytest.raises(ConfigError, match="allowed_hosts"):
        config.load(None, ['api.allowed_hosts=["http://robot.lan"]'])


def test_over_tcp_a_token_holder_is_answered_while_256_silent_sockets_are_open(make):
    d, api = make(f'api.token="{TOKEN}"', listen="127.0.0.1:0", token=TOKEN)
    port = int(api.api.address.rsplit(":", 1)[1])
    silent = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(256)]
    try:
        ws = api.connect(TOKEN)
        ws.send(json.dumps({"op": "status"}))
        assert json.loads(ws.recv(5))["ok"]
        ws.close()
    finally:
        for s in silent:
            s.close()


def test_reset_without_a_reset_credential_is_refused_and_the_estop_stays(make, caplog):
    d, api = make()
    with caplog.at_level(logging.WARNING):
        assert api.call(op="estop")["latched"] and d.safety.estopped
        reply = api.call(op="reset", reset_token=RESET)
    assert not reply["ok"] and "api.reset_token_file" in reply["error"] and d.safety.estopped
    assert d.world.damped and api.call(op="status")["status"]["estopped"]
    assert "E-STOP from pid" in caplog.text and "reset from pid" in caplog.text  # each logged with its peer


def test_reset_goes_through_only_with_its_own_credential(make, caplog):
    d, api = make(f'api.token="{TOKEN}"', f'api.reset_token="{RESET}"', token=TOKEN)
    assert api.call(op="estop")["latched"]
    for given in ({}, {"reset_token": TOKEN}, {"reset_token": "x" * 30}, {"reset_token": 1}):
        reply = api.call(op="reset", **given)
        assert not reply["ok"] and "reset_token" in reply["error"] and d.safety.estopped
    with caplog.at_level(logging.WARNING, "agent.app.daemon"):
        assert api.call(op="reset", reset_token=RESET)["ok"]
    assert not d.safety.estopped and not d.world.damped
    assert any(r.levelno == logging.WARNING and "reset" in r.getMessage() for r in caplog.records)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.mark.parametrize(
    "raw,msg",
    [
        ('{"op": "submit", "instruction": "go", "max_steps": Infinity}', "Infinity"),
        ('{"op": "submit", "instruction": "go", "max_steps": NaN}', "NaN"),
        ('{"op": "submit", "instruction": "go", "max_steps": 1e999}', "max_steps"),
        ('{"op": "submit", "instruction": "go", "max_steps": -3}', "max_steps"),
        ('{"op": "submit", "instruction": "go", "max_steps": 1' + "0" * 400 + "}", "max_steps"),
        ('{"op": "submit", "instruction": "go", "max_steps": 2.5}', "max_steps"),
        ("DEEP", "flat JSON object"),
        ('{"op": "status", "x": DEEP}', "flat JSON object"),
        ("[1, 2]", "JSON object"),
        ('"status"', "JSON object"),
        ("{not json", "Expecting"),
        ('{"op": ["status"]}', "names its op"),
        ('{"op": "fly"}', "unknown op"),
        (json.dumps({"op": "submit", "instruction": "go", "image": b64(BROKEN_PNG)}), "decoded"),
        (json.dumps({"op": "submit", "instruction": "go", "image": b64(b"GIF89a" + b"\0" * 64)}), "JPEG or a PNG"),
        (json.dumps({"op": "submit", "instruction": "go", "image": "data:image/png;base64,"}), "empty"),
        (json.dumps({"op": "submit", "instruction": "go", "image": "!!not base64"}), "base64"),
        (json.dumps({"op": "submit", "instruction": "go", "image": {"a": 1}}), "base64"),
        (json.dumps({"op": "submit", "instruction": "go", "image": "A" * 1_400_000}), "smaller"),
        (b"\xff\xfe", "utf-8"),
    ],
    ids=lambda v: v[:40] if isinstance(v, str) else None,
)
def test_a_bad_request_gets_an_error_and_the_connection_answers_status(make, raw, msg):
    d, api = make()
    api.ws.send(raw.replace("DEEP", "[" * 100_000 + "]" * 100_000) if isinstance(raw, str) else raw)  # 100k deep
    reply = json.loads(api.ws.recv(10))
    assert reply["ok"] is False and msg in reply["error"], reply
    assert api.call(op="status")["ok"]  # the same connection, still open
    assert d._tasks.qsize() == 0


def test_submit_while_busy_is_refused_before_the_image_is_decoded(make, monkeypatch):
    decoded = []
    real = daemon._decode_image
    monkeypatch.setattr(daemon, "_decode_image", lambda data: decoded.append(data) or real(data))
    d, api = make()
    while api.call(op="submit", instruction="go to the red box")["ok"]:  # the running task, then 4 waiting
        pass
    image = b64(BROKEN_PNG)
    reply = api.call(op="submit", instruction="go to the red box", image=image)
    assert not reply["ok"] and "cancel first" in reply["error"] and decoded == []
    api.call(op="cancel")
    reply = api.call(op="submit", instruction="go to the red box", image=image)  # room again: it is decoded
    assert not reply["ok"] and "decoded" in reply["error"] and decoded == [image]


def test_an_image_is_bounded_by_its_header_before_any_decoder_runs(make, monkeypatch):
    """A PNG that says 30000 x 30000 (a few KB that would decode to 2.7 GB) never reaches a decoder."""
    import cv2

    imdecode = []
    monkeypatch.setattr(cv2, "imdecode", lambda *a: imdecode.append(a))
    bomb = BROKEN_PNG.replace(struct.pack(">II", 8, 8), struct.pack(">II", 30_000, 30_000), 1)
    bomb = bomb[:33].replace(bomb[29:33], struct.pack(">I", zlib.crc32(bomb[12:29]))) + bomb[33:]  # IHDR's CRC
    d, api = make()
    reply = api.call(op="submit", instruction="go", image=b64(bomb))
    assert not reply["ok"] and "30000" in reply["error"] and imdecode == []
    assert api.call(op="status")["ok"]
