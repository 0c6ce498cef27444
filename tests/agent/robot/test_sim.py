"""The 2-D simulator: motion, collisions, auto-stop, sightings, camera, map, controller, scripted episodes."""

from __future__ import annotations

import math

import cv2
import numpy as np
import pytest

from agent.robot.actions import VOCABULARY, parse_action
from agent.robot.camera import open_source
from agent.robot.controllers.base import Command, make_controller
from agent.robot.controllers.sim import SimController
from agent.robot.perception import Sighting
from agent.robot.scripted import FakeClock, run_scripted, scripted_action
from agent.robot.sim import START_POSES, Obstacle, SimObject, SimWorld, make_world

RED = (0, 0, 220)


def red_columns_bearing(img: np.ndarray, hfov_deg: float = 90.0) -> float:
    """Bearing (deg, left positive) of the red pixels' mean column through the pinhole model."""
    b, g, r = (img[..., i].astype(int) for i in range(3))
    cols = np.nonzero((r > 150) & (g < 60) & (b < 60))[1]
    assert cols.size, "no red pixels"
    w = img.shape[1]
    f = (w / 2) / math.tan(math.radians(hfov_deg) / 2)
    return math.degrees(math.atan2(w / 2 - (cols.mean() + 0.5), f))


# ---------------------------------------------------------------- the scripted policy, end to end


@pytest.mark.parametrize("start", range(len(START_POSES["red_box"])))
def test_scripted_policy_reaches_red_box_from_every_start(start):
    world = make_world("red_box", start=start, clock=FakeClock())
    result = run_scripted(world, lambda s: scripted_action(s, target="red box"), "red box")
    assert result.reached, (result, world.pose)
    assert result.actions[-1].kind == "stop"
    assert result.collisions == 0
    assert result.steps <= 20
    assert 0.3 < result.final_distance_m <= 0.6
    assert result.path_len_m > 1.0
    assert world.velocity == Command()


def test_a_start_needs_search_by_turning():
    world = make_world("red_box", start=2, clock=FakeClock())
    assert "red box" not in [s.name for s in world.sightings()]
    result = run_scripted(world, None, "red box")
    assert result.reached
    assert [str(a) for a in result.actions[:2]] == ["turn left 45 deg", "turn left 45 deg"]


def test_scripted_action_speaks_navila_exactly():
    texts = {a.text for a in VOCABULARY}
    cases = [
        ([], "turn left 45 deg"),
        ([Sighting("blue ball", 0.0, 1.0, "sim")], "turn left 45 deg"),
        ([Sighting("red box", 3.0, 0.5, "sim")], "stop"),
        ([Sighting("red box", 20.0, 2.0, "sim")], "turn left 15 deg"),
        ([Sighting("red box", -40.0, 2.0, "sim")], "turn right 45 deg"),
        ([Sighting("red box", 28.0, 2.0, "sim")], "turn left 30 deg"),
        ([Sighting("red box", 5.0, 2.0, "sim")], "forward 75 cm"),
        ([Sighting("red box", -5.0, 1.3, "sim")], "forward 50 cm"),
        ([Sighting("red box", 0.0, 0.9, "sim")], "forward 25 cm"),
    ]
    for sightings, want in cases:
        text = scripted_action(sightings)
        assert text in texts
        parsed = parse_action(text)
        assert parsed.how == "exact" and str(parsed.action) == want, (sightings, text)


# ---------------------------------------------------------------- motion


def tiny_world(clock, pose=(1.0, 1.0, 0.0), **kw) -> SimWorld:
    return SimWorld(size_m=(2.0, 2.0), pose=pose, clock=clock, **kw)


