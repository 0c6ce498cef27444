"""The robot side runs on a Jetson without PyTorch and without the server: nothing in agent/ may import
torch, transformers or anything of server_bridge/ (what both sides share lives in protocol/)."""

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_agent_never_imports_torch_or_the_server():
    code = (
        "import sys, agent.cli, agent.decoder, agent.drafter, agent.link, agent.daemon, agent.api, agent.nav, "
        "agent.robot.sim, agent.robot.perception, agent.robot.controllers.serial, agent.robot.scripted; "
        "bad = [m for m in ('torch', 'transformers', 'server_bridge') if m in sys.modules]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"agent imported {r.stdout.strip()}: {r.stderr[-500:]}"


def _imported_modules(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_no_module_of_agent_or_protocol_names_the_server_package():
    """Also the imports inside functions, which the import test above only sees when they run."""
    offenders = {
        str(p.relative_to(ROOT)): sorted(
            m for m in _imported_modules(p) if m.split(".")[0] in ("server_bridge", "torch", "transformers")
        )
        for pkg in ("agent", "protocol")
        for p in (ROOT / pkg).rglob("*.py")
    }
    assert not {p: m for p, m in offenders.items() if m}


def test_protocol_imports_only_numpy_msgpack_and_the_standard_library():
    """grammar.py also reaches llama.cpp's grammar sampler, which both sides run already, native.py
    imports llama_cpp (when installed) so that its libraries load before numpy's, vision.py runs
    libmtmd (llama.cpp's multimodal library) for the images of a prompt, on either side, and llamalog.py
    sets llama.cpp's log level (quiet unless EDGESPEC_VERBOSE)."""
    allowed = {"numpy", "msgpack"} | set(sys.stdlib_module_names)
    may_use_llama = {"grammar.py", "llamalog.py", "native.py", "vision.py"}
    for p in (ROOT / "protocol").rglob("*.py"):
        bad = {
            m
            for m in _imported_modules(p)
            if m.split(".")[0] not in allowed | ({"llama_cpp"} if p.name in may_use_llama else set())
        }
        assert not bad, f"{p.name} imports {bad}"
