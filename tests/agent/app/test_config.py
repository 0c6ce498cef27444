"""edge-agent run's config: TOML sections, --set overrides, validation that says what is wrong."""

import types
from dataclasses import fields

import pytest

from agent.app import config
from agent.app.config import ConfigError
from agent.app.navigator import Navigator
from agent.decoding.link import default_robot_id
from agent.decoding.settings import DraftingSettings, DraftModelSettings, LinkSettings

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


def test_the_daemon_builds_the_navigator_and_the_decoder_from_the_config():
    """The navigator reads the config's sections; [agent] and [link] inherit DecoderSettings' parts, so every
    key of theirs arrives in the decoder's settings by its own name (no table of renames to forget a field in)."""
    from agent.app import daemon

    cfg = config.load(
        EXAMPLE,
        [
            "agent.seed=7",
            "agent.reach_m=0.9",
            "camera.max_age_ms=321",
            "offline.max_turn_deg=30",
            "link.reconnect_backoff_s=0.3",
            "nav.blocked_m=0.5",
            "link.verify_timeout_s=1.5",
            "agent.slo_tokens_per_s=9",
        ],
    )
    nav = Navigator(types.SimpleNamespace(drafter=None), None, None, None, cfg)
    assert (nav.params.seed, nav.links.backoff, nav.memory.max_steps) == (7, 0.3, cfg.nav.memory_steps)
    dec = daemon.decoder_settings(cfg, "secret")
    assert (dec.url, dec.token, dec.verify_timeout_s, dec.slo_tokens_per_s) == (cfg.link.verifier, "secret", 1.5, 9)
    assert dec.reconnect.backoff_s == 0.3 and dec.payload_spec.kind == cfg.agent.payload and dec.keepalive_s == 1.0
    assert dec.reconnect.max_attempts == 1 and dec.fsd.exits is None and dec.trace is None  # the library's
    for part in (DraftModelSettings, DraftingSettings, LinkSettings):
        for f in fields(part):
            section = cfg.link if part is LinkSettings else cfg.agent
            want = default_robot_id() if f.name == "robot_id" and not section.robot_id else getattr(section, f.name)
            assert getattr(dec, f.name) == want, f.name
    assert (dec.draft, dec.threads, dec.mode, dec.gamma) == (cfg.agent.draft, cfg.agent.threads, "sd", cfg.agent.gamma)


def test_a_value_of_the_wrong_type_names_the_key_and_the_type(tmp_path):
    toml = tmp_path / "robot.toml"
    toml.write_text('[link]\nkeepalive_s = "fast"\n')
    with pytest.raises(ConfigError, match="link.keepalive_s must be float, got 'fast'"):
        config.load(toml)
    toml.write_text("link = 1\n")
    with pytest.raises(ConfigError, match=r"\[link\] must be a table"):
        config.load(toml)


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"listen": "unix:/tmp/x.sock"}, "--listen is HOST:PORT"),
        ({"listen": "8080"}, "--listen"),
        ({"listen": "0.0.0.0:8080"}, "not loopback"),
        ({"api_key": "k" * 24, "api_key_file": "/etc/key"}, "give one"),
    ],
)
def test_edge_agent_serve_refuses_a_listen_address_it_cannot_guard(kw, match):
    """`edge-agent serve`: HOST:PORT only, and a key before anything beyond loopback may ask."""
    from agent.app.config import ServeOptions

    with pytest.raises(config.ConfigError, match=match):
        ServeOptions(**kw)
    assert ServeOptions(listen="0.0.0.0:8080", api_key_file="/etc/key").listen == "0.0.0.0:8080"
