"""DeepSpeed's CPU communication op (`build_shm_op`), and the build lock a killed process leaves behind, which would
hang every later rank in `init_distributed`: `clear_stale_build_lock` waits for a lock in use and removes a stale
one, with a warning. docs/design-notes.md ("The stale JIT build lock") says when a lock counts as stale.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time

logger = logging.getLogger(__name__)

SHM_OP = "deepspeed_shm_comm"
# Seconds after which a lock is taken to be left by a dead process: when the op is already built a
# holder only runs ninja's no-op check; a first build on a loaded 2-core machine can take minutes.
STALE_WHEN_BUILT_S = 120.0
STALE_WHEN_UNBUILT_S = 900.0


def clear_stale_build_lock(extension: str = SHM_OP, *, poll_s: float = 0.5) -> None:
    """Return once `extension`'s build folder holds no lock, removing a lock left by a dead process. Stale
    locks of the other ops built there (FusedAdam, DeepSpeedCPUAdam on a GPU machine) go too, unwaited."""
    try:  # torch's own rule for where `load(name=...)` builds; private, so a rename only skips the check
        from torch.utils.cpp_extension import _get_build_directory
    except ImportError:
        return
    folder = _get_build_directory(extension, verbose=False)
    root = os.path.dirname(folder)
    for name in sorted(os.listdir(root)):
        if name != extension and os.path.isdir(os.path.join(root, name)):
            _remove_if_stale(os.path.join(root, name), name)
    waited_s = 0.0
    while (age_s := _remove_if_stale(folder, extension)) is not None:
        if waited_s == 0.0:
            logger.info("waiting for %s/lock (%.0f s old) to be released", folder, age_s)
        time.sleep(poll_s)
        waited_s += poll_s


def _remove_if_stale(folder: str, extension: str) -> float | None:
    """Remove `folder`'s lock when it is older than any live holder keeps it; the age of a lock left in
    place (a build or check under way), or None when there is no lock (any more)."""
    lock = os.path.join(folder, "lock")
    try:
        age_s = time.time() - os.stat(lock).st_mtime
    except FileNotFoundError:
        return None
    built = any(name.endswith(".so") for name in os.listdir(folder))
    if age_s <= (STALE_WHEN_BUILT_S if built else STALE_WHEN_UNBUILT_S):
        return age_s
    logger.warning("removing %s: it is %.0f s old, so the process that took it to build %s died "
                   "(torch would wait for it forever)", lock, age_s, extension)
    with contextlib.suppress(FileNotFoundError):
        os.remove(lock)
    return None


def build_shm_op() -> None:
    """Build (or check) DeepSpeed's CPU communication op once, as `make` does after installing."""
    clear_stale_build_lock()
    from deepspeed.comm.torch import build_shm_op as deepspeed_build_shm_op

    deepspeed_build_shm_op()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    build_shm_op()
