"""A motor controller (MCU) on a serial line: binary frames, CRC, acks, periodic re-send.

Wire format (protocol version 1), one frame:

    offset  size  field     notes
    ------  ----  --------  ------------------------------------------------------------
    0       2     sync      0xAA 0x55
    2       1     type      FrameType below
    3       1     seq       u8, wraps 255 -> 0; ACK/NACK carry the seq they answer
    4       1     len       payload length; must equal the type's fixed length (PAYLOAD_LEN)
    5       len   payload   little-endian struct, by type (below)
    5+len   2     crc       CRC-16/CCITT-FALSE over type..payload (bytes 2..5+len-1), u16 LE

    type           dir        payload          meaning                                     acked
    -------------  ---------  ---------------  ------------------------------------------  -------------
    0x01 VEL       host->MCU  <hhh  vx vy wz   set-point: vx, vy in mm/s, wz in mrad/s    streamed*
    0x02 STOP      host->MCU  -                zero the motors (normal halt)              waited, retried
    0x03 ESTOP     host->MCU  -                zero the motors and latch the e-stop       waited, retried
    0x04 RESET     host->MCU  -                release the e-stop latch                   waited, retried
    0x05 HEARTBEAT host->MCU  -                "host alive" without a new set-point       streamed*
    0x10 ACK       MCU->host  -                frame `seq` was received with a good CRC   -
    0x11 NACK      MCU->host  -                frame `seq` had a good header, bad CRC     -
    0x20 STATUS    MCU->host  <BhhhB           version, vx vy wz (mm/s, mrad/s), flags    no
                                               (bit0 e-stop latched, bit1 auto-stopped)

    A frame of any other type, or with another length than its type's, is dropped as a bad frame.

    * streamed: the MCU acks them, the host counts the acks (`acked`, `missed_acks`) but never
      waits: a lost set-point is replaced by the next periodic re-send within `resend_s`.

The host re-sends the current set-point every `resend_s` (default 0.1 s) whether or not it changed,
so the MCU's own auto-stop (no frame from the host for its window, e.g. 0.5 s; hoverboard-firmware and
ros_arduino_bridge do the same) fires only when the host is gone, never while it is merely idle.
STOP, ESTOP and RESET change state, so they are sent with a sequence number and the caller waits for
the ACK, re-sending the same frame (same seq) up to `max_retries` times on timeout or NACK.

`SerialController` opens its port with `serial.serial_for_url`, so the same code drives
"/dev/ttyUSB0", "socket://host:port" (a TCP serial bridge) and "loop://" (pyserial's loopback:
the host reads back its own frames and nothing ever acks them; good for the wire, not the MCU).
A fake MCU that really answers lives in `agent.robot.controllers.fake_mcu`.
"""

from __future__ import annotations

import logging
import math
import struct
import threading
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass
from enum import IntEnum
from typing import Callable, Protocol

from .base import Command, Controller, ControllerError

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
SYNC = b"\xaa\x55"
HEADER_LEN = 5  # sync(2) type seq len
CRC_LEN = 2
MAX_PAYLOAD = 32  # bytes; a header claiming more is garbage
MAX_FRAME = HEADER_LEN + MAX_PAYLOAD + CRC_LEN


class FrameType(IntEnum):
    VEL = 0x01
    STOP = 0x02
    ESTOP = 0x03
    RESET = 0x04
    HEARTBEAT = 0x05
    ACK = 0x10
    NACK = 0x11
    STATUS = 0x20


VEL_STRUCT = struct.Struct("<hhh")  # vx mm/s, vy mm/s, wz mrad/s
STATUS_STRUCT = struct.Struct("<BhhhB")  # version, vx mm/s, vy mm/s, wz mrad/s, flags
STATUS_ESTOP, STATUS_AUTO_STOPPED = 0x01, 0x02

# The payload length each type must have. The parser rejects any other type or length: with only
# these eight headers valid, a false sync word in line noise rarely survives the header check, and
# one that does holds real frames back for at most the longest frame (14 bytes), not MAX_FRAME.
PAYLOAD_LEN: dict[int, int] = {  # payload bytes by frame type (FrameType keys)
    FrameType.VEL: VEL_STRUCT.size,
    FrameType.STATUS: STATUS_STRUCT.size,
    **{
        t: 0
        for t in (FrameType.STOP, FrameType.ESTOP, FrameType.RESET, FrameType.HEARTBEAT, FrameType.ACK, FrameType.NACK)
    },
}

