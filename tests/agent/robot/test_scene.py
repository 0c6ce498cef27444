"""Scenes from JSON files: the shipped room is the old built-in one exactly, bad files say what and where is wrong;
the camera's source registry (the simulator registers "sim"; camera.py never imports it); the shortest path."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from agent.robot.camera import CameraError, open_source, register_source, registered_sources
from agent.robot.scene import Obstacle, SceneError, SimObject, builtin_scenes, load_scene, parse_scene
from agent.robot.shortest import grid_path, shortest_length, shortest_to_object
from agent.robot.sim import SimCamera, SimWorld, make_world

# The built-in room as sim.py held it before scenes were files (SCENES["red_box"], START_POSES["red_box"]).
RED, BLUE, GREEN = (0, 0, 220), (200, 80, 20), (40, 170, 40)
OLD_RED_BOX = dict(
    size_m=(6.0, 5.0),
    objects=(
        SimObject("red box", "box", 5.3, 4.3, 0.4, 0.4, RED),
        SimObject("blue ball", "ball", 5.2, 0.7, 0.3, 0.3, BLUE),
        SimObject("green box", "box", 1.0, 4.3, 0.4, 0.4, GREEN),
    ),
    obstacles=(Obstacle(2.6, 4.4, 3.4, 5.0, 0.8, "shelf"), Obstacle(4.3, 1.0, 4.8, 1.5, 0.8, "crate")),
    walls=(),
)
OLD_STARTS = [(1.0, 1.0, 0.0), (3.0, 0.8, math.pi / 2), (4.5, 2.2, math.pi), (1.0, 2.5, -math.pi / 2)]


def test_the_shipped_red_box_room_is_the_old_built_in_one_exactly():
    assert "red_box" in builtin_scenes()
    scene = load_scene("red_box")
    assert scene.world_kwargs() == OLD_RED_BOX
    assert list(scene.starts) == OLD_STARTS  # exact floats, pi/2 included
    assert scene.target == "red box" and scene.task() == "go to the red box"
    for i, pose in enumerate(OLD_STARTS):
        world, old = make_world("red_box", start=i), SimWorld(**OLD_RED_BOX, pose=pose)
        assert tuple(world.pose) == tuple(old.pose) and world.start_index == i
        assert all(
            np.array_equal(getattr(world.geometry, f), getattr(old.geometry, f))
            for f in ("segs", "seg_owner", "seg_height", "seg_color", "circles", "thin", "rects")
        )
        assert np.array_equal(world.render_camera(), old.render_camera())
    assert make_world().start_index == 0 and tuple(make_world().pose) == OLD_STARTS[0]
    assert tuple(make_world("red_box", start=(2.0, 2.0, 0.5)).pose) == (2.0, 2.0, 0.5)


def test_a_scene_round_trips_through_its_json_and_loads_from_a_path(tmp_path):
    scene = load_scene("red_box")
    path = tmp_path / "copy.json"
    path.write_text(json.dumps(scene.to_json()))
    again = load_scene(str(path))
    assert again.world_kwargs() == scene.world_kwargs() and again.starts == scene.starts
    assert again.name == "copy" and again.path == str(path)
    world = make_world(str(path), start=3)
    assert world.scene == "copy" and tuple(world.pose) == OLD_STARTS[3] and world.spec == again


def _write(tmp_path, data, name="bad.json"):
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


def _scene(**change):
    data = load_scene("red_box").to_json()
    data.update(change)
    return data


@pytest.mark.parametrize(
    "change, field, why",
    [
        (dict(colour="red"), "scene", "unknown key(s) ['colour']"),
        (dict(objects=[{"name": "red box", "kind": "cube", "x": 1, "y": 1}]), "objects[0].kind", "'box' or 'ball'"),
        (
            dict(objects=[{"name": "red box", "kind": "box", "x": 5.9, "y": 1}]),
            "objects[0]",
            "outside the 6 x 5 m room",
        ),
        (dict(objects=[{"name": "red box", "kind": "box", "x": "1", "y": 1}]), "objects[0].x", "finite number"),
        (dict(objects=[{"name": "red box", "kind": "box", "x": 2, "y": 2, "colour": 1}]), "objects[0]", "unknown key"),
        (
            dict(objects=[{"name": "b", "kind": "box", "x": 2, "y": 2}, {"name": "b", "kind": "ball", "x": 3, "y": 3}]),
            "objects",
            "unique",
        ),
        (dict(obstacles=[{"x0": 5.0, "y0": 1, "x1": 6.5, "y1": 2}]), "obstacles[0]", "outside"),
        (dict(obstacles=[{"x0": 2, "y0": 1, "x1": 1, "y1": 2}]), "obstacles[0]", "x0 < x1"),
        (dict(starts=[[4.5, 1.2, 0.0]]), "starts[0]", "obstacle 'crate'"),
        (dict(starts=[[5.3, 4.0, 0.0]]), "starts[0]", "object 'red box'"),
        (dict(starts=[[0.1, 2.0, 0.0]]), "starts[0]", "the room's walls"),
        (dict(starts=[[1.0, 1.0]]), "starts[0]", "list of 3 numbers"),
        (dict(starts=[]), "starts", "at least one"),
        (dict(size_m=[6.0]), "size_m", "list of 2 numbers"),
        (dict(target="purple box"), "target", "not one of the objects"),
    ],
)
def test_bad_scene_files_name_the_file_and_the_field(tmp_path, change, field, why):
    path = _write(tmp_path, _scene(**change))
    with pytest.raises(SceneError) as e:
        load_scene(path)
    assert f"scene {path}: {field}: " in str(e.value) and why in str(e.value)


def test_unreadable_scenes_and_starts_are_clear_errors(tmp_path):
    with pytest.raises(SceneError, match="not found"):
        load_scene(str(tmp_path / "none.json"))
    bad = tmp_path / "broken.json"
    bad.write_text("{not json")
    with pytest.raises(SceneError, match=f"{bad}: not JSON"):
        load_scene(str(bad))
    with pytest.raises(SceneError, match="unknown scene 'kitchen'.*red_box"):
        make_world("kitchen")
    with pytest.raises(SceneError, match="start 4 out of range.*0..3"):
        make_world("red_box", start=4)
    with pytest.raises(SceneError, match="missing key"):
        parse_scene({"size_m": [3, 3], "objects": [{"name": "x", "kind": "box"}], "starts": [[1, 1, 0]]})


# ---------------------------------------------------------------- the camera's source registry


def test_the_sim_source_comes_through_the_camera_factory():
    assert {"go2", "sim"} <= set(registered_sources())
    world = make_world("red_box", start=1)
    cam = open_source("sim", fps=50, world=world)
    assert isinstance(cam, SimCamera) and cam.world is world and cam.fps == 50
    with pytest.raises(CameraError, match="needs the sim controller's world"):
        open_source("sim")


def test_a_registered_factory_gets_the_options():
    got = {}

    def factory(source, **options):
        got.update(options, source=source)
        return "a source"

    register_source("test-fake", factory)
    assert open_source("test-fake", width=32, fps=5) == "a source"
    assert got["source"] == "test-fake" and got["width"] == 32 and got["fps"] == 5 and got["world"] is None


def test_camera_and_perception_do_not_import_the_simulator():
    code = (
        "import sys, agent.robot.camera, agent.robot.perception; "
        "from agent.robot.camera import open_source, CameraError\n"
        "try:\n    open_source('sim')\nexcept CameraError as e:\n    print('error:', e)\n"
        "print('agent.robot.sim' in sys.modules)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    err, loaded = r.stdout.strip().splitlines()
    assert loaded == "False" and "registered by agent.robot.sim" in err


# ---------------------------------------------------------------- the shortest path


def test_grid_path_goes_around_a_wall_without_cutting_its_corner():
    free = np.ones((3, 5), bool)  # rows x cols; a wall in column 2, open in the bottom row
    free[0:2, 2] = False
    goal = np.zeros_like(free)
    goal[0, 4] = True
    path = grid_path(free, (0, 0), goal)
    assert path[0] == (0, 0) and path[-1] == (0, 4) and (2, 2) in path
    assert all(free[c] for c in path)
    assert shortest_length(free, (0, 0), goal, 0.05) == pytest.approx(4 * math.sqrt(2) * 0.05)
    open_ = np.ones((5, 5), bool)
    far = np.zeros_like(open_)
    far[4, 4] = True
    assert shortest_length(open_, (0, 0), far, 1.0) == pytest.approx(4 * math.sqrt(2))  # pulled taut: diagonal
    far[4, 4], far[1, 4] = False, True
    assert shortest_length(open_, (0, 0), far, 1.0) == pytest.approx(math.hypot(1, 4))  # not 3 + sqrt(2)
    free[2, 2] = False  # the gap closed
    assert grid_path(free, (0, 0), goal) is None and shortest_length(free, (0, 0), goal, 0.05) == math.inf


def test_shortest_to_an_object_in_a_world():
    world = make_world("red_box", start=0)  # nothing in the way: the straight line less the reach
    assert shortest_to_object(world, "red box") == pytest.approx(world.distance_to("red box") - 0.6, abs=0.05)
    blocked = SimWorld(
        size_m=(6.0, 4.0),
        pose=(1.0, 2.0, 0.0),
        obstacles=[Obstacle(2.5, 1.0, 3.0, 3.0)],
        objects=[SimObject("red box", "box", 5.0, 2.0)],
    )
    straight = blocked.distance_to("red box") - 0.6
    around = shortest_to_object(blocked, "red box")
    assert straight + 0.4 < around < straight + 1.0  # around the block's inflated corner
    walled = SimWorld(
        size_m=(6.0, 4.0),
        pose=(1.0, 2.0, 0.0),
        walls=[(3.0, 0.0, 3.0, 4.0)],
        objects=[SimObject("red box", "box", 5.0, 2.0)],
    )
    assert shortest_to_object(walled, "red box") == math.inf
    assert shortest_to_object(blocked, "red box", start=(4.5, 2.0)) == 0.0  # already within reach
