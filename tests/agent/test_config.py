"""edge-agent run's config: TOML sections, --set overrides, validation that says what is wrong."""

import pytest

from agent.app import config
from agent.app.config import ConfigError

EXAMPLE = "systemd/edge-agent.toml"


def test_the_shipped_example_loads():
    cfg = config.load(EXAMPLE)
    assert cfg.robot.controller == "go2" and cfg.offline.policy == "hold" and cfg.link.keepalive_s <= 2


def test_overrides_win_and_are_typed(tmp_path):
    cfg = config.load(
        EXAMPLE,
        [
            "robot.controller=sim",
            "camera.source=sim",
            "perception.kind=sim",
            "safety.max_vx=0.3",
            'robot.options={ scene = "red_box" }',
            "offline.policy=local",
        ],
    )
    assert cfg.robot.controller == "sim" and cfg.safety.max_vx == 0.3 and cfg.robot.options == {"scene": "red_box"}
    assert cfg.offline.policy == "local"


@pytest.mark.parametrize(
    "override,msg",
    [
        ("safety.max_vx=-1", "max_vx"),
        ("offline.policy=fly", "offline.policy"),
        ("link.keepalive_s=20", "keepalive"),
        ("robot.control_hz=5", "10 Hz"),
        ("agent.mode=xyz", "agent.mode"),
        ("nope.x=1", "section"),
        ("agent.colour=1", "no field"),
        ("link.verifier=http://x", "ws://"),
        ('api.listen="8770"', "HOST:PORT"),
        ("api.listen=8770", "api.listen must be str"),
        ("safety.deadman_s=true", "deadman_s must be float"),
    ],
)
def test_bad_values_are_refused_with_the_field_named(override, msg):
    with pytest.raises(ConfigError, match=msg):
        config.load(None, [override])


def test_sim_camera_needs_the_sim_robot():
    with pytest.raises(ConfigError, match="sim"):
        config.load(None, ["robot.controller=serial", "camera.source=sim"])


def test_bad_toml_and_missing_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[agent\nx=")
    with pytest.raises(ConfigError, match="bad.toml"):
        config.load(bad)
    with pytest.raises(ConfigError, match="not found"):
        config.load(tmp_path / "missing.toml")
