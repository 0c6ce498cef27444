"""The code's shape: tools/ stays under a third of the code, no product function outgrows a screen, one
function makes the decoding client's draft model and decoder, and the robot side declares each setting once."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COUNTED = ("agent", "server_bridge", "protocol", "runtime", "tools")
PRODUCT = ("agent", "server_bridge", "protocol", "runtime")
MAX_FUNCTION_LINES = 80
BUILT_IN_ONE_PLACE = ("Drafter", "EdgeDecoder")  # made by open_decoder only: one way from settings to a decoder
OPENER = ("agent/decoding/__init__.py", "open_decoder")


def lines(package: str, root: Path = ROOT) -> int:
    """`find PACKAGE -name '*.py' | xargs cat | wc -l`: newlines in its Python files."""
    return sum(p.read_bytes().count(b"\n") for p in (root / package).rglob("*.py"))


def long_functions(package: str, root: Path = ROOT) -> list[str]:
    """path:line name (N lines) of every function or method longer than MAX_FUNCTION_LINES."""
    out = []
    for path in sorted((root / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    out.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({n} lines)")
    return out


def stray_builds(package: str, root: Path = ROOT) -> list[str]:
    """path:line name of every call of Drafter(...) or EdgeDecoder(...) (by name or attribute) outside
    OPENER's function."""
    out = []
    for path in sorted((root / package).rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        where = path.relative_to(root).as_posix()
        inside = {
            id(n)
            for fn in ast.walk(tree)
            if isinstance(fn, ast.FunctionDef) and (where, fn.name) == OPENER
            for n in ast.walk(fn)
        }
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or id(node) in inside:
                continue
            func = node.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
            if name in BUILT_IN_ONE_PLACE:
                out.append(f"{where}:{node.lineno} {name}")
    return out


def settings_declared(package: str, root: Path = ROOT) -> dict[str, list[str]]:
    """field name -> the classes that declare it with `setting(...)` in their own body (a field inherited from
    another settings class, or a settings class held as a field, declares nothing)."""
    out: dict[str, list[str]] = {}
    for path in sorted((root / package).rglob("*.py")):
        for cls in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(cls, ast.ClassDef):
                continue
            for st in cls.body:
                if (
                    isinstance(st, ast.AnnAssign)
                    and isinstance(st.target, ast.Name)
                    and isinstance(st.value, ast.Call)
                    and getattr(st.value.func, "id", None) == "setting"
                ):
                    out.setdefault(st.target.id, []).append(cls.name)
    return out


# One name, two settings: each its own thing in its own table or command, not one setting declared twice.
NAMESAKES = {
    "allow_remote": ["ApiSection", "RecordSection"],  # the local API on a non-loopback address; the live camera view
    "jpeg_quality": ["PerceptionSection", "RecordSection"],  # the image sent to the models; the recorded frames
    "listen": ["ApiSection", "ServeOptions"],  # the daemon's local API; serve's OpenAI endpoint
    "max_bytes": ["TelemetrySection", "RecordSection"],  # the telemetry log's rotation; the recording's size
    "path": ["TelemetrySection", "RecordSection"],  # where each of the two files goes
    "token": ["ApiSection", "DecoderSettings"],  # the local API's own credential; the verifier's bearer token
}


def test_tools_are_under_a_third_of_the_code():
    counts = {p: lines(p) for p in COUNTED}
    share = counts["tools"] / sum(counts.values())
    assert share < 1 / 3, f"tools/ is {share:.1%} of the code ({counts}); move product capabilities out of it"


def test_no_product_function_is_over_80_lines():
    found = [f for p in PRODUCT for f in long_functions(p)]
    assert not found, "functions over 80 lines:\n" + "\n".join(found)


def test_the_measures_see_what_they_measure(tmp_path):
    body = "\n".join(f"    x = {i}" for i in range(MAX_FUNCTION_LINES))
    text = f"def short():\n    pass\n\n\nasync def long():\n{body}\n"
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(text)
    assert lines("pkg", tmp_path) == 5 + MAX_FUNCTION_LINES
    found = long_functions("pkg", tmp_path)
    assert len(found) == 1 and f"long ({MAX_FUNCTION_LINES + 1} lines)" in found[0]


MAX_CLASS_LINES = 400
CLASSES_CHECKED = PRODUCT


def long_classes(package: str, root: Path = ROOT) -> list[str]:
    """path:line name (N non-blank lines) of every class with more than MAX_CLASS_LINES non-blank lines."""
    out = []
    for path in sorted((root / package).rglob("*.py")):
        text = path.read_text()
        source = text.splitlines()
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, ast.ClassDef):
                n = sum(1 for line in source[node.lineno - 1 : node.end_lineno] if line.strip())
                if n > MAX_CLASS_LINES:
                    out.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({n} non-blank lines)")
    return out


