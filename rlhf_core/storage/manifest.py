"""What a committed checkpoint is made of, whatever holds it: the step folders' names, the manifest (every file's
size and checksum, written last; format 2 names its algorithm, format 1's sha256 still reads), the checksums, and
the writer that hashes a file as it is written. The commit protocol is `rlhf_core.storage.commit`, the media
`rlhf_core.storage.backends`. docs/design-notes.md ("The checkpoint manifest and its checksums") has the format.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import posixpath
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable, Protocol, TypeGuard

from rlhf_core.errors import UserError

FORMAT_VERSION = 2  # 2 added "checksum"; 1 is sha256 throughout and still reads
READABLE_FORMAT_VERSIONS = (1, 2)
MANIFEST_NAME = "MANIFEST.json"
METADATA_NAME = "training_metadata.json"
LATEST_NAME = "latest"
ASIDE_DIR_NAME = ".aside"
ASIDE_REASON_NAME = "REASON.txt"
STAGING_PREFIX = ".tmp_"
# Inside a checkpoint, each model's folder (`actor_model`, `critic_model`, ...) holds:
DEEPSPEED_STATE_DIR = "ds"  # DeepSpeed's own state (weights, optimizer partitions)
UNIVERSAL_STATE_DIR = "ds_universal"  # the same, converted to load on another world size
HF_WEIGHTS_DIR = "hf"  # the model as Hugging Face saves it: what a stage exports as its output
TRAINER_STATE_NAME = "trainer_state.json"  # step and controller state of a checkpoint without DeepSpeed state

STATUS_COMMITTED = "committed"
STATUS_INCOMPLETE = "incomplete"
STATUS_CORRUPT = "corrupt"

BYTES_PER_GB = 1e9
HASH_BLOCK_BYTES = 1 << 20
TRANSFER_BLOCK_BYTES = 8 << 20
TRANSFER_THREADS = 4  # files in flight per process (per rank when ranks upload)

# Only the canonical spelling counts, so "step_007" can never shadow "step_7".
_STEP_DIR_PATTERN = re.compile(r"step_(0|[1-9][0-9]*)")
_HEX_PATTERN = re.compile(r"[0-9a-f]+")
# Every algorithm a manifest may name, with the hex length of its digest. xxh3_128 is the default: on
# this project's bench it hashes a checkpoint at 5-8 GB/s on one core, blake3 at 2.7-4.3 and sha256 at
# 0.9-1.3 (bench/README.md), and a manifest guards against torn, truncated and flipped bytes, not against
# someone who can rewrite the manifest too. blake3 needs the optional `blake3` package (extra [blake3]).
CHECKSUMS = {"sha256": 64, "xxh3_128": 32, "blake3": 64}
DEFAULT_CHECKSUM = "xxh3_128"
LEGACY_CHECKSUM = "sha256"  # what a manifest without a "checksum" field used
# Files the store writes itself; copies of them in a local checkpoint dir are ignored.
RESERVED_NAMES = frozenset({MANIFEST_NAME, METADATA_NAME})


def step_dir_name(step: int) -> str:
    """Name of the dir holding the checkpoint of ``step``, e.g. ``step_100``."""
    return f"step_{step}"


def parse_step_dir_name(name: str) -> int | None:
    """The step encoded in a step dir name, or None if ``name`` is not one."""
    match = _STEP_DIR_PATTERN.fullmatch(name)
    return int(match.group(1)) if match else None


def require_checksum(name: Any) -> str:
    """`name` if it is a checksum algorithm this package knows, else ValueError with one phrase."""
    if not isinstance(name, str) or name not in CHECKSUMS:
        raise ValueError(f"unknown checksum {name!r} (known: {', '.join(CHECKSUMS)})")
    return name


def new_hasher(checksum: str):
    """A fresh hash object (``update``, ``hexdigest``) of algorithm ``checksum``. Every one releases the
    GIL on large blocks, so hashing runs beside a write or another hash."""
    require_checksum(checksum)
    if checksum == "sha256":
        return hashlib.sha256()
    if checksum == "xxh3_128":
        import xxhash

        return xxhash.xxh3_128()
    try:
        import blake3
    except ImportError:
        raise UserError("The blake3 checksum needs the blake3 package; `pip install blake3` to read or write "
                        "it.") from None
    return blake3.blake3()


def digest_of_stream(stream: BinaryIO, checksum: str = DEFAULT_CHECKSUM) -> str:
    """Hex digest of a binary stream, read in blocks so large shards fit in memory."""
    digest = new_hasher(checksum)
    while block := stream.read(HASH_BLOCK_BYTES):
        digest.update(block)
    return digest.hexdigest()


def digest_of_bytes(data: bytes, checksum: str = DEFAULT_CHECKSUM) -> str:
    digest = new_hasher(checksum)
    digest.update(data)
    return digest.hexdigest()


def manifest_digest(manifest_bytes: bytes) -> str:
    """A committed checkpoint's identity: the sha256 of its MANIFEST.json bytes."""
    return hashlib.sha256(manifest_bytes).hexdigest()


