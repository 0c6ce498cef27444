"""The serial motor-controller driver: framing, resync, clamping, re-send vs the MCU deadman, acks and retries.

Which link each test uses, honestly:
- pyserial's real "loop://" (one port reading back its own writes): the frame round trip, and the
  controller's own frames echoed back to it (nothing acks them there);
- pyserial's real "socket://" on both ends, joined by a TCP relay: the whole protocol host <-> FakeMcu;
- fake_mcu.PipePort (in-process, not pyserial): everything that needs timing or fault knobs.
"""

from __future__ import annotations

import random
import socket
import threading
import time

import pytest
import serial

from agent.robot.controllers import ControllerError, make_controller
from agent.robot.controllers.base import Command
from agent.robot.controllers.fake_mcu import FakeMcu, PipePort, fake_link
from agent.robot.controllers.serial import (
    MAX_FRAME,
    MAX_PAYLOAD,
    STATUS_STRUCT,
    SYNC,
    VEL_STRUCT,
    Frame,
    FrameParser,
    FrameType,
    SerialController,
    crc16_ccitt,
    encode_frame,
)
from agent.robot.safety import SafetyLayer, SafetyLimits


def wait_until(pred, timeout=1.0, step=0.005) -> bool:
    """Poll pred until true; a ControllerError (e.g. no MCU status yet) counts as false."""

    def holds():
        try:
            return pred()
        except ControllerError:
            return False

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if holds():
            return True
        time.sleep(step)
    return holds()


@pytest.fixture
def link():
    """link(auto_stop_s=, status_s=, **controller options) -> (connected SerialController, running FakeMcu)."""
    opened = []

    def make(auto_stop_s=0.5, status_s=None, **options):
        factory, mcu = fake_link(auto_stop_s=auto_stop_s, status_s=status_s)
        mcu.start()
        options = {"resend_s": 0.05, "ack_timeout_s": 0.05, **options}
        ctl = SerialController(port="pipe://test", serial_factory=factory, **options)
        ctl.connect()
        opened.append((ctl, mcu))
        return ctl, mcu

    yield make
    for ctl, mcu in opened:
        ctl.disconnect(stop_motion=False)
        mcu.stop()


def settled(ctl):
    """Wait for the connect-time set-point to be acked, so later fault knobs hit the frame under test."""
    assert wait_until(lambda: ctl.acked >= 1)


# --- framing ---------------------------------------------------------------------------------


def test_crc_is_ccitt_false():
    assert crc16_ccitt(b"123456789") == 0x29B1  # the catalogue check value
    frame = encode_frame(FrameType.STOP, 9)
    assert frame[:2] == SYNC and frame[2:5] == bytes((FrameType.STOP, 9, 0))
    assert int.from_bytes(frame[-2:], "little") == crc16_ccitt(frame[2:-2])


def test_round_trip_through_real_loop_port():
    frames = [
        Frame.make_dummy(),
        Frame(FrameType.STOP, 255),
        Frame(FrameType.ACK, 0),
        Frame(FrameType.STATUS, 3, STATUS_STRUCT.pack(1, -32768, 32767, 0, 3)),
    ]
    port = serial.serial_for_url("loop://", timeout=0.05)
    try:
        port.write(b"".join(encode_frame(f.type, f.seq, f.payload) for f in frames))
        parser, got = FrameParser(), []
        while len(got) < len(frames):
            chunk = port.read(7)  # odd-sized reads split frames anywhere
            assert chunk, "loop:// returned nothing"
            got += parser.feed(chunk)
    finally:
        port.close()
    assert got == frames
    assert parser.bad_frames == 0 and parser.skipped_bytes == 0


