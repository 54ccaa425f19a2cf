"""Exports: one written over an older export in a local folder replaces each file, never rewrites it in place;
a stage's export fetches its Hugging Face copy alone."""

from __future__ import annotations

import os

from rlhf_core.driver.export import export_stage_output, upload_dir
from rlhf_core.storage.locate import SOURCE_NAME
from rlhf_core.storage.checkpoint import CheckpointStore


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


def test_a_stage_export_fetches_the_hf_copy_alone(toy_assets, tmp_path):
    """The export reads `actor_model/hf/` only: DeepSpeed's state beside it (several times its size for a large
    model: fp32 master weights and Adam's moments) is never fetched, so a damaged optimizer shard does not stop
    it and the temporary folder holds the model's size, not the checkpoint's."""
    checkpoint = tmp_path / "checkpoint"
    (checkpoint / "actor_model" / "hf").mkdir(parents=True)
    (checkpoint / "actor_model" / "ds").mkdir()
    (checkpoint / "actor_model" / "hf" / "model.safetensors").write_bytes(b"weights" * 100)
    (checkpoint / "actor_model" / "hf" / "config.json").write_text("{}")
    (checkpoint / "actor_model" / "ds" / "optim_states.pt").write_bytes(b"moments" * 300)
    store = CheckpointStore(str(tmp_path / "store"))
    store.commit(7, str(checkpoint), {"step": 7})
    with open(tmp_path / "store" / "step_7" / "actor_model" / "ds" / "optim_states.pt", "r+b") as shard:
        shard.write(b"X")  # caught by its checksum, were it read

    out = tmp_path / "out"
    assert export_stage_output(store, 7, "actor_model", toy_assets["model"], str(out)) == str(out)
    assert (out / "model.safetensors").read_bytes() == b"weights" * 100
    assert {"config.json", "tokenizer_config.json", SOURCE_NAME} <= set(os.listdir(out))
    assert not any("optim" in name for name in os.listdir(out))


def test_an_interrupted_export_has_no_source_file(tmp_path, monkeypatch):
    """The source file (the checkpoint the export came from) goes first and comes back last: an export cut short
    (a kill, a full disk) leaves none, neither its own nor the older export's, so a resuming run never takes the
    folder for a finished stage's output (`resume.finished_checkpoint`) nor fingerprints it as one."""
    from fsspec.implementations.local import LocalFileSystem

    old, new, out = tmp_path / "old", tmp_path / "new", tmp_path / "out"
    for folder, source in ((old, "older"), (new, "newer")):
        folder.mkdir()
        for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
            (folder / name).write_text(f"{source} {name}")
        (folder / SOURCE_NAME).write_text(f'{{"manifest_digest": "{source}"}}')
    upload_dir(str(old), str(out))
    assert (out / SOURCE_NAME).read_text() == '{"manifest_digest": "older"}'

    put_file = LocalFileSystem.put_file

    def cut_at_the_tokenizer(self, local, remote, *args, **kwargs):
        if os.path.basename(local) == "tokenizer.json":
            raise OSError(28, "No space left on device")
        return put_file(self, local, remote, *args, **kwargs)

    monkeypatch.setattr(LocalFileSystem, "put_file", cut_at_the_tokenizer)
    try:
        upload_dir(str(new), str(out))
    except OSError:
        pass
    assert not (out / SOURCE_NAME).exists()
    monkeypatch.undo()
    upload_dir(str(new), str(out))
    assert (out / SOURCE_NAME).read_text() == '{"manifest_digest": "newer"}'
