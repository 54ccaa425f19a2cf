"""One DeepSpeed rank as a Ray actor (`TrainWorker`): it joins the torch.distributed world, hosts one stage's
trainer, trains to the step the driver names, and does the rank's checkpoint I/O (an in-memory snapshot that an
"io" thread uploads while training goes on; verified loads). The driver side is `rlhf_core.driver.engine`;
docs/design-notes.md ("One rank's actor") has its threads and their scheduling.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
import socket
import sys
import time
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import ray

from rlhf_core.config import RunConfig
from rlhf_core.errors import TransientStoreError
from rlhf_core.rank.interim import InterimSnapshots, Sources
from rlhf_core.storage.interim import InterimPlan, holdings, node_folder, recorded, remove_orphans
from rlhf_core.rank.reuse import OutlivesItsCommand
from rlhf_core.rank.signals import Progress, WorkerSignals
from rlhf_core.rank.threads import free_port, torch_threads, yield_cpu_to_training
from rlhf_core.stages.base import StageConfig

if TYPE_CHECKING:
    from rlhf_core.rank.trainers.base import DeepSpeedTrainer
    from rlhf_core.storage.manifest import ManifestEntry, PendingStep

logger = logging.getLogger(__name__)


SNAPSHOT_FILES_BYTES = 64 << 20  # a snapshot folder's config and tokenizer files, with room to spare


def poison_weights(modules) -> None:
    """The fault action `nan` (`train_step@8=nan`): every weight of `modules` becomes NaN at the step's boundary, so
    the step's loss is non-finite, as a diverged run's, with no hook in any loss. ZeRO-3 keeps a rank's share of
    the weights beside the module (`ds_tensor`): that share is poisoned too."""
    import torch

    with torch.no_grad():
        for module in modules:
            for parameter in module.parameters():
                parameter.fill_(float("nan"))
                if getattr(parameter, "ds_tensor", None) is not None:
                    parameter.ds_tensor.fill_(float("nan"))


@dataclass(frozen=True)
class RankLocation:
    hostname: str
    node_ip: str
    node_id: str
    pid: int = 0  # the rank's process, for its stacks when it hangs

    def describe(self) -> str:
        return f"{self.node_ip} ({self.hostname}, node {self.node_id[:8]})"


class TrainWorker(OutlivesItsCommand):
    """One DeepSpeed rank. Runs inside a Ray actor; hosts the trainer of one stage. On a running cluster it may
    outlive its command as a spare for the next one (`retire`, `rlhf_core.rank.reuse`)."""

    def __init__(self, rank: int, world_size: int, owner_job: str = "", idle_s: float = 0.0):
        from rlhf_core.ops.console import rank_warnings

        rank_warnings()
        self.rank, self.world_size = rank, world_size
        self._trainer: DeepSpeedTrainer[StageConfig] | None = None  # the stage's, once `setup` made it
        self._stage = ""
        self._stop_requested = False  # set by request_stop, from the driver's stop signal (rlhf_core.driver.stop)
        self._kept_in_memory: dict[str, dict] = {}  # a snapshot's state dicts, by its folder (see snapshot)
        self._written_state: dict = {}  # the last written snapshot's state dicts: buffers for the next one
        # Background writes in flight, and started so far: a step during which either changed ran beside one.
        self._num_writes_in_flight = self._num_writes_started = 0
        self._progress = Progress()
        self._interim: InterimSnapshots | None = None  # snapshots between commits, when the driver asks for them
        self._metrics_since_commit: list[dict[str, float]] = []  # the steps' after the last chunk end
        self._outlive_command(owner_job, idle_s)

    def retire(self) -> str:
        """After a command's clean end: forget its stage and reset the process for the next command (a spare);
        returns "" when it is one, else why it cannot be (the driver then ends it)."""
        zero_stage = self._trainer.cfg.zero_stage if self._trainer is not None else None
        # this command's snapshots between commits went already (`drop_interim`, and the driver on its host)
        self._trainer, self._stage, self._stop_requested, self._interim = None, "", False, None
        self._kept_in_memory, self._written_state, self._progress = {}, {}, Progress()
        return self._become_spare(zero_stage)

    def _stop_for_reset(self) -> float:  # the step loop stops at the next boundary the ranks agree on
        self._stop_requested = True
        return self._progress.slowest_step_s

    def retire_orphan(self) -> str:
        """`retire` once its command died mid-run, its snapshots between commits removed first (none reads them)."""
        self.drop_interim()
        return self.retire()

    @ray.method(concurrency_group="control")
    def heartbeat(self) -> tuple[int, tuple[str, ...], float, dict[str, tuple[int, int]], int]:
        """This rank's progress count, the work in progress ("setup", "load", "train", "snapshot", "write"), its
        slowest step in seconds, the long work inside the step under way as (done, total) pieces by phase
        ("eval", "generate"), and the last step it finished: a hang names its step (rlhf_core.driver.hang)."""
        return (*self._progress.report(), self._trainer.step if self._trainer is not None else 0)

    @property
    def trainer(self) -> DeepSpeedTrainer[StageConfig]:
        """The trainer `setup` made: the driver calls it before any method that trains, saves or loads."""
        if self._trainer is None:
            raise RuntimeError(f"rank {self.rank} has no trainer: TrainWorker.setup has not run")
        return self._trainer

    def location(self) -> RankLocation:
        return RankLocation(socket.gethostname(), ray.util.get_node_ip_address(),
                            ray.get_runtime_context().get_node_id(), os.getpid())

    def sees(self, path: str) -> bool:
        return os.path.exists(path)

    def rendezvous_address(self) -> tuple[str, int]:
        return ray.util.get_node_ip_address(), free_port()

    def join(self, master_addr: str, master_port: int, ranks_on_node: int,
             num_threads_asked: int | None = None) -> None:
        with self._progress.working_on("setup"):
            import torch

            torch.set_num_threads(torch_threads(num_threads_asked, ranks_on_node))
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
            from rlhf_core.rank.jit_build import clear_stale_build_lock

            clear_stale_build_lock()
            deepspeed.init_distributed()

    def warm_up(self, run: RunConfig, stage: str) -> None:
        """Import what `setup` of `stage` imports (the trainer, transformers, the model family's classes:
        about 1.8 s on a CPU rank), while the driver still starts Prefect. Best effort: any error
        here is left for `setup` to report."""
        from rlhf_core.rank.trainers import trainer_class

        try:
            trainer_class(stage)
            from rlhf_core.models.load import import_model_classes

            import_model_classes(run.section(stage, StageConfig).start_model)
        except Exception:  # noqa: BLE001
            logger.debug("warming up rank %d for %s failed", self.rank, stage, exc_info=True)

    @ray.method(concurrency_group="io")
    def warm_spare(self, run: RunConfig, stage: str) -> bool:
        """As a spare (rlhf_core.driver.spares): import what `join` and `setup` of `stage` import, at the lowest
        nice value, so that taking this process as a rank skips them. Not under SCHED_IDLE like the writer: ranks
        training on every core leave no idle time, and the spare would never be ready; at nice 19 beside ranks
        at Ray's 15 it takes about a third of one core until it is (about 5 s of CPU, once)."""
        import threading

        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        import deepspeed  # noqa: F401 - `join`'s import, the slowest
        import torch  # noqa: F401

        self.warm_up(run, stage)
        return True

    def assign_rank(self, rank: int, world_size: int) -> None:
        """A spare becomes `rank` of a new group of `world_size`, before it joins."""
        self.rank, self.world_size = rank, world_size

    def setup(self, run: RunConfig, stage: str, chunk_ends: list[int], load_universal: bool,
              interim: InterimPlan | None = None) -> None:
        """Build `stage`'s trainer; `interim`: take snapshots between commits as the plan says."""
        from rlhf_core.faults import fault_point, register_action
        from rlhf_core.rank.trainers import trainer_class

        self._stage, self._metrics_since_commit, self._interim = stage, [], None
        if interim is not None:
            remove_orphans()
            self._interim = InterimSnapshots(interim, self.rank, self._interim_folder(interim))
        fault_point("setup", 0, tag=stage)  # also a mark in the fault trace: a new rank's set-up begins (tests/soak)
        with self._progress.working_on("setup"):
            self._trainer = trainer_class(stage)(run, chunk_ends, self.rank, self.world_size, load_universal)
            self._trainer.signals = WorkerSignals(self._progress, self.any_rank_asked_to_stop)
        register_action("nan", lambda: poison_weights(engine.module for engine in self.trainer.engines.values()))

    def train_until(self, target_step: int) -> tuple[list[dict[str, float]], float, int, list[tuple[float, bool]],
                                                     float]:
        """The metrics of each step up to `target_step`, the seconds this rank spent in its step loop, the
        step it reached (fewer when a stop was requested (`request_stop`), at a step all ranks agree on), each
        step's (seconds, whether a background checkpoint write ran beside it), its evaluation left out, and the
        seconds spent evaluating."""
        from rlhf_core.faults import fault_point

        started, metrics, step_times = time.perf_counter(), [], []
        eval_seconds_before = self.trainer.eval_seconds
        with self._progress.working_on("train"):
            while self.trainer.step < target_step:
                stop, snapshot = self._agree_at_boundary()
                if stop:
                    break
                if snapshot:
                    self._take_interim()
                fault_point("train_step", self.trainer.step + 1, tag=self._stage, signals=self.trainer.signals)
                step_started, evaluated_before = time.perf_counter(), self.trainer.eval_seconds
                writes_before = (self._num_writes_in_flight, self._num_writes_started)
                metrics.append(self.trainer.train_step())
                beside_write = writes_before[0] > 0 or self._num_writes_started != writes_before[1]
                evaluating = self.trainer.eval_seconds - evaluated_before  # not the step's: the watch's steady pace
                step_times.append((time.perf_counter() - step_started - evaluating, beside_write))
                self._progress.step_done(step_times[-1][0])
                self._step_finished(metrics[-1], step_times[-1][0])
        return (metrics, time.perf_counter() - started, self.trainer.step, step_times,
                self.trainer.eval_seconds - eval_seconds_before)

    @ray.method(concurrency_group="control")
    def request_stop(self) -> None:
        """Finish the step in progress and train no further (the driver got SIGTERM or Ctrl-C)."""
        self._stop_requested = True

    def _agree_at_boundary(self) -> tuple[bool, bool]:
        """(stop, snapshot), agreed by every rank at this step boundary in one collective: whether any rank has
        been asked to stop (a rank that stopped alone would leave the others waiting in the next step's
        collectives), and whether every rank is ready for a snapshot between commits (DeepSpeed's save is a
        collective too). None at a chunk's end: its commit snapshots it."""
        interim = self._interim
        ready = interim is not None and not self.trainer.is_chunk_end() and interim.due(self.trainer.step)
        if self.world_size == 1:
            return self._stop_requested, ready
        from rlhf_core.faults import fault_point
        from rlhf_core.rank.collectives import max_over_ranks

        fault_point("collective", self.trainer.step + 1)  # a rank stopped here leaves the others in the collective
        stop, not_ready = max_over_ranks([float(self._stop_requested), float(not ready)], device=self._device())
        return stop > 0, not_ready == 0

    def _device(self) -> str:
        import torch

        return f"cuda:{torch.cuda.current_device()}" if self.trainer.on_gpu else "cpu"

    def _step_finished(self, step_metrics: dict[str, float], seconds: float) -> None:
        """Keep the step's metrics until its chunk ends (a snapshot between commits carries them)."""
        self._metrics_since_commit = [] if self.trainer.is_chunk_end() else [*self._metrics_since_commit,
                                                                             step_metrics]
        if self._interim is not None:
            self._interim.step_done(seconds)

    def _take_interim(self) -> None:
        assert self._interim is not None
        with self._progress.working_on("snapshot"):
            self._interim.take(self.trainer.step, self.trainer.engines.values(), self.trainer.save_state,
                               self._metrics_since_commit)

    def _interim_folder(self, plan: InterimPlan) -> str:
        return node_folder(plan, ray.get_runtime_context().get_node_id())

    def interim_holdings(self, plan: InterimPlan) -> tuple[str, dict[int, dict[int, dict]]]:
        """This rank's node, and per rank the snapshots between commits of `plan` it holds whole."""
        return ray.get_runtime_context().get_node_id(), holdings(self._interim_folder(plan), plan.world_size)

    def drop_interim(self) -> None:
        """At a clean end: this command's snapshots between commits on this rank's host go (the driver removes
        those on its own host; it cannot reach another's)."""
        if self._interim is not None:
            shutil.rmtree(os.path.dirname(self._interim.folder), ignore_errors=True)

    def load_interim(self, step: int, sources: Sources) -> tuple[int, list[dict[str, float]], int]:
        """Load the snapshot between commits of `step` (`sources`: each rank's, on this node or through another
        node's keeper); returns the step, the metrics of the steps between the last commit and it, and the
        interval it was taken at."""
        from rlhf_core.faults import fault_point

        interim = self._interim
        assert interim is not None
        with self._progress.working_on("load"):
            loaded = interim.load(step, self.trainer, sources)
            self._metrics_since_commit, interval = recorded(sources[0][0])
        fault_point("loaded", loaded, tag=self._stage)  # the trace's mark, as load_from_store's
        return loaded, self._metrics_since_commit, interval

    def any_rank_asked_to_stop(self) -> bool:
        """Whether any rank has been asked to stop (a collective: every rank asks at the same point)."""
        if self.world_size == 1:
            return self._stop_requested
        from rlhf_core.rank.collectives import max_over_ranks

        return max_over_ranks([float(self._stop_requested)], device=self._device())[0] > 0

    @ray.method(concurrency_group="control")  # asked while the ranks train ahead: shapes and dtypes only
    def model_sizes(self) -> dict:
        from rlhf_core.ops.commit_alerts import model_size_report

        return model_size_report({name: engine.module for name, engine in self.trainer.engines.items()})

    def non_finite_parameters(self) -> list[str]:
        """Parameters holding NaN or Inf (this rank's partition under ZeRO-3)."""
        from rlhf_core.ops.alerts import non_finite_parameters

        return [f"{name}:{parameter}" for name, engine in self.trainer.engines.items()
                for parameter in non_finite_parameters(engine.module)]

    def snapshot(self) -> tuple[str | None, list[str]]:
        """Save this rank's share of the current step into a folder in memory (`rlhf_core.rank.snapshot`) and
        return it, with no parameters named; training may go on while `write_snapshot` uploads it. A step whose
        weights hold NaN or Inf is not saved: None, and the parameters (`non_finite_parameters`). One call for
        both, since the ranks stand idle until training ahead starts."""
        with self._progress.working_on("snapshot"):
            from rlhf_core.rank.snapshot import snapshot_folder, tensors_kept_in_memory

            non_finite = self.non_finite_parameters()
            if non_finite:
                return None, non_finite
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
            return folder, []

    @ray.method(concurrency_group="io")
    def drop_snapshot(self, folder: str) -> None:
        """Forget a snapshot that will not be written (its step was already committed); its buffers serve the next."""
        self._written_state = self._kept_in_memory.pop(folder, {}) or self._written_state
        shutil.rmtree(folder, ignore_errors=True)

    @ray.method(concurrency_group="io")
    def write_snapshot(self, folder: str, store_url: str, storage_options: dict,
                       pending: PendingStep) -> tuple[list[ManifestEntry], dict[str, float]]:
        """Upload a snapshot into the uncommitted step folder `pending` (hashing as it writes), remove it,
        and return its manifest entries and the upload's timings. Runs in the actor's I/O thread, beside
        `train_until`."""
        with self._progress.working_on("write"):
            from rlhf_core.storage.checkpoint import CheckpointStore
            from rlhf_core.rank.snapshot import write_state

            yield_cpu_to_training()  # a syscall each time: the group's thread may not be the same one every call
            kept = self._kept_in_memory.get(folder, {})
            streams = [(path, functools.partial(write_state, state)) for path, state in kept.items()]
            self._num_writes_in_flight += 1
            self._num_writes_started += 1
            try:
                timings: dict[str, float] = {}
                entries = CheckpointStore(store_url, storage_options).upload_tree(pending, folder, streams, timings)
            except TransientStoreError:
                raise  # the snapshot stays, for the driver to write again once the store is back
            except BaseException:
                self._forget_snapshot(folder)
                raise
            finally:
                self._num_writes_in_flight -= 1
            self._forget_snapshot(folder)
            self._written_state = kept  # the same peak memory as while writing, without page faults next time
            return entries, timings

    def _forget_snapshot(self, folder: str) -> None:
        self._kept_in_memory.pop(folder, None)
        shutil.rmtree(folder, ignore_errors=True)

    def _expected_folder_bytes(self) -> int:
        """About what the snapshot's folder holds: config and tokenizer files, and a LoRA model's adapter (peft
        writes its own files). DeepSpeed's state and the HF copy's weights stay in memory (`tensors_kept_in_memory`)."""
        adapter_bytes = sum(parameter.numel() * parameter.element_size()
                            for engine in self.trainer.engines.values() if hasattr(engine.module, "peft_config")
                            for parameter in engine.module.parameters() if parameter.requires_grad)
        return SNAPSHOT_FILES_BYTES + adapter_bytes

    def load_from_store(self, store_url: str, storage_options: dict, step: int, universal: bool,
                        weights_only: bool) -> int:
        """Load the files of committed `step` this rank reads, verified against the manifest: on a local
        store in place while they are hashed, else fetched (hashed as they arrive) first."""
        from rlhf_core.faults import fault_point
        from rlhf_core.rank.loading import load_verified
        from rlhf_core.storage.checkpoint import CheckpointStore

        with self._progress.working_on("load"):
            store = CheckpointStore(store_url, storage_options)
            loaded = load_verified(self.trainer, self.rank, store, step, universal, weights_only)
            if self._interim is not None:
                self._interim.restore_from(loaded)
            self._metrics_since_commit = []
        fault_point("loaded", step, tag=self._stage)  # also a mark in the fault trace: the load's end (tests/soak)
        return loaded
