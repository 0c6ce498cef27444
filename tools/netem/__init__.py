"""Loopback network emulator (delay, jitter, bandwidth, injected disconnects).

See README.md in this folder; ``python -m tools.netem --help`` for the CLI.
"""

from tools.netem.proxy import LinkProfile, NetemProxy

__all__ = ["LinkProfile", "NetemProxy"]
