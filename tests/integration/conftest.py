"""Fixtures for integration tests: background processes that never outlive a test, and a real Prefect server.

- `background`: start long-running commands (workers, servers, moto...), each in a session of its
  own and logging to a file under tmp_path/logs. At teardown each is stopped together with
  everything it started (also what moved to new sessions, e.g. flow runs and their Ray cluster),
  and when the test failed their log tails are printed.
- `prefect_server`: `prefect server start` on a free loopback port with a private PREFECT_HOME,
  shared by the tests of one module. It yields a `PrefectServer` with `api_url`, `env` (the
  environment any `prefect` / `rlhf` subprocess must get to talk to this server), `home` (its log
  is home/server.log) and `cli(...)`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

import pytest
from safetensors.torch import load_file

PROJECT_DIR = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
PREFECT = str(VENV_BIN / "prefect")
SERVER_STARTUP_TIMEOUT = 60.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def tail(path: Path, chars: int = 6000) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return f"(no log at {path})"
    return text[-chars:]


@dataclass
class BackgroundProcess:
    """A command running in a session of its own (start_new_session), stdout+stderr to `log_path`."""

    name: str
    args: list[str]
    log_path: Path
    popen: subprocess.Popen

    @classmethod
    def start(cls, name: str, args: Sequence[str], env: dict[str, str], log_path: Path,
              cwd: str | Path | None = None) -> "BackgroundProcess":
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            popen = subprocess.Popen(list(args), env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        return cls(name, list(args), log_path, popen)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, chars: int = 6000) -> str:
        return tail(self.log_path, chars)

    def stop(self, grace: float = 10.0) -> None:
        """Stop the process and everything it started, whatever session those moved to.

        SIGTERM to the process group, up to `grace` s to exit, then SIGKILL to every process left in
        the sessions of the process tree. Sessions, not only the group: the Prefect worker runs each
        flow run in a new session, and the Ray cluster that the flow run starts lives in that one.
        """
        table = _processes()
        sessions = {self.popen.pid} | {table[pid][2] for pid in _descendants(self.popen.pid, table)}
        _signal_group(self.popen.pid, signal.SIGTERM)
        try:
            self.popen.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            left = [pid for pid, (_, _, sid) in _processes().items() if sid in sessions]
            if not left:
                break
            for pid in left:
                _kill(pid, signal.SIGKILL)
            time.sleep(0.2)
        _signal_group(self.popen.pid, signal.SIGKILL)
        if self.popen.poll() is None:
            self.popen.wait(timeout=10)


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _stat(pid: int) -> tuple[int, int, int] | None:
    """(ppid, pgid, sid) of a live, non-zombie process from /proc (Linux); None if gone or unknown."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[-1].split()  # after "pid (comm)": state ppid pgrp session ...
    if len(fields) < 4 or fields[0] in ("Z", "X"):
        return None
    return int(fields[1]), int(fields[2]), int(fields[3])


def _processes() -> dict[int, tuple[int, int, int]]:
    """Every live process: pid -> (ppid, pgid, sid). Empty where /proc is missing."""
    table = {}
    for entry in Path("/proc").glob("[0-9]*"):
        info = _stat(int(entry.name))
        if info is not None:
            table[int(entry.name)] = info
    return table


def _descendants(root: int, table: dict[int, tuple[int, int, int]]) -> list[int]:
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, stack = [], [root]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def sigkill_tree(root_pid: int) -> list[int]:
    """SIGKILL `root_pid` and every process in the sessions of its process tree (the worker runs each flow
    run in a session of its own, and a Ray cluster that run started lives there), at once: no process gets
    a chance to report anything. Returns the pids killed."""
    table = _processes()
    sessions = {root_pid} | {table[pid][2] for pid in _descendants(root_pid, table)}
    killed: set[int] = set()
    for _ in range(50):
        left = [pid for pid, (_, _, sid) in _processes().items() if sid in sessions or pid == root_pid]
        if not left:
            return sorted(killed)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.2)
    raise AssertionError(f"processes of sessions {sorted(sessions)} survived SIGKILL")



def flow_run_process(worker_pid: int | None, flow_run_id: str):
    """The process running `flow_run_id` (its environment names the run): the worker's child or, when the worker
    died and the run lives on (flows/orphans.py) or `worker_pid` is None, the topmost such process on the machine;
    None when there is none."""
    import psutil

    def runs_it(process) -> bool:
        try:
            return process.environ().get("PREFECT__FLOW_RUN_ID") == flow_run_id
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            return False

    try:
        candidates = psutil.Process(worker_pid).children(recursive=True) if worker_pid else []
    except psutil.NoSuchProcess:
        candidates = []
    found = [process for process in candidates if runs_it(process)]
    if not found:
        found = [process for process in psutil.process_iter() if runs_it(process)]
    pids = {process.pid for process in found}
    return next((process for process in found if process.ppid() not in pids), None)


