"""The soak's set-up, all real and all on this machine: a Prefect server with deployments/automations.yaml
(by deployments/create_automations.py), `rlhf/full` deployed from prefect.yaml, a process worker under a
supervisor that starts it again a second after it dies (systemd's Restart=always), a Ray cluster of a head and
2 worker nodes, S3 on loopback (moto) and the power-cut filesystem (tests/powercut_fs.py) for checkpoints.

The soak touches Prefect only through `submit` (counted in `api_changes`, the soak's tally of calls that change a
run) and by reading: states, the run's process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Callable

from tests.conftest import make_bucket, s3_environment
from tests.integration.conftest import (PREFECT, PROJECT_DIR, BackgroundProcess, free_port, running_prefect_server,
                                        engine_process, flow_run_process, sigkill_tree)
from tests.integration.ray_cluster import RayCluster, active_nodes
from tests.powercut_fs import PowerCutMount
from tests.soak.observe import LogLine, Trace

CREATE_AUTOMATIONS = PROJECT_DIR / "deployments" / "create_automations.py"
DEPLOYMENT = "rlhf/full"
RESTART_SEC = 1.0  # systemd's RestartSec for the worker's unit
BUCKET = "soak"


class Supervisor:
    """The Prefect worker, started again RESTART_SEC after it exits, until `stop` (or while `held`)."""

    def __init__(self, args: list[str], env: dict[str, str], log_path: Path, cwd: Path):
        self.args, self.env, self.log_path, self.cwd = args, env, log_path, cwd
        self.restarts: list[float] = []  # time.time() of each start after the first
        self.held = threading.Event()
        self._stopping = threading.Event()
        self.process = BackgroundProcess.start("prefect-worker", args, env, log_path, cwd=cwd)
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stopping.wait(0.2):
            if self.held.is_set() or self.process.alive():
                continue
            time.sleep(RESTART_SEC)
            if not (self._stopping.is_set() or self.held.is_set()):
                self.process = BackgroundProcess.start("prefect-worker", self.args, self.env, self.log_path,
                                                       cwd=self.cwd)
                self.restarts.append(time.time())

    def kill(self) -> int:
        pid = self.process.pid
        os.kill(pid, signal.SIGKILL)
        return pid

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join()
        self.process.stop()


class MotoStore:
    """S3 on loopback that can go away and come back on the same port with its buckets (moto keeps them in this
    process)."""

    def __init__(self):
        import logging

        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # a line per request otherwise

        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        # for the soak's own reads (its environment is not the runs'): tests.conftest.s3_environment's values
        self.storage_options = {"key": "testing", "secret": "testing-secret",
                                "client_kwargs": {"endpoint_url": self.endpoint, "region_name": "us-east-1"}}
        self._server_class = ThreadedMotoServer
        self._server = None
        self.start()

    def start(self) -> None:
        self._server = self._server_class(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None


class SoakSite:
    """Everything the soak's runs need, started in `__enter__` and stopped in `__exit__`."""

    def __init__(self, workdir: Path, time_scale: float = 1.0, with_power_cut: bool = True):
        self.workdir, self.time_scale, self.with_power_cut = workdir, time_scale, with_power_cut
        self.trace_path = workdir / "trace.txt"
        self.trace = Trace(self.trace_path)
        self.fault_state = workdir / "faults"  # RLHF_FAULT_STATE: where the soak arms a rank's fault action
        self.cleanups: list[Callable[[], None]] = []
        self.api_changes: list[str] = []  # every call this harness made that changes a flow run
        self.flow_run_id = ""
        self._stack = ExitStack()
        self._timers: list[threading.Timer] = []
        self.store: MotoStore | None = None
        self.mount: PowerCutMount | None = None
        self._client = None

    def __enter__(self) -> SoakSite:
        from rlhf_core.toy import init_toy

        try:
            self.toy = init_toy(str(self.workdir / "toy"))
            self.server = self._stack.enter_context(running_prefect_server(self.workdir / "prefect"))
            subprocess.run([sys.executable, str(CREATE_AUTOMATIONS), "--api-url", self.server.api_url],
                           env=self.server.env, check=True, capture_output=True, timeout=120)
            pool = "rlhf-local"
            self.server.cli("work-pool", "create", pool, "--type", "process")
            self.server.cli("--no-prompt", "deploy", "--name", "full", cwd=PROJECT_DIR,
                            env={"PWD": str(PROJECT_DIR)})
            self.store = MotoStore()
            self._stack.callback(self.store.stop)
            make_bucket(self.store.endpoint, BUCKET)
            if self.with_power_cut:
                self.mount = PowerCutMount(self.workdir / "disk-backing", self.workdir / "disk",
                                           self.workdir / "powercut.log")
                self._stack.enter_context(self.mount)
            env = {**{k: v for k, v in self.server.env.items() if k != "RAY_ADDRESS"},
                   **s3_environment(self.store.endpoint), "RAY_AUTH_MODE": "disabled"}
            self.cluster = RayCluster.start(env, self.workdir / "logs", num_worker_nodes=2, cpus_per_worker=1)
            self._stack.callback(self.cluster.stop)
            (self.workdir / "worker").mkdir(exist_ok=True)
            self.fault_state.mkdir(exist_ok=True)
            worker_env = {**env, "PREFECT_WORKER_QUERY_SECONDS": "2", "RAY_ADDRESS": self.cluster.gcs_address,
                          "RLHF_FAULT_TRACE": str(self.trace_path), "RLHF_FAULT_STATE": str(self.fault_state)}
            # deployments/local_worker.sh's last two lines, as a supervisor runs them: the sweep, then the worker
            start_worker = (f'cd "{PROJECT_DIR}" && "{sys.executable}" -m flows.orphans --pool "{pool}"; '
                            f'cd "{self.workdir / "worker"}" && exec "{PREFECT}" worker start --pool "{pool}"')
            self.worker = Supervisor(["bash", "-c", start_worker], worker_env,
                                     self.workdir / "logs" / "prefect-worker.log", self.workdir / "worker")
            self._stack.callback(self.worker.stop)
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        for timer in self._timers:
            timer.cancel()
        for cleanup in self.cleanups:
            cleanup()
        self._kill_flow_run()  # the worker's stop ends its children, not a run that outlived an earlier worker
        self._stack.close()

    def _kill_flow_run(self) -> None:
        process = flow_run_process(None, self.flow_run_id) if self.flow_run_id else None
        if process is not None:
            sigkill_tree(process.pid)

    def pending(self) -> bool:
        """Whether something a fault took away (a node, the store) is still to come back."""
        return any(timer.is_alive() for timer in self._timers)

    def later(self, delay_s: float, action: Callable[[], None]) -> None:
        timer = threading.Timer(delay_s, action)
        timer.daemon = True
        self._timers.append(timer)
        timer.start()

    # ------------------------------------------------------------------------------------------------- runs
    def submit(self, config: dict) -> str:
        """A new flow run of the deployment with `config`: the only call the soak makes that changes a run."""
        client = self.client()
        deployment = client.read_deployment_by_name(DEPLOYMENT)
        flow_run = client.create_flow_run_from_deployment(deployment.id, parameters={"config": config})
        self.api_changes.append(f"create_flow_run_from_deployment {flow_run.id}")
        self.flow_run_id = str(flow_run.id)
        return self.flow_run_id

    def client(self):
        """One client for the soak's calls, kept open: a client per call costs a version check and a connection,
        at nice 0 beside ranks at Ray's nice 15, several times a second."""
        if self._client is None:
            from prefect.client.orchestration import SyncPrefectClient

            self._client = self._stack.enter_context(SyncPrefectClient(self.server.api_url))
        return self._client

    def flow_run(self):
        return self.client().read_flow_run(self.flow_run_id)

    def states(self) -> list[tuple[float, str, str]]:
        states = self.client().read_flow_run_states(self.flow_run_id)
        return sorted((state.timestamp.timestamp(), state.type.value, state.name) for state in states)

    def run_logs(self) -> list[LogLine]:
        """The run's log records at INFO and above as Prefect's server has them (the flow run's and its stage
        subflows'): off the machine, so a power cut loses none that were sent."""
        import logging

        from prefect.client.schemas.filters import FlowRunFilter, LogFilter
        from prefect.client.schemas.sorting import LogSort

        client = self.client()
        children = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(parent_flow_run_id={"any_": [self.flow_run_id]}))
        log_filter = LogFilter(flow_run_id={"any_": [self.flow_run_id, *(str(run.id) for run in children)]},
                               level={"ge_": logging.INFO})
        records, page = [], 200
        while batch := client.read_logs(log_filter, limit=page, offset=len(records), sort=LogSort.TIMESTAMP_ASC):
            records += batch
            if len(batch) < page:
                break
        return [LogLine(record.timestamp.timestamp(), logging.getLevelName(record.level), record.message)
                for record in records]

    def flow_run_process(self, engine: bool = False):
        """The process running the current flow run (the worker's child, or an orphan once its worker died), or
        with `engine` the engine under it; NotNow if there is none."""
        from tests.soak.kinds import NotNow

        find = engine_process if engine else flow_run_process
        process = find(self.worker.process.pid, self.flow_run_id)
        if process is None:
            raise NotNow("no flow-run process")
        return process

    # ---------------------------------------------------------------------------------------------- power
    def power_cut(self) -> str:
        """The machine loses power: every process on it dies at once (the worker, its flow run, both Ray
        worker nodes; the server and the Ray head stand for other machines), the checkpoint disk keeps only
        what was durable, then the nodes and the worker start again."""
        assert self.mount is not None
        self.worker.held.set()
        sigkill_tree(self.worker.process.pid)
        self._kill_flow_run()  # one that outlived an earlier worker is not in the worker's tree
        for node in self.cluster.workers:
            if node.alive():
                node.kill()
        self.mount.cut()
        for node in self.cluster.workers:
            node.start(self.cluster.log_dir)
        num_nodes = len(self.cluster.workers) + 1
        self.cluster.wait_for(lambda status: len(active_nodes(status)) == num_nodes, "the nodes back after a cut")
        self.worker.held.clear()
        return f"{len(self.cluster.workers)} nodes and the worker restarted"
