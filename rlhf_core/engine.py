"""DeepSpeed ranks as a Ray actor group, placed on any node of a Ray cluster.

`WorkerGroup(run)` reserves a Ray placement group (`--placement_strategy`, PACK by default) before
any actor starts, waits `--placement_timeout_s` for it, and starts one `TrainWorker` actor per
bundle. The ranks join one torch.distributed group (gloo on CPU, nccl on GPU) and each drives a stage
trainer. The group outlives a chunk: the next chunk reuses it warm when it already holds the state
the store would give it.

Checkpoint I/O is per rank and asynchronous: at a chunk boundary each rank snapshots its share into
memory on its own node (`rlhf_core.snapshot`), and its actor's second thread ("io") uploads those files
straight into the store's uncommitted step folder, hashing as it writes, while the first thread trains
the next chunk (`train_ahead`); the driver only writes the manifest (`rlhf_core.checkpoint`). On load each rank fetches and
verifies just the files it reads. So the driver can sit anywhere: on the head, in a `ray job`, or
off the cluster as a Ray client (`ray://`). A local --ckpt_path must be a folder every node sees;
a marker file checks that before any training.

When the cluster cannot place the group within the timeout (say a node was lost), `--allow_fewer_workers`
goes on with as many ranks as fit (and as the batch sizes allow); otherwise the placement fails with
one sentence naming what is missing. A rank whose node dies mid-chunk fails the chunk with a
`WorkerLost` naming the node, which Prefect retries.

A named failure raised inside a rank (`rlhf_core.errors`: a bad dataset, reward function or flag, a store
write that failed) reaches the driver as that same exception with its one-sentence message, not as Ray's
RayTaskError with a remote traceback.
The DeepSpeed config lives in `rlhf_core.ds_config`, which the ranks import without this module.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import secrets
import shutil
import socket
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlhf_core import stop
from rlhf_core.config import RunConfig
from rlhf_core.ds_config import resolve_zero_stage
from rlhf_core.errors import PlacementFailed, RLHFError, UserError, WorkerLost
from rlhf_core.goodput import writer_slowdown

logger = logging.getLogger(__name__)

# How long a smaller group (--allow_fewer_workers) may take to place once the full one has timed out.
SMALLER_GROUP_TIMEOUT_S = 10.0
# After a rank fails in a collective, how long to wait for Ray to say which peer was lost (it marks a node
# dead once it misses its heartbeats, ~5-10 s).
LOSS_DETECTION_TIMEOUT_S = 30.0
# How often a wait on the ranks looks at the stop deadline, and how long a stopped run waits to release them.
STOP_POLL_S, STOP_SHUTDOWN_S = 0.5, 2.0
# DeepSpeed's per-rank shard files: ZeRO optimizer partitions (and ZeRO-3 weight partitions).
_RANK_SHARD = re.compile(r"(?:^|/)(?:bf16_)?zero_pp_rank_(\d+)_")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


@dataclass(frozen=True)
class RankLocation:
    hostname: str
    node_ip: str
    node_id: str

    def describe(self) -> str:
        return f"{self.node_ip} ({self.hostname}, node {self.node_id[:8]})"


class TrainWorker:
    """One DeepSpeed rank. Runs inside a Ray actor; hosts the trainer of one stage."""

    def __init__(self, rank: int, world_size: int):
        from rlhf_core.console import rank_warnings

        rank_warnings()
        self.rank, self.world_size = rank, world_size
        self.trainer = None
        self._stop_requested = False  # set by request_stop, from the driver's stop signal (rlhf_core.stop)
        self._kept_in_memory: dict[str, dict] = {}  # a snapshot's state dicts, by its folder (see snapshot)
        self._written_state: dict = {}  # the last written snapshot's state dicts: buffers for the next one
        # Background writes in flight, and started so far: a step during which either changed ran beside one.
        self._num_writes_in_flight = self._num_writes_started = 0

    def location(self) -> RankLocation:
        return RankLocation(socket.gethostname(), ray.util.get_node_ip_address(),
                            ray.get_runtime_context().get_node_id())

    def sees(self, path: str) -> bool:
        return os.path.exists(path)

    def rendezvous_address(self) -> tuple[str, int]:
        return ray.util.get_node_ip_address(), _free_port()

    def join(self, master_addr: str, master_port: int, ranks_on_node: int) -> None:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks_on_node))
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
        from rlhf_core.jit_build import clear_stale_build_lock

        clear_stale_build_lock()
        deepspeed.init_distributed()

    def warm_up(self, run: RunConfig, stage: str) -> None:
        """Import what `setup` of `stage` imports (the trainer, transformers, the model family's classes:
        about 1.8 s on a CPU rank), while the driver still starts Prefect. Best effort: any error
        here is left for `setup` to report."""
        from rlhf_core.trainers import trainer_class

        try:
            trainer_class(stage)
            from rlhf_core.models import import_model_classes

            import_model_classes(run.stage_config(stage).pretrain)
        except Exception:  # noqa: BLE001
            logger.debug("warming up rank %d for %s failed", self.rank, stage, exc_info=True)

    def setup(self, run: RunConfig, stage: str, total_steps: int, load_universal: bool) -> None:
        from rlhf_core.trainers import trainer_class

        self.trainer = trainer_class(stage)(run, total_steps, self.rank, self.world_size, load_universal)

    def train_until(self, target_step: int) -> tuple[list[dict[str, float]], float, int, list[tuple[float, bool]]]:
        """The metrics of each step up to `target_step`, the seconds this rank spent in its step loop, the
        step it reached (fewer when a stop was requested (`request_stop`), at a step all ranks agree on), and
        each step's (seconds, whether a background checkpoint write ran beside it)."""
        from rlhf_core.faults import fault_point

        started, metrics, step_times = time.perf_counter(), [], []
        while self.trainer.step < target_step and not self._stop_agreed():
            fault_point("train_step", self.trainer.step + 1)
            step_started, writes_before = time.perf_counter(), (self._num_writes_in_flight, self._num_writes_started)
            metrics.append(self.trainer.train_step())
            beside_write = writes_before[0] > 0 or self._num_writes_started != writes_before[1]
            step_times.append((time.perf_counter() - step_started, beside_write))
        return metrics, time.perf_counter() - started, self.trainer.step, step_times

    @ray.method(concurrency_group="control")
    def request_stop(self) -> None:
        """Finish the step in progress and train no further (the driver got SIGTERM or Ctrl-C)."""
        self._stop_requested = True

    def _stop_agreed(self) -> bool:
        """Whether any rank has been asked to stop, agreed at this step boundary by every rank (a rank that
        stopped alone would leave the others waiting in the next step's collectives)."""
        if self.world_size == 1:
            return self._stop_requested
        import torch
        import torch.distributed as dist

        device = f"cuda:{torch.cuda.current_device()}" if self.trainer.on_gpu else "cpu"
        flag = torch.tensor([int(self._stop_requested)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def model_sizes(self) -> dict:
        from rlhf_core.alerts import model_size_report

        return model_size_report({name: engine.module for name, engine in self.trainer.engines.items()})

    def non_finite_parameters(self) -> list[str]:
        """Parameters holding NaN or Inf (this rank's partition under ZeRO-3)."""
        from rlhf_core.alerts import non_finite_parameters

        return [f"{name}:{parameter}" for name, engine in self.trainer.engines.items()
                for parameter in non_finite_parameters(engine.module)]

    def snapshot(self) -> str:
        """Save this rank's share of the current step into a folder in memory (`rlhf_core.snapshot`) and
        return it; training may go on while `write_snapshot` uploads it."""
        from rlhf_core.snapshot import snapshot_folder, tensors_kept_in_memory

        folder = snapshot_folder(self.rank, self._expected_folder_bytes())
        try:
            # Only a snapshot whose write has finished lends its buffers (popped: never two at once).
            reuse, self._written_state = self._written_state, {}
            with tensors_kept_in_memory(self.trainer.engines.values(), folder, reuse) as kept:
                self.trainer.save(folder)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        self._kept_in_memory[folder] = kept
        return folder

    @ray.method(concurrency_group="io")
    def write_snapshot(self, folder: str, store_url: str, storage_options: dict, pending) -> list:
        """Upload a snapshot into the uncommitted step folder `pending` (hashing as it writes), remove it,
        and return its manifest entries. Runs in the actor's I/O thread, beside `train_until`."""
        from rlhf_core.checkpoint import CheckpointStore
        from rlhf_core.snapshot import write_state

        kept = self._kept_in_memory.pop(folder, {})
        streams = [(path, functools.partial(write_state, state)) for path, state in kept.items()]
        self._num_writes_in_flight += 1
        self._num_writes_started += 1
        try:
            timings: dict[str, float] = {}
            entries = CheckpointStore(store_url, storage_options).upload_tree(pending, folder, streams, timings)
        finally:
            self._num_writes_in_flight -= 1
            shutil.rmtree(folder, ignore_errors=True)
        self._written_state = kept  # the same peak memory as while writing, without page faults next time
        return entries, timings

    def _expected_folder_bytes(self) -> int:
        """About what the snapshot's folder holds: the HF copy of each model's weights (DeepSpeed's state
        stays in memory, `tensors_kept_in_memory`)."""
        return sum(parameter.numel() * parameter.element_size()
                   for engine in self.trainer.engines.values() for parameter in engine.module.parameters())

    def load_from_store(self, store_url: str, storage_options: dict, step: int, universal: bool,
                        weights_only: bool) -> int:
        """Load the files of committed `step` this rank reads, verified against the manifest: on a local
        store in place while they are hashed, else fetched (hashed as they arrive) first."""
        from rlhf_core.checkpoint import CheckpointStore
        from rlhf_core.resume import convert_to_universal
        from rlhf_core.safe_load import check_no_pickled_code

        # The universal converter, and ZeRO-3's module-only load, read every rank's shard (with a plain
        # unpickler), so they get all files and a scan first; otherwise DeepSpeed's own reads are the scan.
        reads_all_shards = universal or (weights_only and self.trainer.cfg.zero_stage == 3)
        store = CheckpointStore(store_url, storage_options)
        select = lambda paths: files_for_rank(paths, self.rank, reads_all_shards)  # noqa: E731
        if not reads_all_shards:  # both of those write into the folder they read: they get a copy
            # DeepSpeed loads while the files are hashed; a mismatch raises CorruptCheckpoint at the end of
            # the block, and the driver then loads an older checkpoint over whatever this load set.
            with store.read_in_place(step, select) as in_place:
                if in_place is not None:
                    return self.trainer.load(in_place, False, weights_only)
        local_dir = tempfile.mkdtemp(prefix=f"rlhf-load-rank{self.rank}-")
        try:
            store.fetch(step, local_dir, select)
            if reads_all_shards:
                check_no_pickled_code(local_dir)
            universal = universal and convert_to_universal(local_dir)
            return self.trainer.load(local_dir, universal, weights_only)
        finally:
            shutil.rmtree(local_dir, ignore_errors=True)


def files_for_rank(paths: list[str], rank: int, all_shards: bool) -> list[str]:
    """The checkpoint files one rank reads: the shared ones and its own ZeRO shards (every shard with
    `all_shards`), and the Hugging Face copies only when there is no DeepSpeed state to read instead."""
    has_deepspeed_state = any("/ds/" in path for path in paths)
    chosen = []
    for path in paths:
        if has_deepspeed_state and "/hf/" in path:
            continue
        shard = _RANK_SHARD.search(path)
        if shard is None or all_shards or int(shard.group(1)) == rank:
            chosen.append(path)
    return chosen


class WorkerGroup:
    """TrainWorker actors in one placement group, acting as one data-parallel DeepSpeed job."""

    def __init__(self, run: RunConfig):
        ensure_ray(run.ray_address)
        self.placement, self.world_size = reserve_placement(run)
        strategies = [PlacementGroupSchedulingStrategy(self.placement, placement_group_bundle_index=rank)
                      for rank in range(self.world_size)]
        bundle = placement_bundle(run)
        options = {"num_cpus": bundle["CPU"], "num_gpus": bundle.get("GPU", 0)}
        forwarded = forwarded_environment()
        if forwarded:
            options["runtime_env"] = {"env_vars": forwarded}
        # A second thread per actor ("io") uploads the last snapshot while the default one trains on.
        # A third ("control") takes a stop request while the first is busy training.
        remote_worker = ray.remote(concurrency_groups={"io": 1, "control": 1})(TrainWorker)
        self.workers = [remote_worker.options(scheduling_strategy=strategy, **options).remote(rank, self.world_size)
                        for rank, strategy in enumerate(strategies)]
        self._stop_listener = stop.on_request(self.request_stop)
        self.locations: list[RankLocation] = []
        self._model_sizes: dict | None = None
        try:
            self.locations = self._gather([worker.location.remote() for worker in self.workers])
            nodes = [location.describe() for location in self.locations]
            self._placement_line = (logging.WARNING if self.world_size < run.num_workers else logging.INFO,
                                    f"placed {self.world_size} of {run.num_workers} ranks ({run.placement_strategy}) on "
                                    f"nodes: {', '.join(f'{node} x{nodes.count(node)}' for node in dict.fromkeys(nodes))}")
            self._check_store_visible(run)
            master_addr, master_port = self._gather(self.workers[0].rendezvous_address.remote())
            node_ids = [location.node_id for location in self.locations]
            self._gather([worker.join.remote(master_addr, master_port, node_ids.count(location.node_id))
                          for worker, location in zip(self.workers, self.locations)])
        except BaseException:
            self.shutdown()
            raise
        self.step = 0
        self.zero_stage: int | None = None  # resolved by setup
        self._ahead: tuple[int, list] | None = None
        self._step_loop_seconds = 0.0  # rank 0's, since the last take_step_loop_seconds()
        self._step_times: list[tuple[float, bool]] = []  # rank 0's (seconds, beside a write), since then too
        self._clean_step_seconds: float | None = None  # the last known median step with no write beside it
        self.write_seconds: dict[str, float] = {}  # rank 0's writer timers of the last finished write

    def request_stop(self) -> None:
        """Ask every rank to stop after its current step (called from `rlhf_core.stop` on a stop signal)."""
        for worker in self.workers:
            worker.request_stop.remote()

    def log_placement(self) -> None:
        """Log where the ranks were placed, from the chunk that uses the group (its Prefect run shows the line;
        the group may have been started before any run, `rlhf_core.chunk.prestart_workers`)."""
        logger.log(*self._placement_line)

    def setup(self, run: RunConfig, stage: str, total_steps: int, load_universal: bool = False,
              saved_zero_stage: int | None = None) -> None:
        """Build the stage's trainers on every rank, with the ZeRO stage resolved for this group
        (`rlhf_core.ds_config.resolve_zero_stage`; `saved_zero_stage`: the checkpoint's, when resuming)."""
        cfg = run.stage_config(stage)
        self.zero_stage = resolve_zero_stage(cfg.zero_stage, self.world_size, cfg.adam_offload, saved_zero_stage)
        run = run.model_copy(update={stage: cfg.model_copy(update={"zero_stage": self.zero_stage})})
        self._model_sizes = None
        self._gather([worker.setup.remote(run, stage, total_steps, load_universal) for worker in self.workers])

    def warm_up(self, run: RunConfig, stage: str) -> None:
        """Start every rank's imports for `stage` without waiting: `setup` runs after them on each rank."""
        for worker in self.workers:
            worker.warm_up.remote(run, stage)

    def load(self, store_url: str, storage_options: dict, step: int, universal: bool = False,
             weights_only: bool = False) -> None:
        self.step = self._gather([worker.load_from_store.remote(store_url, storage_options, step, universal,
                                                                weights_only) for worker in self.workers])[0]

    def train_until(self, target_step: int) -> list[dict[str, float]]:
        """Per-step metrics as seen by rank 0 (already averaged over ranks); collects training started
        ahead (`train_ahead`) first. On a stop request the ranks stop early: `self.step` says where."""
        metrics = []
        if self._ahead:
            _, ahead = self._ahead
            self._ahead = None
            metrics = self._collect(ahead)
        if self.step > target_step:
            raise RuntimeError(f"the worker group trained ahead to step {self.step}, past the target {target_step}")
        if self.step < target_step and not stop.requested():
            metrics += self._collect([worker.train_until.remote(target_step) for worker in self.workers])
        return metrics

    def _collect(self, trainings: list) -> list[dict[str, float]]:
        metrics, seconds, self.step, step_times = self._gather(trainings)[0]
        self._step_loop_seconds += seconds
        self._step_times += step_times
        return metrics

    def take_step_loop_seconds(self) -> dict[str, float]:
        """For the steps collected since the last call (the goodput ledger's; training ahead runs while the
        driver waits for a commit, so the driver cannot time it): `step_loop`, the seconds rank 0 spent in its
        step loop, and `writer_slowdown`, the part of them lost to the background checkpoint writer, whose
        serialisation, hashing and writes take CPU from the ranks (`goodput.writer_slowdown`)."""
        slowdown, self._clean_step_seconds = writer_slowdown(self._step_times, self._clean_step_seconds)
        seconds = {"step_loop": self._step_loop_seconds, "writer_slowdown": slowdown}
        self._step_loop_seconds, self._step_times = 0.0, []
        return seconds

    def snapshot(self) -> list[str]:
        """Every rank's share of the current step, saved into memory on its node (one folder per rank)."""
        return self._gather([worker.snapshot.remote() for worker in self.workers])

    def start_write(self, folders: list[str], store_url: str, storage_options: dict, pending) -> list:
        """Start every rank's upload of its snapshot into `pending`; `finish_write` waits for them."""
        return [worker.write_snapshot.remote(folder, store_url, storage_options, pending)
                for worker, folder in zip(self.workers, folders)]

    def finish_write(self, writes: list) -> list:
        """Every rank's manifest entries for the files it uploaded (rank 0's writer timers: `write_seconds`)."""
        shares = self._gather(writes)
        self.write_seconds = shares[0][1] if shares else {}
        return [entry for entries, _ in shares for entry in entries]

    def train_ahead(self, target_step: int) -> None:
        """Start training to `target_step` without waiting (the next chunk, while this one commits);
        `train_until(target_step)` collects it."""
        self._ahead = (target_step, [worker.train_until.remote(target_step) for worker in self.workers])

    @property
    def training_ahead_to(self) -> int | None:
        return self._ahead[0] if self._ahead else None

    def model_sizes(self) -> dict:
        """Parameter counts and dtypes of the trained models, which predict a checkpoint's size (fixed for a
        group's stage, so asked of rank 0 once per setup, not once per chunk)."""
        if self._model_sizes is None:
            self._model_sizes = self._gather(self.workers[0].model_sizes.remote())
        return self._model_sizes

    def non_finite_parameters(self) -> list[str]:
        shares = self._gather([worker.non_finite_parameters.remote() for worker in self.workers])
        return sorted({name for share in shares for name in share})[:5]

    def shutdown(self) -> None:
        """Kill the ranks and free their placement. After a stop signal, waits at most STOP_SHUTDOWN_S for that:
        a SIGTERM to the whole process group (Prefect's Cancel of a deployment run) has killed Ray's GCS too,
        and `remove_placement_group` would then wait for it for ever; leaving the process ends the ranks."""
        self._stop_listener()
        workers, placement = self.workers, self.placement
        self.workers, self.placement = [], None

        def release() -> None:
            for worker in workers:
                ray.kill(worker)
            if placement is not None:
                remove_placement_group(placement)

        if not stop.requested():
            release()
            return
        releasing = threading.Thread(target=release, name="rlhf-release-ranks", daemon=True)
        releasing.start()
        releasing.join(STOP_SHUTDOWN_S)

    def _gather(self, refs):
        """`gather`, with a dead rank reported as a WorkerLost naming its node."""
        try:
            return gather(refs)
        except ray.exceptions.RayActorError as error:  # ActorDiedError, ActorUnavailableError
            raise WorkerLost(self._describe_loss(error)) from None
        except ray.exceptions.RayTaskError as error:
            # A rank whose peer died usually fails first, inside a collective (gloo: "Connection closed by
            # peer"), before Ray has marked the peer's node dead: report the peer's loss, not the symptom.
            lost = self._first_lost_rank(LOSS_DETECTION_TIMEOUT_S)
            if lost is None:
                raise
            raise WorkerLost(self._describe_loss(lost)) from error

    def _first_lost_rank(self, timeout_s: float) -> Exception | None:
        """Ping every rank: the RayActorError of the first one that is gone, None if none is known lost."""
        pings = [worker.location.remote() for worker in self.workers]
        deadline = time.monotonic() + timeout_s
        for ping in pings:
            try:
                ray.get(ping, timeout=max(0.1, deadline - time.monotonic()))
            except ray.exceptions.RayActorError as error:
                return error
            except ray.exceptions.GetTimeoutError:
                continue  # busy (still in a collective): not known to be lost
        return None

    def _describe_loss(self, error: Exception) -> str:
        actor_id = getattr(error, "actor_id", None)
        ranks = [rank for rank, worker in enumerate(self.workers)
                 if actor_id and worker._actor_id.hex() == actor_id and rank < len(self.locations)]
        if not ranks:
            return f"a rank of the worker group died mid-chunk ({type(error).__name__}); retrying from the last commit."
        location = self.locations[ranks[0]]
        alive = {node["NodeID"]: node["Alive"] for node in ray.nodes()}
        cause = "its node is gone" if not alive.get(location.node_id, False) else "its actor died"
        return f"rank {ranks[0]} on node {location.describe()} was lost mid-chunk ({cause}); retrying from the last commit."

    def _check_store_visible(self, run: RunConfig) -> None:
        """A local --ckpt_path must be the same folder on every node: ranks write into it directly."""
        import fsspec
        from fsspec.implementations.local import LocalFileSystem

        fs, root = fsspec.core.url_to_fs(run.ckpt_path, **run.storage_options)
        if not isinstance(fs, LocalFileSystem):
            return
        os.makedirs(root, exist_ok=True)
        marker = os.path.join(root, f".rlhf-visible-{secrets.token_hex(6)}")
        open(marker, "w").close()
        try:
            seen = self._gather([worker.sees.remote(marker) for worker in self.workers])
        finally:
            os.remove(marker)
        blind = sorted({location.describe() for location, sees in zip(self.locations, seen) if not sees})
        if blind:
            raise UserError(f"--ckpt_path {run.ckpt_path} is a local folder that node {', '.join(blind)} cannot see; "
                            "use a folder shared by every node at the same path, or an object store (s3://...).")


def group_settings(run: RunConfig) -> dict:
    """The settings a WorkerGroup is built from: two runs that agree on them can use the same group."""
    return run.model_dump(include={"ray_address", "num_workers", "num_cpus_per_worker", "placement_strategy",
                                   "placement_timeout_s", "allow_fewer_workers", "ckpt_path", "storage_options"})


def forwarded_environment() -> dict[str, str]:
    """The driver's variables the ranks need and would not have: workers of an existing cluster inherit
    the cluster's environment, not the driver's. The ranks read and write the store themselves, so the
    standard AWS_* variables (credentials, endpoint, region) travel with them, as the test fault hooks
    (RLHF_FAULT_*) do. Ray keeps a runtime env in its GCS, visible on its dashboard: give the nodes their
    own credentials (an instance role) and leave them out of the driver's environment where that matters."""
    return {name: value for name, value in os.environ.items() if name.startswith(("RLHF_FAULT_", "AWS_"))}


def placement_bundle(run: RunConfig) -> dict[str, float]:
    """The resources one rank reserves: --num_cpus_per_worker (default 1, or an equal share of a small
    cluster's CPUs) and a GPU when the cluster has one per rank."""
    cluster = ray.cluster_resources()
    cpus = run.num_cpus_per_worker or min(1.0, max(0.01, cluster.get("CPU", 1) / run.num_workers))
    bundle = {"CPU": cpus}
    if cluster.get("GPU", 0) >= run.num_workers:
        bundle["GPU"] = 1
    return bundle


def reserve_placement(run: RunConfig):
    """A ready placement group for the ranks, and its size (fewer than num_workers only with
    --allow_fewer_workers); a sentence naming the missing resources when none can be placed."""
    bundle = placement_bundle(run)
    group = _placed(run.num_workers, bundle, run.placement_strategy, run.placement_timeout_s)
    if group is not None:
        return group, run.num_workers
    if run.allow_fewer_workers:
        for num_ranks in _smaller_world_sizes(run):
            group = _placed(num_ranks, bundle, run.placement_strategy, SMALLER_GROUP_TIMEOUT_S)
            if group is not None:
                return group, num_ranks
    message = _placement_shortfall(run, bundle)
    if _cluster_can_hold(run.num_workers, bundle, run.placement_strategy):
        raise PlacementFailed(message + " The resources exist but stayed in use; the chunk is retried.")
    raise UserError(message)


def _placed(num_ranks: int, bundle: dict, strategy: str, timeout_s: float):
    group = placement_group([dict(bundle) for _ in range(num_ranks)], strategy=strategy)
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if ready:
        return group
    remove_placement_group(group)
    return None


def _smaller_world_sizes(run: RunConfig) -> list[int]:
    """World sizes below num_workers that the batch settings allow, largest first."""
    from pydantic import ValidationError

    sizes = []
    for num_ranks in range(run.num_workers - 1, 0, -1):
        try:
            RunConfig.model_validate({**run.model_dump(), "num_workers": num_ranks})
        except ValidationError:
            continue
        sizes.append(num_ranks)
    return sizes


def _alive_nodes() -> list[dict]:
    return [node for node in ray.nodes() if node.get("Alive")]


def _cluster_can_hold(num_ranks: int, bundle: dict, strategy: str) -> bool:
    """Whether the alive nodes' total resources fit the group at all (busy or not)."""
    fits_per_node = [min(int(node["Resources"].get(name, 0) // amount) for name, amount in bundle.items() if amount)
                     for node in _alive_nodes()]
    if strategy == "STRICT_SPREAD":
        return sum(1 for fits in fits_per_node if fits >= 1) >= num_ranks
    return sum(fits_per_node) >= num_ranks


def _placement_shortfall(run: RunConfig, bundle: dict) -> str:
    nodes = _alive_nodes()
    total, free = ray.cluster_resources(), ray.available_resources()
    wanted = ", ".join(f"{amount:g} {name}" for name, amount in bundle.items())
    have = "; ".join(f"{name}: {free.get(name, 0):g} free of {total.get(name, 0):g}" for name in bundle)
    spread = f" on {run.num_workers} different nodes" if run.placement_strategy == "STRICT_SPREAD" else ""
    return (f"--num_workers {run.num_workers}: Ray could not place {run.num_workers} ranks of {{{wanted}}}{spread} "
            f"({run.placement_strategy}) within --placement_timeout_s {run.placement_timeout_s:g}; the cluster has "
            f"{len(nodes)} alive node(s) ({have}). Add nodes or resources, lower --num_workers or "
            f"--num_cpus_per_worker, or pass --allow_fewer_workers.")


def gather(refs):
    """`ray.get(refs)`, re-raising a rank's named failure (`rlhf_core.errors`) as itself (Ray wraps it in a
    RayTaskError), so the retry policy and the CLI see its class. Once a stop
    signal has arrived, waits only until the emergency checkpoint's deadline (`rlhf_core.stop.GraceExpired`)."""
    pending = list(refs) if isinstance(refs, list) else [refs]
    while pending:
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=STOP_POLL_S)
        if pending:
            stop.check_deadline()
    try:
        return ray.get(refs)
    except ray.exceptions.RayTaskError as error:
        cause = getattr(error, "cause", None)
        if isinstance(cause, RLHFError):
            raise cause from None
        raise


def ensure_ray(ray_address: str | None) -> None:
    """Connect to `ray_address` (or RAY_ADDRESS; `ray://` as a Ray client), else start a local cluster,
    once per process."""
    if ray.is_initialized():
        return
    from rlhf_core import console  # the CLI's quiet console: actors' output to the run's log file

    address = ray_address or os.environ.get("RAY_ADDRESS") or None
    with _ray_keeps_off_sigterm():
        if address and address.startswith("ray://"):
            _connect_client(address, console.ray_init_options(client=True))
        else:
            ray.init(address=address, include_dashboard=False, configure_logging=True, **console.ray_init_options())
    stop.reclaim_signals()
    console.route_ray_worker_output()


@contextlib.contextmanager
def _ray_keeps_off_sigterm():
    """`ray.init` first installs a SIGTERM handler that exits with code 15 (in the middle of its own start,
    leaving its processes behind); inside a stop-obeying run (rlhf_core.stop) it is kept from doing so, through
    the private function it calls. Should that name move, `stop.reclaim_signals` after the start still holds."""
    from ray._private import utils as ray_utils

    original = getattr(ray_utils, "set_sigterm_handler", None)
    if original is None or not stop.obeying():
        yield
        return
    ray_utils.set_sigterm_handler = lambda handler: None
    try:
        yield
    finally:
        ray_utils.set_sigterm_handler = original


def _connect_client(address: str, options: dict, num_attempts: int = 3) -> None:
    """`ray.init` as a Ray client, tried again on a connection error: a cluster's first client connection can
    fail while its proxy starts the client server ("Starting Ray client server failed")."""
    for attempt in range(1, num_attempts + 1):
        try:
            ray.init(address=address, **options)
            return
        except ConnectionError as error:  # ConnectionAbortedError on a failed server start
            if attempt == num_attempts:
                raise
            logger.warning("connecting to %s failed (%s); trying again", address, str(error).splitlines()[0])
            time.sleep(2.0 * attempt)
