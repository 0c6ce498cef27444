"""Loopback network emulator (delay, jitter, bandwidth, injected disconnects).

See README.md in this folder; ``python -m tools.cluster.netem --help`` for the CLI.
"""

from tools.cluster.netem.proxy import LinkProfile, NetemProxy

__all__ = ["LinkProfile", "NetemProxy"]
