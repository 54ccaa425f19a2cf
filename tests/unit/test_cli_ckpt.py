"""`rlhf ckpt ls` and `rlhf ckpt verify` on a local store."""

from __future__ import annotations

import json

from flows.cli import main
from rlhf_core.checkpoint import CheckpointStore


def make_store(tmp_path, steps):
    store = CheckpointStore(str(tmp_path / "run" / "sft"))
    for step in steps:
        local = tmp_path / f"local_{step}"
        local.mkdir()
        (local / "weights.bin").write_bytes(bytes([step]) * 1000)
        store.commit(step, str(local), {"step": step})
    return tmp_path / "run" / "sft"


def test_verify_passes_when_newest_is_valid_and_fails_when_not(tmp_path, capsys):
    stage_dir = make_store(tmp_path, [5, 10])
    assert main(["ckpt", "verify", str(stage_dir), "--json"]) == 0
    assert [row["status"] for row in json.loads(capsys.readouterr().out)] == ["committed", "committed"]
    weights = stage_dir / "step_10" / "weights.bin"
    weights.write_bytes(b"\x00" + weights.read_bytes()[1:])  # same size: only sha256 can tell
    assert main(["ckpt", "ls", str(stage_dir)]) == 0  # ls checks sizes only
    assert "corrupt" not in capsys.readouterr().out
    assert main(["ckpt", "verify", str(stage_dir)]) == 1
    captured = capsys.readouterr()
    assert "corrupt" in captured.out and "checksum mismatch in weights.bin" in captured.out
    assert "newest checkpoint is not valid: step_10 is corrupt" in captured.err


def test_verify_of_an_empty_store_fails(tmp_path, capsys):
    (tmp_path / "nothing").mkdir()
    assert main(["ckpt", "verify", str(tmp_path / "nothing")]) == 1
    assert "no checkpoint found" in capsys.readouterr().err
