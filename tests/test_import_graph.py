"""No import cycles in the packages or the tools: every `import` (at module level or inside a
function) of a module of this repository is an edge, and the graph of those edges has no cycle."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("agent", "protocol", "runtime", "server_bridge", "tools")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def repo_modules() -> dict[str, Path]:
    """module name -> file, for every .py file under PACKAGES."""
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def imported(node: ast.AST, module: str, is_package: bool, modules: dict[str, Path]) -> set[str]:
    """The repository modules one import statement reaches. `import a.b.c` runs a, a.b and a.b.c;
    `from a.b import c` runs a and a.b, and a.b.c when c is a submodule. A module's own packages are
    imported before it anyway, so an edge to one of them counts only when a name is taken from it
    (`from . import NAME` in a submodule, NAME not a submodule: the package's __init__ must have run)."""

    def chain(name: str) -> set[str]:
        return {p for p in (".".join(name.split(".")[: i + 1]) for i in range(name.count(".") + 1)) if p in modules}

    own = set(chain(module)) - {module}
    if isinstance(node, ast.Import):
        return set().union(*(chain(a.name) for a in node.names)) - own - {module}
    assert isinstance(node, ast.ImportFrom)
    if node.level:
        package = module if is_package else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{node.module}" if node.module else package
    else:
        base = node.module or ""
    subs = {f"{base}.{a.name}" for a in node.names} & modules.keys()
    names_from_base = len(subs) < len(node.names)
    out = (chain(base) - own) | subs
    if names_from_base and base in modules:
        out.add(base)
    return out - {module}


def import_graph() -> dict[str, set[str]]:
    modules = repo_modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        edges: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges |= imported(node, name, path.name == "__init__.py", modules)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path [a, b, ..., a], or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    for root in sorted(graph):
        if root in state:
            continue
        stack = [(root, iter(sorted(graph[root])))]
        path = [root]
        state[root] = 1
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                path.pop()
                state[node] = 2
            elif state.get(child) == 1:
                return path[path.index(child) :] + [child]
            elif child not in state:
                state[child] = 1
                path.append(child)
                stack.append((child, iter(sorted(graph.get(child, ())))))
    return None


def test_the_graph_sees_imports():
    graph = import_graph()
    assert "server_bridge.engines" in graph["server_bridge.verifier"] or graph["server_bridge.verifier"]
    assert "protocol.images" in graph["protocol.wire"]  # `from . import images as image_wire`
    assert "protocol" in graph["agent.decoding.drafter"]  # `from protocol import modelfiles`


def test_find_cycle_reports_the_path():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


# Who may import whom: a module under a key imports only modules under one of the listed prefixes, or
# the packages those sit in (importing `a.b.c` runs `a` and `a.b`). The decoding client (agent.decoding)
# knows nothing of the robot application, the robot or the server; protocol/ and runtime/ know
# nothing of either side; agent/ never imports server_bridge/.
ALLOWED = {
    "runtime": ("runtime", "protocol.images"),
    "protocol": ("protocol",),
    "agent": ("agent", "runtime.native"),
    "agent.decoding": ("agent.decoding", "protocol", "runtime"),
    "agent.client": ("agent.client", "agent.decoding", "protocol", "runtime"),
    "agent.robot": ("agent.robot", "protocol"),
    "agent.app": ("agent.app", "agent.client", "agent.decoding", "agent.robot", "protocol", "runtime"),
    "server_bridge": ("server_bridge", "protocol", "runtime"),
    "server_bridge.engines": ("server_bridge.engines", "server_bridge.exits", "protocol", "runtime"),
}


def layer(module: str) -> str | None:
    """The most specific key of ALLOWED that `module` falls under."""
    keys = [k for k in ALLOWED if module == k or module.startswith(k + ".")]
    return max(keys, key=len) if keys else None


def allowed(module: str, target: str) -> bool:
    prefixes = ALLOWED[layer(module)]
    parents = {".".join(p.split(".")[:i]) for p in prefixes for i in range(1, p.count(".") + 1)}
    return target in parents or any(target == p or target.startswith(p + ".") for p in prefixes)


def test_layering():
    graph = import_graph()
    bad = [f"{m} -> {t}" for m, edges in graph.items() if layer(m) for t in edges if not allowed(m, t)]
    assert not bad, "imports across layers:\n" + "\n".join(sorted(bad))


def test_layering_catches_a_crossing():
    assert allowed("agent.app.cli", "agent.decoding.decoder") and allowed("agent.decoding.decoder", "agent")
    assert not allowed("agent.decoding.decoder", "agent.app.navigator")
    assert not allowed("agent.decoding.decoder", "agent.robot.camera")
    assert not allowed("agent.app.daemon", "server_bridge.verifier")
    assert not allowed("protocol.wire", "agent.decoding.link")
    assert not allowed("server_bridge.engines.torch", "server_bridge.verifier")


def test_the_verify_path_never_imports_the_operator_tools():
    """server_bridge/ops/ (plan, profile, fleet, ...) sits beside the verifier: only the CLI reaches it."""
    graph = import_graph()
    bad = [
        f"{m} -> {t}"
        for m, edges in graph.items()
        if m.startswith("server_bridge.") and not m.startswith("server_bridge.ops") and m != "server_bridge.cli"
        for t in edges
        if t.startswith("server_bridge.ops")
    ]
    assert not bad, "\n".join(sorted(bad))
