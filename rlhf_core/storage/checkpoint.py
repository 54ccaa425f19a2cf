"""The checkpoint store: resumable training checkpoints of one run stage on any fsspec filesystem (a local path,
``file://``, ``memory://``, ``s3://``). A store lists its steps and tells committed from incomplete or corrupt
ones (a manifest of every file's size and checksum), hands a rank only the files it needs (verified as they
download), sets bad steps aside instead of deleting them, and applies retention after a commit. The commit
protocol itself is `rlhf_core.storage.commit`. docs/design-notes.md ("The checkpoint store's protocol") has the
layout, the durability argument and where this departs from OpenRLHF.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import json
import os
import posixpath
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator

from fsspec.core import url_to_fs

from rlhf_core.storage import manifest as _manifest
from rlhf_core.errors import CorruptCheckpoint, UserError
from rlhf_core.storage.locate import is_local_url, store_unreachable
from rlhf_core.storage.manifest import (ASIDE_DIR_NAME, ASIDE_REASON_NAME, BYTES_PER_GB, LATEST_NAME, MANIFEST_NAME,
                                        METADATA_NAME, STATUS_COMMITTED, STATUS_CORRUPT, STATUS_INCOMPLETE,
                                        TRANSFER_BLOCK_BYTES, TRANSFER_THREADS, CheckpointInfo, Manifest, ManifestEntry,
                                        copy_hashing, digest_of_bytes, digest_of_local_file, manifest_digest,
                                        parse_step_dir_name, require_checksum, step_dir_name)
from rlhf_core.storage.backends import backend_for
from rlhf_core.storage.metadata import CheckpointMetadata
from rlhf_core.storage.commit import StoreWrites

# Which of a checkpoint's files (relative paths) to read. In CheckpointStore, `list` is its method: annotations there
# say `builtins.list`.
FileSelection = Callable[[list[str]], list[str]]


@dataclasses.dataclass(frozen=True)
class AsideEntry:
    """A step dir set aside under ``.aside/``: its folder name there and its URL (why it was moved:
    `CheckpointStore.aside_reason`)."""

    name: str
    uri: str

    @property
    def step(self) -> int | None:
        step_text = self.name.split(".", 1)[0].removeprefix("step_")
        return int(step_text) if step_text.isdigit() else None


class CheckpointStore(StoreWrites):
    """Checkpoints of one run stage, stored under one fsspec URL."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, checksum: str | None = None):
        try:  # read at construction, not import, so a caller (the bench) can set the module's default
            self.checksum: str = require_checksum(checksum or _manifest.DEFAULT_CHECKSUM)
        except ValueError as error:
            raise UserError(f"Checkpoint checksum: {error}.") from None
        self.fs, root = url_to_fs(url, **(storage_options or {}))
        self.backend = backend_for(self.fs)
        # A local listing returns normalized paths; the root must match them to be stripped.
        root = posixpath.normpath(root) if is_local_url(url) else root
        self.root: str = root.rstrip("/") or root
        self.url: str = url.rstrip("/") if "://" in url else self.root

    # ----------------------------------------------------------------- queries

    def uri(self, step: int) -> str:
        return f"{self.url}/{step_dir_name(step)}"

    def list(self, verify: bool = False) -> list[CheckpointInfo]:
        """Every step dir, oldest first; ``verify`` also checks each file's checksum."""
        return [self._inspect(step, verify) for step in self._steps()]

    def newest_valid(self, max_step: int | None = None, verify: bool = True) -> CheckpointInfo | None:
        """The newest committed checkpoint at or below ``max_step``, or None.

        Only candidates that pass the cheap size check are hashed, newest first, so a
        healthy store costs one full verification.
        """
        for info in reversed(self.list(verify=False)):
            if max_step is not None and info.step > max_step:
                continue
            if info.is_committed and verify:
                info = self._inspect(info.step, verify=True)
            if info.is_committed:
                return info
        return None

    def set_aside(self, info: CheckpointInfo) -> str:
        """Move a bad step dir under ``.aside/`` with a REASON file; returns where it went."""
        aside_path = self._move_aside(info.name)
        self._write_bytes(f"{aside_path}/{ASIDE_REASON_NAME}", f"{info.status}: {info.reason}\n".encode())
        return aside_path

    def aside_entries(self) -> builtins.list[AsideEntry]:
        """The folders under ``.aside/`` (bad or leftover step dirs, never deleted), oldest name first."""
        aside_path = self._path(ASIDE_DIR_NAME)
        try:
            self.fs.invalidate_cache(aside_path)  # object stores cache listings
            names = sorted(entry.rstrip("/").rsplit("/", 1)[-1] for entry in self.fs.ls(aside_path, detail=False))
        except FileNotFoundError:
            return []
        return [AsideEntry(name, f"{self.url}/{ASIDE_DIR_NAME}/{name}") for name in names]

    def aside_reason(self, name: str) -> str:
        """Why the folder `name` under ``.aside/`` was set aside (its REASON file; a leftover has none)."""
        try:
            return self.fs.cat_file(self._path(f"{ASIDE_DIR_NAME}/{name}/{ASIDE_REASON_NAME}")).decode().strip()
        except (FileNotFoundError, UnicodeDecodeError):
            return "leftover uncommitted step"

    def read_json(self, name: str) -> Any:
        """A small JSON file at the store root (not in a step dir), or None if absent or unreadable."""
        try:
            return json.loads(self.fs.cat_file(self._path(name)))
        except (FileNotFoundError, UnicodeDecodeError, json.JSONDecodeError):
            return None

    def write_json(self, name: str, value: Any) -> None:
        self._replace_bytes(self._path(name), json.dumps(value, sort_keys=True).encode())

    def require_folder(self) -> None:
        """A UserError naming the URL when it is not a folder: `rlhf ckpt ls` on a mistyped path."""
        if self.backend.is_file(self.root):
            raise UserError(f"{self.url} is a file; give a stage folder {{ckpt_path}}/{{run_name}}/{{stage}}.")
        try:
            exists = self.fs.isdir(self.root)
        except Exception as error:  # noqa: BLE001 - a store's own error types; re-raised unless understood
            _raise_if_unreachable(error, self.url)
            raise
        if not exists:
            raise UserError(f"{self.url}: no such folder; give a stage folder {{ckpt_path}}/{{run_name}}/{{stage}} "
                            "(e.g. ./ckpt/rlhf/sft).")

    def latest_name(self) -> str | None:
        """Contents of ``latest``, or None when it is absent or empty."""
        try:
            text = self.fs.cat_file(self._path(LATEST_NAME)).decode().strip()
        except FileNotFoundError:
            return None
        return text or None

    def is_empty(self) -> bool:
        return not self._steps()

    def read_metadata(self, step: int) -> dict[str, Any]:
        metadata_uri = f"{self.uri(step)}/{METADATA_NAME}"
        try:
            metadata = json.loads(self.fs.cat_file(f"{self._path(step_dir_name(step))}/{METADATA_NAME}"))
        except FileNotFoundError as error:
            raise UserError(f"{metadata_uri} does not exist; pick another step.") from error
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise UserError(f"{metadata_uri} is not valid JSON; pick another step.") from error
        if not isinstance(metadata, dict):
            raise UserError(f"{metadata_uri} is not a JSON object; pick another step.")
        return metadata

    def training_metadata(self, step: int) -> CheckpointMetadata:
        """The training metadata a commit of the driver recorded in ``step_N`` (`read_metadata`, typed)."""
        return CheckpointMetadata.from_json(self.read_metadata(step))

    def verified_training_metadata(self, step: int) -> CheckpointMetadata:
        """`training_metadata` of a committed step, checked against its manifest first (what a resume loads)."""
        return CheckpointMetadata.from_json(json.loads(self.read_verified(step, METADATA_NAME)))

    # ---------------------------------------------------------------- mutations

    def retain(self, max_num: int | None, max_mem_gb: float | None = None) -> builtins.list[str]:
        """Remove the oldest committed checkpoints beyond ``max_num`` or ``max_mem_gb``.

        A limit that is None or <= 0 means unlimited. Incomplete and corrupt dirs
        are left alone, and the newest committed checkpoint is always kept.
        Returns the names of the removed step dirs, oldest first.
        """
        kept = [info for info in self.list(verify=False) if info.is_committed]
        max_bytes = max_mem_gb * BYTES_PER_GB if max_mem_gb and max_mem_gb > 0 else None
        removed_names = []
        while len(kept) > 1:
            over_count = bool(max_num and max_num > 0 and len(kept) > max_num)
            over_size = max_bytes is not None and sum(info.size_bytes for info in kept) > max_bytes
            if not (over_count or over_size):
                break
            oldest = kept.pop(0)
            self._remove_step_dir(oldest.name)
            removed_names.append(oldest.name)
        return removed_names

    def download(self, step: int, local_dir: str, select: FileSelection | None = None) -> str:
        """Copy the committed ``step_N`` (the files ``select`` picks from the manifest's paths, all by default) and
        its manifest into ``local_dir``, every file checked against its checksum."""
        manifest_bytes = self.fetch(step, local_dir, select)
        with open(os.path.join(local_dir, MANIFEST_NAME), "wb") as stream:
            stream.write(manifest_bytes)
        return local_dir

    def fetch(self, step: int, local_dir: str, select: FileSelection | None = None) -> bytes:
        """Download the files of the committed ``step_N`` that ``select`` picks from the manifest's paths
        (all by default) into ``local_dir``, each hashed as it arrives and compared with the manifest
        (CorruptCheckpoint on a mismatch). Returns the manifest's bytes."""
        info, manifest_bytes = self._committed_manifest(step)
        entries = {entry.path: entry for entry in Manifest.from_bytes(manifest_bytes).files}
        chosen = [entries[path] for path in (select or list)(list(entries))]
        os.makedirs(local_dir, exist_ok=True)
        with ThreadPoolExecutor(TRANSFER_THREADS) as pool:
            list(pool.map(lambda entry: self._fetch_file(info, entry, local_dir), chosen))
        return manifest_bytes

    @contextlib.contextmanager
    def read_in_place(self, step: int, select: FileSelection | None = None) -> Iterator[str | None]:
        """On a local store, the folder of the committed ``step_N``, to read where it lies (no copy) while
        the files ``select`` picks are checked against the manifest in background threads (one read each,
        from the page cache the reader warms). Leaving the block waits for the check: CorruptCheckpoint on a
        mismatch, also when the block raised (a damaged file may trip its reader first), so nothing read may
        be used until then. None for an object store, whose files must be fetched (``fetch``)."""
        step_path = self.backend.folder_to_read(self._path(step_dir_name(step)))
        if step_path is None:
            yield None
            return
        info, manifest_bytes = self._committed_manifest(step)
        entries = {entry.path: entry for entry in Manifest.from_bytes(manifest_bytes).files}

        def check(entry: ManifestEntry) -> None:
            path = os.path.join(step_path, *entry.path.split("/"))
            size, digest = digest_of_local_file(path, entry.checksum, entry.size)
            if size != entry.size or digest != entry.digest:
                raise _checksum_mismatch(info, entry)

        with ThreadPoolExecutor(TRANSFER_THREADS) as pool:
            checks = [pool.submit(check, entries[path]) for path in (select or list)(list(entries))]
            try:
                yield step_path
            finally:
                for checked in checks:
                    checked.result()

    def read_verified(self, step: int, relative_path: str) -> bytes:
        """One small file of the committed ``step_N`` (e.g. its metadata), checked against the manifest."""
        info = self._inspect(step, verify=False)
        entry = None
        if info.is_committed:
            manifest = Manifest.from_bytes(self.fs.cat_file(f"{self._path(info.name)}/{MANIFEST_NAME}"))
            entry = next((entry for entry in manifest.files if entry.path == relative_path), None)
        if entry is None:
            raise CorruptCheckpoint(f"{info.uri} has no committed {relative_path}; resume from an earlier step.",
                                    step, f"no {relative_path}")
        data = self.fs.cat_file(f"{self._path(info.name)}/{relative_path}")
        if digest_of_bytes(data, entry.checksum) != entry.digest:
            raise _checksum_mismatch(info, entry)
        return data

    # ------------------------------------------------------------------ helpers

    def _committed_manifest(self, step: int) -> tuple[CheckpointInfo, bytes]:
        """The committed ``step_N`` and its manifest's bytes; one sentence (UserError) when it is not committed."""
        info = self._inspect(step, verify=False)
        if not info.is_committed:
            raise UserError(
                f"Checkpoint {info.uri} is {info.status} ({info.reason}); "
                "pick a committed step from `rlhf ckpt ls`."
            )
        return info, self.fs.cat_file(f"{self._path(info.name)}/{MANIFEST_NAME}")

    def _path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def _steps(self) -> builtins.list[int]:
        self.fs.invalidate_cache()
        try:
            entries = self.fs.ls(self.root, detail=True)
        except (FileNotFoundError, NotADirectoryError):  # nothing yet; a file in the way is the writer's problem
            return []
        except Exception as error:  # noqa: BLE001 - a store's own error types; re-raised unless understood
            _raise_if_unreachable(error, self.url)
            raise
        steps = (
            parse_step_dir_name(posixpath.basename(entry["name"].rstrip("/")))
            for entry in entries
            if entry["type"] == "directory"
        )
        return sorted(step for step in steps if step is not None)

    def _file_sizes(self, dir_path: str) -> dict[str, int]:
        """Size of every file below ``dir_path``, keyed by its path relative to it."""
        prefix = dir_path.rstrip("/") + "/"
        found = self.fs.find(dir_path, detail=True)
        return {
            name[len(prefix):]: int(entry["size"])
            for name, entry in found.items()
            if name.startswith(prefix)
        }

    def _inspect(self, step: int, verify: bool) -> CheckpointInfo:
        name = step_dir_name(step)
        dir_path = self._path(name)
        sizes = self._file_sizes(dir_path)

        def info(status: str, reason: str = "", manifest_digest: str = "") -> CheckpointInfo:
            return CheckpointInfo(
                step=step,
                name=name,
                uri=self.uri(step),
                status=status,
                size_bytes=sum(sizes.values()),
                reason=reason,
                manifest_digest=manifest_digest,
            )

        if MANIFEST_NAME not in sizes:
            return info(STATUS_INCOMPLETE, f"no {MANIFEST_NAME}")
        manifest_bytes = self.fs.cat_file(f"{dir_path}/{MANIFEST_NAME}")
        try:
            manifest = Manifest.from_bytes(manifest_bytes)
        except ValueError as error:
            return info(STATUS_CORRUPT, f"bad {MANIFEST_NAME}: {error}")
        defect = self._find_defect(dir_path, step, manifest, sizes, verify)
        if defect:
            return info(STATUS_CORRUPT, defect)
        return info(STATUS_COMMITTED, manifest_digest=manifest_digest(manifest_bytes))

    def _find_defect(
        self, dir_path: str, step: int, manifest: Manifest, sizes: dict[str, int], verify: bool
    ) -> str:
        """Why the files in ``dir_path`` disagree with ``manifest``, or "" if they agree."""
        if manifest.step != step:
            return f"manifest is for step {manifest.step}"
        for entry in manifest.files:
            if entry.path not in sizes:
                return f"missing {entry.path}"
            if sizes[entry.path] != entry.size:
                return f"size mismatch in {entry.path}"
        if verify:
            for entry in manifest.files:
                if self.backend.digest(f"{dir_path}/{entry.path}", entry.checksum, entry.size) != entry.digest:
                    return f"checksum mismatch in {entry.path}"
        return ""

    def _fetch_file(self, info: CheckpointInfo, entry: ManifestEntry, local_dir: str) -> None:
        local_path = os.path.join(local_dir, *entry.path.split("/"))
        os.makedirs(os.path.dirname(local_path), exist_ok=True)
        with self.fs.open(f"{self._path(info.name)}/{entry.path}", "rb", block_size=TRANSFER_BLOCK_BYTES) as source, \
                open(local_path, "wb") as target:
            size, digest = copy_hashing(source, target, entry.checksum)
        if size != entry.size or digest != entry.digest:
            raise _checksum_mismatch(info, entry)

    def _move_aside(self, name: str) -> str:
        """Move an uncommitted step dir under ``.aside/`` so a new commit can take its name."""
        timestamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        aside_path = self._path(f"{ASIDE_DIR_NAME}/{name}.{timestamp}_{secrets.token_hex(2)}")
        self.backend.move(self._path(name), aside_path)
        self.fs.invalidate_cache()
        return aside_path

    def _remove_step_dir(self, name: str) -> None:
        # Without its manifest a half-deleted dir reads as incomplete, never as committed.
        dir_path = self._path(name)
        self.backend.remove_step(dir_path, f"{dir_path}/{MANIFEST_NAME}")
        self.fs.invalidate_cache()


def _raise_if_unreachable(error: Exception, url: str) -> None:
    """A failure to connect to the store as a UserError naming --ckpt_path, the URL and the endpoint."""
    unreachable = store_unreachable(error, "--ckpt_path", url)
    if unreachable is not None:
        raise unreachable from None


def _checksum_mismatch(info: CheckpointInfo, entry: ManifestEntry) -> CorruptCheckpoint:
    return CorruptCheckpoint(
        f"Downloaded {entry.path} from {info.uri} does not match its checksum; "
        "the checkpoint is corrupt, so resume from an earlier step.",
        info.step, f"checksum mismatch in {entry.path}",
    )