INT16_MAX = 32767  # the largest |vx| in mm/s a VEL payload can carry (32.767 m/s)


# ---------------------------------------------------------------------------------------------
# Pure protocol functions
# ---------------------------------------------------------------------------------------------


def _crc_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else (crc << 1)
        table.append(crc & 0xFFFF)
    return table


_CRC_TABLE = _crc_table()


def crc16_ccitt(data: bytes, crc: int = 0xFFFF) -> int:
    """CRC-16/CCITT-FALSE: poly 0x1021, init 0xFFFF, MSB first, no reflection, no final xor.

    crc = (crc << 8) ^ T[(crc >> 8) ^ byte] per byte; check value crc16_ccitt(b"123456789") == 0x29B1.
    """
    for b in data:
        crc = ((crc << 8) & 0xFFFF) ^ _CRC_TABLE[(crc >> 8) ^ b]
    return crc


@dataclass(frozen=True)
class Frame:
    """One decoded frame (its CRC already checked)."""

    type: int  # a FrameType value; an unknown type stays a plain int
    seq: int  # 0..255; for ACK/NACK the seq of the frame answered
    payload: bytes = b""  # 0..MAX_PAYLOAD bytes, layout by type (module docstring)

    @classmethod
    def make_dummy(cls) -> "Frame":
        return cls(FrameType.VEL, 7, VEL_STRUCT.pack(250, 0, -100))


def encode_frame(ftype: int, seq: int, payload: bytes = b"") -> bytes:
    """sync | type | seq | len | payload | crc16(type..payload) LE. Raises ValueError on out-of-range fields."""
    if not 0 <= ftype <= 0xFF or not 0 <= seq <= 0xFF:
        raise ValueError(f"type and seq must be u8, got type={ftype!r} seq={seq!r}")
    if len(payload) > MAX_PAYLOAD:
        raise ValueError(f"payload of {len(payload)} bytes exceeds MAX_PAYLOAD={MAX_PAYLOAD}")
    body = bytes((ftype, seq, len(payload))) + bytes(payload)
    return SYNC + body + struct.pack("<H", crc16_ccitt(body))


def quantise(cmd: Command, max_vx: float, max_vy: float, max_wz: float) -> tuple[int, int, int]:
    """Clamp each axis to +-max, then round to the wire's units: (mm/s, mm/s, mrad/s).

    q = round(1000 * clamp(v, -max, max)) (round half to even); a non-finite axis zeroes the whole
    command (a NaN is a fault, not a speed), as in safety.clamp.
    """
    if not all(math.isfinite(v) for v in (cmd.vx, cmd.vy, cmd.wz)):
        return (0, 0, 0)
    q = lambda v, m: int(round(1000.0 * max(-m, min(m, v))))  # noqa: E731
    return (q(cmd.vx, max_vx), q(cmd.vy, max_vy), q(cmd.wz, max_wz))


def dequantise(q: tuple[int, int, int]) -> Command:
    """(mm/s, mm/s, mrad/s) -> Command in m/s, m/s, rad/s."""
    return Command(q[0] / 1000.0, q[1] / 1000.0, q[2] / 1000.0)


def encode_vel(seq: int, q: tuple[int, int, int]) -> bytes:
    return encode_frame(FrameType.VEL, seq, VEL_STRUCT.pack(*q))


def _as_type(t: int) -> int:
    try:
        return FrameType(t)
    except ValueError:
        return t


@dataclass(frozen=True)
class Rejected:
    """A frame the parser dropped; `type`/`seq` come from an unverified header (trust them only for a NACK)."""

    type: int
    seq: int
    reason: str  # "crc" (header fine, CRC wrong), "len" or "type" (impossible header)


