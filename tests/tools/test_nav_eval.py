"""tools/robot/nav_eval.py: the scene files it runs are navigable and varied; its aggregation; a scripted run end to end
writes the JSON, the markdown table, the plots and one map per episode."""

from __future__ import annotations

import json
import math

import pytest

from agent.robot.scripted import FakeClock
from agent.robot.shortest import shortest_to_object
from agent.robot.sim import make_world
from tools.robot import nav_eval

SCENES = nav_eval.load_scenes(nav_eval.SCENES)


def test_the_scene_folder_is_varied_and_every_target_reachable_in_30_steps():
    own = [s for s in SCENES if s.name != "red_box"]  # (the demo's room is as it always was)
    assert len(own) >= 6 and "red_box" in [s.name for s in SCENES]
    assert {"red box", "blue ball", "green box", "yellow ball"} <= {s.target for s in SCENES}
    out_of_view = hidden = 0
    for scene in SCENES:
        target = next(o for o in scene.objects if o.name == scene.target)
        assert any(o.name != scene.target for o in scene.objects), f"{scene.name}: no distractor"
        for i in range(len(scene.starts)):
            world = make_world(scene, start=i, clock=FakeClock())
            if scene in own:  # (the demo's room is as it always was)
                assert 2.0 <= world.distance_to(scene.target) <= 5.0, (scene.name, i)
            shortest = shortest_to_object(world, scene.target)
            # 75 cm a step: 8 steps walk 6 m, which leaves 22 of 30 steps for turns
            assert 1.0 < shortest <= 6.0, (scene.name, i, shortest)
            x, y, th = scene.starts[i]
            bearing = abs(math.remainder(math.atan2(target.y - y, target.x - x) - th, 2 * math.pi))
            seen = scene.target in [s.name for s in world.sightings()]
            out_of_view += bearing > math.radians(45)
            hidden += bearing <= math.radians(45) and not seen  # in the field of view, behind something
    assert out_of_view >= 5 and hidden >= 3


def test_aggregate_weights_tau_by_verified_steps_and_time_by_steps():
    e = dict(
        reached=True,
        spl=0.8,
        steps=10,
        path_m=4.0,
        shortest_m=3.2,
        collisions=0,
        mean_tau=3.0,
        verified_steps=8,
        offline_steps=2,
        mean_step_s=2.0,
        scene="a",
        cut=None,
    )
    f = dict(
        e,
        reached=False,
        spl=0.0,
        steps=30,
        path_m=1.0,
        collisions=2,
        mean_tau=1.0,
        verified_steps=2,
        offline_steps=0,
        mean_step_s=1.0,
        cut={"at": 3, "steps": 3},
    )
    agg = nav_eval.aggregate([e, f])
    assert agg["success_rate"] == 0.5 and agg["spl"] == 0.4 and agg["mean_steps"] == 20
    assert agg["mean_tau"] == pytest.approx((3.0 * 8 + 1.0 * 2) / 10)
    assert agg["mean_step_s"] == pytest.approx((2.0 * 10 + 1.0 * 30) / 40)
    assert agg["collisions"] == 2 and agg["verified_steps"] == 10 and agg["offline_steps"] == 2
    overall, by_scene = nav_eval.summarize_run([e, f])
    assert overall["no cut"]["success_rate"] == 1.0 and overall["cut"]["success_rate"] == 0.0
    assert set(by_scene["a"]) == {"no cut", "cut"}


def test_plan_orders_episodes_scene_by_scene_and_limits():
    episodes = nav_eval.plan(SCENES[:2], (False, True))
    assert len(episodes) == 2 * (len(SCENES[0].starts) + len(SCENES[1].starts))
    assert [(e[1], e[2]) for e in episodes[:3]] == [(0, False), (0, True), (1, False)]
    assert nav_eval.plan(SCENES, (True,), limit=1) == [(SCENES[0], 0, True)]


def test_a_scripted_run_writes_the_report(tmp_path, capsys):
    assert nav_eval.main(["--policy", "scripted", "--limit", "3", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "nav_eval.json").read_text())
    assert len(report["episodes"]) == 3 and report["aggregate"]["all"]["episodes"] == 3
    first = report["episodes"][0]
    assert first["scene"] == SCENES[0].name and first["start"] == 0 and first["shortest_m"] > 0
    assert {"reached", "spl", "path_m", "steps", "collisions"} <= set(first)
    md = (tmp_path / "nav_eval.md").read_text()
    assert "| condition | episodes | success | SPL |" in md and md.count(f"| {SCENES[0].name} |") >= 3
    for name in ("nav_eval.png", "nav_eval_spl.png"):
        assert (tmp_path / name).stat().st_size > 1000
    assert len(list((tmp_path / "maps").glob("*.png"))) == 3
    assert "[3/3]" in capsys.readouterr().out


def test_a_scene_without_a_target_is_refused(tmp_path, capsys):
    data = SCENES[0].to_json()
    data.pop("target")
    (tmp_path / "no_target.json").write_text(json.dumps(data))
    assert (
        nav_eval.main(
            ["--scenes", str(tmp_path), "--builtin", "", "--policy", "scripted", "--out", str(tmp_path / "out")]
        )
        == 2
    )
    assert "names no target" in capsys.readouterr().err
