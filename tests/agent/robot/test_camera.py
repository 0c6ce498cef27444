"""The camera grabber: newest frame only, stale frames refused, a dead source noticed."""

import time

import cv2
import numpy as np
import pytest

from agent.robot.camera import CameraError, FrameGrabber, OpenCVSource, StaleFrame, open_source


@pytest.fixture
def video(tmp_path):
    """A real 2-second MJPG video file (a recorded run to replay)."""
    path = str(tmp_path / "run.avi")
    out = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"MJPG"), 20, (64, 48))
    for i in range(40):
        img = np.zeros((48, 64, 3), np.uint8)
        img[:, :, 2] = i * 6  # red grows frame by frame
        out.write(img)
    out.release()
    return path


def test_video_file_frames_are_fresh_and_newest(video):
    with FrameGrabber(OpenCVSource(video, fps=50), name="file") as g:
        deadline = time.monotonic() + 5
        while g.frames < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        f1 = g.read_latest(max_age_ms=500)
        time.sleep(0.1)
        f2 = g.read_latest(max_age_ms=500)
    assert f1.image.shape == (48, 64, 3) and f2.seq > f1.seq and f2.t > f1.t
    assert not g.alive


def test_stale_frame_is_refused_once_the_source_stops(video):
    g = FrameGrabber(OpenCVSource(video, fps=50), name="file").start()
    while g.frames == 0:
        time.sleep(0.01)
    g.stop()
    time.sleep(0.15)
    with pytest.raises(StaleFrame, match="ms old"):
        g.read_latest(max_age_ms=100)
    assert g.latest_age_s() >= 0.1


def test_no_frame_yet_is_stale():
    class Never:
        def open(self):
            pass

        def read(self):
            time.sleep(0.01)
            return None

        def close(self):
            pass

    g = FrameGrabber(Never(), name="never", max_failures=5).start()
    time.sleep(0.2)
    with pytest.raises(StaleFrame, match="no frame yet"):
        g.read_latest(1000)
    assert g.alive and g.retrying and "failed reads" in g.error  # still trying, and says why
    g.stop()


def test_missing_device_is_a_clear_error(tmp_path):
    with pytest.raises(CameraError, match="cannot open"):
        OpenCVSource(str(tmp_path / "nope.avi")).open()


def test_source_kinds():
    assert OpenCVSource("/dev/video0").kind == "v4l2" and OpenCVSource("0").kind == "v4l2"
    assert OpenCVSource("nvarguscamerasrc ! appsink").kind == "gstreamer"
    assert OpenCVSource("run.mp4").kind == "file"
    with pytest.raises(CameraError, match="sim"):
        open_source("sim")


def test_sources_a_robot_has_pass_to_the_right_opencv_backend():
    from agent.robot.camera import Go2CameraSource, OpenCVSource, has_gstreamer, open_source

    csi = (
        "nvarguscamerasrc sensor-id=0 ! video/x-raw(memory:NVMM),width=1280,height=720 ! nvvidconv ! "
        "video/x-raw,format=BGRx ! videoconvert ! video/x-raw,format=BGR ! appsink drop=1 max-buffers=1"
    )
    assert OpenCVSource(csi).kind == "gstreamer"
    assert OpenCVSource("rtsp://192.168.1.20:8554/front").kind == "stream"  # not looped, not paced like a file
    assert OpenCVSource("/dev/video0").kind == "v4l2" and OpenCVSource("run.mp4").kind == "file"
    assert isinstance(open_source("go2", network_interface="eth0"), Go2CameraSource)
    fake = lambda info: type("cv2", (), {"getBuildInformation": staticmethod(lambda: info)})  # noqa: E731
    assert has_gstreamer(fake("  Video I/O:\n    GStreamer:                   YES (1.20.3)\n"))
    assert not has_gstreamer(fake("  Video I/O:\n    GStreamer:                   NO\n"))


def test_a_go2_sample_over_the_image_limits_is_refused_before_opencv_decodes_it(monkeypatch):
    import struct
    from types import SimpleNamespace

    from agent.robot.camera import Go2CameraSource

    jpeg = cv2.imencode(".jpg", np.zeros((48, 64, 3), np.uint8))[1].tobytes()
    at = jpeg.index(b"\xff\xc0") + 5  # the frame header's height and width
    bomb = jpeg[:at] + struct.pack(">HH", 30000, 30000) + jpeg[at + 4 :]
    samples = iter([(0, list(jpeg)), (0, list(bomb))])  # the SDK hands a list of byte values
    source = Go2CameraSource(fps=1000)
    source.client = SimpleNamespace(GetImageSample=lambda: next(samples))
    image, meta = source.read()
    assert image.shape == (48, 64, 3) and meta["jpeg_bytes"] == len(jpeg)
    decoded = []
    monkeypatch.setattr(cv2, "imdecode", lambda *args: decoded.append(args))
    assert source.read() is None and not decoded  # a failed read, and OpenCV never saw it


def test_opencv_decodes_nothing_over_the_image_limits_in_a_robot_process():
    """OpenCV reads its limits once, when it loads: the camera module sets them before the robot imports cv2."""
    import subprocess
    import sys

    code = (
        "import agent.robot.camera, cv2, numpy as np\n"
        "tall = cv2.imencode('.png', np.zeros((4097, 2, 3), np.uint8))[1]\n"
        "try:\n    cv2.imdecode(tall, cv2.IMREAD_COLOR); print('decoded')\n"
        "except cv2.error:\n    print('refused')\n"
        "print(cv2.imdecode(cv2.imencode('.png', np.zeros((4096, 2, 3), np.uint8))[1], cv2.IMREAD_COLOR).shape)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split("\n")[:2] == ["refused", "(4096, 2, 3)"]


def test_a_camera_that_returns_after_an_outage_is_seen_again():
    """Past max_failures the grabber keeps trying (with backoff) and recovers without a restart."""

    class Outage:
        def __init__(self):
            self.reads = 0

        def open(self):
            pass

        def read(self):
            self.reads += 1
            time.sleep(0.005)
            if self.reads <= 8:  # an outage: past max_failures in a row
                return None
            return np.zeros((4, 4, 3), np.uint8), {}

        def close(self):
            pass

    g = FrameGrabber(Outage(), name="outage", max_failures=5).start()
    try:
        deadline = time.monotonic() + 5.0
        while g.frames == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert g.frames > 0 and g.alive and not g.retrying and g.error is None
        assert g.read_latest(1000) is not None
    finally:
        g.stop()
