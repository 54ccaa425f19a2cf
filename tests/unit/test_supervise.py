"""flows/supervise.py without a server: when a dead engine is started again, and what the run's states say then.
The real thing (a worker, a SIGKILLed engine, the run resumed) is test_deployment's
`test_a_killed_flow_run_process_starts_again_on_its_host`; Cancel and preemption through it are the tests beside it."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from types import SimpleNamespace

import prefect
import pytest
from prefect.client.schemas.objects import StateType
from prefect.client.schemas.responses import SetStateStatus
from prefect.states import Completed, Pending, Running, Scheduled

from flows import supervise
from flows.restarts import RESTART_MARK, RESTARTING, recent_restarts
from tests.unit.test_restarts import FakeClient as RestartsClient

RUN_ID = "00000000-0000-0000-0000-000000000047"


class FakeClient(RestartsClient):
    """Prefect's sync client as the supervisor uses it too: the run's parameters, the states proposed to it."""

    def __init__(self, state, status: str = "ACCEPT", states=(), config=None):
        super().__init__(state, states)
        self.status, self.config, self.proposed = status, config or {}, []

    def read_flow_run(self, flow_run_id):
        return SimpleNamespace(state=self.state, parameters={"config": self.config})

    def set_flow_run_state(self, flow_run_id, state, force=False):
        self.proposed.append((state, force))
        return SimpleNamespace(status=SetStateStatus(self.status), details="refused")


@pytest.fixture
def client(monkeypatch):
    def use(state, status="ACCEPT", states=(), config=None) -> FakeClient:
        fake = FakeClient(state, status, states, config)
        monkeypatch.setattr(prefect, "get_client", lambda sync_client=False: fake)
        monkeypatch.setattr("flows.restarts.get_client", lambda sync_client=False: fake)
        return fake
    return use


def test_an_engine_killed_while_its_run_is_running_is_marked_a_restart_and_started_again(client):
    """Pending, not Scheduled: a worker polls for Scheduled runs, and took one between a Scheduled and the
    supervisor's Pending (seen: the run then ended Crashed over its second attempt)."""
    fake = client(Running())
    assert supervise.restart_after(RUN_ID, 4242, signal.SIGKILL)
    [(marked, forced)] = fake.proposed
    assert forced and marked.type == StateType.PENDING and marked.name == RESTARTING
    assert marked.message.startswith(RESTART_MARK) and "process 4242 died by SIGKILL" in marked.message


def test_the_restart_counts_in_the_runs_budget(client):
    """flows/restarts.py counts a restart once per attempt that ran: the supervisor's mark after a Running is one."""
    first_attempt = [Pending(), Running()]
    fake = client(first_attempt[-1])
    supervise.restart_after(RUN_ID, 4242, signal.SIGKILL)
    client(Running(), states=[*first_attempt, *(state for state, _ in fake.proposed), Running()])
    assert [message for _, message in recent_restarts(RUN_ID, 60)] == [fake.proposed[0][0].message]


@pytest.mark.parametrize("state", [Pending(), Completed(), Scheduled(name="Preempted"), None],
                         ids=["never-running", "completed", "rescheduled", "no-state"])
def test_an_engine_that_died_outside_a_running_run_is_left_to_the_worker(client, state):
    fake = client(state)
    assert not supervise.restart_after(RUN_ID, 4242, signal.SIGKILL)
    assert fake.proposed == []


def test_a_restart_the_server_refuses_is_left_to_the_worker(client, capsys):
    client(Running(), status="REJECT")
    assert not supervise.restart_after(RUN_ID, 4242, signal.SIGSEGV)
    assert "the server refused the restart" in capsys.readouterr().err


def test_a_process_that_dies_at_each_start_is_restarted_here_max_restarts_times_at_most(client):
    """The engine's own budget check (flows/restarts.start_attempt) never runs in a process that dies before it:
    the supervisor counts the run's restarts too, and past --max_restarts leaves the run to the worker."""
    def attempts(count: int) -> list:
        return [state for _ in range(count) for state in (Running(), Pending(name=RESTARTING,
                                                                           message=f"{RESTART_MARK} a death"))]

    client(Running(), states=attempts(1), config={"max_restarts": 2})
    assert supervise.restart_after(RUN_ID, 4242, signal.SIGKILL)
    past_the_budget = client(Running(), states=attempts(2), config={"max_restarts": 2})
    assert not supervise.restart_after(RUN_ID, 4242, signal.SIGKILL) and past_the_budget.proposed == []
    client(Running(), states=attempts(9))  # the default --max_restarts, 10
    assert supervise.restart_after(RUN_ID, 4242, signal.SIGKILL)
    client(Running(), states=attempts(10))
    assert not supervise.restart_after(RUN_ID, 4242, signal.SIGKILL)


def test_the_exit_status_of_an_engine_that_is_not_restarted_is_the_shells():
    assert [supervise._exit_code(code) for code in (0, 1, -signal.SIGKILL)] == [0, 1, 137]



def test_a_line_to_a_worker_that_is_gone_does_not_end_the_supervisor(monkeypatch):
    """The worker reads the supervisor's stderr through a pipe; once the worker died (the run outlives it,
    flows/orphans.py), a restart's line meets a broken pipe and must not end the restart."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    with os.fdopen(write_end, "w") as gone:
        monkeypatch.setattr(sys, "stderr", gone)
        supervise._say("rlhf: flow run x: its engine process 1 died by SIGKILL; starting it again on this host")
        monkeypatch.undo()
        with contextlib.suppress(OSError):
            gone.close()


def test_the_supervisor_imports_prefects_client_before_a_restart_needs_it():
    """A restart is marked through Prefect's client: imported ~10 s after the engine's start (1.7 CPU-s), not after
    the engine died. In a fresh interpreter: nothing of it before, all of it after."""
    import subprocess

    wanted = ("prefect.client.orchestration", "prefect.states", "flows.restarts", "rlhf_core.config")
    code = (f"import sys; from flows.supervise import _warm_imports\n"
            f"wanted = {wanted!r}\n"
            "print([name for name in wanted if name in sys.modules])\n"
            "_warm_imports(0)\n"
            "print([name for name in wanted if name not in sys.modules])\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert result.stdout.splitlines() == ["[]", "[]"], result.stdout + result.stderr