class FrameParser:
    """Streaming decoder: feed any chunks of bytes, get whole frames with good CRCs back.

    Resynchronisation: bytes before a sync word are skipped (`skipped_bytes`); a header with a type
    not in `lengths` (`bad_type`) or a length wrong for its type (`bad_len`), and a frame whose CRC
    fails (`bad_crc`), are dropped by discarding their sync word only, so a real frame starting
    inside them is still found. Memory is bounded: input is consumed in CHUNK-byte slices and the
    buffer keeps under one MAX_FRAME of leftover between slices; `rejected` keeps the last 32
    dropped headers (older ones fall off). A partial frame waits for more bytes, so a false header
    that passes the checks holds the real frames behind it until its claimed length has arrived
    (the CRC then rejects it): at most the longest frame, 14 bytes with the default `lengths`.
    `lengths` (type -> payload length, default PAYLOAD_LEN) is the one place to add a frame type.
    """

    CHUNK = 256

    def __init__(self, lengths: dict[int, int] | None = None):
        self.lengths: dict[int, int] = dict(PAYLOAD_LEN if lengths is None else lengths)
        if any(not 0 <= n <= MAX_PAYLOAD for n in self.lengths.values()):
            raise ValueError(f"payload lengths must be 0..{MAX_PAYLOAD}, got {self.lengths}")
        self._buf = bytearray()  # < MAX_FRAME + CHUNK bytes
        self.frames = 0  # good frames returned
        self.bad_crc = 0
        self.bad_len = 0
        self.bad_type = 0
        self.skipped_bytes = 0  # bytes outside any frame (garbage, line noise)
        self.rejected: deque[Rejected] = deque(maxlen=32)

    @property
    def bad_frames(self) -> int:
        return self.bad_crc + self.bad_len + self.bad_type

    def feed(self, data: bytes) -> list[Frame]:
        out: list[Frame] = []
        for i in range(0, len(data), self.CHUNK):
            self._buf += data[i : i + self.CHUNK]
            self._drain(out)
        return out

    def _drain(self, out: list[Frame]) -> None:
        buf = self._buf
        while True:
            start = buf.find(SYNC)
            if start < 0:
                keep = 1 if buf[-1:] == SYNC[:1] else 0  # a lone 0xAA may be half a sync word
                self.skipped_bytes += len(buf) - keep
                del buf[: len(buf) - keep]
                return
            if start:
                self.skipped_bytes += start
                del buf[:start]
            if len(buf) < HEADER_LEN:
                return
            ftype, seq, n = buf[2], buf[3], buf[4]
            want = self.lengths.get(ftype)
            if want is None or want != n:
                if want is None:
                    self.bad_type += 1
                else:
                    self.bad_len += 1
                self.rejected.append(Rejected(ftype, seq, "type" if want is None else "len"))
                del buf[:2]
                continue
            end = HEADER_LEN + n + CRC_LEN
            if len(buf) < end:
                return
            (crc,) = struct.unpack_from("<H", buf, end - CRC_LEN)
            if crc != crc16_ccitt(bytes(buf[2 : end - CRC_LEN])):
                self.bad_crc += 1
                self.rejected.append(Rejected(ftype, seq, "crc"))
                del buf[:2]
                continue
            out.append(Frame(_as_type(ftype), seq, bytes(buf[HEADER_LEN : end - CRC_LEN])))
            self.frames += 1
            del buf[:end]


# ---------------------------------------------------------------------------------------------
# The controller
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class McuStatus:
    """The MCU's last STATUS frame, decoded."""

    version: int  # the MCU's PROTOCOL_VERSION
    motors: Command  # its current set-point, m/s and rad/s
    estopped: bool
    auto_stopped: bool  # its deadman fired since the last set-point
    t: float  # time.monotonic() when it arrived


class SerialPort(Protocol):
    """What the controller needs of a port: pyserial's Serial, or fake_mcu.PipePort in the tests."""

    @property
    def in_waiting(self) -> int: ...  # bytes ready to read

    def read(self, size: int = 1, /) -> bytes: ...

    def write(self, data: bytes, /) -> int | None: ...

    def close(self) -> None: ...


