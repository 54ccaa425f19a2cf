"""A rank process made ready for the next command on the same cluster (`TrainWorker.retire`, then
`rlhf_core.driver.spares`): what the last command left in it is reset, or the process is refused and ends.

Reset: the process group (torch.distributed and DeepSpeed's handle on it), the random generators, this process's own
in-memory snapshots (`remove_stale_snapshots` only removes dead processes'), a fault hook armed for its PID, the
user modules the last command imported (a reward function edited between two commands is imported again), the
working directory. Refused: a thread of the last command that has not ended (`threads_left`), ZeRO-3 (it patches torch's module
construction process-wide), a process that has touched CUDA. docs/design-notes.md ("Spares that outlive their
command") has the rest.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import os
import random
import shutil
import sys
import sysconfig
import tempfile
import threading
import time
from dataclasses import dataclass, field

import ray

THREAD_END_WAIT_S = 2.0  # how long a thread the last command started may take to end before the process is refused


@dataclass(frozen=True)
class ProcessBaseline:
    """What a rank process holds before any command uses it: its threads, modules and working directory."""

    threads: frozenset[int] = field(default_factory=frozenset)
    modules: frozenset[str] = field(default_factory=frozenset)
    cwd: str = ""

    @classmethod
    def now(cls) -> ProcessBaseline:
        return cls(frozenset(thread.ident for thread in threading.enumerate() if thread.ident is not None),
                   frozenset(sys.modules), os.getcwd())


def reset_for_reuse(baseline: ProcessBaseline, zero_stage: int | None) -> str:
    """Reset what the last command left in this process; returns why it cannot be reused ("" when it can)."""
    if zero_stage == 3:
        return "it trained under ZeRO-3, which patches torch's module construction in the whole process"
    if "torch" in sys.modules and sys.modules["torch"].cuda.is_initialized():
        return "it has used CUDA (a spare would hold GPU memory)"
    leftover = threads_left(baseline)
    if leftover:
        return f"threads of the last command are still running: {', '.join(sorted(leftover))}"
    end_process_group()
    reset_random_generators()
    remove_own_snapshots()
    disarm_fault_hook()
    forget_user_modules(baseline)
    if os.getcwd() != baseline.cwd:
        os.chdir(baseline.cwd)
    return ""


def threads_left(baseline: ProcessBaseline, wait_s: float = THREAD_END_WAIT_S) -> list[str]:
    """The names of the last command's threads still running after waiting up to `wait_s` for them to end: those
    started since `baseline` that run rlhf_core's code or a user's. A library's own process-wide thread (tqdm's
    monitor, fsspec's event loop and its executor) is no command's, nor a thread pool's idle worker (it runs only
    what is submitted to it); threads started outside Python (Ray's, torch's) are not Python threads."""
    deadline = time.monotonic() + wait_s

    def commands_threads() -> list[threading.Thread]:
        return [thread for thread in threading.enumerate()
                if thread.ident not in baseline.threads and thread is not threading.current_thread()
                and not isinstance(thread, threading._DummyThread) and _runs_command_code(thread)]

    for thread in commands_threads():
        thread.join(max(0.0, deadline - time.monotonic()))
    return [thread.name for thread in commands_threads() if thread.is_alive()]


def _runs_command_code(thread: threading.Thread) -> bool:
    target = getattr(thread, "_target", None)  # set while a plain Thread runs its target
    module_name = getattr(target if target is not None else type(thread).run, "__module__", None) or ""
    if module_name.split(".")[0] == "rlhf_core":
        return True
    module = sys.modules.get(module_name)
    return module is None or not _from_a_library(module)


def end_process_group() -> None:
    """Leave the torch.distributed group, and drop DeepSpeed's hold on it (its handle, and the groups it derived:
    `deepspeed.utils.groups` is loaded again, its caches empty), so the next `init_distributed` starts anew.
    (DeepSpeed's CPU shared-memory all-reduce keeps its first group's setup for the process's life; it is its
    inference path's, not training's.)"""
    if "torch" not in sys.modules:
        return
    import importlib

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    if "deepspeed.comm.comm" in sys.modules:
        setattr(sys.modules["deepspeed.comm.comm"], "cdb", None)
    if "deepspeed.utils.groups" in sys.modules:
        importlib.reload(sys.modules["deepspeed.utils.groups"])


def reset_random_generators(seed: int = 0) -> None:
    """Python's, NumPy's and torch's global generators to one fixed state: nothing of the last command's draws
    carries over (each stage also seeds torch itself from (seed, stage, step, rank))."""
    random.seed(seed)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(seed)
    if "torch" in sys.modules:
        sys.modules["torch"].manual_seed(seed)


def remove_own_snapshots() -> list[str]:
    """Remove this live process's in-memory snapshot folders (`rlhf_core.rank.snapshot`); returns them."""
    from rlhf_core.rank.snapshot import PREFIX, SHM_ROOT

    removed = []
    for root in {SHM_ROOT, tempfile.gettempdir()}:
        for path in glob.glob(os.path.join(root, f"{PREFIX}{os.getpid()}-*")):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def disarm_fault_hook() -> None:
    """Remove an action armed for this process (`armed-PID` in RLHF_FAULT_STATE, `rlhf_core.faults`)."""
    from rlhf_core.faults import STATE_ENV_VAR

    state_dir = os.environ.get(STATE_ENV_VAR)
    if state_dir:
        try:
            os.remove(os.path.join(state_dir, f"armed-{os.getpid()}"))
        except FileNotFoundError:
            pass


