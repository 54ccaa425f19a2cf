"""flows/restarts.py without a server: which failures a deployment's run reschedules itself after, the restart
budget and its backoff, and a SIGTERM told apart from a Cancel. The real thing, with a server, a worker and the
automations, is the chaos soak (tests/integration/test_soak.py; `make soak` for the lost machine)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from types import SimpleNamespace

import pytest
from prefect.states import Cancelled, StateType

from flows import restarts
from rlhf_core.config import RunConfig
from rlhf_core.errors import RankHung, StoreFull, TransientStoreError, UserError, WorkerLost
from rlhf_core.ops.alerts import NonFiniteTraining
from rlhf_core.stages.sft import SFTConfig


class FakeClient:
    """Prefect's sync client, as far as flows/restarts.py reads it: a flow run's state and its state history."""

    def __init__(self, state=None, states=()):
        self.state, self.states = state, list(states)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def read_flow_run(self, flow_run_id):
        return SimpleNamespace(state=self.state)

    def read_flow_run_states(self, flow_run_id):
        return self.states


@pytest.fixture
def run(tmp_path) -> RunConfig:
    return RunConfig(sft=SFTConfig(pretrain="m", dataset="d.jsonl"), ckpt_path=str(tmp_path / "ckpt"),
                     max_restarts=3, restart_window_minutes=60)


@pytest.fixture
def deployment_run(monkeypatch):
    """A deployment's flow run whose earlier restarts (time, message) the test sets."""
    history: list[tuple[datetime, str]] = []
    monkeypatch.setattr(restarts, "deployment_run_id", lambda: "00000000-0000-0000-0000-000000000001")
    monkeypatch.setattr(restarts, "recent_restarts", lambda flow_run_id, window: list(history))
    return history


def test_the_first_restart_waits_for_nothing_then_10_s_doubling_to_5_minutes():
    assert [restarts.backoff_s(n) for n in range(1, 9)] == [0, 10, 20, 40, 80, 160, 300, 300]


@pytest.mark.parametrize("error", [WorkerLost("rank 0 was lost"), RankHung("rank 0 made no progress"),
                                   TransientStoreError("503 from the store")])
def test_a_fault_that_passes_reschedules_the_run_marked_as_a_restart(run, deployment_run, error):
    state = restarts.after_failure(run, error)
    assert state.type == StateType.SCHEDULED and state.name == "AwaitingRetry"
    assert state.message.startswith(restarts.RESTART_MARK) and type(error).__name__ in state.message


@pytest.mark.parametrize("error", [UserError("--dataset x: no such file"), StoreFull("disk full"),
                                   NonFiniteTraining("sft", 8, ["loss"], []), RuntimeError("a bug")])
def test_a_user_error_a_full_disk_a_nan_or_a_bug_fails_as_before(run, deployment_run, error):
    assert restarts.after_failure(run, error) is None


def test_a_run_by_hand_is_never_rescheduled(run):
    assert restarts.deployment_run_id() is None  # outside any flow run, as in a flow run without a deployment
    assert restarts.after_failure(run, WorkerLost("rank 0 was lost")) is None
    assert restarts.restart_budget(run) is None
    stopped = Cancelled(message="stopped by SIGTERM at step 4")
    assert restarts.after_stop(stopped, "SIGTERM") is stopped


def test_restarts_back_off_and_past_the_budget_the_run_stays_crashed_with_an_alert(run, deployment_run, monkeypatch):
    alerts = []
    monkeypatch.setattr(restarts, "emit_alert", alerts.append)
    now = datetime.now(timezone.utc)
    assert restarts.restart_budget(run) is None  # no restart yet
    deployment_run.append((now - timedelta(seconds=1), f"{restarts.RESTART_MARK} a crash"))
    assert restarts.restart_budget(run) is None  # the first restart starts at once
    deployment_run.append((now, f"{restarts.RESTART_MARK} WorkerLost: rank 0 was lost"))
    held = restarts.restart_budget(run)  # the second waits 10 s after it
    assert held.type == StateType.SCHEDULED and not held.message.startswith(restarts.RESTART_MARK)
    assert held.state_details.scheduled_time >= now + timedelta(seconds=9)
    deployment_run[:] = [(now - timedelta(minutes=10 - n), f"{restarts.RESTART_MARK} crash {n}") for n in range(4)]
    out = restarts.restart_budget(run)  # 4 restarts within the hour, past --max_restarts 3
    assert out.type == StateType.CRASHED and out.name == restarts.OUT_OF_RESTARTS
    assert "past --max_restarts 3" in out.message and "crash 3" in out.message
    assert [alert["name"] for alert in alerts] == ["rlhf.alert.restarts-exhausted"]
    assert len(alerts[0]["details"]["failures"]) == 4


