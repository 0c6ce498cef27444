"""Who may talk to a listener on the robot, whatever library parses its HTTP: the OpenAI endpoint (aiohttp,
agent/app/openai_api.py) and the local API over TCP (websockets, agent/app/api.py).

A web page in a browser on the robot's machine is a hostile peer (DESIGN.md, Trust), and so is another local
user. A page cannot choose its request's `Host`: through DNS rebinding it is the page's own name, so a request
is answered only when its Host names the address the listener was reached on (or a name the operator lists).
A page's request carries an `Origin`: any Origin the operator did not list is refused. Neither depends on a key.

`Admission` decides which connections stay open when many are: at most `max_open` in all and `per_peer` from
one address. A connection counts as *idle* until its request's head has arrived (and again between requests);
a new connection over either bound pushes out the oldest idle one (its peer's own first), so sockets that
never send a byte cannot keep a client that sends its request at once from being answered. Only when every
connection is answering a request is a new one refused. Sans-I/O: the caller closes what it is told to.
"""

from __future__ import annotations

import ipaddress
import re
from collections import Counter, OrderedDict
from collections.abc import Hashable, Iterable
from typing import Generic, TypeVar

LOOPBACK_NAME = "localhost"
# a Host header's value: a name or an IPv4 address, or an IPv6 one in brackets; an optional port. [0-9] and
# not \d: a non-ASCII digit is no digit here.
_HOST = re.compile(r"(\[[0-9a-f:.]+\]|[a-z0-9._-]+)(?::[0-9]{1,5})?", re.IGNORECASE)
_NAME = re.compile(r"[a-z0-9._-]+|[0-9a-f:.]+", re.IGNORECASE)


C = TypeVar("C", bound=Hashable)  # a connection, as the listener names it


def host_name(value: str) -> str | None:
    """A Host header's name: lower case, without its port, brackets or final dot ("[::1]:8080" -> "::1");
    None when the value is not HOST[:PORT]."""
    m = _HOST.fullmatch(value)
    if m is None:
        return None
    return m[1].strip("[]").rstrip(".").lower()


def valid_name(name: str) -> bool:
    """Whether `name` can be listed as an allowed Host: a host name or an IP address, without port or scheme."""
    return bool(_NAME.fullmatch(name)) and name.strip(".") != ""


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        ip = ipaddress.ip_address(text.split("%", 1)[0])  # an IPv6 zone ("fe80::1%eth0") is not compared
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:  # a dual-stack socket's IPv4 peer
        return ip.ipv4_mapped
    return ip


class HostCheck:
    """The Host names one listener answers: the address a connection reached (its socket's own address), the
    address it listens on, "localhost" over loopback, and the names the operator lists."""

    def __init__(self, listen_host: str, listed: Iterable[str] = ()) -> None:
        self.names = frozenset(n.rstrip(".").lower() for n in listed)
        self.listen_ip = _ip(listen_host)
        self.listen_name = listen_host.rstrip(".").lower() if self.listen_ip is None else ""

    def allows(self, host: str | None, local_address: str | None) -> bool:
        """Whether a request whose Host header is `host` (None: it sent none, as HTTP/1.0 allows and no
        browser does) that arrived on the socket address `local_address` is for this listener."""
        if host is None:
            return True
        name = host_name(host)
        if name is None:
            return False
        if name in self.names or (self.listen_name and name == self.listen_name):
            return True
        local = _ip(local_address or "")
        if name == LOOPBACK_NAME:
            return local is not None and local.is_loopback
        ip = _ip(name)
        if ip is None or ip.is_unspecified:
            return False
        return ip == local or ip == self.listen_ip


def origin_allowed(origins: list[str], allowed: frozenset[str]) -> bool:
    """A request with no Origin header (robot processes, SDKs, curl) passes; one with a single Origin the
    operator lists passes; any other (several, `null`, a page's own) is refused."""
    return not origins or (len(origins) == 1 and origins[0] in allowed)


class Admission(Generic[C]):
    """Which connections one listener keeps open (see the module's docstring). Connections are whatever
    hashable objects the caller names them by; peers are their addresses ("" when unknown)."""

    def __init__(self, max_open: int, per_peer: int) -> None:
        if not 1 <= per_peer <= max_open:
            raise ValueError(f"per_peer ({per_peer}) must be 1..max_open ({max_open})")
        self.max_open, self.per_peer = max_open, per_peer
        self.idle: OrderedDict[C, str] = OrderedDict()  # waiting for a request's head, oldest first
        self.busy: dict[C, str] = {}  # answering a request
        self.count: Counter[str] = Counter()  # open connections per peer

    def __len__(self) -> int:
        return len(self.idle) + len(self.busy)

    def admit(self, conn: C, peer: str) -> list[C] | None:
        """Take `conn` from `peer` as idle. Returns the connections to close first to make room (the oldest
        idle of its peer over `per_peer`, the oldest idle of anyone's over `max_open`), already forgotten here;
        or None: there is no room (every connection that would have to go is answering), refuse `conn`."""
        full = self.count[peer] >= self.per_peer or len(self) >= self.max_open
        if not full:
            victim = None
        elif self.count[peer] >= self.per_peer:
            victim = next((c for c, p in self.idle.items() if p == peer), None)
        else:
            victim = next(iter(self.idle), None)
        if full and victim is None:
            return None
        if victim is not None:
            self.gone(victim)
        self.idle[conn] = peer
        self.count[peer] += 1
        return [] if victim is None else [victim]

    def start(self, conn: C) -> None:
        """`conn` has sent a request's head: it is answering, no longer pushed out."""
        peer = self.idle.pop(conn, None)
        if peer is not None:
            self.busy[conn] = peer

    def done(self, conn: C) -> None:
        """`conn` has answered: idle again (the newest), waiting for its next request."""
        peer = self.busy.pop(conn, None)
        if peer is not None:
            self.idle[conn] = peer

    def is_idle(self, conn: C) -> bool:
        return conn in self.idle

    def gone(self, conn: C) -> None:
        """`conn` is closed (or being closed); forgetting an unknown one is a no-op."""
        peer = self.idle.pop(conn, None)
        if peer is None:
            peer = self.busy.pop(conn, None)
        if peer is not None:
            self.count[peer] -= 1
            if self.count[peer] <= 0:
                del self.count[peer]
