"""A process killed while DeepSpeed loads its CPU op leaves torch's build lock behind; the next load must not hang.

The op's real build folder (built by `make`) is copied into a private TORCH_EXTENSIONS_DIR, so the
test neither rebuilds the op (tens of seconds) nor touches the shared cache.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest

from rlhf_core.rank.jit_build import SHM_OP

pytestmark = pytest.mark.slow


def test_make_s_build_step_goes_past_a_lock_left_by_a_killed_process(tmp_path):
    from torch.utils.cpp_extension import _get_build_directory

    built = _get_build_directory(SHM_OP, verbose=False)
    if not any(name.endswith(".so") for name in os.listdir(built)):
        pytest.fail(f"{built} holds no built op: `make` builds it before the tests run")
    folder = tmp_path / SHM_OP
    shutil.copytree(built, folder, symlinks=True, ignore=shutil.ignore_patterns("lock"))
    lock = folder / "lock"
    lock.touch()
    an_hour_ago = time.time() - 3600
    os.utime(lock, (an_hour_ago, an_hour_ago))
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path),
               PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]))
    # Without the lock check this waits forever; 300 s is far above the ~2 s it takes.
    done = subprocess.run([sys.executable, "-m", "rlhf_core.rank.jit_build"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"removing {lock}" in done.stderr
    assert not lock.exists()