def engine_process(worker_pid: int | None, flow_run_id: str):
    """The process running the flow itself (`python -m prefect.engine`, under the worker's supervisor
    flows/supervise.py): the one the OOM killer would pick. None when there is none."""
    import psutil

    top = flow_run_process(worker_pid, flow_run_id)
    if top is None:
        return None
    with contextlib.suppress(psutil.NoSuchProcess):
        for process in [top, *top.children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                if "prefect.engine" in process.cmdline():
                    return process
    return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Keep each phase's report on the item (item.rep_setup, rep_call) so fixtures can see failures."""
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)


def _test_failed(request: pytest.FixtureRequest) -> bool:
    return any(getattr(getattr(request.node, f"rep_{when}", None), "failed", False) for when in ("setup", "call"))


@pytest.fixture
def background(request, tmp_path) -> Iterator[Callable[..., BackgroundProcess]]:
    """Start background processes: `background(name, args, env, cwd=None)`; all stopped at teardown."""
    started: list[BackgroundProcess] = []

    def start(name: str, args: Sequence[str], env: dict[str, str], cwd: str | Path | None = None) -> BackgroundProcess:
        process = BackgroundProcess.start(name, args, env, tmp_path / "logs" / f"{name}.log", cwd=cwd)
        started.append(process)
        return process

    yield start
    failed = _test_failed(request)
    for process in reversed(started):  # the last started (e.g. a worker) first: it may talk to the others
        process.stop()
        if failed:
            print(f"\n===== {process.name} (pid {process.pid}, rc {process.popen.returncode}): "
                  f"{' '.join(process.args)}\n{process.log_tail()}")


def _healthy(api_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{api_url}/health", timeout=2) as response:
            return response.status == 200 and json.loads(response.read() or b"null") is True
    except (OSError, urllib.error.URLError, ValueError):
        return False


@dataclass
class PrefectServer:
    """A running Prefect server and the environment that points subprocesses at it."""

    api_url: str
    env: dict[str, str]
    home: Path
    process: BackgroundProcess = field(repr=False)

    def cli(self, *args: str, cwd: str | Path | None = None, timeout: float = 180,
            env: dict[str, str] | None = None, check: bool = True) -> subprocess.CompletedProcess:
        """Run `prefect ARGS...` against this server; with `check`, fail the test on a non-zero exit."""
        result = subprocess.run([PREFECT, *args], env={**self.env, **(env or {})}, cwd=cwd, capture_output=True,
                                text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        if check and result.returncode != 0:
            pytest.fail(f"`prefect {' '.join(args)}` exited {result.returncode}\n"
                        f"--- stdout\n{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-4000:]}")
        return result


def prefect_env(home: Path, api_url: str | None) -> dict[str, str]:
    """os.environ without any outside Prefect/Ray target, plus a private PREFECT_HOME and `api_url`."""
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("PREFECT_", "RLHF_FAULT")) and key != "RAY_ADDRESS"}
    env.update(
        PREFECT_HOME=str(home),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_UI_ENABLED="false",
        PYTHONUNBUFFERED="1",
    )
    # PATH is left as is, on purpose: the venv's ninja (1.13) and the system's (1.11) hash commands
    # differently, so switching between them makes DeepSpeed rebuild its JIT op (~45 s) every time.
    if api_url:
        env["PREFECT_API_URL"] = api_url
    return env


@contextmanager
def running_prefect_server(home: Path) -> Iterator[PrefectServer]:
    """`prefect server start` on a free loopback port with `home` as its PREFECT_HOME, until the block ends."""
    port = free_port()
    api_url = f"http://127.0.0.1:{port}/api"
    env = prefect_env(home, api_url)
    process = BackgroundProcess.start(
        "prefect-server", [PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env, home / "server.log",
    )
    try:
        deadline = time.monotonic() + SERVER_STARTUP_TIMEOUT
        while not _healthy(api_url):
            if not process.alive():
                pytest.fail(f"the Prefect server exited (rc {process.popen.returncode}):\n{process.log_tail()}")
            if time.monotonic() > deadline:
                pytest.fail(f"the Prefect server was not healthy within {SERVER_STARTUP_TIMEOUT:.0f} s:\n"
                            f"{process.log_tail()}")
            time.sleep(0.5)
        yield PrefectServer(api_url=api_url, env=env, home=home, process=process)
    finally:
        process.stop()


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory) -> Iterator[PrefectServer]:
    """A Prefect server of the module's own: for modules that install automations or work pools, or read runs."""
    with running_prefect_server(tmp_path_factory.mktemp("prefect-home")) as server:
        yield server


