"""A stop signal is obeyed and used: SIGTERM or Ctrl-C ends a run at the next step, with that step committed within
`--stop_grace_s`; a second signal, or the grace period's end, leaves at once. OpenRLHF leaves signals to Python (no
checkpoint). docs/design-notes.md ("Stop signals") has the contract, and "Stopping on a signal" the mechanism.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from typing import Callable, Iterator

DEFAULT_GRACE_S = 25.0
# What the grace period keeps for leaving after the emergency commit (Prefect's final states, the ranks' and
# Ray's shutdown, the server's stop: about 2 s here): a fifth of it, at least 3 s, at most half.
EXIT_RESERVE_FRACTION, MIN_EXIT_RESERVE_S = 0.2, 3.0
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# Set in a deployment's flow run by its supervisor (flows/supervise.py names it too: rlhf_core imports no flows),
# which passes a stop signal on to this process: a service's stop (systemd) signals both, moments apart.
SUPERVISED_ENV = "RLHF_FLOW_RUN_SUPERVISOR"
PASSED_ON_WITHIN_S = 2.0


class StoppedBySignal(Exception):
    """The run stopped on a signal, with `step` its stage's newest commit; its text is the CLI's last line.
    `abandoned_at`: the step the ranks had reached when the grace period ran out before it committed (None: the
    stop committed what it could)."""

    def __init__(self, signal_number: int, stage: str, step: int, committed_in: str | None,
                 abandoned_at: int | None = None, grace_s: float = DEFAULT_GRACE_S):
        self.signal_number, self.stage, self.step, self.committed_in = signal_number, stage, step, committed_in
        self.abandoned_at, self.grace_s = abandoned_at, grace_s
        super().__init__(self.describe())

    def __reduce__(self):  # picklable (Prefect may persist it), with the fields the text is made of
        return (type(self), (self.signal_number, self.stage, self.step, self.committed_in, self.abandoned_at,
                             self.grace_s))

    @property
    def exit_code(self) -> int:
        return 128 + self.signal_number

    def describe(self) -> str:
        name = signal.Signals(self.signal_number).name
        where = f" in {self.committed_in}" if self.committed_in else ""
        commit = f"step_{self.step}{where}" if self.step else None
        if self.abandoned_at is not None:
            kept = f"the last commit, {commit}, stands" if commit else "nothing of this stage is committed yet"
            return (f"stopped by {name} at step {self.abandoned_at}; its emergency checkpoint did not fit in "
                    f"--stop_grace_s {self.grace_s:g}, so {kept}; run the same command to continue")
        if commit is None:
            return f"stopped by {name} before any step of {self.stage} was committed; run the same command to start"
        return f"stopped by {name} at step {self.step}; committed {commit}; run the same command to continue"


class GraceExpired(Exception):
    """The grace period ran out before the ranks finished their step or the emergency checkpoint committed."""


class StopSignals:
    """A run's stop signals: the first one's number and time, whom to tell, and the newest commit seen.

    The CLI creates one for its command (`owns_process`), the flow `rlhf` one for a run called in a process of
    someone else's (a deployment's worker, a notebook); the runner, the worker group and the chunks are handed it.
    `obeying()` installs its handlers for a block; blocks nest (each restores what it found)."""

    def __init__(self, grace_s: float = DEFAULT_GRACE_S, owns_process: bool = False):
        self.grace_s = grace_s
        self.owns_process = owns_process  # whether the watchdog may end the process after the blocks too
        self.signal_number: int | None = None
        self.received_at: float | None = None  # time.monotonic()
        self.outcome: StoppedBySignal | None = None  # the last `stopped()`
        self.last_commit: tuple[str, int, str] | None = None  # (stage, step, stage folder) of the newest commit
        self._lock = threading.Lock()
        self._listeners: list[Callable[[], None]] = []
        self._depth = 0  # nested `obeying` blocks
        self._generation = 0  # counts `reset`s: a watchdog of an earlier stop does nothing

    def requested(self) -> bool:
        """Whether a stop signal has arrived."""
        return self.signal_number is not None

    def commit_deadline(self) -> float | None:
        """The `time.monotonic()` by which an emergency checkpoint must have committed; None with no stop."""
        if self.received_at is None:
            return None
        return self.received_at + self.grace_s - exit_reserve_s(self.grace_s)

    def check_deadline(self) -> None:
        """Raise GraceExpired once the emergency checkpoint's time is up."""
        deadline = self.commit_deadline()
        if deadline is not None and time.monotonic() >= deadline:
            raise GraceExpired(f"--stop_grace_s {self.grace_s:g} ran out")

    def on_request(self, listener: Callable[[], None]) -> Callable[[], None]:
        """Call `listener` (from a thread of its own) when a stop is requested, at once if it already was;
        returns a function that unregisters it."""
        with self._lock:
            self._listeners.append(listener)
            already = self.requested()
        if already:
            _notify([listener])

        def unregister() -> None:
            with self._lock:
                if listener in self._listeners:
                    self._listeners.remove(listener)
        return unregister

    def record_commit(self, stage: str, step: int, stage_url: str) -> None:
        """The newest commit of this run, for the line of a stop that has no time to look it up."""
        self.last_commit = (stage, step, stage_url)

    def stopped(self, stage: str, step: int, stage_url: str, abandoned_at: int | None = None) -> StoppedBySignal:
        """The exception a chunk raises once it has done what a stop allows (also kept as `outcome`);
        `abandoned_at`: see StoppedBySignal."""
        self.outcome = StoppedBySignal(self.signal_number or signal.SIGTERM, stage, step,
                                       stage_url if step else None, abandoned_at, self.grace_s)
        return self.outcome

    @contextlib.contextmanager
    def obeying(self) -> Iterator[StopSignals]:
        """Handle SIGINT and SIGTERM as described in the module's docstring while the block runs. The outermost
        block starts with no stop (a new run in this process). Outside the main thread, signals cannot be
        handled here: nothing changes."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        if self._depth == 0:
            self.reset()
        previous = {number: signal.signal(number, self._on_signal) for number in STOP_SIGNALS}
        self._depth += 1
        try:
            yield self
        finally:
            self._depth -= 1
            for number, handler in previous.items():
                signal.signal(number, handler)

    def is_obeying(self) -> bool:
        """Whether an `obeying` block is running."""
        return self._depth > 0

    def reclaim(self) -> None:
        """Put the handlers back inside an `obeying` block, after a library replaced them (`ray.init` installs a
        SIGTERM handler that exits with code 15 wherever the driver is)."""
        if self._depth > 0 and threading.current_thread() is threading.main_thread():
            for number in STOP_SIGNALS:
                signal.signal(number, self._on_signal)

    def reset(self) -> None:
        """Forget a stop; the listeners stay (worker groups unregister themselves)."""
        with self._lock:
            self.signal_number = self.received_at = self.last_commit = self.outcome = None
            self._generation += 1

    def _on_signal(self, number: int, frame) -> None:
        if self.requested():
            if not self._passed_on_again(number):
                self._leave_now(number, "a second stop signal")
            return
        received_at = time.monotonic()
        with self._lock:
            self.signal_number, self.received_at = number, received_at
            listeners = list(self._listeners)
        name = signal.Signals(number).name
        again = "Ctrl-C" if number == signal.SIGINT else name
        with contextlib.suppress(Exception):
            from rlhf_core.ops.console import end_live_line

            end_live_line()  # the notice goes on a line of its own, not over the live bar
        _write_line(f"rlhf: {name} received: stopping after the current step, which commits within --stop_grace_s "
                    f"{self.grace_s:g}; {again} again to leave at once (the last commit stands).")
        _notify(listeners)
        threading.Thread(target=self._watchdog, args=(self._generation, number, received_at),
                         name="rlhf-stop-watchdog", daemon=True).start()

    def _passed_on_again(self, number: int) -> bool:
        """Whether `number` is the first stop signal again, passed on by this flow run's supervisor
        (flows/supervise.py) moments after it reached this process directly: one stop, not two."""
        return (bool(os.environ.get(SUPERVISED_ENV)) and number == self.signal_number
                and self.received_at is not None and time.monotonic() - self.received_at < PASSED_ON_WITHIN_S)

    def _watchdog(self, generation: int, number: int, received_at: float) -> None:
        """Leave at the end of the grace period of the stop signal `number`, received at `received_at`, if the run
        is still here (and this stop was not forgotten)."""
        time.sleep(max(0.0, received_at + self.grace_s - time.monotonic()))
        with self._lock:
            current = self._generation == generation and self.requested() and (self._depth > 0 or self.owns_process)
        if current:
            _dump_stacks_to_log_file()
            self._leave_now(number, f"--stop_grace_s {self.grace_s:g} ran out")

    def _leave_now(self, number: int, why: str) -> None:
        """Kill every process this one started and exit with 128 + `number`, the last commit standing."""
        commit = self.last_commit
        kept = f"the last commit, step_{commit[1]} in {commit[2]}, stands" if commit else "the last commit stands"
        _write_line(f"rlhf: stopped by {signal.Signals(number).name} ({why}): leaving now; {kept}; "
                    "run the same command to continue")
        kill_descendants()
        os._exit(128 + number)


def exit_reserve_s(grace: float) -> float:
    """The part of the grace period kept for leaving (see MIN_EXIT_RESERVE_S)."""
    return min(grace / 2, max(MIN_EXIT_RESERVE_S, grace * EXIT_RESERVE_FRACTION))


def _notify(listeners: list[Callable[[], None]]) -> None:
    def run() -> None:
        for listener in listeners:
            try:
                listener()
            except Exception:  # noqa: BLE001 - a group already gone has nothing to stop
                pass
    threading.Thread(target=run, name="rlhf-stop-notify", daemon=True).start()


def _dump_stacks_to_log_file() -> None:
    """Where every thread was when the grace period ran out, into the run's log file (what hung)."""
    import faulthandler

    from rlhf_core.ops.console import configured_log_file

    path = configured_log_file()
    if path is None:
        return
    with contextlib.suppress(OSError), open(path, "a") as log:
        log.write("rlhf: --stop_grace_s ran out; the driver's threads were here:\n")
        log.flush()
        faulthandler.dump_traceback(file=log, all_threads=True)


def kill_descendants() -> None:
    """SIGKILL every process started from this one (the ranks too: Ray's raylet started them)."""
    import psutil

    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:
        return
    for child in children:
        with contextlib.suppress(psutil.Error):
            child.kill()


def _write_line(text: str) -> None:
    """One line on stderr, written whole even from a signal handler (no buffered stream in between)."""
    with contextlib.suppress(OSError):
        os.write(2, (text + "\n").encode())
