"""The writing half of the checkpoint store (`CheckpointStore`): the commit protocol. A step's files go into an
uncommitted folder (`prepare_step`), each rank uploading its own and hashing as it writes (`upload_tree`); the
driver then writes the metadata, the manifest (after checking the run lease) and ``latest`` (`finish_commit`).
docs/design-notes.md ("The checkpoint store's protocol", "Durable writes") says why each write is durable and
what a crash leaves."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

from rlhf_core.errors import StoreFull, TransientStoreError, UserError, is_full, is_permanent_os_error, store_full
from rlhf_core.faults import fault_point
from rlhf_core.storage.backends import StoreBackend
from rlhf_core.storage.locate import connection_error
from rlhf_core.storage.manifest import (LATEST_NAME, MANIFEST_NAME, METADATA_NAME, RESERVED_NAMES, STAGING_PREFIX,
                                        TRANSFER_BLOCK_BYTES, TRANSFER_THREADS, CheckpointInfo, Fence, HashingWriter,
                                        Manifest, ManifestEntry, PendingStep, WriteTarget, WriteTimings, digest_of_bytes,
                                        is_count, parse_step_dir_name, step_dir_name)


class StoreWrites:
    """The commit protocol's methods; `CheckpointStore` mixes them in and provides what they read."""

    fs: Any
    backend: StoreBackend
    url: str
    root: str
    checksum: str

    def _path(self, name: str) -> str:
        raise NotImplementedError

    def _inspect(self, step: int, verify: bool) -> CheckpointInfo:
        raise NotImplementedError

    def _move_aside(self, name: str) -> str:
        raise NotImplementedError

    def latest_name(self) -> str | None:
        raise NotImplementedError


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
        if not is_count(step):
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
        except Exception as error:  # noqa: BLE001 - a store client's own types (botocore's are no OSError)
            if connection_error(error) is None:
                raise
            raise TransientStoreError(f"--ckpt_path {self.url}: cannot reach the store ({type(error).__name__}); "
                                      "nothing was committed for this step and earlier checkpoints are "
                                      "intact.") from error

    def upload_tree(self, pending: PendingStep, local_dir: str,
                    streams: Sequence[tuple[str, Callable[[WriteTarget], None]]] = (),
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
        entries = [entry for entry in entries if entry.path not in RESERVED_NAMES]
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

    def _upload_file(self, pending: PendingStep, relative_path: str, local_path: str,
                     timer: WriteTimings | None = None) -> ManifestEntry:
        def copy(target: WriteTarget) -> None:
            with open(local_path, "rb") as source:
                while block := source.read(TRANSFER_BLOCK_BYTES):
                    target.write(block)

        return self._write_stream(pending, relative_path, copy, timer)

    def _write_stream(self, pending: PendingStep, relative_path: str, write: Callable[[WriteTarget], None],
                      timer: WriteTimings | None = None) -> ManifestEntry:
        remote_path = f"{pending.path}/{relative_path}"
        with self._named_store_errors():
            return self._write_stream_into(pending, relative_path, remote_path, write, timer or WriteTimings({}))

    def _write_stream_into(self, pending: PendingStep, relative_path: str, remote_path: str,
                           write: Callable[[WriteTarget], None], timer: WriteTimings) -> ManifestEntry:
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

    def _advance_latest(self, step: int) -> None:
        """Point ``latest`` at ``step`` unless it already names this or a newer step."""
        current_step = parse_step_dir_name(self.latest_name() or "")
        if current_step is None or step > current_step:
            self._replace_bytes(self._path(LATEST_NAME), step_dir_name(step).encode())

    def _write_bytes(self, path: str, data: bytes) -> None:
        """A new file, durable when this returns (`storage.backends`)."""
        with self._named_store_errors():
            self.backend.write_new(path, data)

    def _replace_bytes(self, path: str, data: bytes) -> None:
        """A file replaced whole, durably: readers (and a power cut) see the old bytes or the new."""
        with self._named_store_errors():
            self.backend.replace(path, data)


def _list_local_files(local_dir: str) -> dict[str, str]:
    """Absolute path of every file below ``local_dir``, keyed by its "/"-separated relative path."""
    files = {}
    for dir_path, dir_names, file_names in os.walk(local_dir):
        dir_names.sort()
        for file_name in sorted(file_names):
            absolute_path = os.path.join(dir_path, file_name)
            relative_path = os.path.relpath(absolute_path, local_dir).replace(os.sep, "/")
            if relative_path not in RESERVED_NAMES:
                files[relative_path] = os.path.abspath(absolute_path)
    return files
