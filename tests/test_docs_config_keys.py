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
NOT_KEYS = {"py", "jsonl", "json", "sock", "md", "toml", "yaml", "service", "png"}
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
