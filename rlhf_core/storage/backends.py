"""Where a checkpoint store's bytes live, behind one small interface (`StoreBackend`): a local (or NFS) filesystem
(`LocalBackend`) or an object store (`ObjectStoreBackend`: S3, GCS, Azure, `memory://`), each saying what
"committed" and "durable" mean on its medium; `backend_for` picks one. docs/design-notes.md ("Storage backends:
local filesystem and object store") has the table of what each does.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import shutil
from typing import Any, BinaryIO, Iterator, Protocol

from fsspec.implementations.local import LocalFileSystem

from rlhf_core.storage import direct_io, durable
from rlhf_core.faults import fault_point
from rlhf_core.storage.manifest import (MANIFEST_NAME, TRANSFER_BLOCK_BYTES, WriteTarget, digest_of_local_file,
                                        digest_of_stream, parse_step_dir_name)


class NewFile(WriteTarget, Protocol):
    """A file `open_new` opens: written, then made durable through its descriptor (`sync`)."""

    def fileno(self) -> int: ...


class StoreBackend(Protocol):
    """What `CheckpointStore` needs of the medium under its root; see the module's table."""

    fs: Any

    def uncommitted_folder(self, step_path: str, staging_path: str) -> str: ...

    def publish(self, folder: str, step_path: str) -> None: ...

    @contextlib.contextmanager
    def open_new(self, path: str) -> Iterator[NewFile]: ...

    def sync(self, handle: NewFile) -> None: ...

    def write_new(self, path: str, data: bytes) -> None: ...

    def replace(self, path: str, data: bytes) -> None: ...

    def move(self, source: str, target: str) -> None: ...

    def remove_step(self, step_path: str, manifest_path: str) -> None: ...

    def digest(self, path: str, checksum: str, expected_size: int) -> str | None: ...

    def folder_to_read(self, step_path: str) -> str | None: ...

    def free_bytes(self, root: str) -> int | None: ...

    def is_file(self, path: str) -> bool: ...


class LocalBackend:
    """A local or shared (NFS) filesystem: staging + rename, and every name and byte fsync'd (`rlhf_core.storage.durable`)."""

    def __init__(self, fs: LocalFileSystem):
        self.fs = fs

    def uncommitted_folder(self, step_path: str, staging_path: str) -> str:
        durable.make_dirs_durably(staging_path)  # the first commit also creates the run's folders
        return staging_path

    def publish(self, folder: str, step_path: str) -> None:
        # Every file is fsync'd as it is written; the names go down before the rename that publishes them.
        durable.fsync_tree_dirs(folder)
        os.rename(folder, step_path)  # atomic and, unlike shutil.move, never merges into an existing folder
        durable.fsync_dir(posixpath.dirname(step_path))

    @contextlib.contextmanager
    def open_new(self, path: str) -> Iterator[NewFile]:
        """A new file written around the page cache (`direct_io`); where the filesystem refuses that, through
        it, the disk starting on each window while the rest is still being serialized. Either way the closing
        `sync` waits for little."""
        self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
        direct = direct_io.open_direct(path)
        if direct is not None:
            with contextlib.closing(direct):
                yield direct
            return
        with self.fs.open(path, "wb") as handle:
            yield durable.WritebackAhead(handle)

    def sync(self, handle: NewFile) -> None:
        handle.flush()
        os.fsync(handle.fileno())

    def write_new(self, path: str, data: bytes) -> None:
        with self.open_new(path) as handle:
            handle.write(data)
            self.sync(handle)

    def replace(self, path: str, data: bytes) -> None:
        durable.replace_durably(path, data)

    def move(self, source: str, target: str) -> None:
        self.fs.makedirs(posixpath.dirname(target), exist_ok=True)
        os.rename(source, target)

    def remove_step(self, step_path: str, manifest_path: str) -> None:
        _remove_manifest(self.fs, manifest_path)
        durable.fsync_dir(step_path)  # the manifest's removal lands before any file's, or a cut could leave it alone
        _fault_during_removal(step_path)
        self.fs.rm(step_path, recursive=True)
        durable.fsync_dir(posixpath.dirname(step_path))  # else a power cut brings the half-removed folder back

    def digest(self, path: str, checksum: str, expected_size: int) -> str | None:
        return digest_of_local_file(path, checksum, expected_size)[1]  # mmap: hashed where it lies

    def folder_to_read(self, step_path: str) -> str | None:
        return step_path

    def free_bytes(self, root: str) -> int | None:
        folder = root
        while not os.path.isdir(folder):
            folder = os.path.dirname(folder)
        return shutil.disk_usage(folder).free

    def is_file(self, path: str) -> bool:
        return os.path.isfile(path)


class ObjectStoreBackend:
    """An object store through fsspec: no folders, no rename; the manifest's PUT is the commit."""

    def __init__(self, fs: Any):
        self.fs = fs

    def uncommitted_folder(self, step_path: str, staging_path: str) -> str:
        return step_path

    def publish(self, folder: str, step_path: str) -> None:
        pass  # the manifest, written last into step_N, is the commit

    @contextlib.contextmanager
    def open_new(self, path: str) -> Iterator[NewFile]:
        with self.fs.open(path, "wb") as handle:
            yield _InPieces(handle)

    def sync(self, handle: NewFile) -> None:
        pass  # durable once the upload returns, at the close

    def write_new(self, path: str, data: bytes) -> None:
        self.fs.pipe_file(path, data)

    def replace(self, path: str, data: bytes) -> None:
        self.fs.pipe_file(path, data)

    def move(self, source: str, target: str) -> None:
        # A recursive fs.mv trips over s3's pseudo folders: copy file by file, then remove the original.
        source_paths = sorted(self.fs.find(source))
        if source_paths:
            self.fs.copy(source_paths, [target + path[len(source):] for path in source_paths])
        self.remove_step(source, posixpath.join(source, MANIFEST_NAME))

    def remove_step(self, step_path: str, manifest_path: str) -> None:
        _remove_manifest(self.fs, manifest_path)  # without it a half-deleted step reads as incomplete
        _fault_during_removal(step_path)
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(step_path, recursive=True)

    def digest(self, path: str, checksum: str, expected_size: int) -> str | None:
        with self.fs.open(path, "rb") as stream:
            return digest_of_stream(stream, checksum)

    def folder_to_read(self, step_path: str) -> str | None:
        return None

    def free_bytes(self, root: str) -> int | None:
        return None  # no limit the store tells

    def is_file(self, path: str) -> bool:
        return False  # a key and a prefix may share a name; only a listing tells


class _InPieces:
    """Passes a large block to fsspec's buffered file in pieces: its buffer copies what it is given and uploads
    a part once it holds a block, so a whole tensor written at once (several GB for a large model's optimizer
    state) would first sit in the buffer in full."""

    def __init__(self, target: BinaryIO):
        self.target = target

    def write(self, block) -> int:
        num_bytes = 0
        for piece in durable.pieces_of(block, TRANSFER_BLOCK_BYTES):
            num_bytes += len(piece)
            self.target.write(piece)
        return num_bytes

    def flush(self) -> None:
        self.target.flush()

    def fileno(self) -> int:
        return self.target.fileno()


def backend_for(fs: Any) -> StoreBackend:
    return LocalBackend(fs) if isinstance(fs, LocalFileSystem) else ObjectStoreBackend(fs)


def _remove_manifest(fs: Any, manifest_path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        fs.rm_file(manifest_path)


def _fault_during_removal(step_path: str) -> None:
    fault_point("during_removal", parse_step_dir_name(posixpath.basename(step_path)) or 0)