def digest_of_local_file(path: str, checksum: str = DEFAULT_CHECKSUM, expected_size: int | None = None
                         ) -> tuple[int, str | None]:
    """(size, hex digest) of a local file, hashed where it lies in the page cache (mmap: no copy into
    Python, the GIL released); the digest is None when the size is not ``expected_size`` (nothing read)."""
    digest = new_hasher(checksum)
    with open(path, "rb") as stream:
        size = os.fstat(stream.fileno()).st_size
        if expected_size is not None and size != expected_size:
            return size, None
        if not size:  # mmap refuses an empty file
            return 0, digest.hexdigest()
        with mmap.mmap(stream.fileno(), 0, access=mmap.ACCESS_READ) as view:
            digest.update(view)
        return size, digest.hexdigest()


def sha256_of_local_file(path: str, expected_size: int | None = None) -> tuple[int, str | None]:
    """`digest_of_local_file` with sha256 (format 1 manifests, and callers written for them)."""
    return digest_of_local_file(path, "sha256", expected_size)


@dataclass(frozen=True)
class ManifestEntry:
    path: str  # relative to the step dir, "/"-separated
    size: int
    digest: str  # hex, of algorithm `checksum`
    checksum: str = LEGACY_CHECKSUM  # sha256 unless told: what a three-field entry always held

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size, self.checksum: self.digest}


@dataclass(frozen=True)
class Manifest:
    step: int
    files: tuple[ManifestEntry, ...]
    format_version: int = FORMAT_VERSION  # as read; `to_bytes` always writes FORMAT_VERSION
    lease_token: str = ""  # the fencing token of the run lease held by the writer ("" when unfenced)

    def __post_init__(self) -> None:
        used = sorted({entry.checksum for entry in self.files})
        if len(used) > 1:
            raise ValueError(f"file entries use different checksums ({', '.join(used)})")

    @property
    def checksum(self) -> str:
        """The algorithm of every file entry's digest."""
        return self.files[0].checksum if self.files else DEFAULT_CHECKSUM

    def to_bytes(self) -> bytes:
        document = {
            "format_version": FORMAT_VERSION,
            "step": self.step,
            "checksum": self.checksum,
            "files": [entry.to_json() for entry in self.files],
            **({"lease_token": self.lease_token} if self.lease_token else {}),
        }
        return json.dumps(document, indent=2).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Manifest:
        """Parse and validate a manifest; raises ValueError with a short phrase."""
        try:
            document = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError("not valid JSON") from error
        if not isinstance(document, dict):
            raise ValueError("not a JSON object")
        version = document.get("format_version")
        if version not in READABLE_FORMAT_VERSIONS or isinstance(version, bool):
            raise ValueError(f"unsupported format_version {version!r}")
        step = document.get("step")
        raw_files = document.get("files")
        if not is_count(step) or not isinstance(raw_files, list):
            raise ValueError("missing step or files")
        checksum = LEGACY_CHECKSUM if version == 1 else require_checksum(document.get("checksum"))
        lease_token = document.get("lease_token", "")
        return cls(step=step, files=tuple(_parse_entry(raw, checksum) for raw in raw_files), format_version=version,
                   lease_token=lease_token if isinstance(lease_token, str) else "")


