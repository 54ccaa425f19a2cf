"""DeepSpeed ranks as a Ray actor group (`WorkerGroup`), placed on any node of a Ray cluster: a placement group
reserved first, one `TrainWorker` actor per bundle, one torch.distributed group. The group outlives a chunk; each
rank writes its own checkpoint files in a background thread while the next chunk trains, so the driver can run
anywhere (head, `ray job`, Ray client). A lost node fails the chunk with `WorkerLost` (retried); a named failure
in a rank reaches the driver as itself. docs/design-notes.md ("Ranks on Ray") has the details.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from typing import Any, Callable

import ray
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlhf_core.driver.stop import StopSignals
from rlhf_core.driver.waits import gather
from rlhf_core.config import RunConfig
from rlhf_core.rank.ds_config import resolve_zero_stage
from rlhf_core.driver.ray_start import ensure_ray, forwarded_environment, threads_asked
from rlhf_core.driver.interim import (InterimHoldings, InterimStart, drop_keepers, interim_note, interim_plan,
                                     rank_plans)
from rlhf_core.driver.hang import HangWatch, dump_rank_stacks, save_stacks, stuck_frame
from rlhf_core.driver.lingering import claim_lingering, lingering_options, lingers, retire_ranks
from rlhf_core.errors import FailedAt, RankHung, WorkerLost
from rlhf_core.ops.alerts import ALERT_HANG, Alert, AlertLog
from rlhf_core.ops.console import show_work
from rlhf_core.ops.ray_output import adopt_worker_output
from rlhf_core.ops.run_log import log_file_for
from rlhf_core.ops.step_time import writer_slowdown
from rlhf_core.rank.worker import RankLocation, TrainWorker
from rlhf_core.driver.placement import bundle_nodes, check_store_visible, placement_bundle, reserve_placement
from rlhf_core.stages.base import StageConfig
from rlhf_core.storage.interim import InterimPlan

logger = logging.getLogger(__name__)

# After a rank fails in a collective, how long to wait for Ray to say which peer was lost (it marks a node
# dead once it misses its heartbeats, ~5-10 s).
LOSS_DETECTION_TIMEOUT_S = 30.0
# How long a stopped run waits to release its ranks.
STOP_SHUTDOWN_S = 2.0


class WorkerGroup:
    """TrainWorker actors in one placement group, acting as one data-parallel DeepSpeed job."""

    def __init__(self, run: RunConfig, signals: StopSignals | None = None,
                 take_spares: Callable[[list[str]], dict] | None = None):
        """`signals`: the run's stop signals (a stop asks the ranks to stop after their step); none by default.
        `take_spares(bundle_nodes)`: warm rank actors (`rlhf_core.driver.spares`) by rank, each on its bundle's node,
        to serve in place of new ones: a group replacing lost ranks starts from them."""
        self.signals = signals or StopSignals(run.stop_grace_s)
        ensure_ray(run.ray_address, self.signals)
        self.placement, self.world_size = reserve_placement(run)
        strategies = [PlacementGroupSchedulingStrategy(self.placement, placement_group_bundle_index=rank)
                      for rank in range(self.world_size)]
        self.bundle_nodes = bundle_nodes(self.placement, self.world_size)
        self.lingering = lingers(run)  # its ranks may outlive the command (driver/lingering.py)
        spares = take_spares(self.bundle_nodes) if take_spares is not None else {}
        lingering = claim_lingering({rank: node for rank, node in enumerate(self.bundle_nodes)
                                     if rank not in spares}, run.spare_idle_s) if self.lingering else {}
        spares |= lingering
        for rank, spare in spares.items():
            spare.assign_rank.remote(rank, self.world_size)
        self.workers = [spares.get(rank) or self._new_rank(run, rank, strategies[rank])
                        for rank in range(self.world_size)]
        self.num_spares_taken, self.started_at = len(spares), time.monotonic()
        self._stop_listener = self.signals.on_request(self.request_stop)
        self._watch = HangWatch(self.workers, run.hang_timeout_s)
        self._run_where = (run.run_url(), run.run_name, run.storage_options)  # for a hang's stacks and alert
        self._stage, self.step = "", 0
        self.locations: list[RankLocation] = []
        self._model_sizes: dict | None = None
        try:
            self.locations = self._gather([worker.location.remote() for worker in self.workers])
            if lingering:
                adopt_worker_output([self.locations[rank].pid for rank in lingering])
            nodes = [location.describe() for location in self.locations]
            reused = f"; {len(lingering)} from spare processes of an earlier command" if lingering else ""
            self._placement_line = (logging.WARNING if self.world_size < run.num_workers else logging.INFO,
                                    f"placed {self.world_size} of {run.num_workers} ranks ({run.placement_strategy}) on "
                                    f"nodes: {', '.join(f'{node} x{nodes.count(node)}' for node in dict.fromkeys(nodes))}"
                                    f"{reused}{interim_note(run)}")
            check_store_visible(run, self.locations, lambda marker: self._gather(
                [worker.sees.remote(marker) for worker in self.workers]))
            master_addr, master_port = self._gather(self.workers[0].rendezvous_address.remote())
            node_ids = [location.node_id for location in self.locations]
            num_threads = threads_asked()
            self._gather([worker.join.remote(master_addr, master_port, node_ids.count(location.node_id), num_threads)
                          for worker, location in zip(self.workers, self.locations)])
        except BaseException:
            self.shutdown()
            raise
        self.zero_stage: int | None = None  # resolved by setup
        self.interim_token = ""  # the command's, for its snapshots between commits (none without it)
        self.interim: InterimPlan | None = None  # set by setup
        self._held: InterimHoldings | None = None  # set by interim_steps
        self.restored: InterimStart | None = None  # set by load_interim
        self._ahead: tuple[int, list] | None = None
        self._step_loop_seconds = 0.0  # rank 0's, since the last take_step_loop_seconds()
        self._eval_seconds = 0.0  # the part of them rank 0 spent evaluating
        self._step_times: list[tuple[float, bool]] = []  # rank 0's (seconds, beside a write), since then too
        self._clean_step_seconds: float | None = None  # the last known median step with no write beside it
        self.write_seconds: dict[str, float] = {}  # rank 0's writer timers of the last finished write

    def _new_rank(self, run: RunConfig, rank: int, strategy: PlacementGroupSchedulingStrategy):
        """A new rank process: in its bundle, or, when it may outlive the command, beside it on the bundle's node."""
        if not self.lingering:
            return rank_actor(run, rank, self.world_size, scheduling_strategy=strategy)
        return rank_actor(run, rank, self.world_size, outlive_on=self.bundle_nodes[rank])

    def request_stop(self) -> None:
        """Ask every rank to stop after its current step (called from `rlhf_core.driver.stop` on a stop signal)."""
        for worker in self.workers:
            worker.request_stop.remote()

    def log_placement(self) -> None:
        """Log where the ranks were placed, from the chunk that uses the group (its Prefect run shows the line;
        the group may have been started before any run, `StageRunner.prestart`)."""
        logger.log(*self._placement_line)

    def setup(self, run: RunConfig, stage: str, chunk_ends: list[int], load_universal: bool = False,
              saved_zero_stage: int | None = None) -> None:
        """Build the stage's trainers on every rank, handing them the plan's chunk ends (`StagePlan.targets`: where
        checkpoints commit, the last one the stage's last step), with the ZeRO stage resolved for this group
        (`rlhf_core.rank.ds_config.resolve_zero_stage`; `saved_zero_stage`: the checkpoint's, when resuming)."""
        cfg = run.section(stage, StageConfig)
        self.zero_stage = resolve_zero_stage(cfg.zero_stage, self.world_size, cfg.adam_offload, saved_zero_stage)
        run = run.model_copy(update={stage: cfg.model_copy(update={"zero_stage": self.zero_stage})})
        self._model_sizes, self._stage = None, stage
        self._clean_step_seconds = None  # another stage's steps take another time: no baseline carries over
        self.interim = interim_plan(run, stage, self.interim_token, self.world_size, self.zero_stage)
        plans = rank_plans(self.interim, [location.node_id for location in self.locations])
        self._gather([worker.setup.remote(run, stage, chunk_ends, load_universal, plan)
                      for worker, plan in zip(self.workers, plans)])

    def interim_steps(self, run: RunConfig, stage: str, saved_zero_stage: int | None) -> list[int]:
        """The snapshots between commits (`rlhf_core.rank.interim`) of this command's `stage` on a group of this
        shape of which every rank's is whole on a node still alive (asked before `setup`, which builds the
        models)."""
        cfg = run.section(stage, StageConfig)
        zero_stage = resolve_zero_stage(cfg.zero_stage, self.world_size, cfg.adam_offload, saved_zero_stage)
        plan = interim_plan(run, stage, self.interim_token, self.world_size, zero_stage)
        if plan is None:
            return []
        self._held = InterimHoldings.gather(
            plan, lambda: self._gather([worker.interim_holdings.remote(plan) for worker in self.workers]))
        return self._held.steps()

    def load_interim(self, step: int, base_step: int) -> None:
        """Every rank loads the snapshot of `step`, taken after the commit of `base_step` (0: none yet)."""
        held = self._held
        assert held is not None, "interim_steps comes first"
        loaded = self._gather([worker.load_interim.remote(step, held.sources(step, location.node_id))
                               for worker, location in zip(self.workers, self.locations)])
        held.forget_after(step)
        self.step = loaded[0][0]
        self.restored = InterimStart(self.step, base_step, loaded[0][1], loaded[0][2])

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
        if self.step < target_step and not self.signals.requested():
            metrics += self._collect([worker.train_until.remote(target_step) for worker in self.workers])
        return metrics

    def _collect(self, trainings: list) -> list[dict[str, float]]:
        metrics, seconds, self.step, step_times, eval_seconds = self._gather(trainings)[0]
        self._watch.steps_returned([step_seconds for step_seconds, _ in step_times], self.step)
        self._step_loop_seconds += seconds
        self._eval_seconds += eval_seconds
        self._step_times += step_times
        return metrics

    @property
    def slowest_step_s(self) -> float:
        """The slowest step that came back to the driver from this group (0 before any)."""
        return self._watch.slowest_step_s

    def expect_steps_like(self, slowest_step_s: float) -> None:
        """A group replacing lost ranks of the same stage: the steady hang deadline holds from its first step (the
        start-up window stays for its set-up and load), so a stall at the step the failed group stalled at, now
        the first after a snapshot, is caught as fast as before."""
        self._watch.steps_returned([slowest_step_s])

    @property
    def first_step_seconds(self) -> float:
        """Rank 0's first step since the last `take_step_loop_seconds` (0 before any)."""
        return self._step_times[0][0] if self._step_times else 0.0

    def take_step_loop_seconds(self) -> dict[str, float]:
        """For the steps collected since the last call (the goodput ledger's; training ahead runs while the
        driver waits for a commit, so the driver cannot time it): `step_loop`, the seconds rank 0 spent in its
        step loop, `writer_slowdown`, the part of them lost to the background checkpoint writer, whose
        serialisation, hashing and writes take CPU from the ranks (`goodput.writer_slowdown`), and `eval`, the part
        spent evaluating."""
        slowdown, self._clean_step_seconds = writer_slowdown(self._step_times, self._clean_step_seconds)
        seconds = {"step_loop": self._step_loop_seconds, "writer_slowdown": slowdown, "eval": self._eval_seconds}
        self._step_loop_seconds, self._step_times, self._eval_seconds = 0.0, [], 0.0
        return seconds

    def snapshot(self) -> tuple[list[str], list[str]]:
        """Every rank's share of the current step, saved into memory on its node (one folder per rank), and the
        parameters holding NaN or Inf (the first few by name): when there are any, nothing was saved."""
        shares = self._gather([worker.snapshot.remote() for worker in self.workers])
        non_finite = sorted({name for _, names in shares for name in names})[:5]
        return ([] if non_finite else [folder for folder, _ in shares]), non_finite

    def drop_snapshots(self, folders: list[str]) -> None:
        """Forget snapshots that will not be written (their step was committed already)."""
        self._gather([worker.drop_snapshot.remote(folder) for worker, folder in zip(self.workers, folders)])

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

    def shutdown(self, retire: bool = False) -> None:
        """Kill the ranks and free their placement; with `retire`, after a clean end, ranks that may outlive the
        command become spares instead (`driver/lingering.py`). After a stop signal, waits at most STOP_SHUTDOWN_S
        for that: a SIGTERM to the whole process group (Prefect's Cancel of a deployment run) has killed Ray's GCS
        too, and `remove_placement_group` would then wait for it for ever; leaving the process ends the ranks."""
        self._stop_listener()
        workers, placement = self.workers, self.placement
        self.workers, self.placement = [], None
        clean = retire and self._ahead is None and not self.signals.requested()  # the ranks are alive and idle
        retiring = clean and self.lingering
        left_to_retire = self.lingering and self.signals.requested()  # they reset themselves (rlhf_core.rank.reuse)

        def release() -> None:
            if clean:  # the ranks and keepers remove their snapshots between commits (the driver reaches only its host)
                with contextlib.suppress(Exception):
                    ray.get([worker.drop_interim.remote() for worker in workers], timeout=STOP_SHUTDOWN_S * 5)
                drop_keepers(self.interim)
            if retiring:
                retire_ranks(workers)
            elif left_to_retire:
                with contextlib.suppress(Exception):
                    ray.get([worker.retire_after_stop.remote() for worker in workers], timeout=STOP_SHUTDOWN_S)
            else:
                for worker in workers:
                    ray.kill(worker)
            if placement is not None:
                remove_placement_group(placement)

        if not self.signals.requested():
            release()
            return
        releasing = threading.Thread(target=release, name="rlhf-release-ranks", daemon=True)
        releasing.start()
        releasing.join(STOP_SHUTDOWN_S)

    def _gather(self, refs):
        """`gather`, with a dead rank reported as a WorkerLost naming its node, and a hung one as RankHung."""
        self._watch.restart()
        try:
            return gather(refs, self.signals, self._check_progress)
        except ray.exceptions.RayActorError as error:  # ActorDiedError, ActorUnavailableError
            raise self._loss(error) from None
        except ray.exceptions.RayTaskError as error:
            # A rank whose peer died usually fails first, inside a collective (gloo: "Connection closed by
            # peer"), before Ray has marked the peer's node dead: report the peer's loss, not the symptom.
            lost = self._first_lost_rank(LOSS_DETECTION_TIMEOUT_S)
            if lost is None:
                raise
            raise self._loss(lost) from error

    def _check_progress(self) -> None:
        """Raise RankHung, with every rank's stacks saved and an alert recorded, once a rank is past its deadline."""
        hung = self._watch.poll()
        for phase, (done, total) in self._watch.pieces().items():
            show_work(self._stage, phase, done, total)
        if hung is None:
            return
        run_url, run_name, storage_options = self._run_where
        location = self.locations[hung.rank] if hung.rank < len(self.locations) else None
        dumps = {rank: dump_rank_stacks(where) for rank, where in enumerate(self.locations)}
        path = os.path.join(os.path.dirname(log_file_for(run_url, run_name)),
                            f"hang-{time.strftime('%Y%m%d-%H%M%S')}-rank{hung.rank}.txt")
        save_stacks(path, dumps)
        node = f" on node {location.describe()}" if location else ""
        frame = stuck_frame(dumps.get(hung.rank, "")) or ""
        message = (f"rank {hung.rank}{node} {hung.describe()} at step {hung.step}, stuck in "
                   f"{frame or 'a frame py-spy could not read'}; its stacks and the driver's are in {path}.")
        alert = Alert(ALERT_HANG, run_name, self._stage, hung.step, message,
                      {"rank": hung.rank, "stacks_path": path, "frame": frame})
        with contextlib.suppress(Exception):  # the alert must not hide the hang
            AlertLog(run_url, storage_options).append(alert, announced=False)  # the chunk's failure says it
        raise RankHung(message, hung.rank, path, json.loads(alert.to_json()),
                       FailedAt(hung.rank, hung.step, frame, hung.deadline_s))

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

    def _loss(self, error: Exception) -> WorkerLost:
        """The WorkerLost for `error`: the lost rank, its node, and the step it was at as its last heartbeat said
        (a loss at the same step on every try stops the run, `driver/repeats.py`)."""
        actor_id = getattr(error, "actor_id", None)
        ranks = [rank for rank, worker in enumerate(self.workers)
                 if actor_id and worker._actor_id.hex() == actor_id and rank < len(self.locations)]
        if not ranks:
            return WorkerLost(f"a rank of the worker group died mid-chunk ({type(error).__name__}).")
        location, step = self.locations[ranks[0]], self._watch.step_of(ranks[0])
        alive = {node["NodeID"]: node["Alive"] for node in ray.nodes()}
        cause = "its node is gone" if not alive.get(location.node_id, False) else "its actor died"
        return WorkerLost(f"rank {ranks[0]} on node {location.describe()} was lost mid-chunk at step {step} ({cause}).",
                          FailedAt(ranks[0], step))


