"""A multi-node Ray cluster on one machine, for tests: a head and N `ray start --address` worker nodes.

Each node is its own `ray start --block` process in a session of its own, with a private `--temp-dir`
(Ray's sessions, sockets and logs) and a private TMPDIR (what `tempfile` gives the ranks it hosts),
so two ranks on two nodes can never share a staging folder by accident, as on two real hosts. The
head has no CPUs: ranks only ever land on worker nodes, and `kill_worker(i)` (SIGKILL to every
process of that node's session: the `ray start` process, its raylet and the actors it forked, which
Ray puts in process groups of their own) is the loss of one whole host.

The cluster is observed through the `ray status` CLI, not `ray.init`, so the test process never
joins (or starts) a Ray cluster itself.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.integration.conftest import VENV_BIN, BackgroundProcess, _processes, free_port

RAY = str(VENV_BIN / "ray")
STARTUP_TIMEOUT = 120.0


def active_nodes(status: str) -> list[str]:
    """The node ids listed as active by `ray status` (dead ones move to its failure list)."""
    section = status.split("Active:", 1)[-1].split("Pending:", 1)[0] if "Active:" in status else ""
    return re.findall(r"node_([0-9a-f]+)", section)


@dataclass
class RayNode:
    """One `ray start --block` process and the folders that are private to it."""

    name: str
    args: list[str]
    env: dict[str, str]
    temp_dir: Path  # Ray's --temp-dir: session logs (worker-*.out) live under it
    tmpdir: Path  # the node's TMPDIR: staging folders of the ranks it hosts
    process: BackgroundProcess | None = None

    def start(self, log_dir: Path) -> None:
        self.process = BackgroundProcess.start(self.name, self.args, self.env, log_dir / f"{self.name}.log")

    def alive(self) -> bool:
        return self.process is not None and self.process.alive()

    def kill(self) -> None:
        """SIGKILL the whole node at once: every process of its session (raylet, agents, actors)."""
        session = self.process.pid
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            left = [pid for pid, (_, _, sid) in _processes().items() if sid == session]
            if not left:
                break
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            time.sleep(0.1)
        self.process.popen.wait(timeout=10)

    def actor_logs(self, class_name: str) -> set[Path]:
        """The log files of every actor of `class_name` this node has hosted (Ray tags each worker's log
        with `:actor_name:CLASS` when the actor starts)."""
        tag = f":actor_name:{class_name}"
        return {path.resolve() for path in self.temp_dir.glob("session_*/logs/worker-*.out")  # and session_latest
                if tag in path.read_text(errors="replace")}


@dataclass
class RayCluster:
    """A started cluster: `gcs_address` (host:port) and `client_address` (ray://host:port)."""

    gcs_address: str
    client_address: str
    env: dict[str, str]
    head: RayNode
    workers: list[RayNode]
    log_dir: Path
    cpus_per_worker: int
    _dirs: list[Path] = field(default_factory=list)

    @classmethod
    def start(cls, env: dict[str, str], log_dir: Path, num_worker_nodes: int = 2,
              cpus_per_worker: int = 1) -> RayCluster:
        """Start the head, then the worker nodes; return once every worker node's CPUs are in the cluster."""
        env = {**{k: v for k, v in env.items() if k != "RAY_ADDRESS"}, "RAY_AUTH_MODE": "disabled"}
        port, client_port = free_port(), free_port()
        cluster = cls(f"127.0.0.1:{port}", f"ray://127.0.0.1:{client_port}", env, None, [], log_dir, cpus_per_worker)
        cluster.head = cluster._node("ray-head", [
            "--head", f"--port={port}", "--num-cpus=0", f"--ray-client-server-port={client_port}",
            "--include-dashboard=false", "--disable-usage-stats"])
        cluster.head.start(log_dir)
        try:
            cluster.wait_for(lambda status: "Active:" in status, "the head to start")
            for index in range(num_worker_nodes):
                worker = cluster._node(f"ray-worker-{index}", [
                    f"--address={cluster.gcs_address}", f"--num-cpus={cpus_per_worker}"])
                worker.start(log_dir)
                cluster.workers.append(worker)
            cluster.wait_for_cpus(num_worker_nodes * cpus_per_worker)
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def _node(self, name: str, args: list[str]) -> RayNode:
        # Short folders: Ray's unix socket paths live under --temp-dir and must stay under 108 bytes.
        temp_dir = Path(tempfile.mkdtemp(prefix=f"rlhf-{name}-"))
        tmpdir = temp_dir / "tmp"
        tmpdir.mkdir()
        self._dirs.append(temp_dir)
        return RayNode(name, [RAY, "start", "--block", f"--temp-dir={temp_dir}",
                              f"--dashboard-agent-listen-port={free_port()}", *args],
                       {**self.env, "TMPDIR": str(tmpdir)}, temp_dir, tmpdir)

    def status(self) -> str:
        result = subprocess.run([RAY, "status", f"--address={self.gcs_address}"], check=False, env=self.env,
                                capture_output=True, text=True, timeout=60)
        return result.stdout

    def total_cpus(self, status: str | None = None) -> float:
        """The CPUs of the cluster's live nodes, as `ray status` reports them (0 when it cannot tell)."""
        match = re.search(r"([\d.]+)/([\d.]+) CPU", status if status is not None else self.status())
        return float(match.group(2)) if match else 0.0

    def wait_for(self, ready, what: str, timeout: float = STARTUP_TIMEOUT) -> str:
        """Poll `ray status` until `ready(status_text)`; fail with every node's log tail if it never is."""
        deadline = time.monotonic() + timeout
        while True:
            status = self.status()
            if ready(status):
                return status
            dead = [node for node in (self.head, *self.workers) if node.process is not None and not node.alive()
                    and node.process.popen.returncode != -signal.SIGKILL]
            if dead or time.monotonic() > deadline:
                raise AssertionError(f"gave up waiting for {what}:\n{status}\n" + self.log_tails())
            time.sleep(1)

    def wait_for_cpus(self, num_cpus: float, timeout: float = STARTUP_TIMEOUT) -> None:
        self.wait_for(lambda status: self.total_cpus(status) == num_cpus, f"{num_cpus} CPUs in the cluster", timeout)

    def kill_worker(self, index: int) -> float:
        """Lose worker node `index` (SIGKILL). Returns time.monotonic() of the kill; does not wait for
        the cluster to notice (see `wait_for_cpus`)."""
        killed_at = time.monotonic()
        self.workers[index].kill()
        return killed_at

    def restart_worker(self, index: int, extra_env: dict[str, str] | None = None) -> None:
        """Bring worker node `index` back (a new node: new node id, same folders), killing it first if it
        is alive, with the environment it started with plus `extra_env` (what its actors inherit)."""
        worker = self.workers[index]
        if worker.alive():
            self.kill_worker(index)
        worker.env = {**self.env, "TMPDIR": str(worker.tmpdir), **(extra_env or {})}
        worker.start(self.log_dir)
        num_nodes, num_cpus = len(self.workers) + 1, len(self.workers) * self.cpus_per_worker
        self.wait_for(lambda status: len(active_nodes(status)) == num_nodes and self.total_cpus(status) == num_cpus,
                      f"{worker.name} back in the cluster")

    def actor_nodes(self, class_name: str, before: dict[str, set[Path]] | None = None) -> dict[str, int]:
        """Per worker node name: how many `class_name` actors it started (since the `before` snapshot)."""
        before = before or {}
        return {node.name: len(node.actor_logs(class_name) - before.get(node.name, set())) for node in self.workers}

    def actor_log_snapshot(self, class_name: str) -> dict[str, set[Path]]:
        return {node.name: node.actor_logs(class_name) for node in self.workers}

    def log_tails(self, chars: int = 3000) -> str:
        return "\n".join(f"===== {node.name} (rc {node.process.popen.returncode})\n{node.process.log_tail(chars)}"
                         for node in (self.head, *self.workers) if node.process is not None)

    def stop(self) -> None:
        """Worker nodes first, then the head (SIGKILL after a short grace: a `ray start` head ignores SIGTERM)."""
        for node in (*reversed(self.workers), self.head):
            if node is not None and node.process is not None:
                node.process.stop(grace=3)
        for directory in self._dirs:
            subprocess.run(["rm", "-rf", str(directory)], check=False)
