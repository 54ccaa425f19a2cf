"""A deployment's run that dies, fails on a passing fault or is preempted comes back by itself, as the same flow run.

- Its process died and its supervisor lives (flows/supervise.py): the supervisor marks a restart and starts the
  process again on the same host.
- Its process or worker died otherwise: Prefect marks it Crashed (the worker at once, or the heartbeat automation
  within 90 s), and the automation `rlhf-restart-crashed-runs` (deployments/automations.yaml) reschedules it.
- A chunk used up its retries on a fault that passes (a lost rank, a hang, a store outage: `RLHFError.retryable`):
  the run reschedules itself (`after_failure`).
- SIGTERM with no Cancel requested in Prefect (a spot preemption, a node drain): after its emergency checkpoint the
  run reschedules itself, in a state named Preempted (`after_stop`). A Cancel stays a stop.

Each reschedule by the first two is a restart, marked in its state's message (RESTART_MARK). A run starting again
counts its restarts within --restart_window_minutes (`restart_budget`): past --max_restarts it ends Crashed, named
OutOfRestarts (which the automation leaves alone) with an alert naming the failures; otherwise the k-th restart
waits until `backoff_s(k)` after the one before: restarts minutes apart wait for nothing, a crash loop is spaced
out. A wait of up to IN_PROCESS_WAIT_S is spent in the process already started (a new one would take seconds to
start, and the worker may start it early); a longer one reschedules the run. Preemptions are not failures and
count for neither. Runs without a deployment (`rlhf train` by hand, a notebook) stop and fail as before.
docs/resuming-and-stopping.md has the table; flows/orphans.py keeps a run alive when its worker dies.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from datetime import datetime, timedelta, timezone
from typing import NoReturn

from prefect import get_client, runtime
from prefect.states import Crashed, Scheduled, State, StateType

from rlhf_core.config import RunConfig
from rlhf_core.errors import RLHFError
from rlhf_core.ops.alerts import ALERT_RESTARTS_EXHAUSTED, Alert, AlertLog
from flows import orphans
from tasks.chunks import emit_alert

logger = logging.getLogger(__name__)
RESTART_MARK = "rlhf: restarting after"  # the start of a restart's state message (the automation's too)
OUT_OF_RESTARTS = "OutOfRestarts"
PREEMPTED = "Preempted"
RESTARTING = "Restarting"  # the Pending state of a run its supervisor starts again (flows/supervise.py)
IN_PROCESS_WAIT_S = 60.0


def backoff_s(num_restarts: int) -> float:
    """How long the `num_restarts`-th restart in the window waits after the one before: none for the first (a
    single fault comes back at once), then 10 s doubling to at most 5 minutes."""
    return 0.0 if num_restarts <= 1 else min(300.0, 10.0 * 2 ** (num_restarts - 2))


def deployment_run_id() -> str | None:
    """The flow run's id when it runs from a deployment (a worker will pick a rescheduled run up), else None."""
    return str(runtime.flow_run.id) if runtime.deployment.id else None


def start_attempt(run: RunConfig) -> None:
    """At the start of each attempt of a deployment's run: outlive its worker, label the run with this process
    (for a sweep after a power cut), then wait out the restart backoff here, or end this attempt when the run must
    wait longer or is out of restarts. Nothing for a run without a deployment."""
    flow_run_id = deployment_run_id()
    if flow_run_id is None:
        return
    orphans.outlive_the_worker()
    with get_client(sync_client=True) as client:
        orphans.record_process(client, flow_run_id)
    held_back = restart_budget(run)
    if held_back is None:
        return
    due = held_back.state_details.scheduled_time if held_back.type == StateType.SCHEDULED else None
    wait_s = (due - datetime.now(timezone.utc)).total_seconds() if due is not None else None
    if wait_s is not None and wait_s <= IN_PROCESS_WAIT_S:
        logger.warning("%s: waiting %.0f s here", held_back.message, wait_s)
        time.sleep(max(0.0, wait_s))
        return
    leave_as(held_back)


