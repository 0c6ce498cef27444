"""agent/app/http_guard.py without sockets: which Host names a listener answers, which Origins pass, and which
connections Admission keeps when many are open."""

from __future__ import annotations

import pytest

from agent.app.http_guard import Admission, HostCheck, host_name, origin_allowed, valid_name


def test_host_names_are_read_without_port_brackets_or_case():
    assert host_name("LocalHost:8080") == "localhost"
    assert host_name("[::1]:8080") == "::1" and host_name("[::1]") == "::1"
    assert host_name("go2.lan.") == "go2.lan"
    for bad in ("", "a b", "evil@127.0.0.1", "127.0.0.1/x", "[::1", "h:\u0661\u0662", "h:123456", "*"):
        assert host_name(bad) is None, bad


def test_a_loopback_listener_answers_its_own_address_and_localhost():
    check = HostCheck("127.0.0.1", ["go2.lan"])
    for host in ("127.0.0.1:8080", "127.0.0.1", "localhost:8080", "go2.lan", "GO2.LAN:80", None):
        assert check.allows(host, "127.0.0.1"), host
    for host in ("evil.example", "127.0.0.2", "0.0.0.0", "[::1]", "go2.lan.evil.example", "localhost.evil.example"):
        assert not check.allows(host, "127.0.0.1"), host


def test_a_wildcard_listener_answers_the_address_a_client_reached():
    check = HostCheck("0.0.0.0")
    assert check.allows("192.168.1.20:8080", "192.168.1.20")
    assert check.allows("192.168.1.20", "::ffff:192.168.1.20")  # a dual-stack socket's IPv4 peer
    assert not check.allows("192.168.1.21", "192.168.1.20")
    assert not check.allows("localhost", "192.168.1.20")  # localhost only over loopback
    assert not check.allows("0.0.0.0", "192.168.1.20")


def test_origins_pass_only_when_listed_and_alone():
    listed = frozenset({"https://ui.robot.lan"})
    assert origin_allowed([], listed) and origin_allowed(["https://ui.robot.lan"], listed)
    assert not origin_allowed(["https://ui.robot.lan", "https://ui.robot.lan"], listed)
    assert not origin_allowed(["null"], listed) and not origin_allowed(["http://evil.example"], frozenset())


def test_valid_names():
    assert valid_name("go2.lan") and valid_name("10.0.0.7") and valid_name("fe80::1")
    assert not any(valid_name(n) for n in ("", ".", "http://go2.lan", "go2.lan:80", "*", "a b"))


def test_a_new_connection_pushes_out_its_peers_oldest_idle_one():
    a = Admission[str](max_open=8, per_peer=2)
    assert a.admit("a1", "A") == [] and a.admit("a2", "A") == []
    assert a.admit("a3", "A") == ["a1"]  # the oldest that has sent no head
    a.start("a2")  # a2 is answering: not pushed out
    assert a.admit("a4", "A") == ["a3"]
    a.start("a4")
    assert a.admit("a5", "A") is None  # both of A's are answering: refused
    a.done("a2")  # answered: idle again, the newest
    assert a.admit("a5", "A") == ["a2"] and len(a) == 2 and a.count["A"] == 2


def test_over_max_open_the_oldest_idle_of_anyone_goes():
    a = Admission[str](max_open=3, per_peer=3)
    for conn, peer in (("a1", "A"), ("b1", "B"), ("c1", "C")):
        assert a.admit(conn, peer) == []
    a.start("a1")
    assert a.admit("d1", "D") == ["b1"]
    a.start("c1")
    a.start("d1")
    assert a.admit("e1", "E") is None and len(a) == 3
    a.gone("c1")
    a.gone("c1")  # twice: a no-op
    assert a.admit("e1", "E") == [] and a.is_idle("e1") and not a.is_idle("a1")
    with pytest.raises(ValueError):
        Admission[str](max_open=2, per_peer=3)
