"""What a peer may hold before it is trusted (DESIGN.md, Trust): pure bookkeeping, no I/O.

* `client_address`: who the client is. The TCP peer, unless that peer is a proxy the operator listed in
  `trusted_proxies`: then the right-most address of its `X-Forwarded-For` that is not itself a trusted
  proxy (HAProxy's `option forwardfor` appends the address it saw, so whatever a client wrote there
  itself is to the left of it and never read); likewise the `for=` of RFC 7239 `Forwarded` (HAProxy's
  `option forwarded`), or `X-Real-IP` (nginx). A trusted proxy's request that names no client in any of
  them is a remote client of unknown address, never loopback: the proxy's own host is not its clients'.
  Headers of two kinds that name different clients are one client of unknown address too (a proxy that
  writes one kind passes a client's forged other kind on). A forwarding header from a peer that is not a
  trusted proxy is ignored for the address, and marks the request as proxied: a same-host proxy nobody
  declared never makes its clients look like loopback.
* `Gate`: connections that have not passed hello, at most `max_total` over all peers, and a share of
  `max_per_address` for each client address. A newcomer over its address's share only borrows room the
  table has free (robots behind one NAT address reconnecting all at once) and is the first to go when a
  newcomer within its own share needs room; with the table full it is refused. A newcomer within its
  share evicts the oldest borrowed connection, else the oldest pending one (silent connections age out
  of the table instead of locking newcomers out: a robot's handshake takes milliseconds). So one address
  never pushes out another's connections within their share, whatever names it claims.
* `LogBudget`: at most `limit` log lines per window; the rest are counted and reported in one line.
"""

from __future__ import annotations

import ipaddress
import re
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Any

FORWARDED_HEADERS = ("X-Forwarded-For", "Forwarded", "X-Real-IP")  # any of them: the peer is a proxy
MAX_FORWARDED = 32  # X-Forwarded-For entries read, from the right: no proxy chain is longer

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_networks(cidrs: Iterable[str]) -> tuple[Network, ...]:
    """["10.0.0.0/8", "127.0.0.1"] -> networks; raises ValueError naming the bad entry."""
    nets: list[Network] = []
    for cidr in cidrs:
        try:
            nets.append(ipaddress.ip_network(str(cidr).strip(), strict=False))
        except ValueError:
            raise ValueError(f"not an address or CIDR: {cidr!r}") from None
    return tuple(nets)


def _ip(text: str) -> IPAddress | None:
    """An address from a peer name or a header entry ("1.2.3.4", "[::1]", "::ffff:1.2.3.4"); None if it is none."""
    text = text.strip().strip('"')
    if text.startswith("[") and "]" in text:
        text = text[1 : text.index("]")]
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return None
    return ip.ipv4_mapped or ip if ip.version == 6 else ip


def peer_ip(remote: Any) -> str:
    """The TCP peer's address from websockets' remote_address ((host, port, ...) or None)."""
    try:
        return str(remote[0])
    except (TypeError, IndexError):
        return ""


def _in(ip: IPAddress | None, networks: Iterable[Network]) -> bool:
    return ip is not None and any(ip.version == n.version and ip in n for n in networks)


@dataclass(frozen=True)
class Client:
    address: str  # the client's address as the server uses it (logs, caps, the loopback rule)
    loopback: bool  # it is this host, and no undeclared proxy stands in between
    via_proxy: bool  # the TCP peer is a trusted proxy

    @property
    def unnamed(self) -> bool:
        """A trusted proxy's request that names no client address (its health check, or a proxy that forwards
        none): the proxy's own host is not its clients', so this is a remote client of unknown address."""
        return self.via_proxy and _ip(self.address) is None


UNKNOWN = "unknown"  # the address of a client a trusted proxy does not name


