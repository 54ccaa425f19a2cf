"""The checkpoint store: resumable training checkpoints on any fsspec filesystem.

A store is rooted at a URL such as ``{ckpt_path}/{run_name}/{stage}`` (a local path,
``file://``, ``memory://`` or ``s3://``) and holds::

    root/latest                        name of the newest committed step dir, e.g. "step_200"
    root/step_100/...                  the checkpoint's files (subfolders allowed)
    root/step_100/training_metadata.json
    root/step_100/MANIFEST.json        {"format_version": 2, "step": 100, "checksum": "xxh3_128",
                                        "files": [{"path", "size", "xxh3_128"}, ...]}

Checksums: each file entry holds its digest under the name of the algorithm the manifest records in
``checksum`` (`CHECKSUMS`). New manifests use `DEFAULT_CHECKSUM`; format 1 manifests (no ``checksum``
field, every entry a ``sha256``) still read and verify. The manifest's own digest, a checkpoint's
identity, stays the sha256 of its bytes whatever the files' algorithm.

Commit protocol: every file of a step is uploaded first, ``MANIFEST.json`` last, and
``latest`` after that. A step dir counts as committed only when its manifest parses
and every file it lists is present with the listed size (and, when verifying, the
listed checksum). On a local filesystem the step is staged in a hidden
``.tmp_step_N_<random>`` dir and renamed into place, so a crash never leaves a half
written ``step_N``; object stores have no rename, so there the manifest alone is the
commit marker. A leftover uncommitted ``step_N`` is moved to ``.aside/`` instead of
being deleted, so nothing a person might still want is ever destroyed by a retry.

Durability (`rlhf_core.storage.durable`): on a local or NFS filesystem a commit survives a power cut. Each file
is fsync'd by the rank that writes it, the metadata and the manifest by the driver; then every folder
of the staging tree is fsync'd, the staging dir renamed to ``step_N`` and the store's folder fsync'd;
``latest`` is replaced durably (temp + fsync + rename + fsync), and retention runs only after all that.
On an object store a PUT that returned is durable already.

Per-rank writes: `prepare_step` gives the uncommitted folder (the local staging dir, or ``step_N`` on
an object store), every rank uploads its own files there (`upload_tree`, hashing while it writes,
one pass) and returns their manifest entries, and the driver alone writes the metadata, the
manifest (with the run lease's fencing token, checked just before) and ``latest``
(`finish_commit`). `fetch` gives a rank only the files it needs, each verified as it downloads.

Where this departs from OpenRLHF: OpenRLHF deletes old checkpoints *before* writing
the new one and keeps no checksums, so a crash during a save can leave no usable
checkpoint at all. Here retention runs only after a commit, only over committed
checkpoints, and never removes the newest committed one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import posixpath
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, BinaryIO, Callable, Iterator, Sequence

from fsspec.core import url_to_fs

from rlhf_core.storage import manifest as _manifest
from rlhf_core.errors import (CorruptCheckpoint, StoreFull, TransientStoreError, UserError, is_full,
                              is_permanent_os_error, store_full)
from rlhf_core.faults import fault_point
from rlhf_core.storage.locate import is_local_url, store_unreachable
from rlhf_core.storage.manifest import (_RESERVED_NAMES, ASIDE_DIR_NAME, ASIDE_REASON_NAME, BYTES_PER_GB, LATEST_NAME, MANIFEST_NAME,
                                METADATA_NAME, STAGING_PREFIX, STATUS_COMMITTED, STATUS_CORRUPT, STATUS_INCOMPLETE,
                                TRANSFER_BLOCK_BYTES, TRANSFER_THREADS, CheckpointInfo, Fence, HashingWriter, Manifest,
                                ManifestEntry, PendingStep, WriteTimings, _is_count, copy_hashing, digest_of_bytes,
                                digest_of_local_file, manifest_digest, parse_step_dir_name, require_checksum,
                                step_dir_name)
from rlhf_core.storage.backends import backend_for


@dataclasses.dataclass(frozen=True)
class AsideEntry:
    """A step dir set aside under ``.aside/``: its folder name there, its URL, and why it was moved."""

    name: str
    uri: str
    reason: str

    @property
    def step(self) -> int | None:
        step_text = self.name.split(".", 1)[0].removeprefix("step_")
        return int(step_text) if step_text.isdigit() else None


class CheckpointStore:
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

    def aside_entries(self) -> list[AsideEntry]:
        """The folders under ``.aside/`` (bad or leftover step dirs, never deleted), oldest name first."""
        aside_path = self._path(ASIDE_DIR_NAME)
        try:
            self.fs.invalidate_cache(aside_path)  # object stores cache listings
            names = sorted(entry.rstrip("/").rsplit("/", 1)[-1] for entry in self.fs.ls(aside_path, detail=False))
        except FileNotFoundError:
            return []
        return [AsideEntry(name, f"{self.url}/{ASIDE_DIR_NAME}/{name}", self._aside_reason(name)) for name in names]

    def _aside_reason(self, name: str) -> str:
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

    # ---------------------------------------------------------------- mutations

    def commit(self, step: int, local_dir: str, metadata: dict[str, Any], fence: Fence | None = None) -> CheckpointInfo:
        """Upload the checkpoint in ``local_dir`` as ``step_N`` and mark it committed.

        ``metadata`` becomes ``training_metadata.json``; any ``MANIFEST.json`` or
        ``training_metadata.json`` at the top of ``local_dir`` is ignored. Committing
        a step that is already committed returns it unchanged.
        """
        if not os.path.isdir(local_dir):
            raise UserError(f"Checkpoint folder {local_dir} does not exist; save the checkpoint first.")
        pending = self.prepare_step(step)
        if isinstance(pending, CheckpointInfo):
            return pending
        try:
            return self.finish_commit(pending, self.upload_tree(pending, local_dir), metadata, fence)
        except StoreFull:
            self.discard(pending)  # its space back; the committed steps are untouched
            raise

    def prepare_step(self, step: int) -> PendingStep | CheckpointInfo:
        """The uncommitted folder that step_N's files are uploaded into, or the committed step_N itself
        when it already is (a retry after the commit: `latest` is repaired, nothing is rewritten)."""
        if not _is_count(step):
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        name = step_dir_name(step)
        self.fs.invalidate_cache()
        if self.fs.exists(self._path(name)):
            existing = self._inspect(step, verify=False)
            if existing.is_committed:
                self._advance_latest(step)
                return existing
            self._move_aside(name)
        staging_path = self._path(f"{STAGING_PREFIX}{name}_{secrets.token_hex(4)}")
        with self._named_store_errors():
            return PendingStep(step, self.backend.uncommitted_folder(self._path(name), staging_path), self.checksum)

    def discard(self, pending: PendingStep) -> None:
        """Remove an uncommitted step's files (after a failed write): its space goes back, nothing committed moves."""
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(pending.path, recursive=True)
        self.fs.invalidate_cache()

    def free_bytes(self) -> int | None:
        """Free space on the store's filesystem, or None where the store has no such limit (object stores)."""
        return self.backend.free_bytes(self.root)

    @contextlib.contextmanager
    def _named_store_errors(self):
        """A write's OSError as the failure it is (`rlhf_core.errors`): a full disk or quota is StoreFull (one
        sentence, no retry); one that passes (a 5xx or reset after fsspec's own retries, EIO) is
        TransientStoreError naming the store (the chunk is retried); one no retry fixes (read-only, denied)
        and a missing file pass unchanged."""
        try:
            yield
        except OSError as error:
            if is_full(error):
                raise store_full(self.url, error) from None
            if is_permanent_os_error(error) or isinstance(error, FileNotFoundError):
                raise
            raise TransientStoreError(f"--ckpt_path {self.url}: a write failed ({type(error).__name__}: {error}); "
                                      "nothing was committed for this chunk and earlier checkpoints are intact, so "
                                      "the chunk is retried from the last commit.") from error

    def upload_tree(self, pending: PendingStep, local_dir: str,
                    streams: Sequence[tuple[str, Callable[[BinaryIO], None]]] = (),
                    timings: dict[str, float] | None = None) -> list[ManifestEntry]:
        """Upload every file below ``local_dir`` into ``pending``, and write each of ``streams`` (a relative
        path and a function that writes the file's bytes into a file object, e.g. a ``torch.save`` of
        tensors held in memory) straight into it, hashing everything as it is written (one pass); returns
        their manifest entries. Ranks call this, each with its own files. ``timings``, when given, gathers
        where the writer threads' time went (`WriteTimings`)."""
        files = sorted(_list_local_files(local_dir).items(), key=lambda item: -os.path.getsize(item[1]))
        # Streams (a rank's largest state), then the largest file first: the mid_upload kill point then
        # lands inside a real transfer.
        timer = WriteTimings(timings if timings is not None else {})
        uploads = [functools.partial(self._write_stream, pending, *stream, timer) for stream in streams]
        uploads += [functools.partial(self._upload_file, pending, *item, timer) for item in files]
        if not uploads:
            return []
        # Streams pickle under the GIL, so they go one at a time, in one thread; files copy and hash outside
        # it, beside them. Without streams the largest file goes alone first.
        num_serial = len(streams) or 1
        serial, parallel = uploads[:num_serial], uploads[num_serial:]

        def in_order() -> list[ManifestEntry]:
            written = [serial[0]()]
            fault_point("between_uploads", pending.step)
            return written + [upload() for upload in serial[1:]]

        with ThreadPoolExecutor(TRANSFER_THREADS) as pool:
            if streams:
                first = pool.submit(in_order)
                rest = [pool.submit(upload) for upload in parallel]
                return first.result() + [job.result() for job in rest]
            entries = in_order()
            return entries + list(pool.map(lambda upload: upload(), parallel))

    def finish_commit(self, pending: PendingStep, entries: list[ManifestEntry], metadata: dict[str, Any],
                      fence: Fence | None = None) -> CheckpointInfo:
        """Write the metadata, then (after checking ``fence``, the run lease) the manifest, then
        ``latest``: the driver's part of a commit whose files the ranks uploaded."""
        paths = [entry.path for entry in entries]
        doubled = sorted({path for path in paths if paths.count(path) > 1})
        if doubled:
            raise ValueError(f"two ranks uploaded {doubled[0]} for step {pending.step}")
        metadata_bytes = json.dumps(metadata, indent=2, sort_keys=True).encode()
        self._write_bytes(f"{pending.path}/{METADATA_NAME}", metadata_bytes)
        entries = [entry for entry in entries if entry.path not in _RESERVED_NAMES]
        metadata_digest = digest_of_bytes(metadata_bytes, pending.checksum)
        entries.append(ManifestEntry(METADATA_NAME, len(metadata_bytes), metadata_digest, pending.checksum))
        fault_point("before_manifest", pending.step)
        if fence is not None:
            fence.assert_held()
        manifest = Manifest(pending.step, tuple(sorted(entries, key=lambda entry: entry.path)),
                            lease_token=fence.token if fence is not None else "")
        # The manifest goes last: its presence is what marks the step as committed.
        self._write_bytes(f"{pending.path}/{MANIFEST_NAME}", manifest.to_bytes())
        self.backend.publish(pending.path, self._path(step_dir_name(pending.step)))
        fault_point("before_latest", pending.step)
        self._advance_latest(pending.step)
        self.fs.invalidate_cache()
        return self._inspect(pending.step, verify=False)

    def retain(self, max_num: int | None, max_mem_gb: float | None = None) -> list[str]:
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

    def download(self, step: int, local_dir: str, select: Callable[[list[str]], list[str]] | None = None) -> str:
        """Copy the committed ``step_N`` (the files ``select`` picks from the manifest's paths, all by default) and
        its manifest into ``local_dir``, every file checked against its checksum."""
        manifest_bytes = self.fetch(step, local_dir, select)
        with open(os.path.join(local_dir, MANIFEST_NAME), "wb") as stream:
            stream.write(manifest_bytes)
        return local_dir

    def fetch(self, step: int, local_dir: str, select: Callable[[list[str]], list[str]] | None = None) -> bytes:
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
    def read_in_place(self, step: int, select: Callable[[list[str]], list[str]] | None = None) -> Iterator[str | None]:
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

    def _steps(self) -> list[int]:
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

    def _upload_file(self, pending: PendingStep, relative_path: str, local_path: str,
                     timer: WriteTimings | None = None) -> ManifestEntry:
        def copy(target: BinaryIO) -> None:
            with open(local_path, "rb") as source:
                while block := source.read(TRANSFER_BLOCK_BYTES):
                    target.write(block)

        return self._write_stream(pending, relative_path, copy, timer)

    def _write_stream(self, pending: PendingStep, relative_path: str, write: Callable[[BinaryIO], None],
                      timer: WriteTimings | None = None) -> ManifestEntry:
        remote_path = f"{pending.path}/{relative_path}"
        with self._named_store_errors():
            return self._write_stream_into(pending, relative_path, remote_path, write, timer or WriteTimings({}))

    def _write_stream_into(self, pending: PendingStep, relative_path: str, remote_path: str,
                           write: Callable[[BinaryIO], None], timer: WriteTimings) -> ManifestEntry:
        started = time.perf_counter()
        with self.backend.open_new(remote_path) as target:
            sink = HashingWriter(target, lambda: fault_point("mid_upload", pending.step), pending.checksum)
            try:
                write(sink)
            finally:
                sink.close()
            written = time.perf_counter()
            self.backend.sync(target)  # in the rank's background writer, beside the other files' writes
        timer.add(write=written - started - sink.hash_wait_seconds, hash=sink.hash_wait_seconds,
                  fsync=time.perf_counter() - written)
        return ManifestEntry(relative_path, sink.size, sink.hexdigest(), pending.checksum)

    def _fetch_file(self, info: CheckpointInfo, entry: ManifestEntry, local_dir: str) -> None:
        local_path = os.path.join(local_dir, *entry.path.split("/"))
        os.makedirs(os.path.dirname(local_path), exist_ok=True)
        with self.fs.open(f"{self._path(info.name)}/{entry.path}", "rb", block_size=TRANSFER_BLOCK_BYTES) as source, \
                open(local_path, "wb") as target:
            size, digest = copy_hashing(source, target, entry.checksum)
        if size != entry.size or digest != entry.digest:
            raise _checksum_mismatch(info, entry)

    def _advance_latest(self, step: int) -> None:
        """Point ``latest`` at ``step`` unless it already names this or a newer step."""
        current_step = parse_step_dir_name(self.latest_name() or "")
        if current_step is None or step > current_step:
            self._replace_bytes(self._path(LATEST_NAME), step_dir_name(step).encode())

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

    def _write_bytes(self, path: str, data: bytes) -> None:
        """A new file, durable when this returns (`storage.backends`)."""
        with self._named_store_errors():
            self.backend.write_new(path, data)

    def _replace_bytes(self, path: str, data: bytes) -> None:
        """A file replaced whole, durably: readers (and a power cut) see the old bytes or the new."""
        with self._named_store_errors():
            self.backend.replace(path, data)


