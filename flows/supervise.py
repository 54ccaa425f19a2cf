"""A deployment's flow-run process that dies (the OOM killer, a segfault, a SIGKILL) starts again on its own host in
seconds, instead of the ~40 s of the worker's report, Prefect's automation and a worker's next poll.

prefect.yaml has the process worker run this module (`deployments/flow_run.sh`, the `command` job variable) in
place of `python -m prefect.engine`. It runs the engine as its child and stays between it and the worker:
- the engine ends by itself (a final state, or a reschedule of flows/restarts.py): this exits with its code;
- a stop signal reaches this process (Cancel in the UI, a preemption): it is passed on to the engine, which stops
  as it would alone; a hard kill of this process takes the engine with it (PR_SET_PDEATHSIG);
- the engine dies by a signal while Prefect still has its run Running (it reported nothing): the run is marked
  restarting (Pending, with flows/restarts.py's RESTART_MARK: its restart budget counts it) and the engine starts
  again here. The budget, the backoff and OutOfRestarts apply at its start.
  An engine that dies before its run is Running again is left to the worker's report and the automation.
A host lost with its processes has no supervisor left: Prefect's automation stays the path then.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from uuid import UUID

from rlhf_core.driver.stop import SUPERVISED_ENV  # a stop signal passed on is one stop, not two

PR_SET_PDEATHSIG = 1
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# The worker's cancel channel takes one connection per attempt: a restarted engine must not try it again.
ATTEMPT_ONLY_ENV = ("PREFECT__CONTROL_PORT", "PREFECT__CONTROL_TOKEN")
# Once the engine has started (its own imports, Ray, the ranks: ~10 s here), this process imports what marking a
# restart needs (Prefect's client: ~1.7 s of CPU), so that a restart does not wait for it after a death.
WARM_IMPORTS_AFTER_S = 10.0


def main() -> int:
    """Run the engine until it ends by itself or is stopped; restart it after each death `restart_after` allows."""
    flow_run_id = os.environ.get("PREFECT__FLOW_RUN_ID")
    if not flow_run_id:
        _say("rlhf: flows.supervise runs a deployment's flow run, from a Prefect worker: PREFECT__FLOW_RUN_ID "
             "is not set")
        return 2
    stop_signals: list[int] = []
    engine: subprocess.Popen | None = None

    def pass_on(number: int, frame) -> None:
        stop_signals.append(number)
        if engine is not None and engine.poll() is None:
            engine.send_signal(number)

    for number in FORWARDED_SIGNALS:
        signal.signal(number, pass_on)
    with contextlib.suppress(OSError):  # a session of its own, as Prefect's engine has: a terminal's Ctrl-C to
        os.setsid()                     # the worker's group does not reach the engine too
    environment = {**os.environ, SUPERVISED_ENV: str(os.getpid())}
    threading.Thread(target=_warm_imports, args=(WARM_IMPORTS_AFTER_S,), name="rlhf-warm-imports", daemon=True).start()
    while True:
        engine = subprocess.Popen([sys.executable, "-m", "prefect.engine"], env=environment,
                                  preexec_fn=_die_with_this_process)
        if stop_signals:  # one arrived while the engine was starting
            engine.send_signal(stop_signals[-1])
        returncode = engine.wait()  # a signal's handler runs meanwhile (PEP 475 resumes the wait)
        if returncode >= 0 or stop_signals:
            return _exit_code(returncode)
        started = time.monotonic()
        try:
            restart = restart_after(flow_run_id, engine.pid, -returncode)
        except Exception as error:  # noqa: BLE001 - the worker's report and the automation remain
            _say(f"rlhf: flow run {flow_run_id}: its engine process {engine.pid} died and could not be marked "
                 f"restarting ({type(error).__name__}: {error}); leaving it to the worker")
            restart = False
        if not restart:
            return _exit_code(returncode)
        _say(f"rlhf: flow run {flow_run_id}: its engine process {engine.pid} died by "
             f"{signal.Signals(-returncode).name}; starting it again on this host "
             f"({time.monotonic() - started:.1f} s to mark the restart)")
        environment = {key: value for key, value in environment.items() if key not in ATTEMPT_ONLY_ENV}


def restart_after(flow_run_id: str | UUID, pid: int, signal_number: int) -> bool:
    """After the engine `pid` died by `signal_number`: whether to start it again here. Yes when Prefect still
    has the run Running (the engine reported nothing): the run is then set Pending, named RESTARTING, with
    RESTART_MARK (counted by the run's restart budget). Pending, not Scheduled as a reschedule is: a worker's
    poll would take a Scheduled run too (seen), and two attempts would run. No when the run was not Running (it
    never got there, or it ended or was rescheduled before dying), and when the run has used --max_restarts
    within --restart_window_minutes: the worker's report and the automation take it from there, and the engine's
    start ends it OutOfRestarts (flows/restarts.py). A process that dies at each start, before that check, is
    restarted here --max_restarts times at most."""
    from prefect import get_client
    from prefect.client.schemas.objects import StateType
    from prefect.client.schemas.responses import OrchestrationResult, SetStateStatus
    from prefect.states import Pending

    from flows.restarts import RESTART_MARK, RESTARTING, recent_restarts
    from rlhf_core.config import RunConfig

    name, flow_run_id = signal.Signals(signal_number).name, UUID(str(flow_run_id))
    with get_client(sync_client=True) as client:
        flow_run = client.read_flow_run(flow_run_id)
        if flow_run.state is None or flow_run.state.type != StateType.RUNNING:
            return False
        config = (flow_run.parameters or {}).get("config") or {}
        max_restarts = config.get("max_restarts", RunConfig.model_fields["max_restarts"].default)
        window = config.get("restart_window_minutes", RunConfig.model_fields["restart_window_minutes"].default)
        if len(recent_restarts(str(flow_run_id), window)) >= max_restarts:
            _say(f"rlhf: flow run {flow_run_id}: its engine process {pid} died by {name}, past --max_restarts "
                 f"{max_restarts}: left to the worker's report")
            return False
        message = (f"{RESTART_MARK} the flow-run process {pid} died by {name}; restarted on "
                   f"{socket.gethostname()} by its supervisor")
        marked: OrchestrationResult = client.set_flow_run_state(flow_run_id, Pending(name=RESTARTING, message=message),
                                                                force=True)
    if marked.status != SetStateStatus.ACCEPT:
        _say(f"rlhf: flow run {flow_run_id}: its engine process {pid} died by {name}; the server refused the "
             f"restart ({marked.status.value}: {marked.details})")
    return marked.status == SetStateStatus.ACCEPT


def _warm_imports(after_s: float) -> None:
    """Import what `restart_after` imports, `after_s` from now (its imports then find them loaded)."""
    time.sleep(after_s)
    with contextlib.suppress(Exception):  # restart_after imports them itself, and says what failed
        import prefect.client.orchestration  # noqa: F401
        import prefect.states  # noqa: F401

        import flows.restarts  # noqa: F401
        import rlhf_core.config  # noqa: F401


def _say(line: str) -> None:
    """A line on stderr, the worker's pipe: gone when the worker died (flows/orphans.py), and a restart must
    not end on it."""
    with contextlib.suppress(OSError):
        print(line, file=sys.stderr, flush=True)


def _exit_code(returncode: int) -> int:
    """The engine's exit status as this process's: a death by signal N as 128 + N, as a shell reports it."""
    return returncode if returncode >= 0 else 128 - returncode


def _die_with_this_process() -> None:
    """In the engine, before it runs: the kernel kills it when this supervisor dies (the worker's hard kill)."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main())
