"""Whether a process is alive on this host: a lease holder's, a snapshot folder's owner, a fault test's job."""

from __future__ import annotations

import os


def process_exists(pid: int) -> bool:
    """Whether a process with this pid runs on this host (one we may not signal counts as running). A zombie
    (killed, not yet reaped by its parent) does not: it will never run again, though `kill(pid, 0)` still
    finds it."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not _is_zombie(pid)


def process_started(pid: int) -> str:
    """When the process started, in clock ticks since boot (Linux), or "" when that cannot be read: with the pid
    it names one process, where a pid alone may name a later one (pids are reused)."""
    fields = _stat_fields(pid)
    return fields[19].decode() if len(fields) > 19 else ""


def _is_zombie(pid: int) -> bool:
    fields = _stat_fields(pid)
    return bool(fields) and fields[0] == b"Z"


def _stat_fields(pid: int) -> list[bytes]:
    """The fields of /proc/PID/stat after the command name (the state first); none where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            # the fields follow the command name, which is in parentheses and may itself hold ") "
            return stat.read().rpartition(b")")[2].split()
    except OSError:
        return []
