"""One chunk of a training stage: `ensure_checkpoint(runner, stage, target_step)` returns the target if it is
committed, else trains to it from the newest good checkpoint on a Ray worker group (a warm one reused when it holds
that state) and commits under the run lease, logging metrics to the stage's trackers on the way.
docs/design-notes.md ("One chunk of training") has the details.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import asdict, dataclass, field

from rlhf_core.driver.outage import wait_out_outages
from rlhf_core.driver.stop import GraceExpired
from rlhf_core.ops.alerts import AlertLog, NonFiniteTraining, history_entry, non_finite_metrics
from rlhf_core.ops.commit_alerts import commit_alerts, expected_bytes_from_metadata
from rlhf_core.storage.checkpoint import CheckpointStore
from rlhf_core.storage.manifest import CheckpointInfo
from rlhf_core.config import RunConfig, semantic_fields, semantic_hash
from rlhf_core.stages import STAGES
from rlhf_core.stages.base import StageConfig
from rlhf_core.data.prepared import recorded_hashes
from rlhf_core.data.fingerprints import dataset_fingerprint
from rlhf_core.driver.engine import WorkerGroup
from rlhf_core.driver.runner import Replacement, StageRunner
from rlhf_core.errors import RankHung, StoreFull, WorkerLost, store_full
from rlhf_core.faults import fault_point
from rlhf_core.storage.locate import input_model_fingerprints
from rlhf_core.driver.plan import StagePlan
from rlhf_core.driver.resume import Lineage, open_store
from rlhf_core.ops.trackers import StageTrackers, require_tracker_packages, tracking_enabled

CHECKPOINT_FORMAT_VERSION = 1


@dataclass
class ChunkResult:
    """What a chunk hands to the flow: small and JSON-able, never tensors."""

    stage: str
    step: int
    uri: str
    manifest_digest: str
    num_steps_trained: int
    metrics: dict[str, float] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    world_size: int = 0  # ranks that trained the chunk (0: none trained, the step was already committed)
    alerts: list[dict] = field(default_factory=list)  # rlhf.alert.* raised by this commit (rlhf_core.ops.alerts)
    size_bytes: int = 0  # bytes of the committed checkpoint (0 when unknown)

    def to_dict(self) -> dict:
        return asdict(self)


def _metadata(run: RunConfig, stage: str, plan: StagePlan, step: int, metrics: dict,
              trackers: StageTrackers | None, world_size: int, world_size_changes: list[dict],
              zero_stage: int | None) -> dict:
    from importlib.metadata import version  # not the imports: deepspeed's alone costs the driver ~0.6 s

    cfg, facts = run.section(stage, StageConfig), STAGES[stage]
    return {
        "format_version": CHECKPOINT_FORMAT_VERSION,
        "stage": stage,
        "step": step,
        "total_steps": plan.total_steps,
        "consumed_samples": step * facts.items_per_step(cfg),
        "epoch": step // max(plan.total_steps // facts.num_passes(cfg), 1),
        "seed": run.seed,
        "world_size": world_size,
        "world_size_changes": world_size_changes,
        "zero_stage": zero_stage,
        "config_hash": semantic_hash(run, stage),
        "config": semantic_fields(cfg),
        "save_path": getattr(cfg, facts.output_field, None),
        "dataset_fingerprint": dataset_fingerprint(cfg, run.storage_options,
                                                   recorded_hashes(run.ckpt_path, run.storage_options)),
        "input_models": input_model_fingerprints(cfg, run.storage_options),
        "metrics": metrics,
        "trackers": trackers.tracker_ids() if trackers is not None else {},
        "versions": {package: version(package) for package in ("torch", "deepspeed", "transformers")},
    }


def chunk_summary(step_metrics: list[dict[str, float]]) -> dict[str, float]:
    """The last step's metrics, plus the chunk's mean of the headline one (loss, or reward for PPO)."""
    summary = {name: value for name, value in step_metrics[-1].items() if name != "step"}
    headline = "loss" if "loss" in summary else "reward"
    summary[f"mean_{headline}"] = sum(m[headline] for m in step_metrics) / len(step_metrics)
    return summary


def _saved_tracker_ids(runner: StageRunner, run: RunConfig, stage: str, store: CheckpointStore,
                       start_step: int) -> dict:
    """The tracker ids to continue: those open for this stage, else those the start checkpoint recorded
    (else the newest committed checkpoint's, when training starts over below all of them)."""
    trackers = runner.trackers.get(run, stage)
    if trackers is not None:
        return trackers.tracker_ids()
    committed = [info.step for info in store.list() if info.is_committed]
    source = start_step or (committed[-1] if committed else 0)
    return store.read_metadata(source).get("trackers", {}) if source else {}


def _trackers_at(runner: StageRunner, run: RunConfig, stage: str, store: CheckpointStore, start_step: int,
                 warm: bool) -> StageTrackers | None:
    """The stage's trackers, ready to log the steps after `start_step`; reopened when the group started
    cold, so that TensorBoard hides whatever an earlier attempt logged past `start_step`."""
    if not tracking_enabled(run):
        return None
    trackers = runner.trackers.get(run, stage)
    if trackers is not None and warm:
        return trackers
    return runner.trackers.open(run, stage, _saved_tracker_ids(runner, run, stage, store, start_step), start_step)


def train_and_log(group: WorkerGroup, start_step: int, target_step: int, trackers: StageTrackers | None,
                  logging_steps: int, stage: str, total_steps: int) -> list[dict[str, float]]:
    """Train to `target_step`; with trackers (or a live console bar), stop at each logged step so its metrics
    show while the chunk runs (steps the group already trained ahead come back together)."""
    from rlhf_core.ops import console

    if trackers is None and not console.live_progress():
        return group.train_until(target_step)
    ahead = group.training_ahead_to or 0
    stops = [step for step in range(max(start_step, ahead) + 1, target_step) if step % logging_steps == 0]
    step_metrics = []
    for stop_step in ([ahead] if start_step < ahead < target_step else []) + stops + [target_step]:
        new_metrics = group.train_until(stop_step)
        if trackers is not None:
            trackers.log(new_metrics)
        if new_metrics:
            console.show_step(stage, group.step, total_steps, new_metrics[-1])
        step_metrics += new_metrics
        if group.step < stop_step:  # stopped by a signal (rlhf_core.driver.stop)
            break
    return step_metrics


@dataclass
class ChunkTiming:
    """When each phase of a chunk ended (`time.perf_counter()`), and the commit's own timers."""

    started: float = field(default_factory=time.perf_counter)
    prepared: float = 0.0  # planned, and the store listed
    loaded: float = 0.0  # a worker group holds the start state
    trained: float = 0.0  # the ranks reached the step to commit
    commit_seconds: dict[str, float] = field(default_factory=dict)

    def seconds(self, finished: float) -> dict[str, float]:
        return {"plan": self.prepared - self.started, "workers_and_load": self.loaded - self.prepared,
                "train": self.trained - self.loaded, "save_and_commit": finished - self.trained,
                **self.commit_seconds}


@dataclass
class CommitOutcome:
    """A chunk's commit: the committed checkpoint, the alerts it raised, the chunk's metrics summary, the commit's
    timers, and when the ranks began training ahead (None when they did not)."""

    info: CheckpointInfo
    alerts: list
    summary: dict[str, float]
    seconds: dict[str, float]
    ahead_since: float | None


def ensure_checkpoint(runner: StageRunner, stage: str, target_step: int, lineage: Lineage = Lineage(),
                      train_ahead: bool = True, plan: StagePlan | None = None) -> ChunkResult:
    """Make sure a valid checkpoint at `target_step` exists (training only what is missing), in five steps: find
    what is committed, get a worker group holding the start state, train, commit, retain. With `train_ahead`, the
    ranks train on towards the next chunk while this one commits. `plan`: the stage's (the runner's by default).
    A lost or hung rank is replaced at once, with no retry delay: the chunk trains again from the last commit on
    new ranks (`StageRunner.replaces_ranks_after`). After a stop signal (`rlhf_core.driver.stop`) the ranks stop at
    the next step boundary, that step commits, and StoppedBySignal is raised; one that finds nothing trained since
    the last commit raises it at once. The run's settings are the runner's."""
    run = runner.run
    plan = plan or runner.plan(stage)
    target_step = min(target_step, plan.total_steps)
    store = open_store(run, stage)
    replacing: Replacement | None = None
    while True:
        # preflight reached the store: an outage now is waited out, as a commit's is
        listing = wait_out_outages(store.list, store.url, f"the chunk to step {target_step}",
                                   f"the chunk to step {target_step} did not start", run.store_outage_s,
                                   waited=lambda seconds: runner.ledger.outage_waited(stage, seconds))
        infos = [info for info in listing if info.step <= target_step]
        newest = max((info.step for info in infos if info.is_committed), default=0)
        committed = _committed_result(runner, stage, plan, store, listing, infos, target_step)
        if committed is not None:
            return committed
        warm_group = runner.warm_group
        if runner.signals.requested() and (warm_group is None or warm_group.training_ahead_to is None):
            raise runner.signals.stopped(stage, newest, run.stage_url(stage))  # nothing trained since the last commit
        runner.ledger.chunk_started(stage, newest, target_step)
        try:
            return _train_and_commit(runner, stage, plan, store, infos, newest, target_step, lineage, train_ahead,
                                     replacing)
        except (WorkerLost, RankHung) as error:
            if not runner.replaces_ranks_after(error, stage, target_step):
                raise
            replacing = Replacement(error)


def _train_and_commit(runner: StageRunner, stage: str, plan: StagePlan, store: CheckpointStore,
                      infos: list[CheckpointInfo], newest: int, target_step: int, lineage: Lineage,
                      train_ahead: bool, replacing: Replacement | None) -> ChunkResult:
    """Train from the newest good checkpoint in `infos` (committed up to `newest`) to `target_step` and commit.
    On a failure the group is released (its state is unknown) and the ledger told; `replacing`: the loss this try
    replaces the ranks after, whose times it reports."""
    run, timing, reached = runner.run, ChunkTiming(), newest
    try:
        require_tracker_packages(run)  # before the workers start, not after a chunk of training
        timing.prepared = time.perf_counter()
        warm_group = runner.warm_group
        group, _ = runner.group_at(stage, plan, store, infos, lineage)
        start_step = group.step
        if replacing is not None:
            replacing.ready(group)
        trackers = _trackers_at(runner, run, stage, store, start_step, warm=group is warm_group)
        timing.loaded = time.perf_counter()
        step_metrics = train_and_log(group, start_step, target_step, trackers,
                                     run.section(stage, StageConfig).logging_steps, stage, plan.total_steps)
        reached, timing.trained = group.step, time.perf_counter()
        if replacing is not None:
            replacing.trained(runner.ledger, stage, group)
        _require_progress(runner, run, stage, start_step, reached, target_step)
        outcome = commit_chunk(runner, stage, plan, store, group, infos, start_step, step_metrics, trackers,
                               train_ahead and not runner.signals.requested())
    except GraceExpired:
        runner.trackers.close(run, stage)
        runner.release_workers()  # kills the ranks: the step in flight, or its half-written checkpoint, is abandoned
        raise runner.signals.stopped(stage, newest, run.stage_url(stage), stopped_at=reached,
                                     abandoned=True) from None
    except BaseException as error:
        runner.trackers.close(run, stage, failed=True)
        runner.release_workers()  # the group's state is unknown after a failure: never reuse it
        runner.ledger.chunk_failed(stage, getattr(error, "lost_to", None))
        raise
    timing.commit_seconds = outcome.seconds
    return _retain(runner, run, stage, plan, store, group, start_step, target_step, outcome, timing)


def _committed_result(runner: StageRunner, stage: str, plan: StagePlan, store: CheckpointStore,
                      listing: list[CheckpointInfo], infos: list[CheckpointInfo],
                      target_step: int) -> ChunkResult | None:
    """The chunk's result when nothing is left to train: its target is committed (the last of `infos`, the listing
    up to the target), or retention removed it once a later checkpoint committed (its work is in there; never
    train it again)."""
    if infos and infos[-1].step == target_step and infos[-1].is_committed:
        done = infos[-1]
        runner.signals.record_commit(stage, target_step, runner.run.stage_url(stage))
        if target_step == plan.total_steps:
            runner.trackers.close(runner.run, stage)
        return ChunkResult(stage, target_step, done.uri, done.manifest_digest, 0,
                           store.read_metadata(target_step).get("metrics", {}), size_bytes=done.size_bytes)
    later = next((info for info in listing if info.is_committed and info.step > target_step), None)
    if later is not None:
        return ChunkResult(stage, target_step, later.uri, later.manifest_digest, 0)
    return None


def _require_progress(runner: StageRunner, run: RunConfig, stage: str, start_step: int, reached: int,
                      target_step: int) -> None:
    """The ranks stop short of the target only for a stop signal; one before the first step commits nothing."""
    if reached < target_step and not runner.signals.requested():
        raise RuntimeError(f"the ranks stopped at step {reached}, short of {target_step}, with no stop requested")
    if reached == start_step and runner.signals.requested():
        raise runner.signals.stopped(stage, start_step, run.stage_url(stage))


def _retain(runner: StageRunner, run: RunConfig, stage: str, plan: StagePlan, store: CheckpointStore,
            group: WorkerGroup, start_step: int, target_step: int, outcome: CommitOutcome,
            timing: ChunkTiming) -> ChunkResult:
    """After the commit: record it, apply retention, account the chunk's time, and hand the flow its result."""
    reached = outcome.info.step
    runner.signals.record_commit(stage, reached, run.stage_url(stage))
    if reached == plan.total_steps:
        runner.trackers.close(run, stage)
    runner.keep_spares(stage)
    fault_point("after_commit", reached)
    store.retain(run.max_ckpt_num, run.max_ckpt_mem)
    finished = time.perf_counter()
    seconds = {**timing.seconds(finished), **group.take_step_loop_seconds()}  # the ranks' own, training ahead too
    trained_ahead_s = 0.0 if outcome.ahead_since is None else finished - outcome.ahead_since
    runner.ledger.chunk_committed(stage, reached, seconds, num_steps=reached - start_step,
                                  trained_ahead_s=trained_ahead_s)
    if reached < target_step:  # an emergency checkpoint: the stop is done
        raise runner.signals.stopped(stage, reached, run.stage_url(stage))
    return ChunkResult(stage, reached, outcome.info.uri, outcome.info.manifest_digest, reached - start_step,
                       outcome.summary, seconds, group.world_size,
                       [json.loads(alert.to_json()) for alert in outcome.alerts], outcome.info.size_bytes)


def commit_chunk(runner: StageRunner, stage: str, plan: StagePlan, store: CheckpointStore, group: WorkerGroup,
                 infos: list[CheckpointInfo], start_step: int, step_metrics: list[dict],
                 trackers: StageTrackers | None, train_ahead: bool) -> CommitOutcome:
    """Check and commit the step the group reached (the chunk's target, or an emergency step), then log its
    alerts. The ranks stand idle only for their snapshot (which checks the weights first): they train ahead before
    the driver prepares the commit, and a full disk found then stops the run with them (`_require_room` still
    comes before any write)."""
    run, step = runner.run, group.step
    summary = chunk_summary(step_metrics)
    started = time.perf_counter()
    folders, bad_parameters = group.snapshot()
    _refuse_non_finite(run, stage, step, step_metrics, bad_parameters)
    ahead = _ahead_target(run, stage, plan, step) if train_ahead and not run.sync_checkpoint else None
    if ahead is not None:
        group.train_ahead(ahead)
    snapshotted = time.perf_counter()
    pending: list = []  # the uncommitted step, kept across tries: a try after an outage writes into it again

    def store_part() -> tuple[dict, CheckpointInfo, dict[str, float]]:
        metadata = _metadata(run, stage, plan, step, summary, trackers, group.world_size,
                             runner.world_size_changes, group.zero_stage)
        metadata |= _alert_inputs(store, group, start_step, step, summary)
        _require_room(run, stage, store, metadata, infos)
        pending[:] = pending or [store.prepare_step(step)]
        return (metadata, *_commit(runner, run, stage, store, group, step, metadata, folders, pending[0]))

    metadata, info, writer_seconds = wait_out_outages(
        store_part, store.url, f"the commit of step {step}", f"step {step} was not committed", run.store_outage_s,
        meanwhile="training goes on from the snapshot",
        waited=lambda seconds: runner.ledger.outage_waited(stage, seconds))
    committed = time.perf_counter()
    stall = (committed if run.sync_checkpoint else snapshotted) - started
    alerts = commit_alerts(run.run_name, stage, step, metadata, info.size_bytes,
                           [known.size_bytes for known in infos if known.is_committed and known.step < step],
                           has_ds_state=not run.section(stage, StageConfig).disable_ds_ckpt,
                           window=run.alert_reward_window, min_delta=run.alert_reward_min_delta,
                           tolerance=run.alert_size_tolerance, jump=run.alert_size_jump)
    AlertLog(run.run_url(), run.storage_options).append(*alerts)
    return CommitOutcome(info, alerts, summary, {"stall": stall, "commit": committed - snapshotted, **writer_seconds},
                         snapshotted if ahead is not None else None)


def _refuse_non_finite(run: RunConfig, stage: str, step: int, step_metrics: list[dict],
                       bad_parameters: list[str]) -> None:
    """NaN or Inf in a loss or a weight: log the alert and fail the chunk before anything is committed."""
    bad_metrics = sorted({name for metrics in step_metrics for name in non_finite_metrics(metrics)})
    if bad_metrics or bad_parameters:
        error = NonFiniteTraining(stage, step, bad_metrics, bad_parameters)
        AlertLog(run.run_url(), run.storage_options).append(error.to_alert(run.run_name))
        raise error


def _alert_inputs(store: CheckpointStore, group: WorkerGroup, start_step: int, step: int, summary: dict) -> dict:
    """What the commit-time alerts read from a checkpoint's metadata: the headline metric's history along
    this line of checkpoints (carried forward, since retention deletes old ones) and the models' sizes."""
    previous = store.read_metadata(start_step).get("metric_history", []) if start_step else []
    history = [entry for entry in previous if entry["step"] <= start_step] + [history_entry(step, summary)]
    return {"metric_history": history, "model_sizes": group.model_sizes()}


def _ahead_target(run: RunConfig, stage: str, plan: StagePlan, step: int) -> int | None:
    """How far the ranks train on while `step` commits: to the next chunk's end, or with trackers to the
    next logged step (so its metrics show without waiting for the chunk); None after the last chunk."""
    later = [target for target in plan.targets if target > step]
    if not later:
        return None
    if tracking_enabled(run):
        logging_steps = run.section(stage, StageConfig).logging_steps
        return min(later[0], (step // logging_steps + 1) * logging_steps)
    return later[0]


def _require_room(run: RunConfig, stage: str, store: CheckpointStore, metadata: dict, infos: list) -> None:
    """Stop at this chunk boundary, before writing anything, when the checkpoint will not fit on the store's
    disk: its predicted size (the size alert's) or the previous checkpoint's, whichever is larger."""
    free_bytes = store.free_bytes()
    if free_bytes is None:
        return
    predicted = expected_bytes_from_metadata(metadata, has_ds_state=not run.section(stage, StageConfig).disable_ds_ckpt)
    known = [size for size in (predicted, *(info.size_bytes for info in infos[-1:] if info.is_committed)) if size]
    if known and max(known) > free_bytes:
        raise store_full(store.url, free_bytes=free_bytes, needed_bytes=max(known))


def _commit(runner: StageRunner, run: RunConfig, stage: str, store: CheckpointStore, group: WorkerGroup, step: int,
            metadata: dict, folders: list[str], pending) -> tuple[CheckpointInfo, dict[str, float]]:
    """Every rank uploads its snapshot (`folders`) into the uncommitted step `pending` (`prepare_step`'s); the driver
    commits them under the run lease. The chunk returns after its commit: a chunk the flow (and Prefect's cache)
    calls done is always committed. Also returns rank 0's writer timers."""
    if isinstance(pending, CheckpointInfo):
        group.drop_snapshots(folders)
        return pending, {}
    try:
        writes = group.start_write(folders, run.stage_url(stage), run.storage_options, pending)
        entries = group.finish_write(writes)
        with runner.commit_fence() as lease:
            info = store.finish_commit(pending, entries, metadata, fence=lease)
    except StoreFull:
        store.discard(pending)  # its space back for the next try; the committed steps are untouched
        raise
    except GraceExpired:
        runner.release_workers()  # no rank writes into it any more
        with contextlib.suppress(OSError):
            store.discard(pending)  # else the next run sets it aside as a leftover
        raise
    return info, {f"writer_{name}": seconds for name, seconds in group.write_seconds.items()}
