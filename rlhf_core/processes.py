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


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            # the state follows the command name, which is in parentheses and may itself hold ") "
            return stat.read().rpartition(b")")[2].split()[0] == b"Z"
    except (OSError, IndexError):
        return False
