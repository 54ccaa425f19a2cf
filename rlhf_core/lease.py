"""One writer per run: a lease object with a heartbeat at `{ckpt_path}/{run_name}/LEASE.json`.

A run takes the lease before training and renews it every `heartbeat_s` from a background thread.
A second run finds a fresh lease held by someone else and is refused with a message naming the
holder. A lease is taken over when it is stale (no heartbeat for `stale_after_s`) or when its holder
was a process on this same host that no longer exists (a SIGKILLed run resumes at once).
Object stores offer no compare-and-swap through fsspec, so the take-over writes, waits a moment and
reads back: of two runs racing for a free lease, the later writer wins and the other is refused.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass

import fsspec
from fsspec.implementations.local import LocalFileSystem

from rlhf_core.errors import UserError

LEASE_NAME = "LEASE.json"


@dataclass
class Holder:
    id: str
    host: str
    pid: int
    started: float
    heartbeat: float

    def describe(self, now: float) -> str:
        return f"pid {self.pid} on {self.host}, last heartbeat {now - self.heartbeat:.0f} s ago"


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunLease:
    """Context manager: hold the run's lease while training, renewing it in the background."""

    def __init__(self, run_url: str, storage_options: dict | None = None, stale_after_s: float = 120.0,
                 heartbeat_s: float = 10.0, settle_s: float = 0.2):
        self.fs, root = fsspec.core.url_to_fs(run_url, **(storage_options or {}))
        self.path = f"{root.rstrip('/')}/{LEASE_NAME}"
        self.url = f"{run_url.rstrip('/')}/{LEASE_NAME}"
        self.stale_after_s, self.heartbeat_s, self.settle_s = stale_after_s, heartbeat_s, settle_s
        self.holder = Holder(uuid.uuid4().hex, socket.gethostname(), os.getpid(), time.time(), time.time())
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def read(self) -> Holder | None:
        self.fs.invalidate_cache()
        try:
            return Holder(**json.loads(self.fs.cat_file(self.path)))
        except (FileNotFoundError, ValueError, TypeError):
            return None  # absent or garbled: nobody holds it

    def _may_take_over(self, current: Holder, now: float) -> bool:
        if current.id == self.holder.id or now - current.heartbeat > self.stale_after_s:
            return True
        return current.host == self.holder.host and not _process_exists(current.pid)

    def _write(self) -> None:
        self.holder.heartbeat = time.time()
        payload = json.dumps(asdict(self.holder)).encode()
        self.fs.makedirs(os.path.dirname(self.path), exist_ok=True)
        if isinstance(self.fs, LocalFileSystem):
            # A plain write truncates first: a reader in between would see an empty lease, take it for
            # free and start a second writer. A rename is atomic; an object PUT already is.
            staging = f"{self.path}.{self.holder.id}.tmp"
            with open(staging, "wb") as handle:
                handle.write(payload)
            os.replace(staging, self.path)
        else:
            self.fs.pipe_file(self.path, payload)

    def check_available(self) -> None:
        """Raise UserError naming the holder if another live run holds the lease."""
        current = self.read()
        if current is not None and not self._may_take_over(current, time.time()):
            raise UserError(
                f"{self.url} is held by another run ({current.describe(time.time())}); wait for it to finish, "
                f"or, if it is dead, wait {self.stale_after_s:.0f} s for the lease to go stale."
            )

    def acquire(self) -> None:
        self.check_available()
        self._write()
        time.sleep(self.settle_s)
        winner = self.read()
        if winner is None or winner.id != self.holder.id:
            raise UserError(f"{self.url} was taken by another run starting at the same time; try again later.")
        self._thread = threading.Thread(target=self._renew, name="rlhf-lease", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                self._write()
            except OSError:
                pass  # a missed heartbeat is retried; only stale_after_s of them lose the lease

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        current = self.read()
        if current is not None and current.id == self.holder.id:
            self.fs.rm_file(self.path)

    def __enter__(self) -> "RunLease":
        self.acquire()
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()