def test_collision_stops_the_robot_against_a_wall_and_counts():
    clock = FakeClock()
    world = tiny_world(clock, pose=(1.5, 1.0, 0.0))  # wall at x = 2, robot radius 0.2: 0.3 m to go
    world.set_velocity(Command(vx=0.5))
    clock.advance(0.9)
    x, y, _ = world.pose
    assert 1.75 < x <= 1.8 + 1e-9 and y == pytest.approx(1.0)
    assert world.collisions == 1
    assert world.velocity == Command()
    world.set_velocity(Command(vx=0.5))  # pushing on: still blocked, counted again
    clock.advance(0.5)
    assert world.pose.x <= 1.8 + 1e-9 and world.collisions == 2
    world.set_velocity(Command(vx=-0.5))  # backing out of contact is allowed
    clock.advance(0.5)
    assert world.pose.x == pytest.approx(x - 0.25, abs=1e-6)


def test_objects_and_obstacles_block_motion():
    clock = FakeClock()
    world = SimWorld(
        size_m=(6.0, 2.0),
        pose=(0.5, 1.0, 0.0),
        clock=clock,
        auto_stop_s=10.0,
        obstacles=[Obstacle(2.0, 0.5, 2.5, 1.5)],
        objects=[SimObject("ball", "ball", 4.0, 1.0, 0.4, 0.4)],
    )
    world.set_velocity(Command(vx=1.0))
    clock.advance(3.0)
    assert world.pose.x == pytest.approx(1.8, abs=0.03) and world.collisions == 1
    world.set_pose(3.0, 1.0, 0.0)
    world.set_velocity(Command(vx=1.0))
    clock.advance(3.0)
    assert world.pose.x == pytest.approx(3.6, abs=0.03) and world.collisions == 2


def test_auto_stop_after_one_second_without_commands():
    clock = FakeClock()
    world = tiny_world(clock, pose=(0.5, 1.0, 0.0))
    world.set_velocity(Command(vx=0.5))
    clock.advance(3.0)
    assert world.pose.x == pytest.approx(1.0, abs=1e-9)  # 0.5 m/s for 1 s, then stopped by itself
    assert world.velocity == Command()
    assert world.collisions == 0


def test_integration_turns_and_moves_in_the_body_frame():
    clock = FakeClock()
    world = SimWorld(size_m=(10.0, 10.0), pose=(5.0, 5.0, math.pi / 2), clock=clock)
    world.set_velocity(Command(vx=0.5))  # facing +y
    clock.advance(0.8)
    assert world.pose.x == pytest.approx(5.0) and world.pose.y == pytest.approx(5.4)
    world.set_velocity(Command(vy=0.5))  # left of +y is -x
    clock.advance(0.8)
    assert world.pose.x == pytest.approx(4.6)
    world.set_velocity(Command(wz=math.pi / 4))  # CCW: a quarter turn in 2 s, done in two commands
    clock.advance(1.0)
    world.set_velocity(Command(wz=math.pi / 4))
    clock.advance(1.0)
    assert world.pose.theta == pytest.approx(math.pi, abs=1e-9) or world.pose.theta == pytest.approx(-math.pi)


def test_path_records_poses_with_tags():
    clock = FakeClock()
    world = SimWorld(size_m=(10.0, 10.0), pose=(1.0, 5.0, 0.0), clock=clock)
    world.tag = "verified"
    world.set_velocity(Command(vx=0.5))
    clock.advance(1.0)
    world.tag = "offline"
    world.set_velocity(Command(vx=0.5))
    clock.advance(1.0)
    path = world.path
    tags = [p[4] for p in path]
    assert tags[0] == "" and "verified" in tags and tags[-1] == "offline"
    verified_x = [p[1] for p in path if p[4] == "verified"]
    assert max(verified_x) == pytest.approx(1.5) and path[-1][1] == pytest.approx(2.0)
    steps = [math.hypot(b[1] - a[1], b[2] - a[2]) for a, b in zip(path, path[1:], strict=False)]
    assert max(steps) <= 0.05


# ---------------------------------------------------------------- sightings


def corridor(clock=None, obstacles=(), objects=()) -> SimWorld:
    objs = [SimObject("red box", "box", 3.0, 1.0, 0.4, 0.4, RED)] + list(objects)
    return SimWorld(
        size_m=(8.0, 2.0), pose=(0.5, 1.0, 0.0), clock=clock or FakeClock(), obstacles=obstacles, objects=objs
    )