@pytest.mark.parametrize("piece", [1, 3, 1000])
def test_parser_resyncs_after_garbage_and_corruption(piece):
    good1 = encode_frame(FrameType.VEL, 1, VEL_STRUCT.pack(100, 0, 0))
    bad_crc = bytearray(encode_frame(FrameType.VEL, 2, VEL_STRUCT.pack(200, 0, 0)))
    bad_crc[7] ^= 0x40  # a payload bit flipped on the line
    bad_len = SYNC + bytes((FrameType.VEL, 3, 200))  # claims 200 payload bytes
    good2 = encode_frame(FrameType.STOP, 4)
    stream = b"\x00\xaa\x13garbage\xaa" + good1 + bytes(bad_crc) + bad_len + b"\x55\xaa" + good2 + b"\xaa"
    parser, got = FrameParser(), []
    for i in range(0, len(stream), piece):
        got += parser.feed(stream[i : i + piece])
    assert [(f.type, f.seq) for f in got] == [(FrameType.VEL, 1), (FrameType.STOP, 4)]
    assert VEL_STRUCT.unpack(got[0].payload) == (100, 0, 0)
    assert (parser.bad_crc, parser.bad_len) == (1, 1)
    assert [(r.seq, r.reason) for r in parser.rejected] == [(2, "crc"), (3, "len")]


def test_parser_rejects_unknown_types_unless_declared():
    odd = encode_frame(0x7E, 42, bytes(range(MAX_PAYLOAD)))
    strict = FrameParser()
    assert strict.feed(odd + encode_frame(FrameType.STOP, 1)) == [Frame(FrameType.STOP, 1)]
    assert strict.bad_type == 1 and strict.bad_frames == 1
    extended = FrameParser(lengths={0x7E: MAX_PAYLOAD})
    assert extended.feed(odd) == [Frame(0x7E, 42, bytes(range(MAX_PAYLOAD)))]


def test_parser_finds_every_frame_in_random_noise():
    rng = random.Random(0)
    frames = [Frame(FrameType.VEL, i % 256, VEL_STRUCT.pack(rng.randint(-1000, 1000), 0, i)) for i in range(300)]
    stream = bytearray()
    for f in frames:
        stream += bytes(rng.randrange(256) for _ in range(rng.randrange(12)))
        if rng.random() < 0.2:
            stream += SYNC + bytes(rng.randrange(256) for _ in range(3))  # false sync words too
        stream += encode_frame(f.type, f.seq, f.payload)
    stream += bytes(MAX_FRAME)  # flush any false header still waiting
    parser, got, i = FrameParser(), [], 0
    while i < len(stream):
        n = rng.randint(1, 64)
        got += parser.feed(bytes(stream[i : i + n]))
        i += n
    assert got == frames


def test_parser_memory_stays_bounded():
    parser = FrameParser()
    junk = (SYNC + bytes((FrameType.STATUS, 0, STATUS_STRUCT.size)) + b"\x01" * 20) * 50_000  # ~1.4 MB
    assert parser.feed(junk) == []
    assert len(parser._buf) < MAX_FRAME + FrameParser.CHUNK
    assert parser.bad_crc > 0 and len(parser.rejected) == parser.rejected.maxlen


# --- the controller against the fake MCU -------------------------------------------------------


def test_send_action_clamps_and_quantises(link):
    ctl, mcu = link()
    sent = ctl.send_action(Command(5.0, -5.0, 0.12345))  # limits 1.0, 0.5, 1.5
    assert sent == Command(1.0, -0.5, 0.123)
    assert wait_until(lambda: mcu.motors == sent)
    sent = ctl.send_action(Command(0.0004, 0.2506, -2.0))
    assert sent == Command(0.0, 0.251, -1.5)
    assert wait_until(lambda: mcu.motors == sent)
    assert ctl.send_action(Command(float("nan"), 0.3, 0.3)) == Command()  # a fault, not a speed
    assert wait_until(lambda: mcu.motors == Command())


def test_resend_keeps_mcu_moving_and_its_deadman_stops_a_dead_host(link):
    ctl, mcu = link(auto_stop_s=0.25, resend_s=0.04)
    cmd = ctl.send_action(Command(0.3, 0.0, 0.5))
    time.sleep(0.75)  # three auto-stop windows, one command
    assert mcu.motors == cmd and mcu.auto_stops == 0
    assert ctl.resends >= 8 and ctl.acked >= 8 and ctl.missed_acks == 0

    ctl.disconnect(stop_motion=False)  # the host dies: no STOP, no more frames
    assert wait_until(lambda: mcu.auto_stops == 1, timeout=1.5)
    assert mcu.motors == Command() and mcu.auto_stopped and mcu.counts[FrameType.STOP] == 0
    silence = mcu.auto_stop_t - mcu.last_alive_t
    assert 0.25 <= silence < 0.25 + 0.15  # the MCU loop ticks every 10 ms