def _raise_if_unreachable(error: Exception, url: str) -> None:
    """A failure to connect to the store as a UserError naming --ckpt_path, the URL and the endpoint."""
    unreachable = store_unreachable(error, "--ckpt_path", url)
    if unreachable is not None:
        raise unreachable from None


def _list_local_files(local_dir: str) -> dict[str, str]:
    """Absolute path of every file below ``local_dir``, keyed by its "/"-separated relative path."""
    files = {}
    for dir_path, dir_names, file_names in os.walk(local_dir):
        dir_names.sort()
        for file_name in sorted(file_names):
            absolute_path = os.path.join(dir_path, file_name)
            relative_path = os.path.relpath(absolute_path, local_dir).replace(os.sep, "/")
            if relative_path not in _RESERVED_NAMES:
                files[relative_path] = os.path.abspath(absolute_path)
    return files


def _checksum_mismatch(info: CheckpointInfo, entry: ManifestEntry) -> CorruptCheckpoint:
    return CorruptCheckpoint(
        f"Downloaded {entry.path} from {info.uri} does not match its checksum; "
        "the checkpoint is corrupt, so resume from an earlier step.",
        info.step, f"checksum mismatch in {entry.path}",
    )


def format_listing(infos: list[CheckpointInfo]) -> str:
    """A plain-text table of checkpoints for ``rlhf ckpt ls``."""
    if not infos:
        return "no checkpoints"
    header = ("step", "status", "size", "name", "reason")
    rows = [
        (str(info.step), info.status, f"{info.size_bytes / 1e6:.1f} MB", info.name, info.reason)
        for info in infos
    ]
    table = [header, *rows]
    widths = [max(len(row[column]) for row in table) for column in range(len(header))]
    lines = ("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in table)
    return "\n".join(lines)


def to_json(infos: list[CheckpointInfo]) -> list[dict[str, Any]]:
    """Checkpoint infos as plain dicts, for ``--json`` output."""
    return [dataclasses.asdict(info) for info in infos]
