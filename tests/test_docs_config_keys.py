"""Every `section.field` of edge-agent's config that the guides, the deploy files and the units name exists.

A guide that names a key the config does not have (the Kubernetes guide once told robots to set
`link.token`, which never existed: the token is read from the variable `link.token_env` names) sends an
operator to a setting that the config refuses at start.
"""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

from agent.app.config import Config

ROOT = Path(__file__).resolve().parent.parent
SECTIONS = {f.name: {g.name for g in fields(type(f.default))} for f in fields(Config)}  # section -> its fields
# file names that look like keys: agent/app/api.py, telemetry.jsonl, api.sock
# and module paths: python -m agent.robot.go2_sim
NOT_KEYS = {"py", "jsonl", "json", "sock", "md", "toml", "yaml", "service", "png", "robot"}
KEY = re.compile(r"(?<![\w/.\-])(" + "|".join(SECTIONS) + r")\.([a-z_][a-z0-9_]*)(?![\w(])")


def documents() -> list[Path]:
    suffixes = {".md", ".toml", ".yaml", ".yml", ".cfg", ".service"}
    found = [ROOT / "README.md"]
    for folder in ("docs", "deploy", "systemd"):
        found += sorted(p for p in (ROOT / folder).rglob("*") if p.suffix in suffixes)
    return found


def named_keys(text: str) -> list[tuple[str, str]]:
    return [(m[1], m[2]) for m in KEY.finditer(text) if m[2] not in NOT_KEYS]


def test_the_scan_finds_keys_and_skips_file_names():
    text = "set `link.token_env`, see agent/app/api.py and `api.py`, telemetry.jsonl, `robot.options.port = 1`"
    assert named_keys(text) == [("link", "token_env"), ("robot", "options")]


def test_every_config_key_the_documents_name_exists():
    unknown = []
    for path in documents():
        for section, name in named_keys(path.read_text()):
            if name not in SECTIONS[section]:
                unknown.append(f"{path.relative_to(ROOT)}: {section}.{name}")
    assert not unknown, "keys edge-agent's config does not have:\n" + "\n".join(unknown)


def test_a_made_up_key_is_caught():
    assert "token" not in SECTIONS["link"]
    assert ("link", "token") in named_keys("robots: link.token = the token")


# ------------------------------------------------------------------ the reference page and the example

REFERENCE = ROOT / "docs" / "guide" / "configuration.md"
REGENERATE = "PYTHONPATH=$PWD .venv/bin/python -m tests.test_docs_config_keys"


def tool_configs() -> dict[str, type]:
    """Each operator subcommand's flags, declared in server_bridge/config.py (loadtest has two dataclasses)."""
    from server_bridge import config as c

    return {
        "profile": c.ProfileConfig,
        "train-exits": c.TrainExitsConfig,
        "plan": c.PlanConfig,
        "fleet": c.FleetConfig,
        "loadtest": c.LoadtestConfig,
        "loadtest (the robots)": c.LoadConfig,
    }


TOOL_CONFIGS = tool_configs()


def reference_page() -> str:
    """docs/guide/configuration.md, generated from the declarations (agent/app/config.py, server_bridge/config.py)."""
    from agent.app.config import NOTES, GenerateOptions, ServeOptions
    from runtime import settings
    from server_bridge.config import ServerConfig

    out = [
        "# Configuration reference",
        "",
        "<!-- generated from agent/app/config.py and server_bridge/config.py by",
        f"     {REGENERATE} ; do not edit by hand -->",
        "",
        "Each process has one typed configuration, declared once: a dataclass field with its type, default and",
        "help. The TOML readers, the flags, the errors and this page are derived from those declarations",
        "(runtime/settings.py). A value of the wrong type or a key that does not exist is refused at start,",
        "with the key named.",
        "",
        "## edge-agent run",
        "",
        "`edge-agent run --config /etc/edgespec/edge-agent.toml` reads these tables (systemd/edge-agent.toml is",
        "the annotated example, with every key). Any key can be set on the command line with",
        '`--set section.key=VALUE` (the value is TOML; one key of a table: `--set robot.options.scene="red_box"`);',
        "the keys with a flag of their own take it too (`--verifier URL` is `--set link.verifier=URL`).",
    ]
    for f in fields(Config):
        out += ["", f"### [{f.name}]", ""]
        out += settings.reference(type(f.default), flags="declared", notes=NOTES.get(f.name))
    out += [
        "",
        "## edge-agent generate",
        "",
        "One prompt, decoded once, with its metrics: `edge-agent generate --prompt TEXT --verifier URL`.",
        "",
    ]
    out += settings.reference(GenerateOptions, flags="all", keys=False)
    out += [
        "",
        "## edge-agent serve",
        "",
        "An OpenAI-compatible endpoint on the robot (docs/guide/openai.md): `edge-agent serve --verifier URL",
        "--listen HOST:PORT --api-key-file FILE`.",
        "",
    ]
    out += settings.reference(ServeOptions, flags="all", keys=False)
    out += [
        "",
        "## server-bridge serve",
        "",
        "`server-bridge serve --config /etc/edgespec/server-bridge.toml` reads the `[server]` table (or the",
        "file's top level; systemd/server-bridge.toml is the example). Every key is also a flag, which",
        "overrides the file: `max_sessions` is `--max-sessions`; a list is comma-separated",
        "(`--trusted-proxies 127.0.0.1/32,10.0.0.0/8`), a boolean `--trust-loopback` / `--no-trust-loopback`.",
        "",
    ]
    out += settings.reference(ServerConfig, flags="all")
    out += [
        "",
        "## The other server-bridge subcommands",
        "",
        "Flags only; `server-bridge COMMAND --help` says the same.",
    ]
    for command, cls in TOOL_CONFIGS.items():
        out += ["", f"### server-bridge {command}", ""]
        out += settings.reference(cls, flags="all", keys=False)
    return "\n".join(out) + "\n"


def test_the_reference_page_is_the_generated_one():
    assert REFERENCE.read_text() == reference_page(), f"{REFERENCE.relative_to(ROOT)} is stale: run {REGENERATE}"


def test_every_setting_has_help():
    from agent.app.config import NOTES, GenerateOptions, ServeOptions
    from runtime import settings
    from server_bridge.config import ServerConfig

    for f in fields(Config):
        assert all(settings.help_of(g, NOTES.get(f.name)) for g in fields(type(f.default))), f.name
    for cls in (GenerateOptions, ServeOptions, ServerConfig, *TOOL_CONFIGS.values()):
        assert all(settings.help_of(g) for g in fields(cls)), cls.__name__


def test_the_annotated_examples_hold_every_key():
    """systemd/edge-agent.toml sets every key of every section; systemd/server-bridge.toml names every key
    (trust_loopback, unset by default, which TOML cannot write, as a comment)."""
    from runtime.settings import tomllib
    from server_bridge.config import ServerConfig

    example = tomllib.loads((ROOT / "systemd" / "edge-agent.toml").read_text())
    missing = [f"{s}.{k}" for s, keys in SECTIONS.items() for k in sorted(keys) if k not in example.get(s, {})]
    assert not missing, f"systemd/edge-agent.toml lacks {missing}"
    server = (ROOT / "systemd" / "server-bridge.toml").read_text()
    named = set(re.findall(r"^#?\s*([a-z_0-9]+)\s*=", server, re.M))
    assert not [f.name for f in fields(ServerConfig) if f.name not in named]


if __name__ == "__main__":  # regenerate docs/guide/configuration.md
    REFERENCE.write_text(reference_page())
    print(f"wrote {REFERENCE.relative_to(ROOT)}")
