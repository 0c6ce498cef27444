"""Unitree Go2 through unitree_sdk2py's SportClient (high-level sport mode over DDS).

    Move(vx, vy, vyaw)  send-and-forget; must be streamed at >= 10 Hz (the control loop
                        streams every tick; config refuses robot.control_hz < 10)
    StopMove()          the normal halt
    Damp()              the soft e-stop: joints go limp, the robot sinks (xr_teleoperate #331)

The SDK is imported only when this driver is chosen, so robots without it (and CI)
never need it; a missing SDK is a clear ControllerError with the install hint.
`ChannelFactoryInitialize` is a per-process singleton: call it once, here.
The robot's own ~1 s auto-stop and our deadman (0.3 s) back each other up.
"""
from __future__ import annotations

import logging

from .base import Command, Controller, ControllerError

log = logging.getLogger(__name__)

INSTALL_HINT = ("unitree_sdk2py is not installed: install it from a pinned commit of "
                "https://github.com/unitreerobotics/unitree_sdk2_python (pip install -e .), with CycloneDDS 0.10.x "
                "built first on a Jetson (CYCLONEDDS_HOME); the PyPI 'unitree-sdk2py' is stale")
_channel_ready = False


class Go2Controller(Controller):
    name = "go2"

    def __init__(self, network_interface: str | None = None, timeout_s: float = 10.0,
                 max_vx: float = 1.0, max_vy: float = 0.6, max_wz: float = 1.5):
        self.network_interface = network_interface
        self.timeout_s = timeout_s
        # well inside the documented sport-mode ranges (vx -2.5..3.8, vy -1..1, vyaw -4..4)
        self.max_vx, self.max_vy, self.max_wz = max_vx, max_vy, max_wz
        self.client = None
        self.errors = 0                 # non-zero return codes from the SDK

    def connect(self) -> None:
        global _channel_ready
        try:
            from unitree_sdk2py.core.channel import ChannelFactoryInitialize
            from unitree_sdk2py.go2.sport.sport_client import SportClient
        except ImportError as e:
            raise ControllerError(f"{INSTALL_HINT} ({e})") from None
        if not _channel_ready:
            if self.network_interface:
                ChannelFactoryInitialize(0, self.network_interface)
            else:
                ChannelFactoryInitialize(0)
            _channel_ready = True
        client = SportClient()
        client.SetTimeout(self.timeout_s)
        client.Init()
        self.client = client
        log.info("go2: sport client up on %s", self.network_interface or "the default interface")

    def disconnect(self) -> None:
        if self.client is not None:
            try:
                self.client.StopMove()
            finally:
                self.client = None

    @property
    def connected(self) -> bool:
        return self.client is not None

    def _need(self):
        if self.client is None:
            raise ControllerError("go2: not connected")
        return self.client

    def send_action(self, cmd: Command) -> Command:
        client = self._need()
        sent = cmd.clamped(self.max_vx, self.max_vy, self.max_wz)
        code = client.Move(sent.vx, sent.vy, sent.wz)
        if code not in (0, None):       # Move is send-and-forget; a code here is a local failure
            self.errors += 1
            log.warning("go2: Move returned %s", code)
        return sent

    def stop(self) -> None:
        code = self._need().StopMove()
        if code not in (0, None):
            self.errors += 1
            raise ControllerError(f"go2: StopMove returned {code}")

    def estop(self) -> None:
        client = self._need()
        code = client.Damp()
        if code not in (0, None):
            self.errors += 1
            log.error("go2: Damp returned %s; trying StopMove", code)
            client.StopMove()
