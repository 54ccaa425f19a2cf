"""Unit tests for the fsspec checkpoint store, on memory:// and on a local folder."""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import threading
import uuid
from pathlib import Path

import pytest
import xxhash
from fsspec.implementations.local import LocalFileSystem

from flows.cli_inspect import format_listing, to_json
from rlhf_core.storage.checkpoint import CheckpointStore
from rlhf_core.storage.manifest import LATEST_NAME, MANIFEST_NAME, METADATA_NAME, Manifest
from rlhf_core.storage import direct_io, durable
from rlhf_core.errors import CorruptCheckpoint, UserError

SHARD_BYTES = 4096


@pytest.fixture
def store(store_url: str) -> CheckpointStore:
    return CheckpointStore(store_url)


@pytest.fixture
def make_local_checkpoint(tmp_path: Path):
    """Factory for a local checkpoint folder whose bytes depend on ``seed``."""
    num_made = 0

    def make(seed: int = 0) -> Path:
        nonlocal num_made
        num_made += 1
        local_dir = tmp_path / f"local_{num_made}"
        files = {
            "model/shard_0.bin": os.urandom(SHARD_BYTES),
            "model/shard_1.bin": os.urandom(SHARD_BYTES),
            "optim/rank_0/state.pt": f"optimizer state {seed}".encode(),
            "config.json": json.dumps({"seed": seed}).encode(),
        }
        for relative_path, data in files.items():
            path = local_dir / relative_path
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        return local_dir

    return make


@pytest.fixture
def commit(store: CheckpointStore, make_local_checkpoint):
    def commit_step(step: int) -> None:
        store.commit(step, str(make_local_checkpoint(step)), {"global_step": step})

    return commit_step


def remote_path(store: CheckpointStore, relative_path: str) -> str:
    return f"{store.root}/{relative_path}"


def write_remote(store: CheckpointStore, relative_path: str, data: bytes) -> None:
    path = remote_path(store, relative_path)
    store.fs.makedirs(posixpath.dirname(path), exist_ok=True)
    store.fs.pipe_file(path, data)


def read_remote(store: CheckpointStore, relative_path: str) -> bytes:
    return store.fs.cat_file(remote_path(store, relative_path))


def local_files(local_dir: Path) -> dict[str, bytes]:
    return {
        path.relative_to(local_dir).as_posix(): path.read_bytes()
        for path in local_dir.rglob("*")
        if path.is_file()
    }


def record_writes(store: CheckpointStore, monkeypatch: pytest.MonkeyPatch, on_write=None) -> list[str]:
    """Record the destination of every put_file / pipe_file / open for writing the store makes, in order."""
    written_paths: list[str] = []
    original_put_file, original_pipe_file, original_open = store.fs.put_file, store.fs.pipe_file, store.fs.open

    inside_pipe = threading.local()

    def open_file(path, mode="rb", *args, **kwargs):
        if "w" in mode and not getattr(inside_pipe, "active", False):  # pipe_file may open the file itself
            if on_write:
                on_write(path)
            written_paths.append(path)
        return original_open(path, mode, *args, **kwargs)

    original_replace = durable.replace_durably

    def replace_durably(path, data):  # a local store replaces `latest` through it, not through fs.open
        if on_write:
            on_write(path)
        written_paths.append(path)
        return original_replace(path, data)

    monkeypatch.setattr(durable, "replace_durably", replace_durably)
    original_open_direct = direct_io.open_direct

    def open_direct(path):  # a local store writes its files around the page cache, not through fs.open
        if on_write:
            on_write(path)
        written_paths.append(path)
        writer = original_open_direct(path)
        if writer is None:  # refused here: the backend opens it through fs.open, which records it
            written_paths.pop()
        return writer

    monkeypatch.setattr(direct_io, "open_direct", open_direct)

    def put_file(local_path, path, *args, **kwargs):
        if on_write:
            on_write(path)
        written_paths.append(path)
        return original_put_file(local_path, path, *args, **kwargs)

    def pipe_file(path, data, *args, **kwargs):
        if on_write:
            on_write(path)
        written_paths.append(path)
        inside_pipe.active = True
        try:
            return original_pipe_file(path, data, *args, **kwargs)
        finally:
            inside_pipe.active = False

    monkeypatch.setattr(store.fs, "put_file", put_file)
    monkeypatch.setattr(store.fs, "pipe_file", pipe_file)
    monkeypatch.setattr(store.fs, "open", open_file)
    return written_paths


