"""One writer per run: the lease refuses a second live run, names the holder, and is taken over when
its holder is stale or dead."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid

import pytest

from rlhf_core.errors import UserError
from rlhf_core.lease import RunLease


@pytest.fixture(params=["memory", "local"])
def run_url(request, tmp_path):
    return f"memory://lease-{uuid.uuid4().hex}/run" if request.param == "memory" else str(tmp_path / "run")


def test_second_run_is_refused_with_the_holder_named(run_url):
    with RunLease(run_url, settle_s=0):
        with pytest.raises(UserError, match=r"LEASE.json is held by another run \(pid \d+ on .+, last heartbeat"):
            RunLease(run_url, settle_s=0).acquire()
    with RunLease(run_url, settle_s=0):  # released at exit: free again
        pass


def test_heartbeat_keeps_the_lease_fresh(run_url):
    lease = RunLease(run_url, heartbeat_s=0.05, settle_s=0)
    with lease:
        first = lease.read().heartbeat
        time.sleep(1.5)  # longer than the staleness limit below, so only the heartbeat keeps it fresh
        assert lease.read().heartbeat > first
        with pytest.raises(UserError):  # a 1 s margin absorbs a busy machine's scheduling delays
            RunLease(run_url, stale_after_s=1.0, settle_s=0).acquire()


def test_stale_lease_is_taken_over(run_url):
    holder = RunLease(run_url, settle_s=0)
    holder.holder.host = "another-host"
    holder._write()
    time.sleep(0.2)
    with pytest.raises(UserError):
        RunLease(run_url, settle_s=0).acquire()
    with RunLease(run_url, stale_after_s=0.1, settle_s=0) as taker:
        assert taker.read().id == taker.holder.id


def test_lease_of_a_dead_process_on_this_host_is_taken_over_at_once(tmp_path):
    url = str(tmp_path / "run")
    code = f"from rlhf_core.lease import RunLease; RunLease({url!r}, settle_s=0).acquire()"
    subprocess.run([sys.executable, "-c", code], check=True)  # exits holding the lease, like a SIGKILL
    stale = json.loads((tmp_path / "run" / "LEASE.json").read_text())
    with RunLease(url, settle_s=0) as lease:
        assert lease.read().pid != stale["pid"]


def test_a_reader_never_sees_a_half_written_lease(run_url):
    """A reader that caught the lease between truncate and write took it for free (a CI flake did)."""
    with RunLease(run_url, heartbeat_s=0.0005, settle_s=0) as lease:
        num_empty_reads = sum(lease.read() is None for _ in range(3000))
    assert num_empty_reads == 0