def restart_budget(run: RunConfig) -> State | None:
    """At the start of a deployment's run: None to go on; a Scheduled state (back off until due) or a Crashed one
    (OutOfRestarts, alert recorded) to end this start with."""
    flow_run_id = deployment_run_id()
    if flow_run_id is None:
        return None
    restarts = recent_restarts(flow_run_id, run.restart_window_minutes)
    if len(restarts) > run.max_restarts:
        causes = "; ".join(f"{when:%H:%M:%S} {message.removeprefix(RESTART_MARK).strip()}"
                           for when, message in restarts[-5:])
        message = (f"{len(restarts)} restarts within --restart_window_minutes {run.restart_window_minutes:g}, past "
                   f"--max_restarts {run.max_restarts}; the run stays Crashed until a person retries it. The "
                   f"newest: {causes}")
        _alert(run, message, [entry for _, entry in restarts])
        return Crashed(name=OUT_OF_RESTARTS, message=message)
    if len(restarts) > 1:
        due = restarts[-2][0] + timedelta(seconds=backoff_s(len(restarts)))
        if datetime.now(timezone.utc) < due:
            return Scheduled(scheduled_time=due, name="AwaitingRetry",
                             message=f"rlhf: backing off until {due:%H:%M:%S} ({len(restarts)} restarts)")
    return None


def after_failure(run: RunConfig, error: BaseException) -> State | None:
    """A deployment's run failed with `error`: rescheduled (the restart's wait as its scheduled time) when the
    fault passes; None to fail as usual (a user error, a NaN, a full disk, a drift refusal, a bug)."""
    flow_run_id = deployment_run_id()
    if flow_run_id is None or not (isinstance(error, RLHFError) and error.retryable):
        return None
    earlier = recent_restarts(flow_run_id, run.restart_window_minutes)
    num_restarts = len(earlier) + 1
    due = datetime.now(timezone.utc)
    if earlier:
        due = max(due, earlier[-1][0] + timedelta(seconds=backoff_s(num_restarts)))
    logger.warning("%s; the run is rescheduled (restart %d of --max_restarts %d)", error, num_restarts,
                   run.max_restarts)
    return Scheduled(scheduled_time=due, name="AwaitingRetry", message=f"{RESTART_MARK} {type(error).__name__}: {error}")


def after_stop(stopped: State, signal_name: str | None) -> State:
    """A deployment's run stopped by SIGTERM after its emergency checkpoint: Preempted (rescheduled at once) unless
    a Cancel was asked for in Prefect; any other stop stays `stopped`."""
    flow_run_id = deployment_run_id()
    if flow_run_id is None or signal_name != "SIGTERM":
        return stopped
    with get_client(sync_client=True) as client:
        state = client.read_flow_run(flow_run_id).state
    if state is not None and state.type == StateType.CANCELLING:
        return stopped
    return Scheduled(name=PREEMPTED, message=f"preempted: {stopped.message}; it continues when a worker is free")


def recent_restarts(flow_run_id: str, window_minutes: float) -> list[tuple[datetime, str]]:
    """(time, message) of the run's restarts within the window, oldest first. A restart counts once per attempt
    that ran before it: Prefect's process worker reports one death twice (its executor, then the worker), and the
    second report may restart the run again before any attempt ran."""
    since = datetime.now(timezone.utc) - timedelta(minutes=window_minutes)
    with get_client(sync_client=True) as client:
        states = sorted(client.read_flow_run_states(flow_run_id), key=lambda state: state.timestamp)
    counted, ran = [], False
    for state in states:
        if state.type == StateType.RUNNING:
            ran = True
        elif (state.type in (StateType.SCHEDULED, StateType.PENDING) and (state.message or "").startswith(RESTART_MARK)
              and ran):
            counted.append((state.timestamp, state.message or ""))
            ran = False
    return [(when, message) for when, message in counted if when >= since]


def leave_as(state: State) -> NoReturn:
    """End this flow-run process with the run in `state`, set through the API, and exit 0. A flow that returned a
    Scheduled or Crashed state would exit 1 (the engine cannot take a result from either), and its worker would
    then report the run Crashed over it. The run's ranks and trackers are closed already; Ray and the logs are
    flushed here, as leaving would."""
    import os

    import ray
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    flow_run_id = deployment_run_id()
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(flow_run_id, state, force=True)
    logger.info("flow run left as %s: %s", state.name, state.message)
    with contextlib.suppress(Exception):
        ray.shutdown()  # a local cluster started here would outlive the process
    for worker in (APILogWorker, EventsWorker):  # the run's log lines and events (an alert) still in their queues
        with contextlib.suppress(Exception):
            worker.drain_all(timeout=5)
    os._exit(0)


def _alert(run: RunConfig, message: str, failures: list[str]) -> None:
    alert = Alert(ALERT_RESTARTS_EXHAUSTED, run.run_name, "", 0, message, {"failures": failures})
    try:
        AlertLog(run.run_url(), run.storage_options).append(alert, announced=False)  # the state's message says it
    except OSError:
        logger.warning("could not record %s in the run's alerts", ALERT_RESTARTS_EXHAUSTED, exc_info=True)
    emit_alert(json.loads(alert.to_json()))
