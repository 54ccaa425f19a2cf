"""Fault injection for tests: pause or die at a named point (`fault_point`), chosen by an environment variable such
as `RLHF_FAULT_INJECT="after_commit@10=sleep:60,train_step@7=kill,collective@9=hang"`; unset, it does nothing.
docs/design-notes.md ("Fault injection") has the rules and RLHF_FAULT_JOB_PID, RLHF_FAULT_STATE. With
RLHF_FAULT_TRACE set, every point reached appends `time pid point@step tag` to that file: the chaos soak (tests/soak)
reads the ranks' pids and each step's time from it. A file `armed-PID` in RLHF_FAULT_STATE holding an action is that
process's action at its next fault point, from outside (the soak arms `oom` in a rank it put under a memory limit).
Fault points sit at boundaries (entering a step, a write, a collective), never inside the arithmetic: an action that
changes what the step computes is one a process registers (`register_action`), as a rank registers `nan`.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any, Callable

from rlhf_core.processes import process_exists

HOOK_PREFIX = "RLHF_FAULT_"  # every variable of the fault hooks: a test harness's, not a job's environment
ENV_VAR = "RLHF_FAULT_INJECT"
STATE_ENV_VAR = "RLHF_FAULT_STATE"
JOB_PID_ENV_VAR = "RLHF_FAULT_JOB_PID"
TRACE_ENV_VAR = "RLHF_FAULT_TRACE"
OOM_BLOCK_BYTES = 64 << 20
OOM_MAX_BYTES = 4 << 30  # with no memory limit to meet, `oom` gives up here with a MemoryError
MARKER_WAIT_S = 300.0  # `after:POINT` waits at most this long for POINT's rule to fire
SLOW_PIECE_S = 0.5  # `slow:S` works in pieces this long, each reported as a long evaluation reports its batches

# Actions this process added to the built-in ones, by name (`register_action`).
_REGISTERED: dict[str, Callable[[], None]] = {}


def _marker(point: str) -> Path | None:
    """Where a rule for `point` marks that it fired (None without RLHF_FAULT_STATE: rules fire every time)."""
    state_dir = os.environ.get(STATE_ENV_VAR)
    return Path(state_dir) / point if state_dir else None


def _first_time(point: str) -> bool:
    marker = _marker(point)
    if marker is None:
        return True
    try:
        marker.touch(exist_ok=False)
    except FileExistsError:
        return False
    return True


def _orphaned() -> bool:
    """A rank whose job (RLHF_FAULT_JOB_PID) is already dead: it is training ahead or uploading until Ray
    reaps it, and must not use up a rule meant for the job's next run."""
    job_pid = int(os.environ.get(JOB_PID_ENV_VAR, "0"))
    return bool(job_pid) and job_pid != os.getpid() and not process_exists(job_pid)


def fault_hooks() -> dict[str, str]:
    """This process's fault-hook variables (RLHF_FAULT_*)."""
    return {name: value for name, value in os.environ.items() if name.startswith(HOOK_PREFIX)}


def take_fault_hooks(hooks: dict[str, str]) -> None:
    """Make `hooks` this process's fault hooks, in place of its own: a rank that outlives its command takes those
    of the command that claims it (`rlhf_core.rank.reuse`), as a fresh rank would have inherited them."""
    for name in fault_hooks():
        del os.environ[name]
    os.environ.update({name: value for name, value in hooks.items() if name.startswith(HOOK_PREFIX)})


def register_action(name: str, action: Callable[[], None]) -> None:
    """Let a rule `point@step=name` run `action` in this process, at the point, before the work the point enters.
    A rank registers `nan` (`rlhf_core.rank.worker`): `train_step@8=nan` makes step 8's loss non-finite."""
    _REGISTERED[name] = action


def _trace(point: str, tag: str) -> None:
    path = os.environ.get(TRACE_ENV_VAR)
    if path:  # one short write to a file opened for appending: lines from many processes never interleave
        with open(path, "a") as trace:
            trace.write(f"{time.time():.3f} {os.getpid()} {point} {tag or '-'}\n")


def _armed_action() -> str | None:
    state_dir = os.environ.get(STATE_ENV_VAR)
    if not state_dir:
        return None
    armed = Path(state_dir) / f"armed-{os.getpid()}"
    try:
        action = armed.read_text().strip()
        armed.unlink()
    except FileNotFoundError:
        return None
    return action


def fault_point(name: str, step: int, tag: str = "", signals: Any = None) -> None:
    """Act on this process's armed action, else on the rules for `name@step`; `tag` (a rank's stage) only goes to
    the trace; `signals`: the rank's trainer's (`RankSignals`), which `slow:S` reports its pieces to."""
    point = f"{name}@{step}"
    _trace(point, tag)
    armed = _armed_action()
    if armed:
        _act(armed, signals)
        return
    spec = os.environ.get(ENV_VAR)
    if not spec:
        return
    if _orphaned():
        return
    for rule in spec.split(","):
        where, _, action = rule.strip().partition("=")
        if where == point and _first_time(point):
            _act(action, signals)


def _work_slowly(seconds: float, signals: Any) -> None:
    """Long work that progresses: S seconds in pieces of SLOW_PIECE_S, each told to `signals` as an evaluation
    batch (phase "eval"), as a long evaluation or rollout does. Without signals, or unheard, it is a stall."""
    pieces = max(1, round(seconds / SLOW_PIECE_S))
    for done in range(1, pieces + 1):
        time.sleep(seconds / pieces)
        if signals is not None:
            signals.work_done("eval", done, pieces)


def _wait_for_marker(point: str) -> None:
    """`after:POINT`: wait until POINT's rule has fired in any process (its marker in RLHF_FAULT_STATE), so that
    the faults after this one land after a named moment of another process (a driver's commit), not after a race
    with it. A bounded wait: a point never reached lets the run go on after MARKER_WAIT_S. Without RLHF_FAULT_STATE
    no rule leaves a marker, so there is nothing to wait for."""
    marker = _marker(point)
    if marker is None:
        return
    deadline = time.monotonic() + MARKER_WAIT_S
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def _act(action: str, signals: Any = None) -> None:
    if action == "kill":
        job_pid = int(os.environ.get(JOB_PID_ENV_VAR, "0"))
        if job_pid and job_pid != os.getpid():
            os.kill(job_pid, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "hang":  # as a stuck collective or a dead mount: the process stops, answering nothing
        os.kill(os.getpid(), signal.SIGSTOP)
    elif action.startswith("sleep:"):  # a stall that still answers heartbeats: a loop, a wait on a lock
        time.sleep(float(action.split(":", 1)[1]))
    elif action.startswith("after:"):
        _wait_for_marker(action.split(":", 1)[1])
    elif action.startswith("slow:"):
        _work_slowly(float(action.split(":", 1)[1]), signals)
    elif action in _REGISTERED:
        _REGISTERED[action]()
    elif action == "oom":  # a step whose memory outgrows the limit: the kernel's OOM killer ends the process
        blocks: list[bytearray] = []
        while len(blocks) * OOM_BLOCK_BYTES < OOM_MAX_BYTES:
            blocks.append(bytearray(OOM_BLOCK_BYTES))  # zero-filled: every page is touched, so charged
        raise MemoryError(f"fault oom: {OOM_MAX_BYTES >> 30} GiB allocated and no memory limit met")
