"""agent.app.sdnotify against a real AF_UNIX datagram socket standing in for systemd's $NOTIFY_SOCKET."""

from __future__ import annotations

import logging
import os
import socket
import uuid

import pytest

from agent.app.sdnotify import Notifier


@pytest.fixture
def systemd_socket(tmp_path, monkeypatch):
    """A bound datagram socket at a filesystem path, exported as $NOTIFY_SOCKET."""
    path = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        sock.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
        yield sock


def received(sock: socket.socket) -> str:
    return sock.recv(4096).decode()


def test_sends_ready_status_watchdog_stopping(systemd_socket):
    n = Notifier()
    assert n.ready() is True
    assert received(systemd_socket) == "READY=1\n"
    assert n.status("draft loaded; verifier connected")
    assert received(systemd_socket) == "STATUS=draft loaded; verifier connected\n"
    assert n.watchdog()
    assert received(systemd_socket) == "WATCHDOG=1\n"
    assert n.reloading()
    assert received(systemd_socket) == "RELOADING=1\n"
    assert n.stopping()
    assert received(systemd_socket) == "STOPPING=1\n"


def test_several_fields_in_one_datagram_and_status_stays_one_line(systemd_socket):
    assert Notifier().notify(READY=1, STATUS="two\nlines")
    assert received(systemd_socket) == "READY=1\nSTATUS=two lines\n"


def test_abstract_namespace_socket(monkeypatch):
    name = f"edgespec-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        n = Notifier()
        assert n.address == "\0" + name
        assert n.ready()
        assert received(sock) == "READY=1\n"


def test_unset_variable_is_a_noop(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    n = Notifier()
    assert not n.address
    assert n.ready() is False
    assert n.watchdog() is False
    assert n.status("x") is False
    assert n.stopping() is False


def test_send_errors_are_swallowed_and_logged_once(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "nobody-listens"))  # systemd went away
    n = Notifier()
    with caplog.at_level(logging.DEBUG, logger="agent.app.sdnotify"):
        assert n.ready() is False
        assert n.watchdog() is False
        assert n.stopping() is False
    assert len([r for r in caplog.records if r.name == "agent.app.sdnotify"]) == 1


def test_bad_address_is_swallowed():
    assert Notifier(env={"NOTIFY_SOCKET": "/tmp/a\0b"}).ready() is False  # ValueError from sendto, not OSError


def test_watchdog_interval_is_half_of_watchdog_usec(monkeypatch):
    monkeypatch.setenv("WATCHDOG_USEC", "10000000")  # WatchdogSec=10
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    assert Notifier().watchdog_interval_s() == pytest.approx(5.0)
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert Notifier().watchdog_interval_s() == pytest.approx(5.0)


def test_watchdog_interval_none_when_not_for_us(monkeypatch):
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    assert Notifier().watchdog_interval_s() is None
    monkeypatch.setenv("WATCHDOG_USEC", "10000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))  # meant for another process
    assert Notifier().watchdog_interval_s() is None
    for bad in ("0", "-5", "ten"):
        monkeypatch.setenv("WATCHDOG_USEC", bad)
        monkeypatch.delenv("WATCHDOG_PID", raising=False)
        assert Notifier().watchdog_interval_s() is None


def test_explicit_env_mapping_overrides_os_environ(systemd_socket):
    n = Notifier(env={"WATCHDOG_USEC": "2000000"})
    assert n.ready() is False  # no NOTIFY_SOCKET in the given mapping
    assert n.watchdog_interval_s() == pytest.approx(1.0)
