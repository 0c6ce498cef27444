"""The commands README.md and docs/guide/navigation.md show work as written: each `edge-agent` and
`server-bridge` command of their ```bash blocks runs (the port it serves on swapped for a free one, the state
and runtime directories put in a temporary folder) and prints what the page says it prints. A command that
cannot run here (a real robot, systemd) is in SKIP with the reason. One real navigation, about a minute."""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = ("README.md", "docs/guide/navigation.md")
DOC_PORT = "8765"  # the port the pages serve on and point the robot at
SKIP = {
    "edge-agent run --config /etc/edgespec/edge-agent.toml": "the robot's own config under systemd (a Go2, its camera)",
}
STEP = re.compile(r"^\[ ?\d+\] (VERIFIED|OFFLINE/\w+|HALTED) +\d+\.\ds  (sees|held): ")


def doc_commands(text: str) -> list[str]:
    """The `edge-agent` / `server-bridge` commands of a page's ```bash blocks, continuation lines joined and
    comments dropped, in order."""
    out = []
    for block in re.findall(r"^ *```bash\n(.*?)^ *```", text, re.M | re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            background = bool(words) and words[-1] == "&"
            words = words[:-1] if background else words
            if words and words[0] in ("edge-agent", "server-bridge"):
                out.append(shlex.join(words) + (" &" if background else ""))
    return out


def all_commands() -> list[str]:
    seen: list[str] = []
    for page in PAGES:
        seen += [c for c in doc_commands((ROOT / page).read_text()) if c not in seen]
    return seen


def test_the_pages_show_the_commands_this_test_runs():
    commands = all_commands()
    assert any(c.startswith("server-bridge serve") and c.endswith("&") for c in commands)
    assert sum(c.startswith("edge-agent run") for c in commands) >= 3
    text = "```bash\nedge-agent run --a 1 \\\n    --b 'x y'   # what it does\nmake demo\n```\n"
    assert doc_commands(text) == ["edge-agent run --a 1 --b 'x y'"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    folder = tmp_path_factory.mktemp("doc-commands")
    bin_dir = str(Path(sys.executable).parent)  # edge-agent, server-bridge of this venv
    return {
        **os.environ,
        "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
        "PYTHONPATH": str(ROOT),
        "XDG_STATE_HOME": str(folder / "state"),
        "XDG_RUNTIME_DIR": str(folder / "run"),
        "VERIFIER_TOKEN": "",
    }


@pytest.fixture(scope="module")
def verifier(env):
    """The pages' `server-bridge serve ... &`, as written, on a free port; its URL."""
    (command,) = [c for c in all_commands() if c.startswith("server-bridge serve")]
    port = _free_port()
    words = [port if w == DOC_PORT else w for w in shlex.split(command.rstrip("& "))]
    proc = subprocess.Popen([str(w) for w in words], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                socket.create_connection(("127.0.0.1", port), 0.5).close()
                break
            except OSError:
                time.sleep(0.5)
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        yield f"ws://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(30)


def _cases() -> list:
    return [
        pytest.param(c, id=f"cmd{i}", marks=[pytest.mark.skip(reason=SKIP[c])] if c in SKIP else [])
        for i, c in enumerate(c for c in all_commands() if c.startswith("edge-agent"))
    ]


@pytest.mark.real
@pytest.mark.parametrize("command", _cases())
def test_each_command_runs_as_written_and_prints_what_the_page_says(command, verifier, env):
    words = [w.replace(f"ws://127.0.0.1:{DOC_PORT}", verifier) for w in shlex.split(command)]
    r = subprocess.run(words, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    steps = [line for line in lines if STEP.match(line)]
    assert steps, r.stdout[-2000:]  # a line per step, the demo's
    assert "prefilling the prompt" in r.stderr and "edge-agent: ready" in r.stderr
    assert (Path(env["XDG_STATE_HOME"]) / "edge-agent" / "telemetry.jsonl").is_file()  # not ./telemetry.jsonl
    if "--json" in words:  # the README's: the last line is the JSON, and the robot got there
        out = json.loads(lines[-1])
        assert {"reached", "steps", "spl", "verified_steps"} <= set(out)
        assert out["reached"] and out["end"] == "done" and out["target"] == "red box", out
        assert out["steps"] == len(steps)
    if "--max-steps" in words:
        assert len([s for s in steps if " sees: " in s]) <= int(words[words.index("--max-steps") + 1])
