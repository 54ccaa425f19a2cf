"""The preparation's progress bar on a real terminal (tmux): a JSON Lines file streamed into a preparation, as
`preparation.prepared_rows` writes it, shows `preparing ... rows/s` on the screen while it runs. The source's size
is known only once its first batch is read, so a bar made before that had no total and never showed."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import uuid

import pytest

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (.ci/run installs it)")

SCRIPT = """
import sys, time
from rlhf_core.data import columns
from rlhf_core.data.stream import RecordStream

columns.PROGRESS_DELAY_S = 0.2
stream = RecordStream(sys.argv[1], None, batch_rows=100)

def batches():
    for block in stream.blocks():
        time.sleep(0.4)
        yield columns.flatten({"n": block.numbers}, {"n": "int64"})

columns.write_batches(sys.argv[2], {"n": "int64"}, batches(), "--dataset " + sys.argv[1], lambda: stream.position)
"""


def test_the_preparation_bar_shows_on_a_terminal(tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"row": i, "text": "x" * 2000}) + "\n" for i in range(2000)))
    (tmp_path / "prepare.py").write_text(SCRIPT)
    session = f"prepare-{uuid.uuid4().hex[:8]}"
    command = (f"cd {tmp_path} && {sys.executable} prepare.py {data} {tmp_path / 'out.arrow'} "
               f"> /dev/null; sleep 30")  # the bar is on stderr, the terminal
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "160", "-y", "40", command], check=True,
                   env={**__import__("os").environ, "PYTHONPATH": str(__import__("pathlib").Path.cwd())})
    screens = []
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            screen = subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True,
                                    text=True).stdout
            screens.append(screen)
            if "preparing rows.jsonl" in screen and "rows/s" in screen:
                break
            time.sleep(0.3)
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
    assert any("preparing rows.jsonl" in screen and "rows/s" in screen for screen in screens), screens[-1]
