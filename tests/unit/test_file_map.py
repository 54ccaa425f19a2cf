"""The file map of docs/development.md against the tree, and the docs' layer order against the import rules.

The map is the indented block of its "File map" section: a line starting at the block's indent names a path (a
folder ends with `/`), the lines indented under it describe it. Every path named exists, every file named in a
description (`engine.py`, `bench/README.md`) exists in that folder or from the repository's root, and every package
folder of rlhf_core, flows and tasks has a line. The sentence "driver -> rank -> ... -> stages and the shared
modules" in docs/development.md and docs/architecture.md must not put a package above one that may import it
(`tests/unit/test_import_layers.py`'s ALLOWED).
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.unit.test_import_layers import ALLOWED

ROOT = Path(__file__).resolve().parents[2]
DEVELOPMENT = ROOT / "docs" / "development.md"
PACKAGE_ROOTS = ("rlhf_core", "flows", "tasks")
FILE_NAME = re.compile(r"(?<![\w/.-])([\w/.-]+\.(?:py|md|ya?ml|toml))\b")


def file_map(markdown: str) -> dict[str, str]:
    """Each path the "File map" section's block names, with its description."""
    section = markdown.split("## File map", 1)[1].split("\n## ", 1)[0]
    entries: dict[str, str] = {}
    path = None
    for line in section.splitlines():
        if re.match(r"    \S", line):
            path, _, description = line.strip().partition(" ")
            entries[path] = description.strip()
        elif path is not None and re.match(r"     +\S", line):
            entries[path] += " " + line.strip()
        elif line.strip() and path is not None:
            break
    return entries


def missing_paths(entries: dict[str, str]) -> list[str]:
    """Paths the map names, and files its descriptions name, that the tree does not hold."""
    missing = [path for path in entries if not (ROOT / path).exists()]
    for path, description in entries.items():
        folder = ROOT / path if path.endswith("/") else (ROOT / path).parent
        missing += [f"{name} (under {path})" for name in FILE_NAME.findall(description)
                    if not (folder / name).exists() and not (ROOT / name).exists()]
    return missing


def package_folders() -> set[str]:
    """Every folder of rlhf_core, flows and tasks that holds Python modules, as `rlhf_core/rank/`."""
    return {f"{folder.relative_to(ROOT)}/" for top in PACKAGE_ROOTS for folder in [ROOT / top, *(ROOT / top).rglob("*")]
            if folder.is_dir() and folder.name != "__pycache__" and any(folder.glob("*.py"))}


def layer_order(markdown: str) -> list[list[str]]:
    """The packages of rlhf_core from the page's "driver -> ... -> stages and the shared modules", top first (the
    shared modules as "")."""
    flat = re.sub(r"\s+", " ", markdown)
    chain = re.search(r"driver -> .*? the shared modules", flat)
    assert chain, "the page no longer says the layer order (driver -> ... -> the shared modules)"
    return [[("" if word == "shared" else word) for word in
             re.findall(r"\b(driver|rank|ops|models|data|storage|stages|shared)\b", group)]
            for group in chain.group(0).split("->")]


def upward_imports(order: list[list[str]]) -> list[str]:
    """Pairs where a package placed lower may import one placed above it, which the order would deny."""
    return [f"{lower or 'shared'} may import {upper or 'shared'}, yet sits below it"
            for index, group in enumerate(order) for upper in group
            for lower_group in order[index + 1:] for lower in lower_group if upper in ALLOWED[lower]]


def test_every_path_the_file_map_names_exists():
    entries = file_map(DEVELOPMENT.read_text())
    assert len(entries) >= 15, f"the file map has {len(entries)} lines: has its block's shape changed?"
    assert missing_paths(entries) == []


def test_every_package_folder_has_a_line_in_the_file_map():
    named = set(file_map(DEVELOPMENT.read_text()))
    assert sorted(package_folders() - named) == []


def test_the_docs_layer_order_follows_the_import_rules():
    for page in (DEVELOPMENT, ROOT / "docs" / "architecture.md"):
        order = layer_order(page.read_text())
        assert {package for group in order for package in group} == set(ALLOWED), f"{page.name}: {order}"
        assert upward_imports(order) == [], page.name


def test_the_checks_see_a_stale_map_and_a_wrong_order():
    stale = "## File map\n\n    rlhf_core/      the library: config.py, urls.py\n    rlhf_core/gone/  nothing\n\n## Next"
    assert file_map(stale) == {"rlhf_core/": "the library: config.py, urls.py", "rlhf_core/gone/": "nothing"}
    assert missing_paths(file_map(stale)) == ["rlhf_core/gone/", "urls.py (under rlhf_core/)"]
    wrong = "driver -> ops -> rank and models -> data -> storage -> stages and the shared modules"
    assert "rank may import ops, yet sits below it" in upward_imports(layer_order(wrong))