def test_commit_writes_files_manifest_and_latest(store: CheckpointStore, make_local_checkpoint):
    local_dir = make_local_checkpoint()
    metadata = {"global_step": 100, "consumed_samples": 3200}

    info = store.commit(100, str(local_dir), metadata)

    manifest_bytes = read_remote(store, f"step_100/{MANIFEST_NAME}")
    manifest = json.loads(manifest_bytes)
    assert manifest["format_version"] == 2 and manifest["step"] == 100 and manifest["checksum"] == "xxh3_128"
    expected_files = local_files(local_dir)
    expected_files[METADATA_NAME] = read_remote(store, f"step_100/{METADATA_NAME}")
    assert {entry["path"] for entry in manifest["files"]} == set(expected_files)
    for entry in manifest["files"]:
        data = expected_files[entry["path"]]
        assert read_remote(store, f"step_100/{entry['path']}") == data
        assert entry["size"] == len(data)
        assert entry["xxh3_128"] == xxhash.xxh3_128(data).hexdigest()

    assert store.latest_name() == "step_100"
    assert store.read_metadata(100) == metadata
    assert info.status == "committed" and info.name == "step_100"
    assert info.uri == store.uri(100) and info.uri.endswith("/step_100")
    assert info.manifest_digest == hashlib.sha256(manifest_bytes).hexdigest()
    assert info.size_bytes == sum(entry["size"] for entry in manifest["files"]) + len(manifest_bytes)
    assert store.list(verify=True) == [info]
    assert store.newest_valid() == info
    assert not store.is_empty()
    staging_names = [name for name in store.fs.ls(store.root, detail=False) if ".tmp_" in name]
    assert staging_names == []


def test_commit_writes_manifest_after_every_file_and_latest_last(
    store: CheckpointStore, make_local_checkpoint, monkeypatch: pytest.MonkeyPatch
):
    def check_state_before_write(path: str) -> None:
        if path.endswith(MANIFEST_NAME):
            assert not any(info.status == "committed" for info in store.list())
            # On a local filesystem the step is staged elsewhere and renamed in after the manifest.
            is_local = isinstance(store.fs, LocalFileSystem)
            assert is_local != store.fs.exists(remote_path(store, "step_7"))
        if path.endswith(f"/{LATEST_NAME}"):
            assert [info.status for info in store.list(verify=True)] == ["committed"]

    written_paths = record_writes(store, monkeypatch, check_state_before_write)
    store.commit(7, str(make_local_checkpoint()), {"global_step": 7})

    names = [posixpath.basename(path) for path in written_paths]
    assert names[-2:] == [MANIFEST_NAME, LATEST_NAME]
    expected_names = ["shard_0.bin", "shard_1.bin", "state.pt", "config.json", METADATA_NAME]
    assert sorted(names[:-2]) == sorted(expected_names)
    assert all("step_7" in path for path in written_paths[:-1])


def test_crash_before_manifest_leaves_nothing_committed_and_retry_succeeds(
    store: CheckpointStore, make_local_checkpoint, monkeypatch: pytest.MonkeyPatch
):
    def crash_on_manifest(path: str) -> None:
        if path.endswith(MANIFEST_NAME):
            raise OSError("simulated crash")

    with monkeypatch.context() as patch:
        record_writes(store, patch, crash_on_manifest)
        with pytest.raises(OSError, match="simulated crash"):
            store.commit(3, str(make_local_checkpoint()), {"global_step": 3})

    assert store.newest_valid() is None
    assert all(info.status == "incomplete" for info in store.list())
    assert store.latest_name() is None

    info = store.commit(3, str(make_local_checkpoint()), {"global_step": 3})
    assert info.status == "committed"
    assert store.latest_name() == "step_3"


def test_step_dir_without_manifest_is_incomplete_even_if_latest_points_to_it(store: CheckpointStore, commit):
    commit(1)
    write_remote(store, "step_2/model/shard_0.bin", b"half written")
    write_remote(store, LATEST_NAME, b"step_2")

    infos = store.list()
    assert [(info.step, info.status) for info in infos] == [(1, "committed"), (2, "incomplete")]
    assert MANIFEST_NAME in infos[1].reason
    assert store.newest_valid().step == 1


