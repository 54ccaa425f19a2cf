"""The manifest's checksum algorithm: recorded in every new manifest, each file checked with the algorithm
its manifest names, and format 1 manifests (sha256 throughout, no algorithm field) still verified."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from flows.cli import main
from rlhf_core.storage.checkpoint import CheckpointStore
from rlhf_core.storage.manifest import MANIFEST_NAME
from rlhf_core.errors import CorruptCheckpoint, UserError

ALGORITHMS = ["sha256", "xxh3_128", "blake3"]
WEIGHTS = b"w" * 300_000 + b"tail"


def commit_step(store: CheckpointStore, tmp_path: Path, step: int) -> None:
    local = tmp_path / f"local_{step}"
    (local / "model").mkdir(parents=True)
    (local / "model" / "weights.bin").write_bytes(WEIGHTS)
    (local / "small.txt").write_bytes(b"hello")
    store.commit(step, str(local), {"step": step})


def manifest_of(store: CheckpointStore, step: int) -> dict:
    return json.loads(store.fs.cat_file(f"{store.root}/step_{step}/{MANIFEST_NAME}"))


def flip_first_byte(store: CheckpointStore, step: int, relative_path: str) -> None:
    path = f"{store.root}/step_{step}/{relative_path}"
    data = store.fs.cat_file(path)
    store.fs.pipe_file(path, bytes([data[0] ^ 0xFF]) + data[1:])  # same size: only the checksum can tell


def write_format_1_step(store: CheckpointStore, step: int) -> None:
    """A step as this package wrote it before manifests named their algorithm: sha256 under "sha256"."""
    files = {"model/weights.bin": WEIGHTS, "training_metadata.json": json.dumps({"step": step}).encode()}
    for relative_path, data in files.items():
        store.fs.makedirs(f"{store.root}/step_{step}/{relative_path.rpartition('/')[0]}", exist_ok=True)
        store.fs.pipe_file(f"{store.root}/step_{step}/{relative_path}", data)
    manifest = {"format_version": 1, "step": step,
                "files": [{"path": path, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
                          for path, data in sorted(files.items())]}
    store.fs.pipe_file(f"{store.root}/step_{step}/{MANIFEST_NAME}", json.dumps(manifest, indent=2).encode())
    store.fs.pipe_file(f"{store.root}/latest", f"step_{step}".encode())


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_new_manifest_records_its_algorithm_and_every_digest_under_its_name(store_url, tmp_path, algorithm):
    if algorithm == "blake3":
        pytest.importorskip("blake3")
    store = CheckpointStore(store_url, checksum=algorithm)
    commit_step(store, tmp_path, 4)
    manifest = manifest_of(store, 4)
    assert manifest["format_version"] == 2 and manifest["checksum"] == algorithm
    assert all(set(entry) == {"path", "size", algorithm} for entry in manifest["files"])
    if algorithm == "sha256":
        weights = next(entry for entry in manifest["files"] if entry["path"] == "model/weights.bin")
        assert weights["sha256"] == hashlib.sha256(WEIGHTS).hexdigest()
    assert [info.status for info in CheckpointStore(store_url).list(verify=True)] == ["committed"]


def test_the_default_algorithm_is_xxh3_128(store_url, tmp_path):
    import xxhash

    store = CheckpointStore(store_url)
    commit_step(store, tmp_path, 1)
    manifest = manifest_of(store, 1)
    assert manifest["checksum"] == "xxh3_128"
    weights = next(entry for entry in manifest["files"] if entry["path"] == "model/weights.bin")
    assert weights["xxh3_128"] == xxhash.xxh3_128(WEIGHTS).hexdigest()


def test_a_format_1_sha256_only_manifest_verifies_fetches_and_reads(store_url, tmp_path):
    store = CheckpointStore(store_url)
    write_format_1_step(store, 3)
    assert [(info.step, info.status) for info in store.list(verify=True)] == [(3, "committed")]
    assert store.newest_valid().step == 3
    store.fetch(3, str(tmp_path / "fetched"))
    assert (tmp_path / "fetched" / "model" / "weights.bin").read_bytes() == WEIGHTS
    assert json.loads(store.read_verified(3, "training_metadata.json")) == {"step": 3}
    if store_url.startswith("/"):
        with store.read_in_place(3) as folder:
            assert Path(folder, "model", "weights.bin").read_bytes() == WEIGHTS


def test_rlhf_ckpt_verify_reads_old_and_new_manifests_side_by_side(tmp_path, capsys):
    stage_dir = tmp_path / "run" / "sft"
    store = CheckpointStore(str(stage_dir))
    write_format_1_step(store, 3)
    commit_step(store, tmp_path, 6)
    assert main(["ckpt", "verify", str(stage_dir), "--json"]) == 0
    assert [row["status"] for row in json.loads(capsys.readouterr().out)] == ["committed", "committed"]


@pytest.mark.parametrize("algorithm", ALGORITHMS + ["format 1"])
def test_a_changed_byte_fails_verification_under_each_algorithm(store_url, tmp_path, algorithm):
    if algorithm == "blake3":
        pytest.importorskip("blake3")
    store = CheckpointStore(store_url, checksum=None if algorithm == "format 1" else algorithm)
    if algorithm == "format 1":
        write_format_1_step(store, 5)
    else:
        commit_step(store, tmp_path, 5)
    flip_first_byte(store, 5, "model/weights.bin")
    assert store.list(verify=False)[0].status == "committed"  # sizes still agree
    (info,) = store.list(verify=True)
    assert (info.status, info.reason) == ("corrupt", "checksum mismatch in model/weights.bin")
    with pytest.raises(CorruptCheckpoint, match="model/weights.bin .* does not match its checksum"):
        store.fetch(5, str(tmp_path / "fetched"))


def test_an_unknown_algorithm_is_one_sentence_for_a_store_and_a_corrupt_manifest_for_a_reader(store_url, tmp_path,
                                                                                               capsys):
    with pytest.raises(UserError) as refused:
        CheckpointStore(store_url, checksum="md4")
    assert str(refused.value) == "Checkpoint checksum: unknown checksum 'md4' (known: sha256, xxh3_128, blake3)."
    store = CheckpointStore(store_url)
    commit_step(store, tmp_path, 2)
    manifest = manifest_of(store, 2)
    manifest["checksum"] = "md4"
    for entry in manifest["files"]:
        entry["md4"] = entry.pop("xxh3_128")
    store.fs.pipe_file(f"{store.root}/step_2/{MANIFEST_NAME}", json.dumps(manifest).encode())
    (info,) = store.list(verify=True)
    assert info.status == "corrupt"
    assert info.reason == "bad MANIFEST.json: unknown checksum 'md4' (known: sha256, xxh3_128, blake3)"
    if store_url.startswith("/"):
        assert main(["ckpt", "verify", store_url]) == 1
        assert "Traceback" not in capsys.readouterr().err