class SerialController(Controller):
    """A velocity controller behind a serial MCU speaking the frame protocol above.

    Threads: one named daemon thread ("serial-io:<port>") reads and parses incoming frames,
    matches ACK/NACK to what was sent, expires unanswered set-points (`missed_acks`) and re-sends
    the current set-point whenever `resend_s` passed without one. Callers' writes and the thread's
    re-sends share one lock, so frames never interleave on the wire.

    Counters (ints, read any time): `sent` frames written (re-sends and retries included), `acked`,
    `nacks`, `missed_acks` (no ACK within `ack_timeout_s`), `late_acks` (ACK after that), `resends`
    (periodic set-point re-sends), `retries` (STOP/ESTOP/RESET re-sent), `failed` (never acked:
    ControllerError raised), `bad_frames` (parser: bad CRC, length or type). `rx` counts good frames by type.

    `serial_factory(port, baudrate=, timeout=, write_timeout=)` replaces `serial.serial_for_url`
    (tests pass a `fake_mcu.PipePort`); it must return an object with read(n), write(b),
    in_waiting, close().
    """

    name = "serial"
    PENDING_MAX = 64  # set-points awaiting an ACK; the oldest is dropped (a miss) past this

    def __init__(
        self,
        port: str = "loop://",
        baudrate: int = 115200,
        resend_s: float = 0.1,
        ack_timeout_s: float = 0.05,
        max_retries: int = 3,
        max_vx: float = 1.0,
        max_vy: float = 0.5,
        max_wz: float = 1.5,
        serial_factory: Callable[..., SerialPort] | None = None,
    ):
        for name, v in (
            ("resend_s", resend_s),
            ("ack_timeout_s", ack_timeout_s),
            ("max_vx", max_vx),
            ("max_vy", max_vy),
            ("max_wz", max_wz),
        ):
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a positive number, got {v!r}")
        if max(max_vx, max_vy, max_wz) * 1000 > INT16_MAX:
            raise ValueError(f"limits over {INT16_MAX / 1000} (m/s or rad/s) do not fit the int16 payload")
        if not (isinstance(max_retries, int) and max_retries >= 0):
            raise ValueError(f"max_retries must be an int >= 0, got {max_retries!r}")
        self.port, self.baudrate = port, baudrate
        self.resend_s, self.ack_timeout_s, self.max_retries = resend_s, ack_timeout_s, max_retries
        self.max_vx, self.max_vy, self.max_wz = max_vx, max_vy, max_wz
        self.serial_factory = serial_factory

        self._port: SerialPort | None = None
        self._thread: threading.Thread | None = None
        self._stop_event = threading.Event()
        self._life_lock = threading.Lock()  # connect / disconnect
        self._write_lock = threading.Lock()  # port writes, seq, set-point
        self._cond = threading.Condition()  # pending, waiters, counters, status
        self._parser = FrameParser()  # used by the io thread only
        self._seq = 0
        self._setpoint = (0, 0, 0)  # mm/s, mm/s, mrad/s: what the re-send repeats
        self._setpoint_t = 0.0  # monotonic time of the last VEL written
        self._pending: OrderedDict[int, float] = OrderedDict()  # seq -> sent at, streamed VEL only
        self._waiters: dict[int, str | None] = {}  # seq -> None (waiting), "ack" or "nack"
        self._status: McuStatus | None = None
        self.estopped = False  # latched by estop(), released by clear_estop()
        self.error: BaseException | None = None  # what ended the io thread, if anything
        self.sent = self.acked = self.nacks = self.missed_acks = self.late_acks = 0
        self.resends = self.retries = self.failed = 0
        self.rx: Counter = Counter()  # good frames received, by type

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        return self._port is not None and self._thread is not None and self._thread.is_alive()

    @property
    def bad_frames(self) -> int:
        return self._parser.bad_frames

    def connect(self) -> None:
        with self._life_lock:
            if self._port is not None:
                return
            self._port = self._open()
            self._parser = FrameParser()
            self._stop_event.clear()
            self.error = None
            self._setpoint, self._setpoint_t = (0, 0, 0), 0.0  # announce ourselves at once
            self._thread = threading.Thread(target=self._io_loop, name=f"serial-io:{self.port}", daemon=True)
            self._thread.start()

    def disconnect(self, stop_motion: bool = True) -> None:
        """Send STOP (best effort), stop the io thread (bounded join), close the port; safe twice.

        stop_motion=False skips the STOP: the MCU then only stops by its own auto-stop, exactly as
        when the host process dies (tests use it to simulate that).
        """
        with self._life_lock:
            if self._port is None:
                return
            if stop_motion and self.connected:
                try:
                    self.stop()
                except ControllerError as e:
                    log.warning("serial %s: STOP on disconnect not acknowledged: %s", self.port, e)
            self._stop_event.set()
            if self._thread is not None:
                self._thread.join(timeout=1.0)
                if self._thread.is_alive():
                    log.warning("serial %s: io thread did not stop within 1 s", self.port)
            try:
                self._port.close()
            except OSError as e:
                log.warning("serial %s: close failed: %s", self.port, e)
            self._port, self._thread = None, None

    def _open(self) -> SerialPort:
        read_timeout = min(0.01, self.resend_s / 4)  # the io loop's tick: bounds re-send jitter
        kw = dict(baudrate=self.baudrate, timeout=read_timeout, write_timeout=0.5)
        if self.serial_factory is not None:
            return self.serial_factory(self.port, **kw)
        try:
            import serial  # pyserial; the top-level package, not this module
        except ImportError as e:
            raise ControllerError("the serial controller needs pyserial: pip install pyserial") from e
        try:
            return serial.serial_for_url(self.port, **kw)
        except (serial.SerialException, ValueError) as e:
            raise ControllerError(f"cannot open serial port {self.port!r}: {e}") from e

    # -- commands ----------------------------------------------------------------------------

    def send_action(self, cmd: Command) -> Command:
        """Clamp to the driver's limits, quantise to mm/s and mrad/s, stream one VEL; returns what was sent.

        While the e-stop is latched (estop() until clear_estop()) the set-point stays zero.
        """
        self._require_connected()
        q = (0, 0, 0) if self.estopped else quantise(cmd, self.max_vx, self.max_vy, self.max_wz)
        with self._write_lock:
            self._setpoint = q
            self._send_setpoint(resend=False)
        return dequantise(q)

    def stop(self) -> None:
        """Zero the set-point (so re-sends stream zero), then STOP and wait for its ACK."""
        self._require_connected()
        with self._write_lock:
            self._setpoint = (0, 0, 0)
        self._request(FrameType.STOP)

    def estop(self) -> None:
        """Zero and latch: ESTOP with ACK wait; later set-points are zero until clear_estop()."""
        self._require_connected()
        with self._write_lock:
            self.estopped = True
            self._setpoint = (0, 0, 0)
        self._request(FrameType.ESTOP)

    def clear_estop(self) -> None:
        """Release the e-stop latch here and on the MCU (RESET, acked)."""
        self._require_connected()
        self._request(FrameType.RESET)
        self.estopped = False

    def reset(self) -> None:
        """The Controller interface's name for clear_estop (SafetyLayer.reset calls it)."""
        self.clear_estop()

    def read_status(self, max_age_s: float = 0.5) -> McuStatus:
        """The MCU's latest STATUS; raises ControllerError if none came or it is older than max_age_s."""
        with self._cond:
            st = self._status
        if st is None or time.monotonic() - st.t > max_age_s:
            raise ControllerError(f"no MCU status within {max_age_s} s on {self.port}")
        return st

    def stats(self) -> dict:
        with self._cond:
            return {
                k: getattr(self, k)
                for k in (
                    "sent",
                    "acked",
                    "nacks",
                    "missed_acks",
                    "late_acks",
                    "resends",
                    "retries",
                    "failed",
                    "bad_frames",
                )
            }

    # -- internals ---------------------------------------------------------------------------

    def _require_connected(self) -> None:
        if not self.connected:
            why = f" (io thread ended: {self.error})" if self.error else ""
            raise ControllerError(f"serial controller on {self.port!r} is not connected{why}")

    def _next_seq(self) -> int:
        seq, self._seq = self._seq, (self._seq + 1) & 0xFF
        return seq

    def _write(self, frame: bytes) -> None:
        """Callers hold _write_lock."""
        port = self._port
        try:
            if port is None:
                raise OSError("the port is closed")
            port.write(frame)
        except (OSError, AttributeError) as e:  # SerialException is an OSError; AttributeError: a port gone
            raise ControllerError(f"write to {self.port!r} failed: {e}") from e
        with self._cond:
            self.sent += 1

    def _send_setpoint(self, resend: bool) -> None:
        """Write VEL(current set-point) with a fresh seq and track its ACK. Callers hold _write_lock."""
        seq = self._next_seq()
        now = time.monotonic()
        with self._cond:
            if len(self._pending) >= self.PENDING_MAX:
                self._pending.popitem(last=False)
                self.missed_acks += 1
            self._pending[seq] = now
            if resend:
                self.resends += 1
        self._setpoint_t = now
        self._write(encode_vel(seq, self._setpoint))

    def _request(self, ftype: FrameType) -> None:
        """Send a state-changing frame and wait for its ACK; same seq on each of 1 + max_retries tries."""
        with self._write_lock:
            seq = self._next_seq()
        frame = encode_frame(ftype, seq)
        for attempt in range(self.max_retries + 1):
            with self._cond:
                self._waiters[seq] = None
                if attempt:
                    self.retries += 1
            with self._write_lock:
                self._write(frame)
            with self._cond:
                self._cond.wait_for(
                    lambda: self._waiters[seq] is not None or not self.connected, timeout=self.ack_timeout_s
                )
                answer = self._waiters.pop(seq)
                if answer == "ack":
                    return
                if answer is None:
                    self.missed_acks += 1
            if not self.connected:
                break
        with self._cond:
            self.failed += 1
        raise ControllerError(
            f"{ftype.name} seq {seq} not acknowledged by the MCU on {self.port!r} after {attempt + 1} tries"
        )

    def _io_loop(self) -> None:
        port, parser = self._port, self._parser
        if port is None:  # connect() opens the port before it starts this thread
            return
        try:
            while not self._stop_event.is_set():
                data = port.read(max(1, min(port.in_waiting, 4096)))  # blocks <= the read timeout
                if data:
                    for frame in parser.feed(data):
                        self._on_frame(frame)
                now = time.monotonic()
                self._expire(now)
                if now - self._setpoint_t >= self.resend_s:
                    with self._write_lock:
                        if not self._stop_event.is_set():
                            self._send_setpoint(resend=True)
        except (OSError, ControllerError) as e:  # port unplugged or closed under us
            self.error = e
            log.error("serial %s: io thread stopped: %s", self.port, e)
        except Exception as e:  # a bug: still end visibly (connected -> False)
            self.error = e
            log.exception("serial %s: io thread crashed", self.port)
        finally:
            with self._cond:
                self._cond.notify_all()  # wake any _request waiting on an ACK

    def _on_frame(self, f: Frame) -> None:
        with self._cond:
            self.rx[f.type] += 1
            if f.type in (FrameType.ACK, FrameType.NACK):
                ok = f.type == FrameType.ACK
                if not ok:
                    self.nacks += 1  # a streamed set-point NACKed is replaced by the next re-send
                if self._waiters.get(f.seq, "") is None:
                    self._waiters[f.seq] = "ack" if ok else "nack"
                    self._cond.notify_all()
                elif self._pending.pop(f.seq, None) is None:
                    self.late_acks += ok  # answered after ack_timeout_s (already a miss), or a duplicate
                    return
                self.acked += ok
            elif f.type == FrameType.STATUS:
                ver, vx, vy, wz, flags = STATUS_STRUCT.unpack(f.payload)
                self._status = McuStatus(
                    ver,
                    dequantise((vx, vy, wz)),
                    bool(flags & STATUS_ESTOP),
                    bool(flags & STATUS_AUTO_STOPPED),
                    time.monotonic(),
                )
            # anything else (our own frames echoed back by loop://) is only counted in rx

    def _expire(self, now: float) -> None:
        """Streamed set-points unanswered for ack_timeout_s become missed_acks (oldest first)."""
        with self._cond:
            while self._pending:
                seq, t = next(iter(self._pending.items()))
                if now - t <= self.ack_timeout_s:
                    break
                del self._pending[seq]
                self.missed_acks += 1