@pytest.fixture(scope="session")
def worker_prefect_server(tmp_path_factory) -> Iterator[PrefectServer]:
    """One Prefect server per pytest process, behind `rlhf_env`."""
    with running_prefect_server(tmp_path_factory.mktemp("worker-prefect-home")) as server:
        yield server


@pytest.fixture(scope="session")
def worker_ray_head(ephemeral_rlhf_env, tmp_path_factory) -> Iterator[str]:
    """One Ray head per pytest process (2 CPUs, as the local cluster a bare `ray.init()` starts here), behind
    `rlhf_env`: its address."""
    with ray_head(ephemeral_rlhf_env, tmp_path_factory.mktemp("worker-ray") / "head.log") as address:
        yield address


@pytest.fixture(scope="session")
def worker_rlhf_env(ephemeral_rlhf_env, worker_prefect_server, worker_ray_head) -> dict[str, str]:
    """Environment for `rlhf` subprocesses: this worker's Prefect server and Ray head, as a user's commands find
    theirs (PREFECT_API_URL, RAY_ADDRESS). Each `rlhf` command otherwise starts Prefect's ephemeral server and a
    local Ray: a toy SFT took 31-40 CPU-s on the ephemeral server, 21-29 with a running one, and a local Ray's
    start and stop costs another ~6 CPU-s (the suite is bound by CPU on 2 cores)."""
    return {**ephemeral_rlhf_env, "PREFECT_API_URL": worker_prefect_server.api_url, "RAY_ADDRESS": worker_ray_head}


def on_local_ray(env: dict[str, str]) -> dict[str, str]:
    """`env` without RAY_ADDRESS: the command starts a local Ray, whose ranks inherit the command's environment.
    For a test that gives its ranks HF_HOME or PYTHONPATH: a running cluster's workers have the cluster's
    environment, not the driver's (a real cluster's nodes have their own HF cache and code)."""
    return {key: value for key, value in env.items() if key != "RAY_ADDRESS"}


@pytest.fixture(scope="session")
def rlhf_env(worker_rlhf_env) -> dict[str, str]:
    """The tests' `rlhf` environment: `worker_rlhf_env`. Modules that test the ephemeral path itself (stop
    signals, the console, the kill-and-resume) override it with `ephemeral_rlhf_env`."""
    return worker_rlhf_env


def kill_once_committed(command: list[str], env: dict[str, str], paused_step: int, faults_dir: Path,
                        manifest: Path, cwd: Path | None = None) -> None:
    """Run `command` with step `paused_step` paused (the ranks train it while the step before commits in the
    background), and SIGKILL its whole session once `manifest` exists: a mid-chunk kill one commit behind."""
    faults_dir.mkdir(exist_ok=True)
    point = f"train_step@{paused_step}"
    log_path = faults_dir.with_name(faults_dir.name + "-job.log")  # what the job printed, for a failure message
    with open(log_path, "wb") as log:
        paused = subprocess.Popen(command, env={**env, "RLHF_FAULT_INJECT": f"{point}=sleep:600",
                                                "RLHF_FAULT_STATE": str(faults_dir)},
                                  stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=cwd)
    try:
        deadline = time.monotonic() + 500  # a hang guard, not a speed check
        while not manifest.exists() or not (faults_dir / point).exists():
            assert paused.poll() is None, (f"the job ended (rc {paused.returncode}) before {manifest} appeared; "
                                           f"it printed:\n{log_path.read_text(errors='replace')[-4000:]}")
            assert time.monotonic() < deadline, f"{manifest} did not appear while {point} was paused"
            time.sleep(0.2)
    finally:
        try:
            os.killpg(paused.pid, signal.SIGKILL)
        except ProcessLookupError:  # the job ended by itself and took its session with it
            pass
        paused.wait()


def fault_driver_job(run, env: dict[str, str], timeout: float = 900) -> subprocess.CompletedProcess:
    """`run` (a RunConfig) trained and exported by tests/integration/fault_driver.py in a process of its own."""
    return subprocess.run([sys.executable, "-m", "tests.integration.fault_driver", run.model_dump_json()], env=env,
                          capture_output=True, text=True, timeout=timeout, cwd=PROJECT_DIR, check=False)


def finished_copy(killed, root: Path, num_workers: int, env: dict[str, str]):
    """A killed one-stage run's checkpoints copied under `root` and finished there on `num_workers` ranks."""
    (stage,) = killed.stages
    shutil.copytree(Path(killed.ckpt_path), root / "ckpt")
    settings = killed.stage_config(stage).model_copy(update={"save_path": str(root / "out")})
    run = killed.model_copy(update={"ckpt_path": str(root / "ckpt"), "num_workers": num_workers, stage: settings})
    done = fault_driver_job(run, env)
    assert done.returncode == 0, done.stderr[-3000:]
    return run


