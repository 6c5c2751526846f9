"""kvzip_eval's modules import one another without cycles (imports inside functions too: a
lazy import still ties two modules into one unit that cannot be read or changed alone)."""

from __future__ import annotations

import ast
from pathlib import Path

import kvzip_eval

ROOT = Path(kvzip_eval.__file__).parent
PACKAGE = "kvzip_eval"


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join((PACKAGE, *parts))] = path
    return out


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The package module ``name`` denotes: itself, or (``from pkg import attr``) its parent."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: from the module's package
                    base = mod.split(".")
                    base = base[: len(base) - node.level + (1 if is_pkg else 0)]
                    prefix = ".".join(base + ([node.module] if node.module else []))
                else:
                    prefix = node.module or ""
                # `from pkg import sub` imports the submodule when there is one
                targets = [f"{prefix}.{a.name}" for a in node.names] or [prefix]
            for t in targets:
                if t == PACKAGE or t.startswith(PACKAGE + "."):
                    dep = _resolve(t, modules)
                    if dep and dep != mod:
                        graph[mod].add(dep)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a list of modules (first == last), or None (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                return [*stack[stack.index(d) :], d]
            if d not in state and (c := visit(d)):
                return c
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (c := visit(m)):
            return c
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_graph_sees_lazy_and_from_imports():
    g = import_graph()
    # cmd_eval imports cmd_calibrate inside a function; suite imports `quality.kl as kl_mod`
    assert "kvzip_eval.cmd_calibrate" in g["kvzip_eval.cmd_eval"]
    assert "kvzip_eval.quality.kl" in g["kvzip_eval.quality.suite"]


def test_intra_package_imports_are_acyclic():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