def test_no_product_class_is_over_400_lines():
    """A class that size does several things (BridgeServer did: HTTP, admission, handshake, dispatch, drain)."""
    found = [f for p in CLASSES_CHECKED for f in long_classes(p)]
    assert not found, "classes over 400 non-blank lines:\n" + "\n".join(found)


def test_the_class_measure_counts_non_blank_lines(tmp_path):
    body = "\n\n".join(f"    x{i} = {i}" for i in range(MAX_CLASS_LINES))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(f"class Small:\n    pass\n\n\nclass Big:\n{body}\n")
    found = long_classes("pkg", tmp_path)
    assert len(found) == 1 and f"Big ({MAX_CLASS_LINES + 1} non-blank lines)" in found[0]


# The unit tests of the Drafter itself, which build it with what open_decoder does not take (a context size for
# the target's GGUF as a second draft, llama.cpp's loader replaced): every other test goes through open_decoder.
DRAFTER_UNIT_TESTS = ("tests/agent/decoding/test_offload.py", "tests/agent/decoding/test_vision_mrope.py")


def test_only_open_decoder_makes_a_drafter_or_a_decoder():
    found = [f for p in ("agent", "tools", "tests") for f in stray_builds(p)]
    found = [f for f in found if f.partition(":")[0] not in DRAFTER_UNIT_TESTS]
    assert not found, "build these through agent.decoding.open_decoder(settings, drafter):\n" + "\n".join(found)


def test_stray_builds_are_found(tmp_path):
    opener, name = OPENER
    (tmp_path / opener).parent.mkdir(parents=True)
    (tmp_path / opener).write_text(f"def {name}(s):\n    return EdgeDecoder(Drafter(s), s)\n")
    (tmp_path / "agent" / "m.py").write_text("import x\nd = x.Drafter()\n\n\ndef f(d):\n    return EdgeDecoder(d)\n")
    assert stray_builds("agent", tmp_path) == ["agent/m.py:2 Drafter", "agent/m.py:6 EdgeDecoder"]


def test_each_setting_of_the_robot_side_is_declared_once():
    twice = {name: sorted(classes) for name, classes in settings_declared("agent").items() if len(classes) > 1}
    known = {name: sorted(classes) for name, classes in NAMESAKES.items()}
    assert twice == known, (
        "declare a setting once (embed or inherit its settings class); declared more than once: "
        + str({n: c for n, c in twice.items() if known.get(n) != c})
        + "; listed but no longer twice: "
        + str(sorted(n for n in known if n not in twice))
    )


def test_settings_declared_twice_are_found(tmp_path):
    (tmp_path / "agent").mkdir()
    (tmp_path / "agent" / "m.py").write_text(
        "class A:\n    x: int = setting(1, help='')\n    y: int = 2\n\n\n"
        "class B(A):\n    x: int = setting(2, help='')\n    a: A = A()\n\n\n"
        "class C(A):\n    z: int = setting(3, help='')\n"
    )
    assert settings_declared("agent", tmp_path) == {"x": ["A", "B"], "z": ["C"]}


# The server's namesakes: one name, each command's own thing (serve's listening port and fleet's balancer port;
# profile's prompt lengths and train-exits' prompt file; profile's coefficients file and train-exits' folder;
# serve's estimator found by its target, plan's an example fit with no target to find one by).
SERVER_NAMESAKES = {
    "port": ["ServerConfig", "FleetConfig"],
    "prompts": ["ProfileConfig", "TrainExitsConfig"],
    "out": ["ProfileConfig", "TrainExitsConfig"],
    "estimator": ["ServerConfig", "PlanConfig"],
}


def test_each_setting_of_the_server_side_is_declared_once():
    twice = {name: sorted(classes) for name, classes in settings_declared("server_bridge").items() if len(classes) > 1}
    known = {name: sorted(classes) for name, classes in SERVER_NAMESAKES.items()}
    assert twice == known, f"declare a setting once (inherit its settings class): {twice}"
