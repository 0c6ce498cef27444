"""Perception on simulator frames: the colour detector against ground truth, and SimPerception's frame pose."""

from __future__ import annotations

import math

import numpy as np
import pytest

from agent.robot.camera import Frame
from agent.robot.perception import PERCEPTIONS, ColorDetector, SimPerception
from agent.robot.scripted import FakeClock
from agent.robot.sim import make_world

TARGET = (5.3, 4.3)  # the red box in the "red_box" scene


def frame_at(world, pose, seq=1) -> Frame:
    return Frame(world.render_camera(pose=pose), 0.0, seq, {"pose": pose, "source": "sim"})


def facing_box(x, y, off_deg=0.0):
    return (x, y, math.atan2(TARGET[1] - y, TARGET[0] - x) + math.radians(off_deg))


@pytest.mark.parametrize(
    "pose",
    [
        facing_box(1.0, 1.0, 0),
        facing_box(1.0, 1.0, 30),
        facing_box(2.0, 2.0, -20),
        facing_box(3.0, 1.5, 10),
        facing_box(4.0, 3.0, -15),
        facing_box(1.5, 3.0, 25),
        (1.0, 1.0, 0.0),
    ],
)
def test_color_detector_finds_the_red_box_like_ground_truth(pose):
    world = make_world("red_box")
    frame = frame_at(world, pose)
    (truth,) = [s for s in SimPerception(world).describe(frame) if s.name == "red box"]
    found = [s for s in ColorDetector(names={"red": "red box"}).describe(frame) if s.name == "red box"]
    assert len(found) == 1, pose
    s = found[0]
    assert s.source == "color"
    assert abs(s.bearing_deg - truth.bearing_deg) <= 5.0, (s, truth)
    assert abs(s.distance_m / truth.distance_m - 1) <= 0.25, (s, truth)


def test_color_detector_reports_nothing_when_the_box_is_out_of_view():
    world = make_world("red_box")
    for pose in [facing_box(2.0, 2.0, 180), facing_box(1.0, 1.0, 70), facing_box(4.0, 3.0, -90)]:
        names = [s.name for s in ColorDetector().describe(frame_at(world, pose))]
        assert "red object" not in names, pose
    blank = Frame(np.full((120, 160, 3), 128, np.uint8), 0.0, 1)
    assert ColorDetector().describe(blank) == []


def test_color_detector_names_other_colours_and_sorts_by_distance():
    world = make_world("red_box")
    pose = (1.0, 1.0, math.radians(20))  # the blue ball to the right, the red box to the left
    got = ColorDetector().describe(frame_at(world, pose))
    names = [s.name for s in got]
    assert "red object" in names and "blue object" in names
    assert [s.distance_m for s in got] == sorted(s.distance_m for s in got)
    blue = got[names.index("blue object")]
    (truth,) = [s for s in world.sightings(pose=pose) if s.name == "blue ball"]
    assert abs(blue.bearing_deg - truth.bearing_deg) <= 5.0


def test_color_detector_checks_its_input():
    with pytest.raises(ValueError, match="uint8"):
        ColorDetector().describe(Frame(np.zeros((120, 160), np.uint8), 0.0, 1))


def test_sim_perception_uses_the_frames_pose_not_the_worlds_now():
    world = make_world("red_box", start=0, clock=FakeClock())
    then = facing_box(1.0, 1.0, 0)
    frame = frame_at(world, then)
    world.set_pose(4.5, 2.2, math.pi)  # the robot has since turned away from the box
    assert "red box" not in [s.name for s in world.sightings()]
    seen = SimPerception(world).describe(frame)
    assert seen == world.sightings(pose=then)
    (s,) = [s for s in seen if s.name == "red box"]
    assert s.bearing_deg == pytest.approx(0.0, abs=1e-6) and s.source == "sim"
    assert s.distance_m == pytest.approx(math.hypot(4.3, 3.3) - 0.2)


def test_sim_perception_needs_a_pose():
    world = make_world("red_box")
    with pytest.raises(ValueError, match="pose"):
        SimPerception(world).describe(Frame(world.render_camera(), 0.0, 1))


def test_perceptions_registry():
    assert PERCEPTIONS["sim"].kind == "sim" and PERCEPTIONS["color"].kind == "color"