def rfc7239_for(values: Iterable[str]) -> list[str]:
    """The `for=` of each element of RFC 7239 `Forwarded` header values, in order ("" for an element without
    one): `for=192.0.2.60;proto=http, for="[2001:db8::17]:4711"` -> ["192.0.2.60", "[2001:db8::17]:4711"]."""
    hops = []
    for value in values:
        for element in value.split(",")[-MAX_FORWARDED:]:
            pairs = (pair.partition("=") for pair in element.split(";"))
            hops.append(next((v.strip().strip('"') for k, _, v in pairs if k.strip().lower() == "for"), ""))
    return hops[-MAX_FORWARDED:]


def _strip_port(hop: str) -> str:
    """An RFC 7239 node without its port: "192.0.2.60:4711" -> "192.0.2.60", "[::1]:80" -> "[::1]"."""
    if hop.startswith("["):
        return hop[: hop.index("]") + 1] if "]" in hop else hop
    return hop.rpartition(":")[0] if hop.count(":") == 1 else hop


def _named(hops: list[str], trusted_proxies: Iterable[Network]) -> str | None:
    """The client a chain of hops names (nearest last): the right-most hop no trusted proxy vouches for, else
    the left-most (every hop trusted, as nginx does); None for no hops."""
    hops = [h.strip() for h in hops if h.strip()][-MAX_FORWARDED:]
    if not hops:
        return None
    for hop in reversed(hops):  # nearest first; stop at the first address no trusted proxy vouches for
        client = _ip(hop)
        if client is None or not _in(client, trusted_proxies):
            return hop
    return hops[0]


def client_address(
    peer: str,
    forwarded_for: list[str],
    proxied: bool,
    trusted_proxies: Iterable[Network],
    forwarded: Iterable[str] = (),
    real_ip: Iterable[str] = (),
) -> Client:
    """Who the client is: `peer` is the TCP peer's address, `forwarded_for` the X-Forwarded-For header values
    in order, `proxied` whether the request carries any forwarding header at all, `forwarded` its RFC 7239
    Forwarded values and `real_ip` its X-Real-IP values (read from a trusted proxy only)."""
    ip = _ip(peer)
    if ip is not None and _in(ip, trusted_proxies):
        named = {
            hop
            for hop in (
                _named([h for value in forwarded_for for h in value.split(",")], trusted_proxies),
                _named([_strip_port(h) for h in rfc7239_for(forwarded)], trusted_proxies),
                _named(list(real_ip)[-1:], trusted_proxies),  # one value, set by the proxy: its last
            )
            if hop is not None
        }
        clients = {str(_ip(hop) or hop[:64]) for hop in named}
        if len(clients) != 1:  # none named (the proxy's own request), or two kinds that disagree
            return Client(UNKNOWN, False, True)
        hop = clients.pop()
        client = _ip(hop)
        if client is None:  # something that is not an address ("unknown", "_hidden"): no loopback, its own bucket
            return Client(hop or UNKNOWN, False, True)
        return Client(str(client), client.is_loopback, True)
    if ip is None:
        return Client(peer[:64] or UNKNOWN, False, False)
    return Client(str(ip), ip.is_loopback and not proxied, False)


def address_key(address: str) -> str:
    """What the per-address cap counts: an IPv4 address, or an IPv6 address's /64 (one host's share)."""
    ip = _ip(address)
    if ip is not None and ip.version == 6:
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return address


MAX_ROBOT_NAME = 64  # characters of a robot's name kept in its share's key (the key goes into log lines)
_NOT_NAME = re.compile(r"[^A-Za-z0-9_.:/@+-]")


def share_key(address: str, robot_id: str, hello_client: str) -> str:
    """Whose share of the session table (max_sessions_per_client) an authenticated connection's sessions count
    against: its address (an IPv6 /64) and the robot it says it is, its X-Robot-Id and hello's client. Robots
    behind one NAT address each hold a share of their own. A name is believed only once hello passed the
    token, and only for this: a token holder is the operator's own robot, and what it may claim costs the
    others nothing the whole table's bound (least recently used idle first) does not already allow. Before
    hello nothing a peer says about itself is read: the caps on strangers count its address alone."""
    names = (_NOT_NAME.sub("?", name[:MAX_ROBOT_NAME]) or "-" for name in (robot_id, hello_client))
    return " ".join((address_key(address), *names))