def flip_byte(store: CheckpointStore) -> None:
    data = bytearray(read_remote(store, "step_2/model/shard_0.bin"))
    data[100] ^= 0xFF
    write_remote(store, "step_2/model/shard_0.bin", bytes(data))


def truncate_file(store: CheckpointStore) -> None:
    write_remote(store, "step_2/model/shard_1.bin", read_remote(store, "step_2/model/shard_1.bin")[:-1])


def delete_file(store: CheckpointStore) -> None:
    store.fs.rm_file(remote_path(store, "step_2/optim/rank_0/state.pt"))


def garble_manifest(store: CheckpointStore) -> None:
    write_remote(store, f"step_2/{MANIFEST_NAME}", read_remote(store, f"step_2/{MANIFEST_NAME}")[:-5])


def claim_another_step_in_manifest(store: CheckpointStore) -> None:
    manifest = json.loads(read_remote(store, f"step_2/{MANIFEST_NAME}"))
    manifest["step"] = 3
    write_remote(store, f"step_2/{MANIFEST_NAME}", json.dumps(manifest).encode())


def point_manifest_outside_step_dir(store: CheckpointStore) -> None:
    manifest = json.loads(read_remote(store, f"step_2/{MANIFEST_NAME}"))
    manifest["files"][0]["path"] = "../step_1/config.json"
    write_remote(store, f"step_2/{MANIFEST_NAME}", json.dumps(manifest).encode())


@pytest.mark.parametrize(
    "damage, found_without_hashing",
    [
        (flip_byte, False),
        (truncate_file, True),
        (delete_file, True),
        (garble_manifest, True),
        (claim_another_step_in_manifest, True),
        (point_manifest_outside_step_dir, True),
    ],
)
def test_verify_detects_damage_and_newest_valid_falls_back(
    store: CheckpointStore, commit, damage, found_without_hashing: bool
):
    commit(1)
    commit(2)

    damage(store)

    infos = store.list(verify=True)
    assert [(info.step, info.status) for info in infos] == [(1, "committed"), (2, "corrupt")]
    assert infos[1].reason and not infos[1].manifest_digest
    assert store.newest_valid().step == 1
    expected_cheap_status = "corrupt" if found_without_hashing else "committed"
    assert store.list(verify=False)[1].status == expected_cheap_status


@pytest.mark.parametrize("bad_path", ["../outside.bin", "/etc/passwd", "a/../../b", "./a", ""])
def test_manifest_rejects_paths_outside_the_step_dir(bad_path: str):
    document = {"format_version": 1, "step": 1, "files": [{"path": bad_path, "size": 1, "sha256": "0" * 64}]}

    with pytest.raises(ValueError, match="bad file path"):
        Manifest.from_bytes(json.dumps(document).encode())


def test_cheap_listing_misses_a_flipped_byte_that_verify_finds(store: CheckpointStore, commit):
    commit(1)
    commit(2)
    flip_byte(store)

    assert store.list(verify=False)[1].status == "committed"
    assert store.newest_valid(verify=False).step == 2
    assert store.list(verify=True)[1].reason == "checksum mismatch in model/shard_0.bin"


def test_newest_valid_respects_max_step(store: CheckpointStore, commit):
    for step in (10, 20, 30):
        commit(step)

    assert store.newest_valid(max_step=25).step == 20
    assert store.newest_valid(max_step=30).step == 30
    assert store.newest_valid(max_step=5) is None


def test_retain_keeps_the_newest_max_num(store: CheckpointStore, commit):
    for step in (1, 2, 3, 4):
        commit(step)

    assert store.retain(max_num=2) == ["step_1", "step_2"]

    assert [info.step for info in store.list(verify=True)] == [3, 4]
    assert not store.fs.exists(remote_path(store, "step_1"))
    assert store.latest_name() == "step_4"


@pytest.mark.parametrize("max_num", [None, 0, -1, 5])
def test_retain_without_effective_limit_removes_nothing(store: CheckpointStore, commit, max_num):
    for step in (1, 2, 3):
        commit(step)

    assert store.retain(max_num=max_num) == []
    assert len(store.list()) == 3


