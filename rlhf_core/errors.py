"""Every failure the pipeline names, as one taxonomy (after Ray Train v2's): one class per failure, each saying
whether a retry can help (`retryable`), what the CLI exits with (`exit_code`) and the remedy, read through
`is_retryable` and `exit_code_of`. docs/design-notes.md ("The error taxonomy") has the class tree and the rule for
exceptions outside it.
"""

import errno
from dataclasses import dataclass
from typing import ClassVar


class RLHFError(Exception):
    """Base of every failure the pipeline names; see the module docstring for the attributes."""

    retryable: ClassVar[bool] = False
    exit_code: ClassVar[int] = 1


class UserError(RLHFError):
    """A mistake in the user's input (flag, config field, file); the message says what to do."""

    exit_code = 2


@dataclass(frozen=True)
class FailedAt:
    """Where a rank failed: the step it was at and, for a hang, the frame it stood in and the deadline it missed.
    The same place on every try is a failure new ranks do not cure (`StallRepeats`)."""

    rank: int
    step: int
    frame: str = ""  # a hang's `stuck_frame`; "" for a lost rank
    deadline_s: float = 0.0  # a hang's


class WorkerLost(RLHFError, RuntimeError):
    """A rank's actor or node died mid-chunk; the chunk is retried from the last commit. `where`: the lost rank
    and the step it was at, when known."""

    retryable = True
    lost_to: ClassVar[str] = "lost ranks"  # the goodput ledger's name for the time it cost

    def __init__(self, message: str, where: FailedAt | None = None):
        super().__init__(message)
        self.where = where

    def __reduce__(self):  # picklable with its fields (Ray and Prefect may persist it)
        return (type(self), (str(self), self.where))


class RankHung(RLHFError, RuntimeError):
    """A rank made no progress within its deadline (`rlhf_core.driver.hang`): the ranks are killed and the chunk
    is retried from the last commit. `where`: the hung rank, its step, frame and deadline."""

    retryable = True
    lost_to: ClassVar[str] = "hangs"

    def __init__(self, message: str, rank: int = 0, stacks_path: str | None = None, alert: dict | None = None,
                 where: FailedAt | None = None):
        super().__init__(message)
        self.rank, self.stacks_path, self.alert = rank, stacks_path, alert  # alert: its rlhf.alert.hang, as JSON
        self.where = where

    def __reduce__(self):  # picklable with its fields (Ray and Prefect may persist it)
        return (type(self), (str(self), self.rank, self.stacks_path, self.alert, self.where))


class StallRepeats(RLHFError, RuntimeError):
    """The same hang (same step, same frame) or the same loss (same step) came back on new ranks after every
    replacement a chunk allows (`rlhf_core.driver.repeats`): neither a new rank nor a new process cures it, so no
    Prefect retry and no restart of a deployment's run is spent on it; the run ends Failed with the one sentence."""

    lost_to: ClassVar[str] = "hangs"

    def __init__(self, message: str, alert: dict | None = None):
        super().__init__(message)
        self.alert = alert  # the last hang's rlhf.alert.hang, as JSON (None after lost ranks)

    def __reduce__(self):
        return (type(self), (str(self), self.alert))


class PreparationWorkerDied(RLHFError, RuntimeError):
    """A worker process preparing a dataset ended mid-batch (killed, out of memory); nothing was published, and
    the next run prepares it again."""


class PlacementFailed(RLHFError, RuntimeError):
    """The cluster has the resources in total, but they stayed taken for the whole timeout; the chunk is retried."""

    retryable = True


class LeaseLost(RLHFError, RuntimeError):
    """This process no longer holds the run's lease: it must not commit anything more, and a retry in this
    process would only fight the new holder."""


class TransientStoreError(RLHFError, OSError):
    """The checkpoint store failed in a way that passes (a 5xx, a reset connection, EIO from a flaky NFS server)
    after fsspec's own retries; the chunk is retried from the last commit, which it left intact."""

    retryable = True


class StoreUnreachable(TransientStoreError):
    """The checkpoint store stayed unreachable past --store_outage_s while a commit waited for it
    (`rlhf_core.driver.outage`): the run stops, and resumes from the last commit once the store is back."""

    lost_to: ClassVar[str] = "store outages"


def is_retryable(error: BaseException) -> bool:
    """Whether running the same chunk (or export) again can succeed: a named failure says so itself; any other
    exception may pass on a retry unless it is an OSError no retry fixes."""
    if isinstance(error, RLHFError):
        return error.retryable
    return not is_permanent_os_error(error)


def exit_code_of(error: BaseException) -> int:
    """The CLI's exit status for `error`: the taxonomy's, else 1."""
    return error.exit_code if isinstance(error, RLHFError) else 1


class CorruptCheckpoint(UserError):
    """A checkpoint's bytes disagree with its manifest; resume falls back to an older one."""

    def __init__(self, message: str, step: int, reason: str):
        super().__init__(message)
        self.step, self.reason = step, reason

    def __reduce__(self):  # Ray pickles a rank's exception to the driver; __init__ takes three arguments
        return (type(self), (self.args[0], self.step, self.reason))


class UnsafeCheckpoint(UserError):
    """A checkpoint file would run code when unpickled; it is refused, never loaded."""


# OSErrors that the same write, retried, meets again: only a person can free space, lift a quota or
# remount. Everything else (EIO from a flaky NFS server, a reset connection) may pass on a retry. Looked up
# by OSError.errno, which may be None.
_FULL: dict[int | None, str] = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exceeded"}
_PERMANENT_ERRNOS = {*_FULL, errno.EROFS, errno.EACCES, errno.EPERM}


def is_permanent_os_error(error: BaseException) -> bool:
    """Whether `error` (or an error it was raised from) is an OSError no retry can fix."""
    current: BaseException | None = error
    while current is not None:
        if isinstance(current, OSError) and current.errno in _PERMANENT_ERRNOS:
            return True
        current = current.__cause__ or current.__context__
    return False


class StoreFull(UserError):
    """The checkpoint store has no room for a checkpoint: the run stops at the chunk boundary, nothing committed is
    touched, and no retry is spent (freeing space is a person's job)."""


def is_full(error: BaseException) -> bool:
    return isinstance(error, OSError) and error.errno in _FULL


def store_full(path: str, error: OSError | None = None, *, free_bytes: int | None = None,
               needed_bytes: int | None = None) -> StoreFull:
    """The one sentence for a full store: the path, the free and needed bytes, and what to do about it."""
    what = _FULL.get(error.errno, "the disk is full") if error is not None else "the checkpoint will not fit"
    sizes = (f" ({human_bytes(free_bytes)} free, the checkpoint needs {human_bytes(needed_bytes)})"
             if free_bytes is not None and needed_bytes is not None else "")
    return StoreFull(f"--ckpt_path {path}: {what}{sizes}; nothing was committed for this chunk and earlier "
                     "checkpoints are intact. Free space, keep fewer checkpoints (--max_ckpt_num, --max_ckpt_mem) "
                     "or give another --ckpt_path, then run the same command to continue.")


def human_bytes(num_bytes: float) -> str:
    """Bytes for a message: GB from 1 GB up, else MB, two decimals."""
    return f"{num_bytes / 1e9:.2f} GB" if num_bytes >= 1e9 else f"{num_bytes / 1e6:.2f} MB"
