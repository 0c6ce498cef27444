"""sd_notify(3) without libsystemd: tell systemd the daemon is READY, alive (WATCHDOG=1) or STOPPING.

Send WATCHDOG=1 from the control loop itself, once per watchdog_interval_s(), never from a thread of
its own: a timer thread keeps pinging while the loop is hung, and the point of WatchdogSec= is that a
hung loop stops pinging and systemd kills and restarts the service.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

log = logging.getLogger(__name__)


class Notifier:
    """Datagrams to $NOTIFY_SOCKET. Outside systemd (variable unset) every call is a no-op returning False."""

    def __init__(self, env: Mapping[str, str] | None = None):
        env = os.environ if env is None else env
        path = env.get("NOTIFY_SOCKET", "")
        self.address = "\0" + path[1:] if path.startswith("@") else path  # '@': Linux abstract namespace
        self._usec, self._pid = env.get("WATCHDOG_USEC", ""), env.get("WATCHDOG_PID", "")
        self._logged = False

    def notify(self, **fields) -> bool:
        """Send KEY=VALUE lines, e.g. notify(READY=1, STATUS="up"); True when the datagram went out."""
        if not self.address:
            return False
        # A newline inside a value would start a new field: STATUS text is one line.
        msg = "".join(f"{k}={str(v).replace(chr(10), ' ')}\n" for k, v in fields.items())
        try:  # a socket per message, as libsystemd does: nothing to keep open or to reopen after fork
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.sendto(msg.encode(), self.address)
            return True
        except (OSError, ValueError) as e:  # systemd gone, socket full, a bad path: never fatal
            if not self._logged:
                log.debug("sd_notify to %r failed: %s (not logged again)", self.address, e)
                self._logged = True
            return False

    def ready(self) -> bool:
        return self.notify(READY=1)  # after the model, the controller and the camera are up

    def status(self, text: str) -> bool:
        return self.notify(STATUS=text)  # one line shown by `systemctl status`

    def watchdog(self) -> bool:
        return self.notify(WATCHDOG=1)  # from the control loop: see the module docstring

    def stopping(self) -> bool:
        return self.notify(STOPPING=1)

    def reloading(self) -> bool:
        return self.notify(RELOADING=1)

    def watchdog_interval_s(self) -> float | None:
        """Half of $WATCHDOG_USEC in seconds (sd_watchdog_enabled(3)); None when no watchdog is meant for us."""
        try:
            usec = int(self._usec)
            if usec <= 0 or (self._pid and int(self._pid) != os.getpid()):
                return None
        except ValueError:
            return None
        return usec / 2e6
