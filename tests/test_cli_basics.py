"""What a user meets first on both CLIs: --version, --log-level on either side of the subcommand, one-line
errors (no traceback) for a misspelt target or a busy port, and the licence the project states."""

import re
import socket
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


@pytest.mark.parametrize("argv", [["--log-level", "DEBUG", "prepare", "--help"], ["prepare", "--log-level", "DEBUG"]])
def test_server_log_level_either_side_of_the_subcommand(argv):
    args = server_cli._parser().parse_args([a for a in argv if a != "--help"])
    assert args.log_level == "DEBUG" and args.cmd == "prepare"


def test_agent_log_level_either_side_of_the_subcommand(monkeypatch):
    seen = []
    monkeypatch.setattr(agent_cli, "_setup_logging", seen.append)
    monkeypatch.setattr(agent_cli, "_generate", lambda args: 0)
    assert agent_cli.main(["--log-level", "DEBUG", "generate", "--prompt", "hi"]) == 0
    assert agent_cli.main(["generate", "--prompt", "hi", "--log-level", "ERROR"]) == 0
    assert agent_cli.main(["generate", "--prompt", "hi"]) == 0
    assert seen == ["DEBUG", "ERROR", "WARNING"]


def test_server_errors_are_one_line(capsys):
    assert server_cli.main(["serve", "--target", "no-such-model", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "server-bridge: target 'no-such-model'" in err and "Traceback" not in err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert server_cli.main(["serve", "--port", str(port)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"server-bridge: cannot listen on 127.0.0.1:{port}") and "Traceback" not in "".join(err)


def test_a_changelog_starts_now():
    text = (ROOT / "CHANGELOG.md").read_text()
    assert text.startswith("# Changelog") and re.search(r"^## .*\(\d{4}-\d{2}-\d{2}\)$", text, re.M)


def test_generate_streams_and_a_first_ctrl_c_ends_it_at_the_next_commit(capsys):
    import signal

    stream = agent_cli._Stream(lambda ids: "".join(chr(97 + i) for i in ids))
    with stream.catching_sigint():
        assert stream([0]) is False and stream([0, 1]) is False
        assert capsys.readouterr().out == "ab"  # each committed token on stdout as it comes
        signal.raise_signal(signal.SIGINT)  # no KeyboardInterrupt inside the model: a flag
        assert stream([0, 1, 2]) is True and stream.interrupted
    stream.end([0, 1, 2, 3])
    assert capsys.readouterr().out == "cd\n" and signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.real
def test_ctrl_c_ends_generate_with_what_was_committed(tmp_path):
    """A real Ctrl-C to `edge-agent generate --local`: exit 130, the text so far on stdout, one line on stderr."""
    import os
    import signal
    import subprocess
    import sys
    import time

    cmd = [
        sys.executable,
        "-m",
        "agent.app.cli",
        "generate",
        "--local",
        "--chat",
        "--max-tokens",
        "2000",
        "--threads",
        "1",
    ]
    p = subprocess.Popen(
        [*cmd, "--prompt", "Write a very long story about a robot dog."],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert p.stdout is not None
    first = p.stdout.read(8)  # streamed: text before the generation ends
    time.sleep(0.3)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130 and first
    assert "Traceback" not in err.decode() and err.decode().strip().splitlines()[-1].startswith(
        "edge-agent: interrupted"
    )
    assert len((first + out).split()) > 1
