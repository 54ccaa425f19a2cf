"""One writer per run: a fenced lease with a heartbeat at `{ckpt_path}/{run_name}/LEASE.json` (`RunLease`). A run
takes it before training and renews it from a thread; every change is a compare-and-swap (atomic on a local or
NFSv4 filesystem and on S3, best effort on other fsspec backends), and each commit is fenced with the holder's
token. docs/design-notes.md ("The run lease") has the protocol and its limits.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass, fields, replace

import fsspec
from fsspec.implementations.local import LocalFileSystem

from rlhf_core.storage import durable
from rlhf_core.errors import LeaseLost, UserError
from rlhf_core.processes import process_exists

LEASE_NAME = "LEASE.json"


@dataclass
class Holder:
    id: str
    host: str
    pid: int
    started: float
    heartbeat: float
    generation: int = 0
    released: bool = False

    def describe(self, now: float) -> str:
        return f"pid {self.pid} on {self.host}, last heartbeat {now - self.heartbeat:.0f} s ago"

    @property
    def token(self) -> str:
        return f"{self.generation}-{self.id[:12]}"

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, payload: bytes) -> "Holder | None":
        try:
            raw = json.loads(payload)
            known = {field.name for field in fields(cls)}
            return cls(**{key: value for key, value in raw.items() if key in known})
        except (ValueError, TypeError, AttributeError):
            return None  # garbled: nobody holds it


# --------------------------------------------------------------------------- stores
# A store reads the record with a version (what a compare-and-swap compares against: the bytes
# locally, the ETag on S3), creates it when absent, and swaps it when unchanged. `create` and `swap`
# return the new version, or None when someone else got there first.


class _LocalStore:
    def __init__(self, path: str):
        self.path = path

    def read(self) -> tuple[bytes | None, bytes | None]:
        try:
            with open(self.path, "rb") as handle:
                payload = handle.read()
        except FileNotFoundError:
            return None, None
        return payload, payload

    def _staged(self, payload: bytes) -> str:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        staging = f"{self.path}.{uuid.uuid4().hex}.tmp"
        with open(staging, "wb") as handle:
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())  # the record is durable before any name points at it
        return staging

    def create(self, payload: bytes) -> bytes | None:
        staging = self._staged(payload)
        try:
            os.link(staging, self.path)
        except FileExistsError:
            return None
        except OSError as error:
            if error.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP):
                raise
            return self.swap(None, payload)  # no hard links here: a create is a swap from "absent"
        finally:
            os.unlink(staging)
        durable.fsync_dir(os.path.dirname(self.path))
        return payload

    def swap(self, expected: bytes | None, payload: bytes) -> bytes | None:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with open(f"{self.path}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            if self.read()[1] != expected:
                return None
            os.replace(self._staged(payload), self.path)
            durable.fsync_dir(os.path.dirname(self.path))
        return payload


def _is_lost_race(error: BaseException) -> bool:
    """Whether an s3fs error is S3 refusing a conditional write (412, or 409 for a concurrent one)."""
    current: BaseException | None = error
    while current is not None:
        response = getattr(current, "response", None)
        if isinstance(response, dict):
            code = str(response.get("Error", {}).get("Code", ""))
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            return code in ("PreconditionFailed", "ConditionalRequestConflict", "412", "409") or status in (409, 412)
        current = current.__cause__ or current.__context__
    return False


def _quoted(etag: str) -> str:
    """ETags compare equal with or without their quotes (s3fs reports them quoted today)."""
    return f'"{etag.strip(chr(34))}"'


class _S3Store:
    def __init__(self, fs, path: str):
        self.fs, self.path = fs, path

    def read(self) -> tuple[bytes | None, str | None]:
        # The ETag is read before the body: if the record changes in between, a swap against this
        # (older) ETag fails, so a decision is never made on content newer than its version.
        self.fs.invalidate_cache(self.path)
        try:
            etag = _quoted(self.fs.info(self.path)["ETag"])
            return self.fs.cat_file(self.path), etag
        except FileNotFoundError:
            return None, None

    def _conditional_put(self, payload: bytes, **condition) -> str | None:
        try:
            return _quoted(self.fs.pipe_file(self.path, payload, **condition)["ETag"])
        except (FileExistsError, FileNotFoundError):
            pass  # If-None-Match on an existing key, If-Match on a deleted one
        except OSError as error:
            if not _is_lost_race(error):
                raise
        # A PUT that landed but whose reply was lost is retried by s3fs and then refused: ours anyway.
        current, etag = self.read()
        return etag if current == payload else None

    def create(self, payload: bytes) -> str | None:
        return self._conditional_put(payload, mode="create")

    def swap(self, expected: str | None, payload: bytes) -> str | None:
        if expected is None:
            return self.create(payload)
        return self._conditional_put(payload, IfMatch=expected)


class _SettleStore:
    """Backends without a conditional write: write, wait `settle_s`, read back. Not atomic."""

    def __init__(self, fs, path: str, settle_s: float):
        self.fs, self.path, self.settle_s = fs, path, settle_s

    def read(self) -> tuple[bytes | None, bytes | None]:
        self.fs.invalidate_cache()
        try:
            payload = self.fs.cat_file(self.path)
        except FileNotFoundError:
            return None, None
        return payload, payload

    def create(self, payload: bytes) -> bytes | None:
        return self.swap(None, payload)

    def swap(self, expected: bytes | None, payload: bytes) -> bytes | None:
        if self.read()[1] != expected:
            return None
        self.fs.makedirs(os.path.dirname(self.path), exist_ok=True)
        self.fs.pipe_file(self.path, payload)
        time.sleep(self.settle_s)
        return payload if self.read()[1] == payload else None


def _store_for(fs, path: str, settle_s: float):
    if isinstance(fs, LocalFileSystem):
        return _LocalStore(path)
    if "s3" in fs.protocol or "s3a" in fs.protocol:
        return _S3Store(fs, path)
    return _SettleStore(fs, path, settle_s)


# --------------------------------------------------------------------------- the lease


class RunLease:
    """Context manager: hold the run's lease while training, renewing it in the background."""

    def __init__(self, run_url: str, storage_options: dict | None = None, stale_after_s: float = 120.0,
                 heartbeat_s: float = 10.0, settle_s: float = 0.2):
        self.fs, root = fsspec.core.url_to_fs(run_url, **(storage_options or {}))
        self.path = f"{root.rstrip('/')}/{LEASE_NAME}"
        self.url = f"{run_url.rstrip('/')}/{LEASE_NAME}"
        self.run_url = run_url
        self.stale_after_s, self.heartbeat_s = stale_after_s, heartbeat_s
        self.holder = Holder(uuid.uuid4().hex, socket.gethostname(), os.getpid(), time.time(), time.time())
        self._store = _store_for(self.fs, self.path, settle_s)
        self._version = None  # of the record we last wrote; None while not held
        self._lost: str | None = None  # why a renewal found the lease gone
        self._mutex = threading.RLock()  # one lease operation at a time: renewal, assert_held, release
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def held(self) -> bool:
        """Whether this process took the lease and has not released it (it may still have been lost since)."""
        return self._thread is not None and self._thread.is_alive() and self._version is not None

    @property
    def token(self) -> str:
        """Fencing token of this holder's current (or last) tenure: "<generation>-<holder id prefix>"."""
        return self.holder.token

    def read(self) -> Holder | None:
        return self._read()[0]

    def _read(self) -> tuple[Holder | None, object]:
        payload, version = self._store.read()
        return (None if payload is None else Holder.decode(payload)), version

    def _may_take_over(self, current: Holder, now: float) -> bool:
        if current.released or current.id == self.holder.id or now - current.heartbeat > self.stale_after_s:
            return True
        return current.host == self.holder.host and not process_exists(current.pid)

    def check_available(self) -> None:
        """Raise UserError naming the holder if another live run holds the lease."""
        self._refuse_if_held(self.read())

    def _refuse_if_held(self, current: Holder | None) -> None:
        if current is not None and not self._may_take_over(current, time.time()):
            raise UserError(
                f"{self.url} is held by another run ({current.describe(time.time())}); wait for it to finish, "
                f"or, if it is dead, wait {self.stale_after_s:.0f} s for the lease to go stale."
            )

    def acquire(self) -> None:
        """Take the lease (UserError if a live run holds it) and start renewing it. A no-op while held."""
        if self._thread is not None and self._thread.is_alive():
            return
        with self._mutex:
            current, version = self._read()
            self._refuse_if_held(current)
            generation = max(self.holder.generation, current.generation if current else 0) + 1
            record = replace(self.holder, heartbeat=time.time(), generation=generation, released=False)
            payload = record.encode()
            new_version = self._store.create(payload) if version is None else self._store.swap(version, payload)
            if new_version is None:
                raise UserError(f"{self.url} was taken by another run starting at the same time; try again later.")
            self.holder, self._version, self._lost = record, new_version, None
        self._stop.clear()
        self._thread = threading.Thread(target=self._renew, name="rlhf-lease", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                if not self._renew_once():
                    return  # lost: renewing now would only fail again; assert_held reports it
            except Exception:  # noqa: BLE001 - OSError, or a store client's own (botocore's are none)
                pass  # a missed heartbeat is retried; only stale_after_s of them lose the lease

    def _renew_once(self) -> bool:
        with self._mutex:
            if self._version is None or self._lost:
                return False
            record = replace(self.holder, heartbeat=time.time())
            new_version = self._store.swap(self._version, record.encode())
            if new_version is None:
                self._lost = "a renewal found the lease record changed by someone else"
                return False
            self.holder, self._version = record, new_version
            return True

    def assert_held(self) -> str:
        """Re-read the lease; return our token if we still hold it, else raise LeaseLost."""
        with self._mutex:
            why = self._lost
            if self._version is None:
                why = "this run does not hold it (never acquired, or released)"
            current, version = self._read()
            if not why and version != self._version:
                why = "the lease record changed under it"
            elif not why and time.time() - self.holder.heartbeat > self.stale_after_s and not self._renew_once():
                # Stale (the store was unreachable, say) but untouched: nobody took it over, so it is still ours.
                why = (f"its last renewal is {time.time() - self.holder.heartbeat:.1f} s old, past the "
                       f"{self.stale_after_s:g} s after which another run may take it over, and it changed since")
            if why:
                raise self._lost_error(why, current)
            return self.holder.token

    def _lost_error(self, why: str, current: Holder | None) -> LeaseLost:
        if current is None or current.released:
            now_held = "nobody holds it now"
        elif current.token == self.holder.token:
            now_held = "its record still names this run, but any other run may take it over now"
        else:
            now_held = f"it is now held by {current.describe(time.time())} with token {current.token}"
        return LeaseLost(
            f"{self.url} is no longer held by this run (token {self.holder.token}): {why}, and {now_held}; "
            f"stop this run without committing, and resume it when no other run is writing to it."
        )

    def release(self) -> None:
        """Stop renewing and mark the lease released, if it is still ours. Safe to call twice."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        with self._mutex:
            if self._version is not None and not self._lost:
                released = replace(self.holder, heartbeat=time.time(), released=True)
                try:
                    if self._store.swap(self._version, released.encode()) is not None:
                        self.holder = released
                except OSError:
                    pass  # unreachable store: the lease goes stale in stale_after_s instead
            self._version = None

    def __enter__(self) -> "RunLease":
        self.acquire()
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()