def test_sightings_bearing_and_surface_distance():
    world = corridor()
    (s,) = world.sightings()
    assert s.name == "red box" and s.source == "sim"
    assert s.bearing_deg == pytest.approx(0.0) and s.distance_m == pytest.approx(2.3)
    (s,) = world.sightings(pose=(0.5, 1.0, math.radians(-30)))  # turned right: the box is to the left
    assert s.bearing_deg == pytest.approx(30.0)
    assert world.distance_to("red box") == pytest.approx(2.3)
    assert not world.reached("red box") and world.reached("red box", reach_m=2.4)


def test_sightings_respect_field_of_view_and_range():
    world = corridor()
    assert world.sightings(pose=(0.5, 1.0, math.radians(50))) == []  # 50 deg off, hfov 90
    assert len(world.sightings(pose=(0.5, 1.0, math.radians(50)), hfov_deg=120)) == 1
    assert world.sightings(pose=(0.5, 1.0, math.pi)) == []  # behind
    assert world.sightings(max_range_m=2.0) == []  # centre 2.5 m away
    assert len(world.sightings(max_range_m=2.6)) == 1


def test_sightings_respect_occlusion():
    hidden = corridor(obstacles=[Obstacle(1.5, 0.8, 1.8, 1.2)])
    assert hidden.sightings() == []
    side = corridor(obstacles=[Obstacle(1.5, 1.3, 1.8, 1.7)])  # beside the line of sight
    assert [s.name for s in side.sightings()] == ["red box"]
    behind_ball = corridor(objects=[SimObject("blue ball", "ball", 2.0, 1.0, 0.3, 0.3, (200, 80, 20))])
    assert [s.name for s in behind_ball.sightings()] == ["blue ball"]
    walled = SimWorld(
        size_m=(8.0, 2.0),
        pose=(0.5, 1.0, 0.0),
        clock=FakeClock(),
        walls=[(1.5, 0.0, 1.5, 1.5)],
        objects=[SimObject("red box", "box", 3.0, 1.0)],
    )
    assert walled.sightings() == []


# ---------------------------------------------------------------- pictures


def test_render_camera_shape_and_red_box_columns_match_its_bearing():
    world = make_world("red_box", start=0)
    img = world.render_camera()
    assert img.shape == (120, 160, 3) and img.dtype == np.uint8
    for pose in [(1.0, 1.0, 0.0), (2.0, 2.0, 0.9), (3.5, 2.5, 1.2), (4.0, 3.0, 0.2)]:
        (truth,) = [s for s in world.sightings(pose=pose) if s.name == "red box"]
        img = world.render_camera(pose=pose)
        assert abs(red_columns_bearing(img) - truth.bearing_deg) < 3.0, pose
    big = world.render_camera(width=320, height=240, hfov_deg=60, pose=(2.0, 2.0, 0.9))
    assert big.shape == (240, 320, 3)
    (truth,) = [s for s in world.sightings(pose=(2.0, 2.0, 0.9), hfov_deg=60) if s.name == "red box"]
    assert abs(red_columns_bearing(big, 60) - truth.bearing_deg) < 2.0


def test_render_camera_object_rows_follow_the_pinhole_model():
    world = corridor()  # box 0.4 tall, near face 2.3 m ahead
    img = world.render_camera(width=160, height=120, pose=(0.5, 1.0, 0.0))
    col = img[:, 80].astype(int)
    rows = np.nonzero((col[:, 2] > 150) & (col[:, 1] < 60))[0]  # red rows in the centre column
    f, z, horizon = 80.0, 2.3, 60.0
    assert rows.min() == pytest.approx(horizon - f * (0.4 - 0.3) / z, abs=1.0)
    assert rows.max() + 1 == pytest.approx(horizon + f * 0.3 / z, abs=1.0)


def test_render_camera_is_fast():
    import time

    world = make_world("red_box")
    world.render_camera()
    t = time.perf_counter()
    for _ in range(20):
        world.render_camera()
    assert (time.perf_counter() - t) / 20 < 0.05  # typically ~3 ms; slack for CI


