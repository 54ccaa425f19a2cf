"""One writer per run: the lease refuses a second live run, names the holder, is taken over when its
holder is stale or dead, and fences a holder that lost it (taken over, or paused past expiry)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import uuid

import pytest

from rlhf_core.errors import UserError
from rlhf_core.errors import LeaseLost
from rlhf_core.storage.lease import RunLease
from tests.conftest import make_bucket, s3_environment


@pytest.fixture(params=["memory", "local"])
def run_url(request, tmp_path):
    return f"memory://lease-{uuid.uuid4().hex}/run" if request.param == "memory" else str(tmp_path / "run")


@pytest.fixture(params=["memory", "local", "s3"])
def any_run_url(request, tmp_path, monkeypatch):
    """A run on each kind of store: memory (write / settle / read-back), local (link + flock), S3 (conditional PUT)."""
    if request.param == "memory":
        return f"memory://lease-{uuid.uuid4().hex}/run"
    if request.param == "local":
        return str(tmp_path / "run")
    endpoint = request.getfixturevalue("s3_endpoint")
    for name, value in s3_environment(endpoint).items():
        monkeypatch.setenv(name, value)
    bucket = f"lease-{uuid.uuid4().hex[:12]}"
    make_bucket(endpoint, bucket)
    return f"s3://{bucket}/ckpt/run"


def _stale_holder(url: str) -> RunLease:
    """A lease held by a run on another host that stopped renewing (so only staleness can free it)."""
    lease = RunLease(url, heartbeat_s=3600, settle_s=0)
    lease.holder.host = "another-host"
    lease.acquire()
    return lease


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
        assert lease.assert_held() == lease.token


def test_lease_of_a_dead_process_on_this_host_is_taken_over_at_once(tmp_path):
    url = str(tmp_path / "run")
    code = f"from rlhf_core.storage.lease import RunLease; RunLease({url!r}, settle_s=0).acquire()"
    subprocess.run([sys.executable, "-c", code], check=True)  # exits holding the lease, like a SIGKILL
    stale = json.loads((tmp_path / "run" / "LEASE.json").read_text())
    with RunLease(url, settle_s=0) as lease:
        assert lease.read().pid != stale["pid"]
        assert lease.holder.generation == stale["generation"] + 1


def test_a_reader_never_sees_a_half_written_lease(run_url):
    """A reader that caught the lease between truncate and write took it for free (a CI flake did)."""
    with RunLease(run_url, heartbeat_s=0.0005, settle_s=0) as lease:
        num_empty_reads = sum(lease.read() is None for _ in range(3000))
    assert num_empty_reads == 0


@pytest.mark.parametrize("first_take", ["create", "take-over"])
def test_of_two_runs_racing_for_a_local_lease_only_one_acquires(tmp_path, first_take):
    """Both runs have read the lease as free before either writes: the atomic create (os.link) or the
    flock'd compare-and-swap lets exactly one through, the other is refused."""
    url = str(tmp_path / "run")
    if first_take == "take-over":
        with RunLease(url):
            pass  # leaves a released record: free, but taken by compare-and-swap, not by create
    racers = [RunLease(url, heartbeat_s=3600) for _ in range(2)]
    both_read = threading.Barrier(2)
    for racer in racers:  # the patch lives on the instance: `del` restores the store's own methods
        write = racer._store.create if first_take == "create" else racer._store.swap
        racer._store.create = racer._store.swap = _after(both_read, write)
    outcomes: list[object] = []

    def attempt(lease: RunLease) -> None:
        try:
            lease.acquire()
            outcomes.append(lease)
        except UserError as error:
            outcomes.append(error)

    threads = [threading.Thread(target=attempt, args=(racer,)) for racer in racers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for racer in racers:
        del racer._store.create, racer._store.swap
    winners = [outcome for outcome in outcomes if isinstance(outcome, RunLease)]
    refusals = [str(outcome) for outcome in outcomes if isinstance(outcome, UserError)]
    assert len(winners) == 1 and len(refusals) == 1, outcomes
    assert "was taken by another run starting at the same time" in refusals[0]
    assert winners[0].read().id == winners[0].holder.id
    winners[0].release()


def _after(barrier: threading.Barrier, write):
    def wait_then_write(*args):
        barrier.wait()
        return write(*args)
    return wait_then_write


def test_a_stale_lease_is_taken_over_and_its_old_holder_is_fenced(any_run_url):
    old = _stale_holder(any_run_url)
    assert old.assert_held() == old.token
    time.sleep(0.2)
    with RunLease(any_run_url, stale_after_s=0.1, settle_s=0) as taker:
        taker.stale_after_s = 120.0  # took over at 0.1 s; from now on it holds the lease like any run
        assert taker.holder.generation == old.holder.generation + 1
        assert taker.token != old.token and taker.token.startswith(f"{taker.holder.generation}-")
        with pytest.raises(LeaseLost, match=rf"LEASE.json is no longer held by this run \(token {old.token}\): "
                                            rf"the lease record changed under it, and it is now held by pid \d+"):
            old.assert_held()
        assert not old._renew_once()  # its compare-and-swap fails: the taker's record stays
        assert taker.assert_held() == taker.token
        old.release()  # releases nothing: the lease is not old's any more
        assert taker.read().id == taker.holder.id and not taker.read().released
        assert taker.held and not old.held
    assert not taker.held


def test_renewal_stops_once_a_compare_and_swap_fails(tmp_path):
    url = str(tmp_path / "run")
    old = RunLease(url, heartbeat_s=0.02)
    old.acquire()
    taker = RunLease(url, stale_after_s=0.0)  # everything is stale to it: it takes the live lease
    taker.acquire()
    taker.stale_after_s = 120.0  # and then holds it like any run
    old._thread.join()  # the renewal thread ends by itself after its first failed renewal
    assert "a renewal found the lease record changed" in old._lost
    with pytest.raises(LeaseLost, match="a renewal found the lease record changed by someone else"):
        old.assert_held()
    assert taker.assert_held() == taker.token
    taker.release()
    old.release()


def test_a_holder_paused_past_expiry_renews_before_it_commits_when_nobody_took_over(any_run_url):
    """A store outage (or a paused process) outlasts the lease's staleness limit: the record on the store is still
    this run's, unchanged, so the check renews it (a compare-and-swap, which a taker's own would have beaten) and
    the commit goes ahead. One that someone took over meanwhile is fenced (the test above)."""
    lease = RunLease(any_run_url, heartbeat_s=3600, settle_s=0)
    with lease:
        lease.assert_held()
        lease.stale_after_s = 0.3  # set after the take, so a slow store cannot age the lease before it
        time.sleep(0.5)  # no renewal (heartbeat_s is an hour): as if the store had been unreachable
        before = lease.holder.heartbeat
        assert lease.assert_held() == lease.token
        assert lease.holder.heartbeat > before and RunLease(any_run_url).read().heartbeat == lease.holder.heartbeat


def test_token_changes_with_every_take_and_release_frees_the_lease(any_run_url):
    first = RunLease(any_run_url, settle_s=0)
    tokens = []
    for _ in range(2):
        with first:
            assert first.held
            tokens.append(first.assert_held())
        assert not first.held
        assert first.read().released
        with pytest.raises(LeaseLost, match="this run does not hold it"):
            first.assert_held()
        first.check_available()  # a released lease is free
    with RunLease(any_run_url, settle_s=0) as second:
        tokens.append(second.token)
        assert second.holder.generation == 3
    assert len(set(tokens)) == 3
    assert [int(token.split("-")[0]) for token in tokens] == [1, 2, 3]


def test_lease_lost_is_not_a_user_error():
    assert issubclass(LeaseLost, RuntimeError) and not issubclass(LeaseLost, UserError)


def test_an_old_lease_record_without_a_generation_is_still_read(tmp_path):
    """LEASE.json written before generations existed (or by an older version) names its holder."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "LEASE.json").write_text(json.dumps(
        {"id": "other", "host": "elsewhere", "pid": 1, "started": time.time(), "heartbeat": time.time()}))
    with pytest.raises(UserError, match="pid 1 on elsewhere"):
        RunLease(str(tmp_path / "run")).check_available()
    with RunLease(str(tmp_path / "run"), stale_after_s=0.0) as lease:
        assert lease.holder.generation == 1