def test_retain_by_size_keeps_what_fits(store: CheckpointStore, commit):
    for step in (1, 2, 3, 4):
        commit(step)
    checkpoint_bytes = max(info.size_bytes for info in store.list())

    assert store.retain(max_num=None, max_mem_gb=2.5 * checkpoint_bytes / 1e9) == ["step_1", "step_2"]
    assert [info.step for info in store.list()] == [3, 4]


def test_retain_never_removes_the_newest_committed_and_ignores_uncommitted(store: CheckpointStore, commit):
    write_remote(store, "step_0/leftover.bin", b"from a crash")
    for step in (1, 2, 3):
        commit(step)
    write_remote(store, "step_9/model/shard_0.bin", b"half written")

    assert store.retain(max_num=1, max_mem_gb=1e-12) == ["step_1", "step_2"]

    statuses = [(info.step, info.status) for info in store.list()]
    assert statuses == [(0, "incomplete"), (3, "committed"), (9, "incomplete")]
    assert store.retain(max_num=1, max_mem_gb=1e-12) == []


def test_commit_of_a_committed_step_returns_it_without_rewriting(
    store: CheckpointStore, make_local_checkpoint, monkeypatch: pytest.MonkeyPatch
):
    first = store.commit(3, str(make_local_checkpoint(seed=1)), {"global_step": 3})
    manifest_before = read_remote(store, f"step_3/{MANIFEST_NAME}")
    shard_before = read_remote(store, "step_3/model/shard_0.bin")
    written_paths = record_writes(store, monkeypatch)

    second = store.commit(3, str(make_local_checkpoint(seed=2)), {"global_step": 3, "other": True})

    assert second == first
    assert written_paths == []
    assert read_remote(store, f"step_3/{MANIFEST_NAME}") == manifest_before
    assert read_remote(store, "step_3/model/shard_0.bin") == shard_before
    assert store.read_metadata(3) == {"global_step": 3}


def test_commit_moves_a_leftover_step_dir_aside(store: CheckpointStore, make_local_checkpoint):
    write_remote(store, "step_5/junk.bin", b"left by a crash")

    info = store.commit(5, str(make_local_checkpoint()), {"global_step": 5})

    assert info.status == "committed"
    assert not store.fs.exists(remote_path(store, "step_5/junk.bin"))
    aside_paths = store.fs.ls(remote_path(store, ".aside"), detail=False)
    aside_names = [posixpath.basename(path) for path in aside_paths]
    assert len(aside_names) == 1 and aside_names[0].startswith("step_5.")
    assert read_remote(store, f".aside/{aside_names[0]}/junk.bin") == b"left by a crash"
    assert [listed.name for listed in store.list()] == ["step_5"]


def test_latest_never_moves_backwards(store: CheckpointStore, commit):
    commit(10)
    commit(5)
    assert store.latest_name() == "step_10"
    assert store.newest_valid().step == 10

    commit(20)
    assert store.latest_name() == "step_20"


def test_download_round_trips(store: CheckpointStore, make_local_checkpoint, tmp_path: Path):
    local_dir = make_local_checkpoint()
    store.commit(4, str(local_dir), {"global_step": 4})

    target = tmp_path / "download"
    assert store.download(4, str(target)) == str(target)

    downloaded = local_files(target)
    assert json.loads(downloaded.pop(METADATA_NAME)) == {"global_step": 4}
    assert downloaded.pop(MANIFEST_NAME) == read_remote(store, f"step_4/{MANIFEST_NAME}")
    assert downloaded == local_files(local_dir)


def test_download_detects_a_checksum_mismatch(store: CheckpointStore, commit, tmp_path: Path):
    commit(1)
    commit(2)
    flip_byte(store)

    with pytest.raises(UserError, match="model/shard_0.bin"):
        store.download(2, str(tmp_path / "download"))


def test_download_refuses_an_incomplete_step(store: CheckpointStore, tmp_path: Path):
    write_remote(store, "step_2/model/shard_0.bin", b"half written")

    with pytest.raises(UserError, match="incomplete"):
        store.download(2, str(tmp_path / "download"))