def rank_actor(run: RunConfig, rank: int, world_size: int, outlive_on: str = "", **options: Any):
    """A new TrainWorker actor with the run's resources per rank and forwarded environment; `options`: Ray's
    actor options to add or override (where to place it, or no resources at all for a spare). `outlive_on`: the
    node of a rank that may outlive the command (`driver/lingering.py`: a detached actor there, which ends itself
    once this command's job is dead)."""
    bundle = placement_bundle(run)
    actor_options: dict[str, Any] = {"num_cpus": bundle["CPU"], "num_gpus": bundle.get("GPU", 0)}
    forwarded = forwarded_environment()
    if forwarded:
        actor_options["runtime_env"] = {"env_vars": forwarded}
    # A second thread per actor ("io") uploads the last snapshot while the default one trains on.
    # A third ("control") takes a stop request, or the models' sizes, while the first is busy training.
    # ray's typed overloads of remote() omit concurrency_groups, an actor option it takes
    remote_worker = ray.remote(concurrency_groups={"io": 1, "control": 1})(TrainWorker)  # type: ignore[call-overload]
    owner_job = ray.get_runtime_context().get_job_id() if outlive_on else ""
    if outlive_on:
        options = lingering_options(outlive_on) | options
    return remote_worker.options(**(actor_options | options)).remote(rank, world_size, owner_job, run.spare_idle_s)
