"""A fake motor-controller MCU speaking the `serial` frame protocol, and an in-process port pair for it.

What is real and what is not:

- `PipePort.pair()` is NOT pyserial. It is two port-like objects joined by two bounded byte
  queues (A's writes are B's reads and the other way round), because pyserial's "loop://" is one
  port that reads back its own writes and cannot join a host to a separate MCU. It implements
  the part of pyserial's Serial API the host and the MCU use: read(n) (waits up to `timeout`,
  returns what arrived), write(b), in_waiting, timeout, is_open, open(), close(), flush(),
  reset_input_buffer().
- `FakeMcu` runs the MCU side of the protocol on any such port (a PipePort end, or a real pyserial
  port such as one end of a TCP bridge reached with "socket://"; its `timeout` must be small, not
  None). It is what real firmware should do: ACK good frames, NACK a frame whose header is sane but
  whose CRC fails, ignore garbage, latch ESTOP until RESET, report STATUS every `status_s`, and
  zero its motors by itself when no VEL/HEARTBEAT came for `auto_stop_s` (its deadman).
- `fake_link()` wires the two: (serial_factory for SerialController, FakeMcu on the other end).

Test knobs (thread-safe properties): `drop_acks` (do not answer the next n frames, but still act on
them: the ACK is lost on the way back), `corrupt_next` (send the next n ACKs with a broken CRC),
`nack_next` (answer the next n frames with NACK and ignore them, as if their CRC had failed).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from typing import Callable

from .base import Command
from .serial import (
    PROTOCOL_VERSION,
    STATUS_AUTO_STOPPED,
    STATUS_ESTOP,
    STATUS_STRUCT,
    VEL_STRUCT,
    Frame,
    FrameParser,
    FrameType,
    dequantise,
    encode_frame,
)

log = logging.getLogger(__name__)


class PortClosed(OSError):
    """read/write on a closed PipePort (pyserial raises its PortNotOpenError, also an OSError)."""


class _ByteQueue:
    """A bounded byte FIFO; bytes that do not fit are dropped and counted, like a UART overrun."""

    def __init__(self, maxsize: int):
        self.maxsize = maxsize
        self.dropped = 0  # bytes lost to overrun
        self._buf = bytearray()  # <= maxsize bytes
        self._cond = threading.Condition()

    def put(self, data: bytes) -> None:
        with self._cond:
            room = self.maxsize - len(self._buf)
            self._buf += data[:room]
            self.dropped += max(0, len(data) - room)
            self._cond.notify_all()

    def get(self, n: int, timeout: float | None, is_open: Callable[[], bool]) -> bytes:
        """Up to n bytes: returns once n are there, the timeout passed, or the port closed."""
        with self._cond:
            self._cond.wait_for(lambda: len(self._buf) >= n or not is_open(), timeout)
            out = bytes(self._buf[:n])
            del self._buf[:n]
            return out

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def clear(self) -> None:
        with self._cond:
            self._buf.clear()

    def __len__(self) -> int:
        return len(self._buf)


class PipePort:
    """One end of an in-process serial line (see the module docstring: not pyserial)."""

    def __init__(self, rx: _ByteQueue, tx: _ByteQueue, timeout: float | None = 0.01, name: str = "pipe"):
        self._rx, self._tx = rx, tx
        self.timeout = timeout  # seconds read() waits; None waits for all n bytes
        self.name = name
        self.is_open = True

    @classmethod
    def pair(cls, maxsize: int = 4096, timeout: float | None = 0.01) -> tuple["PipePort", "PipePort"]:
        """(host end, mcu end); each direction buffers at most `maxsize` bytes."""
        a_to_b, b_to_a = _ByteQueue(maxsize), _ByteQueue(maxsize)
        return cls(b_to_a, a_to_b, timeout, "pipe:host"), cls(a_to_b, b_to_a, timeout, "pipe:mcu")

    @property
    def in_waiting(self) -> int:
        return len(self._rx)

    @property
    def overruns(self) -> int:
        """Bytes this end lost because its RX buffer was full."""
        return self._rx.dropped

    def read(self, n: int = 1) -> bytes:
        if not self.is_open:
            raise PortClosed(f"{self.name} is closed")
        return self._rx.get(n, self.timeout, lambda: self.is_open)

    def write(self, data: bytes) -> int:
        if not self.is_open:
            raise PortClosed(f"{self.name} is closed")
        self._tx.put(bytes(data))
        return len(data)

    def open(self) -> None:
        self.is_open = True

    def close(self) -> None:
        """Closes this end only; the peer just stops hearing from it (a dead host, a pulled cable)."""
        self.is_open = False
        self._rx.wake()

    def flush(self) -> None:
        pass

    def reset_input_buffer(self) -> None:
        self._rx.clear()


def _knob(name: str) -> property:
    """A lock-guarded int property over one of FakeMcu's fault knobs."""

    def get(self: FakeMcu) -> int:
        with self._lock:
            return self._faults[name]

    def set(self: FakeMcu, n: int) -> None:
        with self._lock:
            self._faults[name] = int(n)

    return property(get, set)


