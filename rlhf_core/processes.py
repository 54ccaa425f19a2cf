"""Whether a process is alive on this host: a lease holder's, a snapshot folder's owner, a fault test's job."""

from __future__ import annotations

import os


def process_exists(pid: int) -> bool:
    """Whether a process with this pid runs on this host (one we may not signal counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
