"""A user's Python file (a reward function's, an agent's), imported by its path as OpenRLHF imports it; the caller
says in one sentence what went wrong, naming its flag."""

from __future__ import annotations

import importlib.util
from types import ModuleType


def import_user_file(path: str, module_name: str) -> ModuleType:
    """The module the file at `path` defines (its top level runs). Raises what the file raises, FileNotFoundError
    when there is no such file, and ImportError when it is not Python source."""
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ImportError("not a Python source file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