def test_missing_root_is_an_empty_store(store: CheckpointStore):
    assert store.list() == []
    assert store.is_empty()
    assert store.newest_valid() is None
    assert store.latest_name() is None
    assert store.retain(max_num=1) == []


def test_listing_ignores_entries_that_are_not_step_dirs(store: CheckpointStore, commit):
    for name in ("step_abc", "step_007", ".tmp_step_3_ab12", "_prefect", ".aside/step_4.x"):
        write_remote(store, f"{name}/file.bin", b"x")
    write_remote(store, "step_8", b"a file, not a dir")
    assert store.is_empty()

    commit(7)
    assert [info.name for info in store.list()] == ["step_7"]


def test_read_metadata_of_a_missing_step_is_a_user_error(store: CheckpointStore):
    with pytest.raises(UserError, match="step_3"):
        store.read_metadata(3)


def test_commit_of_a_missing_folder_is_a_user_error(store: CheckpointStore, tmp_path: Path):
    with pytest.raises(UserError, match="does not exist"):
        store.commit(1, str(tmp_path / "nowhere"), {})


def test_local_store_accepts_file_urls_and_builds_plain_uris(tmp_path: Path, make_local_checkpoint):
    plain = CheckpointStore(str(tmp_path / "store"))
    by_url = CheckpointStore(f"file://{tmp_path / 'store'}")
    plain.commit(1, str(make_local_checkpoint()), {})

    assert plain.uri(1) == f"{tmp_path / 'store'}/step_1"
    assert by_url.uri(1) == f"file://{tmp_path / 'store'}/step_1"
    assert [info.status for info in by_url.list(verify=True)] == ["committed"]


def test_manifest_round_trips_through_bytes(store: CheckpointStore, commit):
    commit(1)
    manifest_bytes = read_remote(store, f"step_1/{MANIFEST_NAME}")

    assert Manifest.from_bytes(manifest_bytes).to_bytes() == manifest_bytes


def test_format_listing_and_to_json(store: CheckpointStore, commit):
    commit(1)
    write_remote(store, "step_2/model/shard_0.bin", b"half written")
    infos = store.list()

    lines = format_listing(infos).splitlines()
    assert lines[0].split() == ["step", "status", "size", "name", "reason"]
    assert lines[1].split()[:4] == ["1", "committed", f"{infos[0].size_bytes / 1e6:.1f}", "MB"]
    assert "incomplete" in lines[2] and f"no {MANIFEST_NAME}" in lines[2]
    assert format_listing([]) == "no checkpoints"

    rows = to_json(infos)
    assert json.loads(json.dumps(rows)) == rows
    assert rows[0]["status"] == "committed" and rows[1]["reason"] == f"no {MANIFEST_NAME}"


def test_s3_store_commits_moves_aside_verifies_retains_and_downloads(
    s3_endpoint: str, make_local_checkpoint, tmp_path: Path
):
    bucket = f"ckpt-{uuid.uuid4().hex}"
    storage_options = {"key": "x", "secret": "x", "client_kwargs": {"endpoint_url": s3_endpoint}}
    store = CheckpointStore(f"s3://{bucket}/run/sft", storage_options)
    store.fs.mkdir(bucket)
    assert store.uri(1) == f"s3://{bucket}/run/sft/step_1"

    for step in (1, 2):
        store.commit(step, str(make_local_checkpoint(step)), {"global_step": step})
    write_remote(store, "step_3/junk.bin", b"left by a crash")
    local_dir = make_local_checkpoint(3)
    assert store.commit(3, str(local_dir), {"global_step": 3}).status == "committed"

    store.fs.invalidate_cache()
    assert len(store.fs.ls(remote_path(store, ".aside"))) == 1
    assert store.latest_name() == "step_3"
    flip_byte(store)
    assert [info.status for info in store.list(verify=True)] == ["committed", "corrupt", "committed"]
    assert store.newest_valid(max_step=2).step == 1
    with pytest.raises(UserError, match="model/shard_0.bin"):
        store.download(2, str(tmp_path / "corrupt_download"))

    assert store.retain(max_num=1) == ["step_1", "step_2"]
    store.download(3, str(tmp_path / "download"))
    downloaded, committed = local_files(tmp_path / "download"), local_files(local_dir)
    assert downloaded.keys() - committed.keys() == {MANIFEST_NAME, METADATA_NAME}
    assert all(downloaded[name] == data for name, data in committed.items())


