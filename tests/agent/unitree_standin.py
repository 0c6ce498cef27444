"""A stand-in for unitree_sdk2py (the Go2 is absent here), at the depth the drivers use it.

Like the real SDK, every SportClient call but Move waits for the robot's reply: here on
`StandIn.reply`, an Event the test holds. While it is clear, StopMove, Damp, RecoveryStand
and BalanceStand block as on a robot that does not answer, until the client's timeout
(SetTimeout, 10 s) - or until the test sets it (the fixture does at teardown, so no test
waits the 10 s). The robot's state (`rt/sportmodestate`: mode) follows the calls; its
range finder (`rt/utlidar/range_info`) and front camera (VideoClient: JPEG samples) give
what the test puts in `range_m` and `image`.
"""

from __future__ import annotations

import sys
import threading
import time
import types

import numpy as np

TIMEOUT_CODE = 3104  # the SDK's RPC_ERR_CLIENT_API_TIMEOUT


class StandIn:
    def __init__(self, mode: int = 1, sport: str = "normal"):
        self.calls: list[tuple] = []
        self.reply = threading.Event()  # set: the robot answers at once; clear: calls hang until timeout
        self.reply.set()
        self.mode = mode  # SportModeState_.mode: 1 balance stand, 5 lie down, 7 damping
        self.sport = sport  # the motion switcher's mode name; "" = sport service released
        self.range_m = (5.0, 5.0, 5.0)  # ahead, left, right
        self.image: np.ndarray | None = np.full((48, 64, 3), (0, 0, 200), np.uint8)  # BGR red
        self._handlers: dict[str, list] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._streamer = threading.Thread(target=self._stream, name="standin-dds", daemon=True)

    def _stream(self) -> None:
        while not self._stop.wait(0.02):  # the robot publishes its state far faster; 50 Hz is enough here
            self.publish()

    def close(self) -> None:
        """Answer every hung call and stop publishing (the fixture's teardown)."""
        self.reply.set()
        self._stop.set()
        self._streamer.join(1.0)

    # ---- what the test sees
    def names(self) -> list[str]:
        with self._lock:
            return [c[0] for c in self.calls]

    def publish(self) -> None:
        """Deliver the current state and range once to every subscriber (the robot streams them)."""
        for topic, msg in (
            ("rt/sportmodestate", types.SimpleNamespace(mode=self.mode)),
            (
                "rt/utlidar/range_info",
                types.SimpleNamespace(
                    point=types.SimpleNamespace(x=self.range_m[0], y=self.range_m[1], z=self.range_m[2])
                ),
            ),
        ):
            for handler in list(self._handlers.get(topic, ())):
                handler(msg)

    def _record(self, *call) -> None:
        with self._lock:
            self.calls.append(call)

    # ---- the modules
    def install(self, monkeypatch) -> "StandIn":
        sdk = self

        class Client:
            def __init__(self):
                self.timeout = 1.0

            def SetTimeout(self, t):
                self.timeout = t
                sdk._record("SetTimeout", t)

            def Init(self):
                sdk._record("Init", type(self).__name__)

            def _call(self, name, new_mode=None):
                sdk._record(name)
                if not sdk.reply.wait(self.timeout):
                    return TIMEOUT_CODE
                if new_mode is not None:
                    sdk.mode = new_mode
                    sdk.publish()
                return 0

        class SportClient(Client):
            def Move(self, vx, vy, wz):
                sdk._record("Move", vx, vy, wz)
                return 0

            def StopMove(self):
                return self._call("StopMove")

            def Damp(self):
                return self._call("Damp", 7)

            def RecoveryStand(self):
                return self._call("RecoveryStand", 6)

            def BalanceStand(self):
                return self._call("BalanceStand", 1)

        class MotionSwitcherClient(Client):
            def CheckMode(self):
                sdk._record("CheckMode")
                return 0, {"name": sdk.sport, "form": "0"}

        class VideoClient(Client):
            def GetImageSample(self):
                import cv2

                if sdk.image is None:  # no sample: the request times out
                    time.sleep(min(self.timeout, 0.05))
                    return TIMEOUT_CODE, None
                return 0, list(cv2.imencode(".jpg", sdk.image)[1].tobytes())

        class ChannelSubscriber:
            def __init__(self, topic, typ):
                self.topic = topic

            def Init(self, handler, depth):
                self.handler = handler
                sdk._handlers.setdefault(self.topic, []).append(handler)
                sdk.publish()

            def Close(self):
                sdk._handlers[self.topic].remove(self.handler)

        def module(name, **attrs):
            mod = types.ModuleType(name)
            mod.__dict__.update(attrs)
            monkeypatch.setitem(sys.modules, name, mod)

        for name in (
            "unitree_sdk2py",
            "unitree_sdk2py.core",
            "unitree_sdk2py.go2",
            "unitree_sdk2py.go2.sport",
            "unitree_sdk2py.go2.video",
            "unitree_sdk2py.comm",
            "unitree_sdk2py.comm.motion_switcher",
            "unitree_sdk2py.idl",
            "unitree_sdk2py.idl.unitree_go",
            "unitree_sdk2py.idl.unitree_go.msg",
            "unitree_sdk2py.idl.geometry_msgs",
            "unitree_sdk2py.idl.geometry_msgs.msg",
        ):
            module(name)
        module(
            "unitree_sdk2py.core.channel",
            ChannelSubscriber=ChannelSubscriber,
            ChannelFactoryInitialize=lambda *a: sdk._record("ChannelFactoryInitialize", *a),
        )
        module("unitree_sdk2py.go2.sport.sport_client", SportClient=SportClient)
        module("unitree_sdk2py.go2.video.video_client", VideoClient=VideoClient)
        module("unitree_sdk2py.comm.motion_switcher.motion_switcher_client", MotionSwitcherClient=MotionSwitcherClient)
        module("unitree_sdk2py.idl.unitree_go.msg.dds_", SportModeState_=object)
        module("unitree_sdk2py.idl.geometry_msgs.msg.dds_", PointStamped_=object)
        import agent.robot.controllers.go2 as go2

        monkeypatch.setattr(go2, "_channel_ready", False)
        self._streamer.start()
        return self