def test_restarts_minutes_apart_wait_for_nothing_and_a_crash_loop_is_spaced_out(run, deployment_run):
    """The k-th restart waits until backoff_s(k) after the one before, not after itself: a run that trained for
    minutes between two faults starts again at once."""
    now = datetime.now(timezone.utc)
    deployment_run[:] = [(now - timedelta(minutes=6), f"{restarts.RESTART_MARK} a crash"),
                         (now - timedelta(minutes=3), f"{restarts.RESTART_MARK} a crash"),
                         (now, f"{restarts.RESTART_MARK} a crash")]
    assert restarts.restart_budget(run) is None  # the 3rd restart, 3 minutes after the 2nd: 20 s have passed
    failed_again = restarts.after_failure(run, WorkerLost("rank 1 was lost"))  # the 4th, at once after the 3rd
    assert failed_again.state_details.scheduled_time >= now + timedelta(seconds=restarts.backoff_s(4) - 1)
    deployment_run[-1] = (now - timedelta(minutes=2), f"{restarts.RESTART_MARK} a crash")
    assert restarts.after_failure(run, WorkerLost("rank 1 was lost")).state_details.scheduled_time < \
        datetime.now(timezone.utc) + timedelta(seconds=1)  # 2 minutes after the 3rd: at once


def test_a_short_backoff_is_waited_out_in_the_process_and_a_long_one_reschedules(run, deployment_run, monkeypatch):
    run = run.model_copy(update={"max_restarts": 10})
    slept, left = [], []
    monkeypatch.setattr(restarts.orphans, "outlive_the_worker", lambda: None)
    monkeypatch.setattr(restarts.orphans, "record_process", lambda client, flow_run_id: None)
    monkeypatch.setattr(restarts, "get_client", lambda sync_client: FakeClient())
    monkeypatch.setattr(restarts, "time", SimpleNamespace(sleep=slept.append))
    monkeypatch.setattr(restarts, "leave_as", left.append)
    now = datetime.now(timezone.utc)
    deployment_run[:] = [(now - timedelta(seconds=5), f"{restarts.RESTART_MARK} a crash"),
                         (now - timedelta(seconds=4), f"{restarts.RESTART_MARK} a crash")]
    restarts.start_attempt(run)  # the 2nd restart, 1 s after the 1st and 4 s ago: 5 s to go, here
    assert len(slept) == 1 and 4 <= slept[0] <= 5 and not left
    deployment_run.append((now, f"{restarts.RESTART_MARK} a crash"))
    deployment_run.append((now, f"{restarts.RESTART_MARK} a crash"))
    deployment_run.append((now, f"{restarts.RESTART_MARK} a crash"))  # the 5th waits 80 s: the run is rescheduled
    restarts.start_attempt(run)
    assert len(slept) == 1 and left[0].type == StateType.SCHEDULED


def test_sigterm_without_a_cancel_is_a_preemption_and_with_one_a_stop(deployment_run, monkeypatch):
    server_state = SimpleNamespace(type=StateType.RUNNING)

    monkeypatch.setattr(restarts, "get_client", lambda sync_client: FakeClient(state=server_state))
    stopped = Cancelled(message="stopped by SIGTERM at step 4; committed step_4")
    preempted = restarts.after_stop(stopped, "SIGTERM")
    assert preempted.type == StateType.SCHEDULED and preempted.name == restarts.PREEMPTED
    assert "committed step_4" in preempted.message
    assert restarts.after_stop(stopped, "SIGINT") is stopped  # Ctrl-C is a person
    server_state.type = StateType.CANCELLING  # Cancel in the UI: the worker's SIGTERM follows it
    assert restarts.after_stop(stopped, "SIGTERM") is stopped


def test_a_death_reported_twice_before_any_attempt_ran_counts_as_one_restart(monkeypatch):
    """Prefect's process worker reports a SIGKILLed run Crashed twice (its executor, then the worker itself), and the
    automation reschedules it each time; only restarts with an attempt (Running) before them count."""
    now = datetime.now(timezone.utc)

    def state(seconds_ago, state_type, message=""):
        return SimpleNamespace(type=state_type, message=message, timestamp=now - timedelta(seconds=seconds_ago))

    restart = f"{restarts.RESTART_MARK} a crash"
    history = [state(100, StateType.RUNNING), state(90, StateType.CRASHED), state(89, StateType.SCHEDULED, restart),
               state(88, StateType.CRASHED), state(87, StateType.SCHEDULED, restart), state(80, StateType.RUNNING),
               state(40, StateType.CRASHED), state(39, StateType.SCHEDULED, restart),
               state(4000, StateType.SCHEDULED, "created")]

    monkeypatch.setattr(restarts, "get_client", lambda sync_client: FakeClient(states=history))
    assert [round((now - when).total_seconds()) for when, _ in restarts.recent_restarts("id", 60)] == [89, 39]
    assert [round((now - when).total_seconds()) for when, _ in restarts.recent_restarts("id", 1)] == [39]  # the window