def test_without_resend_the_mcu_stops_itself(link):
    ctl, mcu = link(auto_stop_s=0.15, resend_s=10.0)  # a host that sends once and goes quiet
    settled(ctl)
    ctl.send_action(Command(0.2, 0.0, 0.0))
    assert wait_until(lambda: mcu.motors.vx == 0.2)
    assert wait_until(lambda: mcu.auto_stops == 1, timeout=1.0)
    assert mcu.motors == Command()


def test_lost_stop_acks_are_retried(link):
    ctl, mcu = link(resend_s=10.0, max_retries=3)
    settled(ctl)
    ctl.send_action(Command(0.5, 0.0, 0.0))
    assert wait_until(lambda: ctl.acked >= 2)
    mcu.drop_acks = 2
    ctl.stop()  # third try is acked
    assert ctl.retries == 2 and ctl.failed == 0 and ctl.missed_acks >= 2
    stops = [f.seq for _, f in mcu.log if f.type == FrameType.STOP]
    assert len(stops) == 3 and len(set(stops)) == 1  # the same frame, the same seq
    assert mcu.motors == Command()


def test_stop_never_acked_raises_after_max_retries(link):
    ctl, mcu = link(resend_s=10.0, max_retries=3)
    settled(ctl)
    mcu.drop_acks = 100
    t0 = time.monotonic()
    with pytest.raises(ControllerError, match="not acknowledged"):
        ctl.stop()
    assert time.monotonic() - t0 < 1.0
    assert mcu.counts[FrameType.STOP] == 4  # 1 + max_retries
    assert ctl.retries == 3 and ctl.failed == 1 and ctl.missed_acks >= 4
    assert ctl.connected  # a failed STOP does not kill the link


def test_corrupted_ack_is_a_bad_frame_and_retried(link):
    ctl, mcu = link(resend_s=10.0)
    settled(ctl)
    mcu.corrupt_next = 1
    ctl.stop()
    assert ctl.bad_frames == 1 and ctl.retries == 1 and ctl.failed == 0
    assert mcu.counts[FrameType.STOP] == 2


def test_nack_is_retried(link):
    ctl, mcu = link(resend_s=10.0)
    settled(ctl)
    mcu.nack_next = 1
    ctl.stop()
    assert ctl.nacks == 1 and ctl.retries == 1 and ctl.missed_acks == 0


def test_missed_acks_on_streamed_setpoints_are_counted_not_fatal(link):
    ctl, mcu = link(resend_s=0.02)
    settled(ctl)
    mcu.drop_acks = 5
    assert wait_until(lambda: ctl.missed_acks >= 5 and ctl.acked >= 8)
    assert ctl.connected and ctl.failed == 0


def test_estop_reaches_the_mcu_and_latches(link):
    ctl, mcu = link(status_s=0.02)
    ctl.send_action(Command(0.4, 0.0, 0.0))
    assert wait_until(lambda: mcu.motors.vx == 0.4)
    ctl.estop()
    assert mcu.estopped and mcu.estops == 1 and mcu.motors == Command()
    assert ctl.send_action(Command(0.4, 0.0, 0.0)) == Command()
    assert wait_until(lambda: ctl.read_status(max_age_s=0.2).estopped)
    ctl.clear_estop()
    assert not mcu.estopped
    assert ctl.send_action(Command(0.4, 0.0, 0.0)).vx == 0.4
    assert wait_until(lambda: mcu.motors.vx == 0.4)


def test_safety_layer_estop_goes_through_to_the_mcu(link):
    ctl, mcu = link()
    safety = SafetyLayer(ctl, SafetyLimits(max_dvx=100.0))
    assert safety.send_action(Command(0.3, 0.0, 0.0)).vx == 0.3
    assert wait_until(lambda: mcu.motors.vx == 0.3)
    safety.estop().result(5)  # the ESTOP frame waits for its ACK on its own lane
    assert mcu.estopped and mcu.motors == Command()


def test_disconnect_sends_stop_and_is_idempotent(link):
    ctl, mcu = link()
    ctl.send_action(Command(0.3, 0.0, 0.0))
    ctl.disconnect()
    assert mcu.counts[FrameType.STOP] == 1 and mcu.motors == Command()
    ctl.disconnect()
    assert not ctl.connected
    with pytest.raises(ControllerError, match="not connected"):
        ctl.send_action(Command(0.1, 0.0, 0.0))