def kill_fault_driver_once_committed(run_json: str, env: dict[str, str], paused_step: int, faults_dir: Path,
                                     committed_step_dir: Path) -> None:
    """`kill_once_committed` for tests.integration.fault_driver running `run_json` (its pause is no hang)."""
    run_json = json.dumps({**json.loads(run_json), "hang_timeout_s": PAUSE_IS_NO_HANG_S})
    kill_once_committed([sys.executable, "-m", "tests.integration.fault_driver", run_json], env, paused_step,
                        faults_dir, committed_step_dir / "MANIFEST.json", cwd=PROJECT_DIR)


@contextmanager
def ray_head(env: dict[str, str], log_path: Path) -> Iterator[str]:
    """`ray start --head` on a free loopback port (2 CPUs, no dashboard) in a temp dir of its own, so it never
    becomes the machine's default cluster; yields its address once it is up. Stopped by SIGKILL
    after a grace period: after SIGTERM its gcs_server and raylet stay alive."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    temp_dir = tempfile.mkdtemp(prefix="rlhf-ray-")  # short: Ray's socket paths live under it
    env = {**env, "RAY_AUTH_MODE": "disabled"}  # `ray start` turns token auth on by default
    head = BackgroundProcess.start("ray-head", [str(VENV_BIN / "ray"), "start", "--head", "--block", f"--port={port}",
                                                "--num-cpus=2", "--include-dashboard=false", "--disable-usage-stats",
                                                f"--temp-dir={temp_dir}"], env, log_path)
    try:
        deadline = time.monotonic() + 120
        # `ray start` says so once its head answers; each `ray status` to ask would cost ~1.5 CPU-s.
        while "Ray runtime started." not in head.log_tail():
            assert head.alive() and time.monotonic() < deadline, f"the Ray head did not start:\n{head.log_tail()}"
            time.sleep(0.2)
        yield address
    finally:
        head.stop(grace=3)
        shutil.rmtree(temp_dir, ignore_errors=True)


# --hang_timeout_s of a run a test pauses on purpose (`sleep:600` at a fault point, then a kill): not a hang.
PAUSE_IS_NO_HANG_S = 3600
PAUSED_ON_PURPOSE = ["--hang_timeout_s", str(PAUSE_IS_NO_HANG_S)]


NO_SNAPSHOTS = ["--snapshot_steps", "-1"]  # a reference run: no snapshots between commits (rlhf_core.rank.interim)

# Fault rules: the ranks enter step 6 only once the driver has committed step 5. Ranks train ahead of a commit, so
# a fault at step 8 could otherwise land while step 5 is still being written (on a loaded machine) and the ranks go
# back to step 4's snapshot, the newest below that chunk's target, instead of step 7's.
AFTER_THE_STEP_5_COMMIT = "after_commit@5=sleep:0,train_step@6=after:after_commit@5"


def train_sft_args(toy: dict[str, str], ckpt: Path, out: Path) -> list[str]:
    """The SFT command of the README, as an OpenRLHF user would type it."""
    return [
        "train", "sft", "--pretrain", toy["model"], "--dataset", toy["sft"],
        "--input_key", "prompt", "--output_key", "response", "--input_template", "{}", "--max_len", "128",
        "--train_batch_size", "8", "--micro_train_batch_size", "4", "--max_epochs", "1",
        "--learning_rate", "1e-3", "--save_steps", "5", "--ckpt_path", str(ckpt), "--max_ckpt_num", "3",
        "--save_path", str(out), "--seed", "42", "--load_checkpoint",
    ]


@pytest.fixture(scope="session")
def reference_sft_weights(toy_assets, worker_rlhf_env, tmp_path_factory) -> dict:
    """The final weights of `train_sft_args` run once, never interrupted (one rank): what every kill
    test of that run must end with. Once per pytest run, not once per xdist worker: the first worker to need it
    trains it under a lock in the folder the workers share, and the others read its file (the toy is the same
    bytes on every worker)."""
    from filelock import FileLock

    from tests.conftest import WORKER, run_rlhf

    shared = tmp_path_factory.getbasetemp()
    if WORKER != "main":
        shared = shared.parent  # pytest-N/, above each worker's popen-gwK/
    out = shared / "reference-sft"
    weights = out / "model" / "model.safetensors"
    with FileLock(str(shared / "reference-sft.lock")):
        if not weights.exists():
            shutil.rmtree(out, ignore_errors=True)  # a try that failed before the weights were written
            # No snapshots between commits here (every other run takes them): each test that compares with it
            # also shows they change no bit of the weights.
            reference = run_rlhf(train_sft_args(toy_assets, out / "ckpt", out / "model") + NO_SNAPSHOTS,
                                 worker_rlhf_env)
            assert reference.returncode == 0, reference.stderr[-3000:]
    return load_file(str(weights))