@dataclass
class _Pending:
    since: float
    key: str | None  # counted under this address; None: behind a trusted proxy, known at its request
    borrowed: bool = False  # admitted past its address's share into free room: the first to make room


class Gate:
    """Connections before hello. Every method takes an opaque, hashable connection key."""

    def __init__(self, max_total: int, max_per_address: int, clock: Callable[[], float] = time.monotonic):
        self.max_total = max_total
        self.max_per_address = max_per_address
        self.clock = clock
        self._pending: OrderedDict[Hashable, _Pending] = OrderedDict()  # oldest first
        self._per_address: Counter = Counter()

    def __len__(self) -> int:
        return len(self._pending)

    def __contains__(self, conn: Hashable) -> bool:
        return conn in self._pending

    def held_by(self, address: str) -> int:
        """Pending connections counted under `address`'s share (borrowed ones included)."""
        return self._per_address.get(address_key(address), 0)

    def admit(self, conn: Hashable, address: str | None) -> tuple[bool, list]:
        """A new connection (TCP accepted). `address` None: its client is known only from its request (a
        trusted proxy's connection). Returns (admitted, connections evicted to make room, oldest first):
        refused when its address already holds max_per_address pending connections and the table is full."""
        key = None if address is None else address_key(address)
        over = key is not None and self._per_address[key] >= self.max_per_address
        if over and len(self._pending) >= self.max_total:
            return False, []
        evicted = []
        while len(self._pending) >= self.max_total:  # (never when over: it only borrows free room)
            victim = next((c for c, p in self._pending.items() if p.borrowed), next(iter(self._pending)))
            self.release(victim)
            evicted.append(victim)
        self._pending[conn] = _Pending(self.clock(), key, over)
        if key is not None:
            self._per_address[key] += 1
        return True, evicted

    def identify(self, conn: Hashable, address: str) -> bool:
        """The client of a connection admitted without an address; False when that address is over its share
        and the table is full (the connection stays pending until it closes)."""
        pending = self._pending.get(conn)
        if pending is None or pending.key is not None:
            return True
        key = address_key(address)
        if self._per_address[key] >= self.max_per_address:
            if len(self._pending) >= self.max_total:
                return False
            pending.borrowed = True
        pending.key = key
        self._per_address[key] += 1
        return True

    def release(self, conn: Hashable) -> None:
        """It passed hello, was exempted or closed; idempotent."""
        pending = self._pending.pop(conn, None)
        if pending is not None and pending.key is not None:
            self._per_address[pending.key] -= 1
            if not self._per_address[pending.key]:
                del self._per_address[pending.key]


class LogBudget:
    """At most `limit` lines per `window_s`; lines over it are counted, and reported once the window turns."""

    def __init__(self, limit: int, window_s: float = 10.0, clock: Callable[[], float] = time.monotonic, name: str = ""):
        self.limit, self.window_s, self.clock, self.name = limit, window_s, clock, name  # name: whose lines
        self._start = clock()
        self._used = 0
        self.suppressed = 0  # in the current window, not reported yet

    def take(self) -> tuple[bool, int]:
        """(may this line be logged, lines suppressed in the window just ended: report them first)."""
        now = self.clock()
        ended = 0
        if now - self._start >= self.window_s:
            ended, self.suppressed = self.suppressed, 0
            self._start, self._used = now, 0
        if self._used < self.limit:
            self._used += 1
            return True, ended
        self.suppressed += 1
        return False, ended

    def flush(self) -> int:
        """Lines suppressed and not reported yet (at the connection's end)."""
        n, self.suppressed = self.suppressed, 0
        return n
