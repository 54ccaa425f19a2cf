"""Every flag the table (flows/openrlhf_flags.py) calls implemented sets a config field that the code reads
outside its own definition: a flag listed as implemented whose value nothing reads would do nothing while
claiming to (as --deepspeed_enable_sleep did: its engines' sleep and wake were never called)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from flows.openrlhf_flags import FLAGS, IMPLEMENTED, Flag

ROOT = Path(__file__).resolve().parents[2]
# A sample value of each kind, to learn which fields a converting flag sets.
SAMPLES = {"switch": True, "pair": (0.5, 0.5), "list": ["q_proj"]}


def _sources() -> dict[Path, str]:
    """The code that could read a field: the packages, without the flag table (its rows and their parts) that only
    names fields."""
    return {path: path.read_text() for package in ("rlhf_core", "flows", "tasks") for path in (ROOT / package).rglob("*.py")
            if path.name not in ("openrlhf_flags.py", "flag_table.py")}


def fields_set(flag: Flag) -> set[str]:
    if flag.convert is None:
        return {flag.field} if flag.field else set()
    value = SAMPLES.get(flag.takes, flag.value_type("1") if flag.value_type in (int, float) else "true")
    return {field for field in flag.convert(value) if not field.startswith("_")}  # _num_nodes: folded by the CLI


def readers(field: str, sources: dict[Path, str]) -> list[str]:
    """Files that read `field` as an attribute or a key; a field's own declaration (`field: type = Field(`) does
    not count."""
    read = re.compile(rf"\.{field}\b|[\"']{field}[\"']")
    declared = re.compile(rf"^\s*{field}\s*:.*$", re.MULTILINE)
    return [str(path.relative_to(ROOT)) for path, text in sources.items() if read.search(declared.sub("", text))]


IMPLEMENTED_FIELDS = sorted({(field, flag.name or str(flag.dotted)) for flag in FLAGS if flag.kind == IMPLEMENTED
                             for field in fields_set(flag)})


def test_the_table_implements_flags():
    assert len(IMPLEMENTED_FIELDS) > 100


@pytest.mark.parametrize("field, flag", IMPLEMENTED_FIELDS, ids=[f"{flag}->{field}" for field, flag in IMPLEMENTED_FIELDS])
def test_every_implemented_flag_sets_a_field_something_reads(field, flag):
    assert readers(field, _SOURCES), f"--{flag} is listed as implemented, but nothing reads its field {field!r}"


def test_the_check_sees_a_field_nothing_reads():
    sources = {ROOT / "rlhf_core" / "config.py": "class C:\n    orphan_field: int = Field(1)\n",
               ROOT / "rlhf_core" / "user.py": "print(cfg.other_field)\n"}
    assert readers("orphan_field", sources) == [] and readers("other_field", sources) == ["rlhf_core/user.py"]


_SOURCES = _sources()
