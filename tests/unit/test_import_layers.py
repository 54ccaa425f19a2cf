"""The import graph of the packages: no module of rlhf_core reaches itself through imports (function-level
imports included: hiding a circle inside a function does not remove it), imports run one way between its
packages (driver -> rank -> ops and models -> data -> storage -> the shared modules at the top of rlhf_core), and
rlhf_core never imports the packages above it (flows, tasks)."""

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


# Each package of rlhf_core and the packages it may import (the shared modules at rlhf_core's top: ""). The stages
# (their configs and facts) sit beside the shared modules: every layer reads them, and they read only the shared.
ALLOWED = {"": {"", "stages"}, "stages": {"", "stages"}, "storage": {"", "stages", "storage"},
           "data": {"", "stages", "storage", "data"}, "models": {"", "stages", "storage", "data", "models"},
           "ops": {"", "stages", "storage", "ops"}, "rank": {"", "stages", "storage", "data", "models", "ops", "rank"},
           "driver": {"", "stages", "storage", "data", "models", "ops", "rank", "driver"}}


def package_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "rlhf_core" or len(parts) == 1:
        return None
    return parts[1] if parts[1] in ALLOWED else ""


def test_imports_run_one_way_between_the_packages_of_rlhf_core():
    against = sorted(f"{name} ({package_of(name) or 'shared'}) imports {target}"
                     for name, targets in graph().items() if package_of(name) is not None
                     for target in targets if package_of(target) is not None
                     and package_of(target) not in ALLOWED[package_of(name)])
    assert against == []


def test_only_the_engine_reaches_into_the_ranks():
    """What runs inside a rank stays behind one door: the driver's engine starts the rank actors; everything else
    (the planner, preflight, export, the flows) finds what it needs in the layers below both."""
    reaching = sorted(f"{name} imports {target}" for name, targets in graph().items()
                      if package_of(name) != "rank" and name != "rlhf_core.driver.engine"
                      for target in targets if package_of(target) == "rank")
    assert reaching == []


def test_every_module_of_rlhf_core_sits_in_a_known_package():
    top = {path.stem for path in (ROOT / "rlhf_core").glob("*.py")} - {"__init__"}
    assert top == {"agent", "config", "config_file", "errors", "faults", "notices", "processes", "rewards",
                   "run_config", "run_settings", "toy", "user_files"}, top
    assert {path.name for path in (ROOT / "rlhf_core").iterdir() if path.is_dir() and path.name != "__pycache__"} \
        == set(ALLOWED) - {""}