def forget_user_modules(baseline: ProcessBaseline) -> list[str]:
    """Drop from `sys.modules` the modules imported since `baseline` from outside the installed libraries and the
    standard library (a user's reward function, say): the next command imports them again, as edited. Returns them."""
    forgotten = [name for name, module in list(sys.modules.items())
                 if name not in baseline.modules and not _from_a_library(module)]
    for name in forgotten:
        del sys.modules[name]
    return forgotten


@functools.cache  # a retire asks for each of the ~2,300 modules torch, transformers and DeepSpeed bring
def _library_roots() -> tuple[str, ...]:
    """The folders of the standard library, the installed packages and rlhf_core, resolved."""
    paths = sysconfig.get_paths()
    roots = {paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib") if key in paths}
    roots.add(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # rlhf_core itself
    return tuple({os.path.realpath(root) + os.sep for root in roots})


def _from_a_library(module) -> bool:
    """Whether a module comes from the standard library, an installed package or rlhf_core (kept), or has no
    file at all (built in; kept)."""
    try:
        found = [getattr(module, "__file__", None), *list(getattr(module, "__path__", None) or [])]
    except Exception:  # noqa: BLE001 - a module with an odd __path__ (torch's class namespaces): no file of its own
        return True
    locations = [location for location in found if isinstance(location, str)]
    if not locations:
        return True
    return all(_resolved(location).startswith(_library_roots()) for location in locations)


def _resolved(location: str) -> str:
    """`os.path.realpath(location)`, its folder's resolution shared by the folder's modules (a folder's links are
    resolved once per process, not once per module: a retire asks for ~2,300 of them)."""
    if os.path.islink(location):
        return os.path.realpath(location)
    return os.path.join(_resolved_folder(os.path.dirname(location)), os.path.basename(location))


@functools.lru_cache(maxsize=4096)
def _resolved_folder(folder: str) -> str:
    return os.path.realpath(folder)


OWNER_POLL_S = 2.0  # how often a rank outliving its command looks at its command's job, or its idle time
# How long a rank whose command died mid-run may take to finish its step, with the other ranks, and reset: this, or
# ORPHAN_STEPS times its slowest step when longer. Past it (a rank stuck in a step, a collective whose peer is gone)
# it ends.
ORPHAN_RETIRE_S = 10.0
ORPHAN_STEPS = 3


class OutlivesItsCommand:
    """The part of a rank actor (`TrainWorker`) that outlives its command on a running cluster: a detached actor is
    not ended by Ray with its driver, so while in use it notices within OWNER_POLL_S that its command's job is dead
    (a killed or stopped driver) and becomes a spare for the command that comes next (the flow run started again),
    or ends when it cannot be one; while a spare it ends once it has waited `idle_s` unclaimed."""

    def _outlive_command(self, owner_job: str, idle_s: float) -> None:
        """`owner_job`: the hex id of the job using this process ("" for an actor Ray ends with its driver)."""
        self._reuse_lock = threading.Lock()
        self._owner_job, self._idle_s = owner_job, idle_s
        self._spare_since: float | None = None
        self._orphaned = False  # its command died while using it: it is on its way to being a spare
        if owner_job:
            threading.Thread(target=self._watch_owner, name="rlhf-spare-watch", daemon=True).start()
        self._baseline = ProcessBaseline.now()

    def _become_spare(self, zero_stage: int | None) -> str:
        """Reset this process for the next command; "" when it is now a spare, else why it cannot be one."""
        import gc

        gc.collect()  # the last command's models and optimizer
        reason = reset_for_reuse(self._baseline, zero_stage)
        if not reason:
            with self._reuse_lock:
                self._spare_since = time.monotonic()
        return reason

    @ray.method(concurrency_group="control")
    def claim(self, owner_job: str, idle_s: float, fault_hooks: dict[str, str] | None = None) -> bool:
        """Take this spare for the command of `owner_job` (whose --spare_idle_s is `idle_s`, whose test fault hooks
        are `fault_hooks`): True for the first caller only."""
        from rlhf_core.faults import take_fault_hooks

        with self._reuse_lock:
            if self._spare_since is None:
                return False
            self._spare_since, self._owner_job, self._idle_s, self._orphaned = None, owner_job, idle_s, False
            take_fault_hooks(fault_hooks or {})
            return True

    @ray.method(concurrency_group="control")
    def becoming_spare(self) -> bool:
        """Whether its command died or stopped while using it and it is resetting to be a spare (worth a claim's
        wait)."""
        return self._resetting()

    def _resetting(self) -> bool:
        with self._reuse_lock:
            return self._orphaned and self._spare_since is None

    @ray.method(concurrency_group="control")
    def spare_since(self) -> float | None:
        """Seconds this process has waited as a spare, or None when in use."""
        with self._reuse_lock:
            return None if self._spare_since is None else time.monotonic() - self._spare_since

    def _watch_owner(self) -> None:
        while True:
            time.sleep(OWNER_POLL_S)
            with self._reuse_lock:
                idle_since, owner = self._spare_since, self._owner_job
            if idle_since is not None and time.monotonic() - idle_since > self._idle_s:
                self._end_self()
            if idle_since is None and not self._resetting() and not job_alive(owner):
                self._retire_orphaned()

    @ray.method(concurrency_group="control")
    def retire_after_stop(self) -> None:
        """Its command was stopped (the ranks stopped at a step they agreed on) and is ending: reset as its ranks'
        command would at a clean end, once the work in progress is done, without the command waiting for it."""
        threading.Thread(target=self._retire_orphaned, name="rlhf-retire-after-stop", daemon=True).start()

    def _retire_orphaned(self) -> None:
        """This process's command died while using it: its step loop stops at the next step every rank agrees on
        (they all notice), then it resets as after a clean end (`retire_orphan`, queued behind the work in
        progress), and waits as a spare; it ends when that is refused or takes too long (ORPHAN_RETIRE_S). Not bounded
        to one spare per CPU of the node here: the next command's clean end applies that."""
        with self._reuse_lock:
            self._orphaned = True
            # this thread waits for the reset: it is no command's thread left running
            self._baseline = dataclasses.replace(self._baseline,
                                                 threads=self._baseline.threads | {threading.get_ident()})
        wait_s = max(ORPHAN_RETIRE_S, ORPHAN_STEPS * self._stop_for_reset() + THREAD_END_WAIT_S)
        try:
            refused = ray.get(ray.get_runtime_context().current_actor.retire_orphan.remote(), timeout=wait_s)
        except Exception as error:  # noqa: BLE001 - stuck, or its reset failed: the process ends as before
            refused = f"{type(error).__name__}: {error}"
        if refused:
            self._end_self()

    def _stop_for_reset(self) -> float:
        """Ask the work in progress to stop at its next safe point; returns the seconds one piece of it has taken
        at most (the rank class says how: `TrainWorker` stops after its step)."""
        return 0.0

    @staticmethod
    def _end_self() -> None:
        try:
            ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
            time.sleep(OWNER_POLL_S * 5)  # Ray ends the process meanwhile
        finally:
            os._exit(0)


def job_alive(job_hex: str) -> bool:
    """Whether the Ray job `job_hex` is still running (its driver alive); True when Ray cannot tell."""
    try:
        from ray._private.state import jobs  # the GCS job table; no public API without the dashboard

        return not any(job["JobID"] == job_hex and job["IsDead"] for job in jobs())
    except Exception:  # noqa: BLE001 - an unreachable GCS ends the workers by itself
        return True
