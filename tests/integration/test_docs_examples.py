"""The docs' runnable examples run as written, so the docs cannot drift from the code.

A runnable example is a fenced block opened by exactly ```` ```bash title="Runnable example" ```` in README.md or a
page under docs/ (the site shows that title above it). Each one runs, as written, in a fresh empty folder under
`bash -euo pipefail`: it makes its own inputs (`rlhf toy init ./toy`, a file written by a heredoc) and must exit 0.
The same example on several pages runs once (the quick start of README.md, docs/index.md and the SFT page; the
PPO page's, which the LoRA merge page shows too). Other code blocks are sketches (a cluster's address, a bucket)
and do not run.

The commands find this worker's Prefect server and Ray head through PREFECT_API_URL and RAY_ADDRESS (`rlhf_env`),
as a user's commands find theirs; `rlhf` is the venv's, put first on PATH alone (the venv's ninja stays off it).
`mkdocs build --strict` (in `make test`) checks the pages' links and nav; the cheap tests at the end of this module
check the pages' shape (every stage has a page with an example, the README stays a front page).

Cost, measured alone on a quiet machine (cgroup CPU of the whole tree, OMP_NUM_THREADS=1 as under `make test`):
the six distinct examples took 20-28 CPU-s each, ~130 CPU-s in all, on top of the worker's Prefect server and Ray
head, which the suite starts anyway.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.conftest import RLHF

PROJECT_DIR = Path(__file__).resolve().parents[2]
EXAMPLE_OPENING = '```bash title="Runnable example"'
README_MAX_LINES = 120


def pages() -> list[Path]:
    return [PROJECT_DIR / "README.md", *sorted((PROJECT_DIR / "docs").rglob("*.md"))]


def examples_in(page: Path) -> list[str]:
    """The runnable examples of one page, in order, as the text between the opening fence and its closing one."""
    found, lines = [], page.read_text().splitlines()
    for index, line in enumerate(lines):
        if line.strip() == EXAMPLE_OPENING:
            indent = line[: len(line) - len(line.lstrip())]
            body = []
            for inner in lines[index + 1:]:
                if inner.strip() == "```":
                    break
                body.append(inner.removeprefix(indent))
            else:
                raise AssertionError(f"{page}: the example at line {index + 1} is never closed")
            found.append("\n".join(body) + "\n")
    return found


def collect_examples() -> dict[str, list[str]]:
    """Each distinct example and the pages (`docs/stages/ppo.md#1`) that show it."""
    shown: dict[str, list[str]] = {}
    for page in pages():
        for number, example in enumerate(examples_in(page), start=1):
            shown.setdefault(example, []).append(f"{page.relative_to(PROJECT_DIR)}#{number}")
    return shown


EXAMPLES = collect_examples()


@pytest.fixture(scope="module")
def rlhf_on_path(tmp_path_factory) -> str:
    """A folder holding only `rlhf` (the venv's): PATH's first entry for the examples."""
    folder = tmp_path_factory.mktemp("bin")
    (folder / "rlhf").symlink_to(RLHF)
    return str(folder)


@pytest.mark.slow
@pytest.mark.parametrize("example", list(EXAMPLES), ids=[" ".join(where) for where in EXAMPLES.values()])
def test_the_example_runs_as_written(example, rlhf_env, rlhf_on_path, tmp_path):
    workdir = tmp_path / "work"
    workdir.mkdir()
    script = tmp_path / "example.sh"
    script.write_text(example)
    env = {**rlhf_env, "PATH": f"{rlhf_on_path}:{rlhf_env['PATH']}"}
    done = subprocess.run(["bash", "-euo", "pipefail", str(script)], cwd=workdir, env=env, capture_output=True,
                          text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, (f"the example of {', '.join(EXAMPLES[example])} exited {done.returncode}:\n"
                                  f"{example}\n--- stdout\n{done.stdout[-4000:]}\n--- stderr\n{done.stderr[-6000:]}")


def test_every_stage_has_a_page_with_a_runnable_example():
    from rlhf_core.stages import STAGES

    for stage in STAGES:
        page = PROJECT_DIR / "docs" / "stages" / f"{stage}.md"
        assert page.exists(), f"the stage {stage} has no page: docs/stages/{stage}.md (and its line in mkdocs.yml)"
        assert examples_in(page), f"{page.relative_to(PROJECT_DIR)} has no runnable example ({EXAMPLE_OPENING})"


def test_the_readme_is_a_front_page_with_the_quick_start_and_the_two_commands():
    text = (PROJECT_DIR / "README.md").read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    assert examples_in(PROJECT_DIR / "README.md"), "the README's quick start is no runnable example"
    assert "make demo" in text and "make test" in text


def test_a_runnable_example_uses_only_what_it_makes():
    """An example that names a path it did not make (an absolute path, or `../`) would pass here and fail a reader."""
    for example, where in EXAMPLES.items():
        assert not re.search(r"(?<![\w.:/-])(/(?!dev/null)[\w.-]+/|\.\./)", example), \
            f"{', '.join(where)}: an example must work in an empty folder; it names a path outside it"
