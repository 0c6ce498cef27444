"""Python 3.10 (JetPack 6, ROS 2 Humble): agent/, server_bridge/ and protocol/ use nothing newer.

No 3.10 interpreter can be installed on the development machine (none in its package registries),
so the check is static: vermin finds 3.11-only syntax, modules and APIs, and fails the build on one.
The one 3.11 module used, tomllib, has a fallback (tomli), exercised here by hiding tomllib.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("agent", "server_bridge", "protocol", "runtime")


def test_packages_need_nothing_newer_than_python_310():
    vermin = Path(sys.executable).with_name("vermin")
    assert vermin.exists(), "vermin is missing: it is in setup.py's dev extra (make setup installs it)"
    proc = subprocess.run(
        [str(vermin), "--target=3.10-", "--violations", "--eval-annotations", "--no-tips", *PACKAGES],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_configs_load_without_tomllib():
    """As on 3.10: `import tomllib` fails, and both processes' configs still parse (through tomli)."""
    code = """
import sys
sys.modules["tomllib"] = None                   # None in sys.modules makes the import fail
from agent.app import config
from server_bridge.config import ServerConfig
cfg = config.load("systemd/edge-agent.toml", ["safety.max_vx=0.3"])
server = ServerConfig.load("systemd/server-bridge.toml")
assert cfg.safety.max_vx == 0.3 and server.port > 0
assert config.tomllib.__name__ == "tomli"
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr


def test_async_code_catches_asyncio_timeouts():
    """On 3.10 asyncio.wait_for raises asyncio.TimeoutError, which is not the builtin TimeoutError (3.11 made
    them one): an `except TimeoutError` inside `async def` misses it there. vermin does not see this."""
    import ast

    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for fn in ast.walk(ast.parse(path.read_text(), str(path))):
                if not isinstance(fn, ast.AsyncFunctionDef):
                    continue
                for handler in ast.walk(fn):
                    if isinstance(handler, ast.ExceptHandler) and handler.type is not None:
                        names = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
                        if any(isinstance(n, ast.Name) and n.id == "TimeoutError" for n in names):
                            found.append(f"{path.relative_to(ROOT)}:{handler.lineno}")
    assert not found, f"use asyncio.TimeoutError in async code: {found}"
