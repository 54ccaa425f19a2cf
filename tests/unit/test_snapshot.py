"""The in-memory snapshot folders of `rlhf_core.rank.snapshot`: where they go, and that a dead rank's are removed."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from rlhf_core.rank import snapshot


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_snapshot_goes_to_tmpfs_when_it_fits_and_to_the_temp_folder_when_not(tmp_path, monkeypatch, caplog):
    from rlhf_core import notices

    monkeypatch.setattr(notices.logger, "filters", [notices.OncePerKey()])  # as in a new process
    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setattr(snapshot, "SHM_ROOT", str(shm))
    monkeypatch.setattr(snapshot.tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    small = snapshot.snapshot_folder(rank=0, expected_bytes=1)
    huge = snapshot.snapshot_folder(rank=1, expected_bytes=1 << 60)
    assert os.path.dirname(small) == str(shm) and os.path.basename(small).startswith(f"rlhf-snapshot-{os.getpid()}-rank0-")
    assert os.path.dirname(huge) == str(tmp_path / "tmp")
    snapshot.snapshot_folder(rank=1, expected_bytes=1 << 60)
    fallbacks = [record.getMessage() for record in caplog.records if "snapshots into" in record.getMessage()]
    assert len(fallbacks) == 1, "one line says so, once"
    assert fallbacks[0].startswith(f"{shm} has ") and f"rank 1's snapshot, so it snapshots into {tmp_path / 'tmp'}" \
        in fallbacks[0]


def test_a_dead_process_snapshot_is_removed_and_a_live_one_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(snapshot, "SHM_ROOT", str(tmp_path))
    monkeypatch.setattr(snapshot.tempfile, "tempdir", str(tmp_path))
    dead = tmp_path / f"rlhf-snapshot-{dead_pid()}-rank0-abc"
    alive = tmp_path / f"rlhf-snapshot-{os.getpid()}-rank0-def"
    unrelated = tmp_path / "rlhf-snapshot-notapid"
    for folder in (dead, alive, unrelated):
        (folder / "ds").mkdir(parents=True)
    assert snapshot.remove_stale_snapshots() == [str(dead)]
    assert not dead.exists() and alive.exists() and unrelated.exists()


def test_torch_save_options_drop_the_crc32_and_align_each_tensor_to_a_page_in_the_file(tmp_path):
    import zipfile

    from torch.utils.serialization import config

    tensors = {"weight": torch.randn(64, 64), "bias": torch.randn(7), "step": torch.tensor(3)}
    with snapshot.torch_save_options():
        assert config.save.compute_crc32 is False
        torch.save(tensors, tmp_path / "state.pt")
    assert config.save.compute_crc32 is True and config.save.storage_alignment == 64, "torch's own defaults come back"
    loaded = torch.load(tmp_path / "state.pt")
    assert all(loaded[name].equal(tensor) for name, tensor in tensors.items())
    with zipfile.ZipFile(tmp_path / "state.pt") as archive:
        records = [record for record in archive.infolist() if "/data/" in record.filename]
        assert len(records) == 3
        for record in records:  # where the record's bytes start: after its local header and extra field
            with archive.open(record) as opened:
                start = opened._fileobj.tell()
            assert start % 4096 == 0, f"{record.filename} starts at {start}"


def test_a_small_state_is_written_unpadded_and_a_large_one_page_aligned_at_under_one_percent():
    """Page alignment pays only where the writer writes a tensor from where it lies; a small model's state padded to
    pages would grow by half (and trip the checkpoint-size alert), so it keeps torch's own 64-byte alignment."""
    import io

    from rlhf_core.storage.direct_io import IN_PLACE_MIN_BYTES

    def saved_bytes(state, write) -> int:
        buffer = io.BytesIO()
        write(state, buffer)
        return len(buffer.getvalue())

    small = {f"layer{i}": torch.randn(16, 16) for i in range(100)}  # ~100 KiB in 100 tensors
    plain = saved_bytes(small, torch.save)
    assert not snapshot.pays_to_align(small)
    assert saved_bytes(small, snapshot.write_state) <= plain * 1.01
    large = dict(list(small.items())[:20]) | {"embedding": torch.randn(IN_PLACE_MIN_BYTES * 10 // 4)}  # padding < 1%
    assert snapshot.pays_to_align(large)
    plain = saved_bytes(large, torch.save)
    assert plain < saved_bytes(large, snapshot.write_state) <= plain * 1.01
    assert not snapshot.pays_to_align({"step": 3})
    assert not snapshot.pays_to_align({"w": torch.randn(IN_PLACE_MIN_BYTES // 4)} | small)


def test_large_kept_tensors_start_on_a_page_so_the_writer_writes_them_where_they_lie():
    from rlhf_core.storage.direct_io import IN_PLACE_MIN_BYTES, address_of

    large = snapshot.copy_into(None, {"w": torch.randn(IN_PLACE_MIN_BYTES // 4 + 3), "b": torch.randn(5)})
    assert large["w"].data_ptr() % 4096 == 0 and address_of(large["w"].numpy().data) == large["w"].data_ptr()
    bf16 = snapshot.page_aligned_empty((IN_PLACE_MIN_BYTES, 2), torch.bfloat16)
    assert bf16.data_ptr() % 4096 == 0 and bf16.shape == (IN_PLACE_MIN_BYTES, 2) and bf16.dtype == torch.bfloat16
    bf16.fill_(1.5)  # the mmap stays alive with the tensor alone holding it
    assert bf16.float().sum().item() == 1.5 * 2 * IN_PLACE_MIN_BYTES


def test_kept_state_is_a_copy_written_later_as_torch_saved_and_its_buffers_serve_the_next(tmp_path):
    """DeepSpeed's saves are kept in memory as copies: training on after the snapshot changes nothing in what
    the background writer serializes; the next snapshot copies into the same buffers; and the engine's own
    checkpoint engine comes back."""
    import io

    class Engine:  # what tensors_kept_in_memory touches of a DeepSpeedEngine
        checkpoint_engine = "torch's"

    def take_snapshot(reuse=None) -> dict:
        with snapshot.tensors_kept_in_memory([engine], folder, reuse) as kept:
            engine.checkpoint_engine.save({"module": {"w": weights[2:]}, "step": 3}, f"{folder}/actor/ds/mp_rank_00.pt")
            assert not engine.checkpoint_engine.preserves_storage_sharing()
        assert engine.checkpoint_engine == "torch's"
        return kept

    def written(kept: dict) -> dict:
        buffer = io.BytesIO()
        snapshot.write_state(kept["actor/ds/mp_rank_00.pt"], buffer)
        return torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)

    engine, weights = Engine(), torch.arange(6, dtype=torch.float32)
    folder = str(tmp_path / "snapshot")
    first = take_snapshot()
    weights.add_(100)  # the next chunk trains on
    saved = written(first)
    assert list(first) == ["actor/ds/mp_rank_00.pt"] and saved["step"] == 3
    assert torch.equal(saved["module"]["w"], torch.arange(2, 6, dtype=torch.float32))
    assert saved["module"]["w"].untyped_storage().nbytes() == 4 * 4  # the slice alone, not its base
    buffer = first["actor/ds/mp_rank_00.pt"]["module"]["w"]
    second = take_snapshot(reuse=first)
    assert second["actor/ds/mp_rank_00.pt"]["module"]["w"] is buffer
    assert torch.equal(written(second)["module"]["w"], torch.arange(102, 106, dtype=torch.float32))


def test_the_hf_copy_is_kept_in_memory_and_written_as_save_pretrained_writes_it_but_for_the_header_padding(tmp_path,
                                                                                                        monkeypatch):
    """transformers' save_pretrained inside the snapshot leaves its weights in memory (its config in the folder).
    The writer's safetensors file is the one save_pretrained writes, for fp32 and bf16 models with tied weights,
    but for the header's padding of spaces, which ends it on a page (so the data section goes out from memory, one
    write); safetensors and transformers read it back the same. A later change to the model does not reach the kept
    copy, and the next snapshot reuses its buffer."""
    import io
    import struct

    from safetensors import safe_open
    from transformers import GPT2Config, GPT2LMHeadModel

    monkeypatch.setattr(snapshot, "IN_PLACE_MIN_BYTES", 1)  # this tiny model's buffer starts on a page too
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64)).to(dtype)
        model.save_pretrained(tmp_path / f"plain-{dtype}", safe_serialization=True)
        folder = tmp_path / f"snapshot-{dtype}"
        with snapshot.tensors_kept_in_memory([], str(folder)) as kept:
            model.save_pretrained(folder / "actor" / "hf", safe_serialization=True)
        assert list(kept) == ["actor/hf/model.safetensors"]
        assert (folder / "actor" / "hf" / "config.json").exists()
        assert not (folder / "actor" / "hf" / "model.safetensors").exists()
        with torch.no_grad():
            next(model.parameters()).add_(1.0)  # training goes on after the snapshot
        buffer = io.BytesIO()
        snapshot.write_state(kept["actor/hf/model.safetensors"], buffer)
        ours, theirs = buffer.getvalue(), (tmp_path / f"plain-{dtype}" / "model.safetensors").read_bytes()
        (our_length,), (their_length,) = struct.unpack("<Q", ours[:8]), struct.unpack("<Q", theirs[:8])
        assert (8 + our_length) % 4096 == 0
        assert ours[8:8 + our_length].rstrip(b" ") == theirs[8:8 + their_length].rstrip(b" ")
        assert ours[8 + our_length:] == theirs[8 + their_length:], "the data section, byte for byte"
        (folder / "actor" / "hf" / "model.safetensors").write_bytes(ours)
        with safe_open(folder / "actor" / "hf" / "model.safetensors", "pt") as opened:
            assert opened.metadata() == {"format": "pt"}
            assert len(opened.keys()) == len(kept["actor/hf/model.safetensors"].tensors)
        reloaded = GPT2LMHeadModel.from_pretrained(folder / "actor" / "hf", torch_dtype=dtype)
        original = GPT2LMHeadModel.from_pretrained(tmp_path / f"plain-{dtype}", torch_dtype=dtype)
        assert all(torch.equal(a, b) for a, b in zip(reloaded.state_dict().values(), original.state_dict().values()))
        with snapshot.tensors_kept_in_memory([], str(folder), reuse=kept) as again:
            model.save_pretrained(folder / "actor" / "hf", safe_serialization=True)
        first, second = (state["actor/hf/model.safetensors"] for state in (kept, again))
        assert second.data is first.data, "the next snapshot copies into the same buffer"
        assert second.data.data_ptr() % 4096 == 0


def test_a_dtype_only_safetensors_names_is_written_by_safetensors_itself():
    import io

    from safetensors.torch import load

    tensors = {"scale": torch.ones(4, dtype=torch.float8_e4m3fn), "weight": torch.randn(3, 3)}
    buffer = io.BytesIO()
    snapshot.write_state(snapshot.SafetensorsFile(tensors, {"format": "pt"}), buffer)
    loaded = load(buffer.getvalue())
    assert loaded["weight"].equal(tensors["weight"]) and loaded["scale"].float().equal(tensors["scale"].float())