class FakeMcu:
    """The MCU side of the protocol on `port`, in a named daemon thread ("fake-mcu"). See the module docstring."""

    HOST_TYPES = (FrameType.VEL, FrameType.STOP, FrameType.ESTOP, FrameType.RESET, FrameType.HEARTBEAT)

    def __init__(self, port: PipePort, auto_stop_s: float = 0.5, status_s: float | None = 0.1):
        if not auto_stop_s > 0:
            raise ValueError(f"auto_stop_s must be positive, got {auto_stop_s!r}")
        self.port = port
        self.auto_stop_s = auto_stop_s
        self.status_s = status_s  # None: never send STATUS
        self.parser = FrameParser()
        self.log: deque[tuple[float, Frame]] = deque(maxlen=256)  # (monotonic t, frame) received; oldest dropped
        self.counts: Counter = Counter()  # good frames received, by type
        self.acks_sent = self.nacks_sent = 0
        self.auto_stops = 0  # times the deadman fired
        self.auto_stop_t: float | None = None  # monotonic time it last fired
        self.last_alive_t: float | None = None  # last VEL/STOP/HEARTBEAT... that kept it alive
        self.estops = 0
        self._motors = (0, 0, 0)  # mm/s, mm/s, mrad/s
        self._estopped = False
        self._auto_stopped = False
        self._armed = False  # the deadman runs once the host has spoken
        self._faults = {"drop_acks": 0, "corrupt_next": 0, "nack_next": 0}
        self._lock = threading.Lock()
        self._stop_event = threading.Event()
        self._thread: threading.Thread | None = None
        self._seq = 0  # seq of STATUS frames
        self._status_t = 0.0

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> "FakeMcu":
        if self._thread is None:
            self._stop_event.clear()
            self._thread = threading.Thread(target=self._loop, name="fake-mcu", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread (bounded join); the port stays open (the caller owns it)."""
        self._stop_event.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
            self._thread = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    # -- state and knobs -----------------------------------------------------------------------

    @property
    def motors(self) -> Command:
        """The current motor set-point in m/s, m/s, rad/s."""
        with self._lock:
            return dequantise(self._motors)

    @property
    def estopped(self) -> bool:
        return self._estopped

    @property
    def auto_stopped(self) -> bool:
        """True from the deadman firing until the next set-point."""
        return self._auto_stopped

    drop_acks = _knob("drop_acks")
    corrupt_next = _knob("corrupt_next")
    nack_next = _knob("nack_next")

    def _take(self, name: str) -> bool:
        """Use up one of a fault knob's count; True if it was set."""
        with self._lock:
            if self._faults[name] > 0:
                self._faults[name] -= 1
                return True
            return False

    # -- the firmware loop ---------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while not self._stop_event.is_set():
                data = self.port.read(max(1, min(self.port.in_waiting, 4096)))
                if data:
                    frames = self.parser.feed(data)
                    while self.parser.rejected:
                        bad = self.parser.rejected.popleft()
                        if bad.reason == "crc":  # header sane, so its seq is probably right
                            self._reply(FrameType.NACK, bad.seq)
                    for f in frames:
                        self._on_frame(f)
                now = time.monotonic()
                self._deadman(now)
                if self.status_s is not None and now - self._status_t >= self.status_s:
                    self._send_status(now)
        except OSError as e:
            log.info("fake MCU stopped: %s", e)

    def _on_frame(self, f: Frame) -> None:
        now = time.monotonic()
        self.log.append((now, f))
        self.counts[f.type] += 1
        if f.type not in self.HOST_TYPES:
            return  # ACK/STATUS echoes, unknown types: ignored
        if self._take("nack_next"):
            self._reply(FrameType.NACK, f.seq)
            return
        if not self._take("drop_acks"):
            self._reply(FrameType.ACK, f.seq, corrupt=self._take("corrupt_next"))
        with self._lock:
            self.last_alive_t, self._armed, self._auto_stopped = now, True, False
            if f.type == FrameType.VEL:
                if not self._estopped:
                    self._motors = VEL_STRUCT.unpack(f.payload)
            elif f.type == FrameType.STOP:
                self._motors = (0, 0, 0)
            elif f.type == FrameType.ESTOP:
                self._motors, self._estopped = (0, 0, 0), True
                self.estops += 1
            elif f.type == FrameType.RESET:
                self._estopped = False

    def _deadman(self, now: float) -> None:
        """Zero the motors once no host frame came for auto_stop_s; fires once per silence."""
        with self._lock:
            if self._armed and self.last_alive_t is not None and now - self.last_alive_t > self.auto_stop_s:
                self._motors, self._armed, self._auto_stopped = (0, 0, 0), False, True
                self.auto_stops += 1
                self.auto_stop_t = now

    def _reply(self, ftype: FrameType, seq: int, corrupt: bool = False) -> None:
        frame = bytearray(encode_frame(ftype, seq))
        if corrupt:
            frame[-1] ^= 0xFF  # break the CRC
        self.port.write(bytes(frame))
        if ftype == FrameType.ACK:
            self.acks_sent += 1
        else:
            self.nacks_sent += 1

    def _send_status(self, now: float) -> None:
        with self._lock:
            flags = (STATUS_ESTOP if self._estopped else 0) | (STATUS_AUTO_STOPPED if self._auto_stopped else 0)
            payload = STATUS_STRUCT.pack(PROTOCOL_VERSION, *self._motors, flags)
        self.port.write(encode_frame(FrameType.STATUS, self._seq, payload))
        self._seq = (self._seq + 1) & 0xFF
        self._status_t = now


def fake_link(
    auto_stop_s: float = 0.5, status_s: float | None = 0.1, maxsize: int = 4096
) -> tuple[Callable[..., PipePort], FakeMcu]:
    """(serial_factory, mcu): pass the factory to SerialController, start the MCU (`with mcu:`).

    The factory ignores the URL and baud rate and hands out the host end of one PipePort pair,
    reopened and with the controller's read timeout, so a controller can connect again after
    disconnect.
    """
    host, mcu_end = PipePort.pair(maxsize=maxsize)

    def factory(url: str, timeout: float | None = 0.01, **_ignored) -> PipePort:
        host.open()
        host.reset_input_buffer()
        host.timeout = timeout
        return host

    return factory, FakeMcu(mcu_end, auto_stop_s=auto_stop_s, status_s=status_s)
