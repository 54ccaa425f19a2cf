"""What a chunk carries (`ChunkState`: its run, stage, target, plan, store, and the runner's ledger, signals and
trackers) and its commit (`commit_chunk`): the ranks' snapshot, the checkpoint's metadata, the room on the store's
disk, the write under the run lease, and the commit's alerts. `rlhf_core.driver.chunk` trains the chunk.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

from rlhf_core.config import RunConfig
from rlhf_core.driver.engine import WorkerGroup
from rlhf_core.driver.outage import OutageWait, wait_out_outages
from rlhf_core.driver.plan import StageIdentity, StagePlan
from rlhf_core.driver.resume import Lineage
from rlhf_core.driver.runner import StageRunner
from rlhf_core.driver.stop import GraceExpired, StoppedBySignal
from rlhf_core.errors import StoreFull, store_full
from rlhf_core.ops.alerts import Alert, AlertLog, NonFiniteTraining, history_entry, non_finite_metrics
from rlhf_core.ops.commit_alerts import AlertSettings, commit_alerts, expected_bytes_from_metadata
from rlhf_core.ops.goodput import GoodputLedger
from rlhf_core.ops.trackers import OpenTrackers, StageTrackers, tracking_enabled
from rlhf_core.stages import STAGES
from rlhf_core.stages.base import StageConfig
from rlhf_core.storage.checkpoint import CheckpointStore
from rlhf_core.storage.manifest import CheckpointInfo
from rlhf_core.storage.metadata import CheckpointMetadata


@dataclass(frozen=True)
class ChunkState:
    """One chunk of a stage, to `target_step` of the stage's `plan`, in its `store`, on the `runner`'s processes
    (its worker group, ledger, signals and trackers). `train_ahead`: the ranks train on towards the next chunk
    while this one commits."""

    runner: StageRunner
    stage: str
    target_step: int
    plan: StagePlan
    identity: StageIdentity
    store: CheckpointStore
    lineage: Lineage = Lineage()
    train_ahead: bool = True

    @property
    def run(self) -> RunConfig:
        return self.runner.run

    @property
    def config(self) -> StageConfig:
        return self.run.section(self.stage, StageConfig)

    @property
    def ledger(self) -> GoodputLedger:
        return self.runner.ledger

    @property
    def trackers(self) -> OpenTrackers:
        return self.runner.trackers

    def stop_requested(self) -> bool:
        return self.runner.signals.requested()

    def stopped(self, step: int, abandoned_at: int | None = None) -> StoppedBySignal:
        """The exception that ends the chunk after a stop signal, with `step` the stage's newest commit
        (`abandoned_at`: see StoppedBySignal)."""
        return self.runner.signals.stopped(self.stage, step, self.run.stage_url(self.stage), abandoned_at)

    def outage_wait(self, waiting: str, lost: str, meanwhile: str = "") -> OutageWait:
        """How a store call of this chunk waits out an outage (`rlhf_core.driver.outage`), told to the ledger."""
        return OutageWait(self.store.url, waiting, lost, self.run.store_outage_s, meanwhile,
                          waited=lambda seconds: self.ledger.outage_waited(self.stage, seconds))

    def alert_log(self) -> AlertLog:
        return AlertLog(self.run.run_url(), self.run.storage_options)


@dataclass(frozen=True)
class Trained:
    """What one try of a chunk trained: its worker group (now at the step to commit), the store's listing up to
    the target (`infos`), the step it started from, each step's metrics, the trackers, and whether the ranks
    train ahead while the step commits."""

    group: WorkerGroup
    infos: list[CheckpointInfo]
    start_step: int
    step_metrics: list[dict]
    trackers: StageTrackers | None
    train_ahead: bool


@dataclass
class CommitOutcome:
    """A chunk's commit: the committed checkpoint, the alerts it raised, the chunk's metrics summary, the commit's
    timers, and when the ranks began training ahead (None when they did not)."""

    info: CheckpointInfo
    alerts: list[Alert]
    summary: dict[str, float]
    seconds: dict[str, float]
    ahead_since: float | None


def chunk_summary(step_metrics: list[dict[str, float]]) -> dict[str, float]:
    """The last step's metrics, plus the chunk's mean of the headline one (loss, or reward for PPO)."""
    summary = {name: value for name, value in step_metrics[-1].items() if name != "step"}
    headline = "loss" if "loss" in summary else "reward"
    summary[f"mean_{headline}"] = sum(m[headline] for m in step_metrics) / len(step_metrics)
    return summary


def commit_chunk(chunk: ChunkState, trained: Trained) -> CommitOutcome:
    """Check and commit the step the group reached (the chunk's target, or an emergency step), then log its
    alerts. The ranks stand idle only for their snapshot (which checks the weights first): they train ahead before
    the driver prepares the commit, and a full disk found then stops the run with them (`_require_room` still
    comes before any write)."""
    run, group, step = chunk.run, trained.group, trained.group.step
    summary = chunk_summary(trained.step_metrics)
    started = time.perf_counter()
    folders, bad_parameters = group.snapshot()
    _refuse_non_finite(chunk, trained, bad_parameters)
    ahead = _ahead_target(chunk, step) if trained.train_ahead and not run.sync_checkpoint else None
    if ahead is not None:
        group.train_ahead(ahead)
    snapshotted = time.perf_counter()
    pending: list = []  # the uncommitted step, kept across tries: a try after an outage writes into it again

    def store_part() -> tuple[CheckpointMetadata, CheckpointInfo, dict[str, float]]:
        metadata = checkpoint_metadata(chunk, trained, summary)
        _require_room(chunk, metadata, trained.infos)
        pending[:] = pending or [chunk.store.prepare_step(step)]
        return (metadata, *_write(chunk, group, metadata, folders, pending[0]))

    metadata, info, writer_seconds = wait_out_outages(store_part, chunk.outage_wait(
        f"the commit of step {step}", f"step {step} was not committed", meanwhile="training goes on from the snapshot"))
    committed = time.perf_counter()
    stall = (committed if run.sync_checkpoint else snapshotted) - started
    settings = AlertSettings(run.run_name, run.alert_reward_window, run.alert_reward_min_delta,
                             run.alert_size_tolerance, run.alert_size_jump, not chunk.config.disable_ds_ckpt)
    alerts = commit_alerts(settings, metadata, info.size_bytes,
                           [known.size_bytes for known in trained.infos if known.is_committed and known.step < step])
    chunk.alert_log().append(*alerts)
    return CommitOutcome(info, alerts, summary, {"stall": stall, "commit": committed - snapshotted, **writer_seconds},
                         snapshotted if ahead is not None else None)


def checkpoint_metadata(chunk: ChunkState, trained: Trained, summary: dict[str, float]) -> CheckpointMetadata:
    """The metadata of the step the group reached: where it stands in the stage, what trained it and on what
    (the stage's identity: the drift check's inputs), its metrics, and what the commit-time alerts read (the headline
    metric's history along this line of checkpoints, carried forward since retention deletes old ones, and the models'
    sizes)."""
    run, cfg, facts, group, identity = chunk.run, chunk.config, STAGES[chunk.stage], trained.group, chunk.identity
    step, start_step, total_steps = group.step, trained.start_step, chunk.plan.total_steps
    previous = chunk.store.training_metadata(start_step).history_up_to(start_step) if start_step else []
    return CheckpointMetadata(
        stage=chunk.stage, step=step, total_steps=total_steps,
        consumed_samples=step * facts.items_per_step(cfg),
        epoch=step // max(total_steps // facts.num_passes(cfg), 1),
        seed=run.seed, world_size=group.world_size,
        world_size_changes=chunk.runner.world_size_changes,
        zero_stage=group.zero_stage, config_hash=identity.config_hash, config=identity.config,
        save_path=getattr(cfg, facts.output_field, None),
        dataset_fingerprint=identity.dataset_fingerprint, input_models=identity.input_models,
        metrics=summary,
        trackers=trained.trackers.tracker_ids() if trained.trackers is not None else {},
        versions=identity.versions,
        metric_history=(*previous, history_entry(step, summary)),
        model_sizes=group.model_sizes())


def _refuse_non_finite(chunk: ChunkState, trained: Trained, bad_parameters: list[str]) -> None:
    """NaN or Inf in a loss or a weight: log the alert and fail the chunk before anything is committed."""
    bad_metrics = sorted({name for metrics in trained.step_metrics for name in non_finite_metrics(metrics)})
    if bad_metrics or bad_parameters:
        error = NonFiniteTraining(chunk.stage, trained.group.step, bad_metrics, bad_parameters)
        chunk.alert_log().append(error.to_alert(chunk.run.run_name))
        raise error


def _ahead_target(chunk: ChunkState, step: int) -> int | None:
    """How far the ranks train on while `step` commits: to the next chunk's end, or with trackers to the
    next logged step (so its metrics show without waiting for the chunk); None after the last chunk."""
    later = [target for target in chunk.plan.targets if target > step]
    if not later:
        return None
    if tracking_enabled(chunk.run):
        logging_steps = chunk.config.logging_steps
        return min(later[0], (step // logging_steps + 1) * logging_steps)
    return later[0]


def _require_room(chunk: ChunkState, metadata: CheckpointMetadata, infos: list[CheckpointInfo]) -> None:
    """Stop at this chunk boundary, before writing anything, when the checkpoint will not fit on the store's
    disk: its predicted size (the size alert's) or the previous checkpoint's, whichever is larger."""
    free_bytes = chunk.store.free_bytes()
    if free_bytes is None:
        return
    predicted = expected_bytes_from_metadata(metadata, has_ds_state=not chunk.config.disable_ds_ckpt)
    known = [size for size in (predicted, *(info.size_bytes for info in infos[-1:] if info.is_committed)) if size]
    if known and max(known) > free_bytes:
        raise store_full(chunk.store.url, free_bytes=free_bytes, needed_bytes=max(known))


def _write(chunk: ChunkState, group: WorkerGroup, metadata: CheckpointMetadata, folders: list[str],
           pending) -> tuple[CheckpointInfo, dict[str, float]]:
    """Every rank uploads its snapshot (`folders`) into the uncommitted step `pending` (`prepare_step`'s); the driver
    commits them under the run lease. The chunk returns after its commit: a chunk the flow (and Prefect's cache)
    calls done is always committed. Also returns rank 0's writer timers."""
    store = chunk.store
    if isinstance(pending, CheckpointInfo):
        group.drop_snapshots(folders)
        return pending, {}
    try:
        writes = group.start_write(folders, chunk.run.stage_url(chunk.stage), chunk.run.storage_options, pending)
        entries = group.finish_write(writes)
        with chunk.runner.commit_fence() as lease:
            info = store.finish_commit(pending, entries, metadata.to_json(), fence=lease)
    except StoreFull:
        store.discard(pending)  # its space back for the next try; the committed steps are untouched
        raise
    except GraceExpired:
        chunk.runner.release_workers()  # no rank writes into it any more
        with contextlib.suppress(OSError):
            store.discard(pending)  # else the next run sets it aside as a leftover
        raise
    return info, {f"writer_{name}": seconds for name, seconds in group.write_seconds.items()}