def test_mcu_nacks_a_bad_crc_and_ignores_garbage():
    host, mcu_end = PipePort.pair(timeout=0.01)
    bad = bytearray(encode_frame(FrameType.STOP, 77))
    bad[-2] ^= 0x01
    with FakeMcu(mcu_end, status_s=None) as mcu:
        host.write(b"\xaa\xaa\x55\xff\x00 line noise " + bytes(bad) + encode_frame(FrameType.HEARTBEAT, 78))
        parser, got = FrameParser(), []
        end = time.monotonic() + 1.0
        while len(got) < 2 and time.monotonic() < end:
            got += parser.feed(host.read(64))
    assert [(f.type, f.seq) for f in got] == [(FrameType.NACK, 77), (FrameType.ACK, 78)]
    assert mcu.counts[FrameType.STOP] == 0 and mcu.nacks_sent == 1


# --- the controller over real pyserial URLs ------------------------------------------------------


def test_make_controller_builds_the_serial_driver():
    ctl = make_controller("serial", port="loop://", max_vx=0.8)
    assert isinstance(ctl, SerialController) and ctl.name == "serial" and ctl.max_vx == 0.8
    assert not ctl.connected


def test_controller_over_real_loop_port_hears_its_own_frames():
    """loop:// echoes TX to RX: the controller parses its own frames; no MCU, so nothing is acked."""
    ctl = make_controller("serial", port="loop://", resend_s=0.02, ack_timeout_s=0.02, max_retries=1)
    ctl.connect()
    try:
        assert ctl.send_action(Command(0.25, 0.0, -0.1)) == Command(0.25, 0.0, -0.1)
        assert wait_until(lambda: ctl.rx[FrameType.VEL] >= 3 and ctl.missed_acks >= 3)
        assert ctl.acked == 0 and ctl.bad_frames == 0
        with pytest.raises(ControllerError):
            ctl.stop()
        assert ctl.rx[FrameType.STOP] >= 1 and ctl.failed == 1
    finally:
        ctl.disconnect()  # best-effort STOP fails quietly
    ctl.disconnect()


class TcpRelay:
    """Accepts two TCP clients on 127.0.0.1 and pipes bytes between them (a null-modem cable)."""

    def __init__(self):
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._run, name="test-relay", daemon=True).start()

    def _run(self):
        a, _ = self.server.accept()
        b, _ = self.server.accept()
        self.conns = [a, b]
        for src, dst in ((a, b), (b, a)):
            threading.Thread(target=self._pump, args=(src, dst), name="test-relay-pump", daemon=True).start()

    @staticmethod
    def _pump(src, dst):
        try:
            while data := src.recv(4096):
                dst.sendall(data)
        except OSError:
            pass

    def close(self):
        for s in (*self.conns, self.server):
            s.close()


def test_whole_protocol_over_real_socket_urls():
    relay = TcpRelay()
    url = f"socket://127.0.0.1:{relay.port}"
    mcu_port = serial.serial_for_url(url, timeout=0.01)
    ctl = SerialController(port=url, resend_s=0.03, ack_timeout_s=0.1)
    try:
        with FakeMcu(mcu_port, auto_stop_s=0.3, status_s=0.05) as mcu:
            ctl.connect()
            sent = ctl.send_action(Command(0.5, 0.1, 0.2))
            assert wait_until(lambda: mcu.motors == sent)
            assert wait_until(lambda: ctl.read_status(0.2).motors == sent)
            ctl.stop()
            assert mcu.motors == Command() and ctl.acked >= 2 and ctl.bad_frames == 0
            ctl.disconnect()
    finally:
        ctl.disconnect()
        mcu_port.close()
        relay.close()


def test_safety_layer_reset_releases_the_mcu_latch(link):
    from agent.robot.safety import SafetyLayer, SafetyLimits

    ctl, mcu = link(status_s=0.02)
    safety = SafetyLayer(ctl, SafetyLimits(max_frame_age_s=None))
    safety.estop().result(5)
    assert mcu.estopped and ctl.estopped
    safety.reset().result(5)
    assert not mcu.estopped and not ctl.estopped
