"""DeepSpeed ranks as a Ray actor group.

`WorkerGroup` starts `num_workers` `TrainWorker` actors, joins them in one torch.distributed group
(gloo on CPU, nccl on GPU), and drives a stage trainer inside each. The group outlives a chunk: the
next chunk reuses it warm when it already holds the state the store would give it.

Every rank must run on the driver's host: ranks save into and load from folders on the driver's
disk, which the driver uploads and downloads. A group placed across hosts is refused; per-rank
uploads (multi-node) are not built yet.

A UserError raised inside a rank (a bad dataset, reward function, flag) reaches the driver as that
same UserError with its one-sentence message, not as Ray's RayTaskError with a remote traceback.
The DeepSpeed config lives in `rlhf_core.ds_config`, which the ranks import without this module.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import warnings

import ray

from rlhf_core.config import RunConfig
from rlhf_core.errors import UserError


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


class TrainWorker:
    """One DeepSpeed rank. Runs inside a Ray actor; hosts the trainer of one stage."""

    def __init__(self, rank: int, world_size: int, num_threads: int):
        import torch

        self.rank, self.world_size = rank, world_size
        torch.set_num_threads(num_threads)
        self.trainer = None

    def hostname(self) -> str:
        return socket.gethostname()

    def rendezvous_address(self) -> tuple[str, int]:
        return ray.util.get_node_ip_address(), _free_port()

    def join(self, master_addr: str, master_port: int) -> None:
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(self.rank),
                          WORLD_SIZE=str(self.world_size), LOCAL_RANK="0")
        # DeepSpeed JIT-builds an op with whichever `ninja` is first on PATH; two ninjas (system and
        # venv) record builds differently and force a rebuild each time they alternate.
        os.environ["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
        import deepspeed
        from deepspeed.utils import logger as deepspeed_logger

        deepspeed_logger.setLevel(logging.WARNING)
        # ZeRO-3 on torch >= 2.13 calls a collective torch deprecated, once per step and rank.
        warnings.filterwarnings("ignore", message=r".*reduce_scatter_tensor.* is deprecated")
        deepspeed.init_distributed()

    def setup(self, run: RunConfig, stage: str, total_steps: int, load_universal: bool) -> None:
        from rlhf_core.trainers import trainer_class

        self.trainer = trainer_class(stage)(run, total_steps, self.rank, self.world_size, load_universal)

    def load(self, directory: str, universal: bool, weights_only: bool) -> int:
        return self.trainer.load(directory, universal, weights_only)

    def train_until(self, target_step: int) -> list[dict[str, float]]:
        from rlhf_core.faults import fault_point

        metrics = []
        while self.trainer.step < target_step:
            fault_point("train_step", self.trainer.step + 1)
            metrics.append(self.trainer.train_step())
        return metrics

    def save(self, directory: str) -> None:
        self.trainer.save(directory)


class WorkerGroup:
    """`num_workers` TrainWorker actors acting as one data-parallel DeepSpeed job."""

    def __init__(self, num_workers: int, ray_address: str | None = None):
        ensure_ray(ray_address)
        cpus_per_worker = min(1.0, max(0.01, ray.available_resources().get("CPU", 1) / num_workers))
        gpus_per_worker = 1 if ray.cluster_resources().get("GPU", 0) >= num_workers else 0
        num_threads = max(1, (os.cpu_count() or 1) // num_workers)
        remote_worker = ray.remote(TrainWorker)
        # Workers of an existing cluster inherit its environment, not this process's: the test fault
        # hooks (RLHF_FAULT_*) must travel with the job.
        fault_hooks = {name: value for name, value in os.environ.items() if name.startswith("RLHF_FAULT_")}
        options = {"num_cpus": cpus_per_worker, "num_gpus": gpus_per_worker}
        if fault_hooks:
            options["runtime_env"] = {"env_vars": fault_hooks}
        self.workers = [remote_worker.options(**options).remote(rank, num_workers, num_threads)
                        for rank in range(num_workers)]
        try:
            require_driver_host(socket.gethostname(), gather([worker.hostname.remote() for worker in self.workers]))
        except UserError:
            self.shutdown()
            raise
        master_addr, master_port = gather(self.workers[0].rendezvous_address.remote())
        gather([worker.join.remote(master_addr, master_port) for worker in self.workers])
        self.step = 0

    def setup(self, run: RunConfig, stage: str, total_steps: int, load_universal: bool = False) -> None:
        gather([worker.setup.remote(run, stage, total_steps, load_universal) for worker in self.workers])

    def load(self, directory: str, universal: bool = False, weights_only: bool = False) -> None:
        steps = gather([worker.load.remote(directory, universal, weights_only) for worker in self.workers])
        self.step = steps[0]

    def train_until(self, target_step: int) -> list[dict[str, float]]:
        """Per-step metrics as seen by rank 0 (already averaged over ranks)."""
        metrics = gather([worker.train_until.remote(target_step) for worker in self.workers])[0]
        self.step = target_step
        return metrics

    def save(self, directory: str) -> None:
        gather([worker.save.remote(directory) for worker in self.workers])

    def shutdown(self) -> None:
        for worker in self.workers:
            ray.kill(worker)
        self.workers = []


def gather(refs):
    """`ray.get(refs)`, re-raising a rank's UserError as itself (Ray wraps it in a RayTaskError)."""
    try:
        return ray.get(refs)
    except ray.exceptions.RayTaskError as error:
        cause = getattr(error, "cause", None)
        if isinstance(cause, UserError):
            raise cause from None
        raise


def require_driver_host(driver_host: str, worker_hosts: list[str]) -> None:
    """Ranks save into, and load from, folders on the driver's disk: they must run on its host."""
    elsewhere = sorted(set(worker_hosts) - {driver_host})
    if elsewhere:
        raise UserError(
            f"--num_workers {len(worker_hosts)}: ranks were placed on {', '.join(elsewhere)}, but checkpoints are "
            f"staged on the driver's disk ({driver_host}), so every rank must run on the driver's host; run the "
            f"job on a node with enough CPUs/GPUs (multi-node groups are not supported yet)."
        )


def ensure_ray(ray_address: str | None) -> None:
    """Connect to `ray_address` (or RAY_ADDRESS), else start a local cluster, once per process."""
    if ray.is_initialized():
        return
    address = ray_address or os.environ.get("RAY_ADDRESS") or None
    ray.init(address=address, include_dashboard=False, log_to_driver=True, logging_level=logging.WARNING,
             configure_logging=True)
