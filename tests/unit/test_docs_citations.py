"""Every section of docs/design-notes.md that a docstring cites by name exists, so a module's "see the design
notes" never points at nothing.

A citation is `design-notes.md ("Title")`, `design-notes.md ("Title", "Other title")` or `design-notes.md, "Title"`,
possibly wrapped across lines; every other mention of the file in the code counts as a citation this module cannot
read, and fails too, so a new spelling cannot slip past the check.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NOTES = ROOT / "docs" / "design-notes.md"
CODE_FOLDERS = ("rlhf_core", "flows", "tasks", "bench")
CITATION = re.compile(r'design-notes\.md(?:\s*\(|,)\s*((?:"[^"]+"\s*,?\s*(?:and\s+)?)+)')
TITLE = re.compile(r'"([^"]+)"')


def section_titles(markdown: str) -> set[str]:
    """The titles of the page's headings (`#` to `######`), outside fenced code."""
    titles, fenced = set(), False
    for line in markdown.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and (heading := re.match(r"#{1,6}\s+(.+?)\s*#*\s*$", line)):
            titles.add(heading.group(1))
    return titles


def citations(text: str) -> tuple[list[str], int]:
    """The section titles `text` cites, and how many mentions of design-notes.md it holds in all."""
    flat = re.sub(r"\s+", " ", text)
    cited = [title for match in CITATION.finditer(flat) for title in TITLE.findall(match.group(1))]
    return cited, flat.count("design-notes.md")


def cited_sections() -> dict[str, list[str]]:
    """Each cited title and the files citing it; a file whose mentions outnumber its citations is listed under
    the key "unreadable: <file>"."""
    found: dict[str, list[str]] = {}
    for folder in CODE_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            text = path.read_text()
            if "design-notes.md" not in text:
                continue
            where = str(path.relative_to(ROOT))
            cited, mentions = citations(text)
            for title in cited:
                found.setdefault(title, []).append(where)
            if mentions > len(CITATION.findall(re.sub(r"\s+", " ", text))):
                found.setdefault(f"unreadable: {where}", []).append(where)
    return found


def test_every_section_a_docstring_cites_exists():
    cited = cited_sections()
    titles = section_titles(NOTES.read_text())
    missing = {title: files for title, files in cited.items() if title not in titles}
    assert missing == {}, f"cited in the code, no such section in docs/design-notes.md: {missing}"
    assert len(cited) >= 40, f"only {len(cited)} cited sections found: has the citation's spelling changed?"


def test_the_reader_finds_each_spelling_of_a_citation():
    text = '''docs/design-notes.md ("Alerts") and docs/design-notes.md ("The
    quiet console", "Durable writes"), or (docs/design-notes.md, "Goodput"); docs/design-notes.md says'''
    assert citations(text) == (["Alerts", "The quiet console", "Durable writes", "Goodput"], 4)


def test_a_heading_inside_a_code_block_is_no_section():
    assert section_titles("## Real\n```\n## In code\n```\n### Also real ###\n") == {"Real", "Also real"}
