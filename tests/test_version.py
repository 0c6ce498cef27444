"""Both CLIs answer --version with the installed version, and the project states its licence."""

import re
from pathlib import Path

import pytest

from agent.app import cli as agent_cli
from runtime import settings
from server_bridge import cli as server_cli

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("main,prog", [(agent_cli.main, "edge-agent"), (server_cli.main, "server-bridge")])
def test_version(main, prog, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    out = capsys.readouterr().out.strip()
    assert out == f"{prog} {settings.version()}" and re.fullmatch(r"\S+ \d+\.\d+\.\d+\S*", out)


def test_licence_is_stated():
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License")
    assert 'license="MIT"' in (ROOT / "setup.py").read_text()
