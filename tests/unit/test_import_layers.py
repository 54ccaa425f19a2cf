"""The import graph of the packages: no module of rlhf_core reaches itself through imports (function-level
imports included: hiding a circle inside a function does not remove it), and rlhf_core never imports prefect or
the packages above it (flows, tasks)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("rlhf_core", "tasks", "flows")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The project modules `path` imports anywhere in its body (the longest known prefix of each name)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def graph() -> dict[str, set[str]]:
    paths = {module_name(path): path for package in PACKAGES for path in (ROOT / package).rglob("*.py")}
    return {name: imports_of(path, set(paths)) - {name} - _parents(name) for name, path in paths.items()}


def _parents(name: str) -> set[str]:
    parts = name.split(".")
    return {".".join(parts[:index]) for index in range(1, len(parts))}


def find_cycle(edges: dict[str, set[str]]) -> list[str]:
    """One import circle as a list of modules, or []."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        stack.append(node)
        for target in sorted(edges.get(node, ())):
            if state.get(target) == 1:
                return stack[stack.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        state[node] = 2
        stack.pop()
        return []

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return []


def test_no_module_of_rlhf_core_imports_itself_round_a_circle():
    edges = {name: {target for target in targets if target.startswith("rlhf_core")}
             for name, targets in graph().items() if name.startswith("rlhf_core")}
    assert find_cycle(edges) == []


def test_the_cycle_finder_sees_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]


def test_rlhf_core_never_imports_the_layers_above_it():
    upward = {name: sorted(target for target in targets if target.split(".")[0] in ("flows", "tasks"))
              for name, targets in graph().items() if name.startswith("rlhf_core")}
    assert {name: targets for name, targets in upward.items() if targets} == {}
