"""The camera line names what blocks the way ahead when the range source says so (nav.blocked_m)."""

import pytest

from agent.app import config
from agent.app.prompt import blocked_text
from agent.robot.perception import Sighting


def test_the_way_ahead_is_named_blocked_below_the_threshold_only():
    assert blocked_text(0.3, [], 0.5) == "; the way ahead is blocked, 0.3 m away"
    assert blocked_text(0.7, [], 0.5) == ""  # far enough
    assert blocked_text(None, [], 0.5) == ""  # no range source or no reading
    assert blocked_text(0.1, [], 0.0) == ""  # off


def test_the_target_itself_ahead_is_not_an_obstacle():
    box_ahead = Sighting("green box", 2.0, 0.5, "sim")
    box_aside = Sighting("green box", 40.0, 0.5, "sim")
    assert blocked_text(0.3, [box_ahead], 0.5) == ""  # walking up to it is the task
    assert blocked_text(0.3, [box_aside], 0.5).startswith("; the way ahead is blocked")
    assert blocked_text(0.3, [Sighting("green box", 0.0, 3.0, "sim")], 0.5) != ""  # a wall before the box


def test_nav_blocked_m_is_read_and_checked():
    assert config.load(None, ["nav.blocked_m=0.6"]).nav.blocked_m == 0.6
    assert config.load(None, []).nav.blocked_m == 0.0
    with pytest.raises(config.ConfigError, match="blocked_m"):
        config.load(None, ["nav.blocked_m=-1"])


def test_the_daemon_reads_the_range_ahead_from_the_simulator_when_asked():
    from agent.app.daemon import Daemon
    from tests.agent.app.test_go2_daemon import RecordingNotifier, StubDrafter

    for blocked_m, expect_reading in ((5.0, True), (0.0, False)):
        cfg = config.load(None, ['robot.controller="sim"', 'telemetry.path=""', f"nav.blocked_m={blocked_m}"])
        d = Daemon(cfg, drafter=StubDrafter(), notifier=RecordingNotifier()).start()
        try:
            reading = d.nav._clearance_ahead()
            if expect_reading:
                assert reading == pytest.approx(d.controller.ranges.clearance_m(0.0)) and 0 < reading < 5
                assert d.safety.limits.min_clearance_m > 0  # and the obstacle stop is on
            else:
                assert reading is None
        finally:
            d.close()
