"""A deployment's run and its worker, each outliving the other.

- The worker dies and the run lives on (`outlive_the_worker`): a process worker reads its flow run's console
  through a pipe. When the worker is killed (and its supervisor starts another), the run's next console line meets
  a broken pipe, and rich's console (Prefect's console handler) ends the process with SystemExit(1): a run that
  was training fine is Crashed and restarted, 30-90 s lost. Here the run says it once, sends its console to
  /dev/null and goes on; its lines still reach Prefect's API and the run's log file.
- The run dies with its machine, and the machine comes back (`sweep`): a power cut or a reboot kills the worker
  and its runs, which Prefect keeps Running until the heartbeat automation gives up on them (90 s). Each run
  labels itself with its host, boot and process (`record_process`); a worker starting on that host first marks
  Crashed every Running run of its pool whose process is gone, and `rlhf-restart-crashed-runs` restarts it at once.
  `deployments/local_worker.sh` runs the sweep before the worker: `python -m flows.orphans --pool POOL`.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from pathlib import Path

from rlhf_core.processes import process_exists, process_started

logger = logging.getLogger(__name__)
HOST, BOOT, PID, STARTED, ATTEMPT = "rlhf.host", "rlhf.boot_id", "rlhf.pid", "rlhf.pid_started", "rlhf.attempt"


def outlive_the_worker() -> None:
    """Let this flow-run process outlive the worker reading its console: every rich console of a logging handler
    (Prefect's) sends stdout and stderr to /dev/null on a broken pipe instead of exiting."""
    from rich.console import Console

    loggers = [logging.getLogger(), *(entry for entry in logging.Logger.manager.loggerDict.values()
                                      if isinstance(entry, logging.Logger))]
    for handler in (handler for each in loggers for handler in each.handlers):
        console = getattr(handler, "console", None)
        if isinstance(console, Console):
            console.on_broken_pipe = lambda console=console: _console_gone(console)  # rich: "override this"


def _console_gone(console) -> None:
    console.quiet = True
    devnull = os.open(os.devnull, os.O_WRONLY)
    for stream in (sys.stdout, sys.stderr):
        os.dup2(devnull, stream.fileno())
    os.close(devnull)
    logger.warning("the console of this run is gone (its worker died?): the run goes on; its lines still reach "
                   "Prefect's API and the run's log file")


def this_process() -> dict[str, str]:
    """The labels naming this process: host, boot and pid with its start time (a pid is reused, a start is not)."""
    return {HOST: socket.gethostname(), BOOT: _boot_id(), PID: str(os.getpid()), STARTED: process_started(os.getpid())}


def record_process(client, flow_run_id: str) -> None:
    """Label the running flow run with this process, for `sweep` on this host after a power cut, and with its
    run_count (the server's: this process's copy of the run predates its Running), so that a sweep never takes
    these labels for the next attempt's."""
    attempt = client.read_flow_run(flow_run_id).run_count
    client.update_flow_run_labels(flow_run_id, {**this_process(), ATTEMPT: str(attempt)})


def orphaned(labels: dict, run_count: int, here: dict[str, str]) -> str | None:
    """Why a Running run with `labels` is an orphan of this host (`here`: `this_process()` of the sweep), or None:
    its labels are its current attempt's, it ran here, and its process is gone (another boot, or no such pid
    started when it did)."""
    if labels.get(HOST) != here[HOST] or labels.get(ATTEMPT) != str(run_count) or PID not in labels:
        return None
    if labels.get(BOOT) != here[BOOT]:
        return f"this machine restarted since its process {labels[PID]} started"
    pid = int(labels[PID])
    if not process_exists(pid) or process_started(pid) != labels.get(STARTED):
        return f"its process {pid} is gone"
    return None


def sweep(client, pool: str) -> list[str]:
    """Mark Crashed every Running run of `pool` orphaned on this host; their names."""
    from prefect.client.schemas.filters import (FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType,
                                                WorkPoolFilter, WorkPoolFilterName)
    from prefect.client.schemas.objects import StateType
    from prefect.states import Crashed

    running = FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.RUNNING])))
    runs = client.read_flow_runs(flow_run_filter=running,
                                 work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[pool])))
    here, swept = this_process(), []
    for run in runs:
        reason = orphaned(dict(run.labels or {}), run.run_count, here)
        if reason:
            client.set_flow_run_state(run.id, Crashed(message=f"Orphaned on {here[HOST]}: {reason}. "
                                                              "rlhf-restart-crashed-runs reschedules it."))
            swept.append(run.name)
    return swept


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def main(argv: list[str] | None = None) -> int:
    """`python -m flows.orphans --pool POOL`: the sweep a worker runs before it starts. A failure is one line and
    exit 0: the worker starts anyway, and the heartbeat automation is still there."""
    parser = argparse.ArgumentParser(prog="python -m flows.orphans", description=__doc__.split("\n\n")[0])
    parser.add_argument("--pool", required=True, help="the work pool whose runs on this host to sweep")
    args = parser.parse_args(argv)
    from prefect import get_client

    try:
        with get_client(sync_client=True) as client:
            swept = sweep(client, args.pool)
    except Exception as error:  # noqa: BLE001 - a sweep must never keep a worker from starting
        print(f"rlhf: warning: could not look for runs orphaned on this host: {error}", file=sys.stderr)
        return 0
    for name in swept:
        print(f"rlhf: flow run {name} ran here and its process is gone: marked Crashed, to be restarted")
    return 0


if __name__ == "__main__":
    sys.exit(main())
