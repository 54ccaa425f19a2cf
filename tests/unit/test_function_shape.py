"""No function of `rlhf_core/`, `flows/` or `tasks/` takes more than MAX_PARAMETERS parameters (`self` and `cls`
not counted; `*args` and `**kwargs` count as one each): a chunk's or a commit's state travels as one typed object,
not spelled out in every signature. A caller that sets many options passes a dataclass of them."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("rlhf_core", "flows", "tasks")
MAX_PARAMETERS = 6

# Functions allowed over the limit: none since issue 45 reshaped the last 14. An entry that no longer needs to be
# here fails the test, so the list only shrinks.
ALLOWED: frozenset[str] = frozenset()


def parameter_count(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    arguments = function.args
    names = [arg.arg for arg in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs)]
    if names and names[0] in ("self", "cls"):
        names = names[1:]
    return len(names) + (arguments.vararg is not None) + (arguments.kwarg is not None)


def functions_over_limit() -> dict[str, int]:
    """{`path:Qualified.name`: parameter count} of every function over MAX_PARAMETERS."""
    found: dict[str, int] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            _visit(ast.parse(path.read_text()), str(path.relative_to(ROOT)), "", found)
    return found


def _visit(node: ast.AST, path: str, prefix: str, found: dict[str, int]) -> None:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name = f"{prefix}{child.name}"
            count = parameter_count(child)
            if count > MAX_PARAMETERS:
                found[f"{path}:{name}"] = count
            _visit(child, path, f"{name}.", found)
        elif isinstance(child, ast.ClassDef):
            _visit(child, path, f"{prefix}{child.name}.", found)
        else:
            _visit(child, path, prefix, found)


def test_no_function_takes_more_than_six_parameters():
    over = functions_over_limit()
    unexpected = {name: count for name, count in over.items() if name not in ALLOWED}
    assert not unexpected, "\n".join(f"{name} takes {count} parameters (at most {MAX_PARAMETERS})"
                                     for name, count in sorted(unexpected.items()))


def test_the_allow_list_only_names_functions_still_over_the_limit():
    assert not ALLOWED - set(functions_over_limit()), "remove these from ALLOWED: they fit now"


def test_the_count_skips_self_and_counts_every_kind_of_parameter():
    function = ast.parse("def f(self, a, /, b, *args, c, **kwargs): pass").body[0]
    assert isinstance(function, ast.FunctionDef)
    assert parameter_count(function) == 5