def is_count(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _parse_entry(raw: Any, checksum: str) -> ManifestEntry:
    if not isinstance(raw, dict):
        raise ValueError("file entry is not an object")
    path, size, digest = raw.get("path"), raw.get("size"), raw.get(checksum)
    if not isinstance(path, str) or not _is_contained(path):
        raise ValueError(f"bad file path {path!r}")
    if not is_count(size) or not isinstance(digest, str) or len(digest) != CHECKSUMS[checksum] \
            or not _HEX_PATTERN.fullmatch(digest):
        raise ValueError(f"bad size or {checksum} for {path}")
    return ManifestEntry(path=path, size=size, digest=digest, checksum=checksum)


def _is_contained(relative_path: str) -> bool:
    # download() writes to local_dir/<path>, so a path must not escape the step dir.
    normalized = posixpath.normpath(relative_path)
    return (
        relative_path == normalized
        and not posixpath.isabs(normalized)
        and normalized != "."
        and not normalized.startswith("../")
        and normalized != ".."
    )


class WriteTarget(Protocol):
    """A file open for writing, as a checkpoint's bytes go into it: a binary file, a backend's writer
    (`rlhf_core.storage.backends`) or the `HashingWriter` over one, which the stream writers are handed."""

    def write(self, block: bytes | bytearray | memoryview, /) -> int: ...

    def flush(self) -> None: ...


class Fence(Protocol):
    """The run lease, as a commit sees it (`rlhf_core.storage.lease.RunLease`)."""

    @property
    def token(self) -> str: ...

    def assert_held(self) -> str: ...  # the token while held; raises LeaseLost once it is not


@dataclass(frozen=True)
class PendingStep:
    """An uncommitted step folder (a fs path) that ranks upload into, and the checksum they hash with (the
    driver's choice, so every entry of the manifest agrees); plain data, so it travels to them."""

    step: int
    path: str
    checksum: str = DEFAULT_CHECKSUM


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    name: str  # "step_100"
    uri: str  # full URL of the step dir
    status: str  # STATUS_COMMITTED | STATUS_INCOMPLETE (no manifest) | STATUS_CORRUPT
    size_bytes: int  # sum of the sizes of the files found in the step dir
    reason: str = ""  # why incomplete or corrupt, one phrase
    manifest_digest: str = ""  # sha256 of the MANIFEST.json bytes, for committed ones

    @property
    def is_committed(self) -> bool:
        return self.status == STATUS_COMMITTED


class WriteTimings:
    """Where a writer's threads spent their time, summed over its files (thread-seconds: files written in
    parallel add up to more than the wall time): `write` (serialising and writing, the page cache's copy
    included), `hash` (waiting for the checksum beyond the write it runs beside), `fsync` (waiting for the disk)."""

    def __init__(self, seconds: dict[str, float]):
        self.seconds, self._lock = seconds, threading.Lock()

    def add(self, **seconds: float) -> None:
        with self._lock:
            for name, value in seconds.items():
                self.seconds[name] = self.seconds.get(name, 0.0) + value


class HashingWriter:
    """A write-only file object that passes what it is given to ``target`` and hashes it
    on the way: each large block is hashed in a second thread while it is written (both release the
    GIL), so hashing costs no extra pass. ``after_first_block`` is a fault hook: a kill there lands
    mid-transfer."""

    _PARALLEL_BYTES = 1 << 20  # smaller writes are hashed inline (a thread hand-off costs more)

    def __init__(self, target: WriteTarget, after_first_block: Callable[[], None] | None = None,
                 checksum: str = DEFAULT_CHECKSUM):
        self.target, self.after_first_block = target, after_first_block
        self.size, self._digest = 0, new_hasher(checksum)
        self._hasher: ThreadPoolExecutor | None = None
        self.hash_wait_seconds = 0.0  # hashing that the writes beside it did not hide

    def write(self, block) -> int:
        num_bytes = memoryview(block).nbytes
        if num_bytes >= self._PARALLEL_BYTES:
            self._hasher = self._hasher or ThreadPoolExecutor(1, thread_name_prefix="checksum")
            hashed = self._hasher.submit(self._digest.update, block)
            self.target.write(block)
            waited = time.perf_counter()
            hashed.result()
            self.hash_wait_seconds += time.perf_counter() - waited
        else:
            waited = time.perf_counter()
            self._digest.update(block)
            self.hash_wait_seconds += time.perf_counter() - waited
            self.target.write(block)
        first = not self.size
        self.size += num_bytes
        if first and self.after_first_block is not None:
            self.after_first_block()
        return num_bytes

    def flush(self) -> None:
        self.target.flush()

    def close(self) -> None:
        if self._hasher is not None:
            self._hasher.shutdown()

    def hexdigest(self) -> str:
        return self._digest.hexdigest()


def copy_hashing(source: BinaryIO, target: WriteTarget, checksum: str) -> tuple[int, str]:
    """Copy ``source`` into ``target`` block by block, hashing on the way (one read):
    (size, hex digest of algorithm ``checksum``)."""
    sink = HashingWriter(target, checksum=checksum)
    try:
        while block := source.read(TRANSFER_BLOCK_BYTES):
            sink.write(block)
    finally:
        sink.close()
    return sink.size, sink.hexdigest()
