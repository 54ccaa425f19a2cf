"""rlhf_core.driver.stop: the first SIGTERM or Ctrl-C asks for a stop, a second one leaves at once, and the exit line.

The handlers are exercised with real signals: in this process for the first signal (its handler only records
and notifies), in a child process for what ends a process (the second signal, the watchdog).
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from rlhf_core.driver import stop
from rlhf_core.ops import goodput


def test_the_exit_lines_name_the_signal_the_step_and_what_stands():
    committed = stop.StoppedBySignal(signal.SIGTERM, "sft", 8, "/ckpt/rlhf/sft")
    assert str(committed) == ("stopped by SIGTERM at step 8; committed step_8 in /ckpt/rlhf/sft; "
                              "run the same command to continue")
    assert committed.exit_code == 143
    abandoned = stop.StoppedBySignal(signal.SIGINT, "sft", 5, "/ckpt/rlhf/sft", abandoned_at=7)
    assert abandoned.exit_code == 130
    assert "at step 7" in str(abandoned) and "the last commit, step_5 in /ckpt/rlhf/sft, stands" in str(abandoned)
    nothing = stop.StoppedBySignal(signal.SIGINT, "rm", 0, None)
    assert str(nothing) == "stopped by SIGINT before any step of rm was committed; run the same command to start"
    copy = pickle.loads(pickle.dumps(abandoned))  # Prefect may persist it
    assert (str(copy), copy.exit_code) == (str(abandoned), 130)


def test_a_first_signal_asks_for_a_stop_and_tells_the_listeners(capfd):
    told = threading.Event()
    before = signal.getsignal(signal.SIGTERM)
    with stop.StopSignals(grace_s=10).obeying() as signals:
        unregister = signals.on_request(told.set)
        assert not signals.requested() and signals.commit_deadline() is None
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)  # the handler runs between two bytecodes of this thread
        assert signals.requested() and signals.signal_number == signal.SIGTERM
        assert told.wait(5), "the listener was not called"
        unregister()
        assert 0 < signals.commit_deadline() - time.monotonic() <= 10 - 3
    assert signal.getsignal(signal.SIGTERM) is before
    assert "SIGTERM received: stopping after the current step" in capfd.readouterr().err


def test_a_listener_registered_after_the_stop_is_told_at_once():
    with stop.StopSignals().obeying() as signals:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        told = threading.Event()
        signals.on_request(told.set)
        assert told.wait(5)


def test_the_watchdog_of_a_flow_called_in_process_never_ends_the_caller():
    with stop.StopSignals(grace_s=0.5).obeying() as signals:  # as a flow body does, with no CLI around it
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
    time.sleep(1.0)  # past the grace period, after the block: this process is still here
    assert signals.requested()


def test_a_new_run_in_the_process_starts_with_no_stop_and_two_runs_keep_their_own():
    first = stop.StopSignals()
    with first.obeying():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
    second = stop.StopSignals()
    assert first.requested() and not second.requested()
    with first.obeying():  # the same run's signals obeyed again: a new run of it, with no stop
        assert not first.requested()


def test_the_deadline_keeps_a_reserve_for_leaving():
    assert stop.exit_reserve_s(25) == 5.0
    assert stop.exit_reserve_s(6) == 3.0
    assert stop.exit_reserve_s(2) == 1.0
    stop.StopSignals().check_deadline()  # no stop: never expires


def test_an_emergency_commit_counts_its_steps_as_useful():
    doc = goodput.empty_ledger()
    attempt = goodput.begin_attempt(doc, "a", 0.0)
    goodput.start_chunk(doc, attempt, "sft", 5, 10, 1.0)
    goodput.commit_chunk(doc, attempt, goodput.CommittedChunk("sft", 8, {"train": 3.0}, num_steps=3), 4.0)
    goodput.finish_attempt(doc, attempt, 5.0)
    record = doc["stages"]["sft"]
    assert (record["steps"], record["lost_steps"], record["lost_s"], doc["pending"]) == (3, 0, 0.0, [])


CHILD = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    from rlhf_core.driver import stop
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(sleeper.pid, flush=True)
    with stop.StopSignals(float(sys.argv[1]), owns_process=True).obeying() as signals:
        signals.record_commit("sft", 5, "/ckpt/rlhf/sft")
        for number in sys.argv[2:]:
            os.kill(os.getpid(), getattr(signal, number))
            time.sleep(0.2)
        time.sleep(600)
""")


@pytest.mark.parametrize("grace, signals, why", [(600, ["SIGINT", "SIGINT"], "a second stop signal"),
                                                 (600, ["SIGTERM", "SIGINT"], "a second stop signal"),
                                                 (1.5, ["SIGTERM"], "--stop_grace_s 1.5 ran out")])
def test_a_second_signal_or_the_end_of_the_grace_period_leaves_at_once(grace, signals, why):
    child = subprocess.run([sys.executable, "-c", CHILD, str(grace), *signals], capture_output=True, text=True,
                           timeout=120)
    last = getattr(signal, signals[-1])  # the signal that made it leave
    assert child.returncode == 128 + last, child.stderr
    assert (f"stopped by {signals[-1]} ({why}): leaving now; the last commit, step_5 in /ckpt/rlhf/sft, stands; "
            "run the same command to continue") in child.stderr
    assert "Traceback" not in child.stderr
    sleeper = int(child.stdout.split()[0])
    deadline = time.monotonic() + 10
    while _alive(sleeper) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(sleeper), "a process the stopped one started outlived it"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[-1].split()[0] not in ("Z", "X")
    except OSError:
        return False


@pytest.mark.parametrize("supervised, why", [(True, "--stop_grace_s 1.5 ran out"), (False, "a second stop signal")])
def test_a_signal_passed_on_by_the_flow_runs_supervisor_is_the_same_stop(supervised, why):
    """systemd stops a deployment's whole service: SIGTERM reaches the flow run's engine and its supervisor
    (flows/supervise.py), which passes it on. The engine takes the copy 0.2 s later as the same stop, so the
    emergency commit still runs (here the grace period ends it); outside a supervisor a second signal leaves."""
    env = {**os.environ, stop.SUPERVISED_ENV: "1"} if supervised else {
        key: value for key, value in os.environ.items() if key != stop.SUPERVISED_ENV}
    child = subprocess.run([sys.executable, "-c", CHILD, "1.5", "SIGTERM", "SIGTERM"], capture_output=True,
                           text=True, timeout=120, env=env)
    assert child.returncode == 128 + signal.SIGTERM, child.stderr
    assert f"stopped by SIGTERM ({why}): leaving now" in child.stderr, child.stderr