def test_render_map_writes_a_png_with_the_tagged_path(tmp_path):
    clock = FakeClock()
    world = make_world("red_box", start=0, clock=clock)
    world.tag = "verified"
    world.set_velocity(Command(vx=0.5))
    clock.advance(1.0)
    world.tag = "offline"
    world.set_velocity(Command(vx=0.5, wz=0.5))
    clock.advance(1.0)
    img = world.render_map(scale_px_per_m=60)
    assert img.dtype == np.uint8 and img.ndim == 3 and img.shape[1] > img.shape[0]
    out = tmp_path / "map.png"
    assert cv2.imwrite(str(out), img) and out.stat().st_size > 0
    back = cv2.imread(str(out))
    assert back.shape == img.shape
    px = back.reshape(-1, 3).astype(int)
    assert ((px == (0, 170, 0)).all(axis=1)).any()  # verified: green
    assert ((px == (0, 140, 255)).all(axis=1)).any()  # offline: orange
    assert ((px == (0, 0, 220)).all(axis=1)).any()  # the red box


# ---------------------------------------------------------------- camera source and controller


def test_sim_camera_is_a_frame_source_with_the_pose():
    world = make_world("red_box", start=1)
    cam = open_source("sim", fps=100, world=world)
    cam.open()
    image, meta = cam.read()
    assert image.shape == (120, 160, 3) and meta["source"] == "sim"
    assert meta["pose"] == pytest.approx(tuple(START_POSES["red_box"][1]))
    cam.close()
    assert cam.read() is None


def test_sim_controller_clamps_and_estop_damps():
    ctl = make_controller("sim")
    assert isinstance(ctl, SimController) and ctl.name == "sim" and not ctl.connected
    clock = FakeClock()
    ctl = SimController(make_world("red_box", start=0, clock=clock))
    with ctl:
        assert ctl.connected
        sent = ctl.send_action(Command(vx=3.0, vy=-2.0, wz=9.0))
        assert sent == Command(1.0, -0.5, 1.5)
        assert ctl.world.velocity == sent
        assert ctl.send_action(Command(vx=float("nan"))) == Command()
        ctl.send_action(Command(vx=0.5))
        ctl.stop()
        assert ctl.world.velocity == Command()
        ctl.estop()
        assert ctl.world.damped
        assert ctl.send_action(Command(vx=0.5)) == Command()
        x0 = ctl.world.pose.x
        clock.advance(0.5)
        assert ctl.world.pose.x == x0 and ctl.world.velocity == Command()
        ctl.connect()  # connecting again undamps
        assert not ctl.world.damped
        assert ctl.send_action(Command(vx=0.5)) == Command(vx=0.5)
        clock.advance(0.5)
        assert ctl.world.pose.x == pytest.approx(x0 + 0.25)
    assert not ctl.connected
    with pytest.raises(Exception, match="not connected"):
        ctl.send_action(Command(vx=0.1))


def test_sim_ray_cast_is_the_obstacle_stops_range_source():
    """A block 1 m ahead: the robot drives at it and the safety layer stops it short, without contact."""
    from agent.robot.actions import Motion
    from agent.robot.control import ControlLoop
    from agent.robot.safety import SafetyLayer, SafetyLimits

    world = SimWorld(size_m=(6.0, 5.0), obstacles=[(2.0, 0.5, 2.4, 1.5)], pose=(1.0, 1.0, 0.0))
    assert world.clearance_m(0.0) == pytest.approx(1.0 - world.radius)
    assert world.clearance_m(math.pi / 2) == pytest.approx(4.0 - world.radius)  # the wall at y = 5
    ctl = SimController(world)
    with ctl:
        safety = SafetyLayer(ctl, SafetyLimits(min_clearance_m=0.3, max_frame_age_s=None), ranges=ctl.ranges)
        loop = ControlLoop(safety, hz=50).start()
        try:
            assert not loop.execute(Motion(Command(vx=0.4), 5.0))  # cut short by the obstacle
        finally:
            loop.stop()
    assert safety.stops.get("obstacle") == 1 and world.collisions == 0
    assert 0.25 <= world.clearance_m(0.0) < 0.3 + 0.05
