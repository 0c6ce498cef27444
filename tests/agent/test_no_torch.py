"""The robot side runs on a Jetson without PyTorch and without the server: nothing in agent/ may import
torch, transformers or anything of server_bridge/ (what both sides share lives in protocol/)."""

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_agent_never_imports_torch_or_the_server():
    code = (
        "import sys, agent.app.cli, agent.decoding.decoder, agent.decoding.drafter, agent.decoding.link, "
        "agent.app.daemon, agent.app.api, agent.app.navigator, "
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
        for pkg in ("agent", "protocol", "runtime")
        for p in (ROOT / pkg).rglob("*.py")
    }
    assert not {p: m for p, m in offenders.items() if m}


def test_protocol_and_runtime_import_only_numpy_msgpack_llama_cpp_and_the_standard_library():
    """protocol/ (the wire and the maths) takes numpy, msgpack and, where a grammar is compiled, llama.cpp
    (grammar.py's sampler; __init__.py loads its libraries first, for the native order) and LLGuidance
    (structured.py), which both sides run already; runtime/ is llama.cpp underneath both sides (the
    native libraries' order, libmtmd's images, llama.cpp's log), so llama_cpp is its own."""
    allowed = {"numpy", "msgpack", "protocol", "runtime", "tomli"} | set(
        sys.stdlib_module_names
    )  # tomli: tomllib on 3.10
    extra = {
        "protocol": {
            "grammar.py": {"llama_cpp"},
            "__init__.py": {"llama_cpp"},
            "structured.py": {"llguidance", "llama_cpp"},
        },
        "runtime": None,
    }
    for pkg, own in extra.items():
        for p in (ROOT / pkg).rglob("*.py"):
            may = {"llama_cpp"} if own is None else own.get(p.name, set())
            bad = {m for m in _imported_modules(p) if m.split(".")[0] not in allowed | may}
            assert not bad, f"{pkg}/{p.name} imports {bad}"