def test_read_in_place_yields_the_local_step_folder_and_copies_nothing(store: CheckpointStore, commit,
                                                                       tmp_path: Path):
    commit(3)
    files_before = sorted(tmp_path.rglob("*"))
    with store.read_in_place(3, lambda paths: [path for path in paths if path.startswith("model/")]) as folder:
        if not isinstance(store.fs, LocalFileSystem):
            assert folder is None  # an object store's files must be fetched
            return
        assert folder == remote_path(store, "step_3")
    assert sorted(tmp_path.rglob("*")) == files_before


def test_read_in_place_detects_a_changed_byte_in_a_selected_file_only_and_it_wins_over_the_readers_error(
        store: CheckpointStore, commit):
    commit(3)
    if not isinstance(store.fs, LocalFileSystem):
        pytest.skip("read_in_place is for local stores")
    path = remote_path(store, "step_3/model/shard_1.bin")
    data = bytearray(open(path, "rb").read())
    data[100] ^= 0xFF
    open(path, "wb").write(bytes(data))
    with store.read_in_place(3, lambda paths: [p for p in paths if p.endswith("shard_0.bin")]) as folder:
        assert folder
    with pytest.raises(CorruptCheckpoint, match="shard_1.bin"):
        with store.read_in_place(3):
            pass
    with pytest.raises(CorruptCheckpoint, match="shard_1.bin"):
        with store.read_in_place(3):
            raise RuntimeError("PytorchStreamReader failed reading zip archive")  # the damaged file's reader
    with pytest.raises(RuntimeError, match="not the files"):
        with store.read_in_place(3, lambda paths: [p for p in paths if p.endswith("shard_0.bin")]):
            raise RuntimeError("not the files' fault")


def test_read_in_place_refuses_an_uncommitted_step(store: CheckpointStore, commit):
    commit(3)
    if not isinstance(store.fs, LocalFileSystem):
        pytest.skip("read_in_place is for local stores")
    os.remove(remote_path(store, f"step_3/{MANIFEST_NAME}"))
    with pytest.raises(UserError, match="step_3"):
        with store.read_in_place(3):
            pass


def test_streams_are_written_and_hashed_beside_the_files(store: CheckpointStore, make_local_checkpoint):
    """A rank's state kept in memory goes straight into the step (no local file), hashed as it is written,
    large blocks (hashed in a second thread while written) and small ones alike."""
    local_dir = make_local_checkpoint()
    large, small = os.urandom((3 << 20) + 12345), b"tail"  # not a whole number of write pieces

    def write_state(target) -> None:
        target.write(large)
        target.write(memoryview(small))

    pending = store.prepare_step(7)
    entries = store.upload_tree(pending, str(local_dir), [("model/ds/state.pt", write_state)])
    info = store.finish_commit(pending, entries, {"step": 7})
    manifest = {entry["path"]: entry for entry in json.loads(read_remote(store, f"step_7/{MANIFEST_NAME}"))["files"]}
    assert read_remote(store, "step_7/model/ds/state.pt") == large + small
    assert manifest["model/ds/state.pt"] == {"path": "model/ds/state.pt", "size": len(large) + len(small),
                                             "xxh3_128": xxhash.xxh3_128(large + small).hexdigest()}
    assert set(manifest) == {"model/ds/state.pt", METADATA_NAME, *local_files(local_dir)}
    assert store.list(verify=True) == [info]


def test_sha256_of_local_file_hashes_in_place_and_reads_nothing_of_the_wrong_size(tmp_path):
    import hashlib

    from rlhf_core.storage.manifest import sha256_of_local_file

    data, empty = tmp_path / "data.bin", tmp_path / "empty.bin"
    data.write_bytes(b"x" * 300_000)
    empty.write_bytes(b"")
    assert sha256_of_local_file(str(data)) == (300_000, hashlib.sha256(b"x" * 300_000).hexdigest())
    assert sha256_of_local_file(str(data), 300_001) == (300_000, None)
    assert sha256_of_local_file(str(empty), 0) == (0, hashlib.sha256(b"").hexdigest())

