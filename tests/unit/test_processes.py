"""process_exists: what a lease, a snapshot folder's owner and a fault test's orphan check rely on."""

import os
import subprocess
import sys
import time

from rlhf_core.processes import process_exists


def test_a_running_process_exists():
    assert process_exists(os.getpid())


def test_a_killed_but_unreaped_process_does_not_exist():
    """A SIGKILLed child stays a zombie until its parent waits: kill(pid, 0) still finds it, yet it will never
    run again. A rank that took a zombie driver for alive fired the next fault of a dead job."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert process_exists(child.pid)
        child.kill()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the kernel turns it into a zombie; we do not reap it
            with open(f"/proc/{child.pid}/stat") as stat:
                if stat.read().rpartition(")")[2].split()[0] == "Z":
                    break
            time.sleep(0.01)
        assert not process_exists(child.pid)
    finally:
        child.wait()
    assert not process_exists(child.pid)
