"""Errors the user can fix: the CLI prints the message in one sentence and exits 2; and which OSErrors no retry fixes."""


import errno


class UserError(Exception):
    """A mistake in the user's input (flag, config field, file); the message says what to do."""


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
# remount. Everything else (EIO from a flaky NFS server, a reset connection) may pass on a retry.
_FULL = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exceeded"}
_PERMANENT_ERRNOS = {*_FULL, errno.EROFS, errno.EACCES, errno.EPERM}


def is_permanent_os_error(error: BaseException) -> bool:
    """Whether `error` (or an error it was raised from) is an OSError no retry can fix."""
    while error is not None:
        if isinstance(error, OSError) and error.errno in _PERMANENT_ERRNOS:
            return True
        error = error.__cause__ or error.__context__
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
