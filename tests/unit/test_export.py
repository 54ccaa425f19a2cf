"""Exports written over an older export in a local folder: each file is replaced, never rewritten in place."""

from __future__ import annotations

import os

from rlhf_core.driver.export import upload_dir


def test_an_export_over_an_older_one_leaves_its_readers_the_old_bytes(tmp_path):
    """A resumed pipeline exports each cached stage's output again while another process (a later stage, an
    evaluation) may be reading it, with the safetensors memory-mapped: rewritten in place, the file would be
    truncated under that reader (SIGBUS); replaced, the reader keeps the bytes it opened."""
    old, new, out = tmp_path / "old", tmp_path / "new", tmp_path / "out"
    old.mkdir(), new.mkdir()
    (old / "model.safetensors").write_bytes(b"A" * 4096)
    (new / "model.safetensors").write_bytes(b"B" * 100)
    upload_dir(str(old), str(out))
    with open(out / "model.safetensors", "rb") as reader:
        upload_dir(str(new), str(out))
        assert reader.read() == b"A" * 4096
    assert (out / "model.safetensors").read_bytes() == b"B" * 100
    assert os.listdir(out) == ["model.safetensors"]  # no temporary file left behind
