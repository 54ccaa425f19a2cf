"""One chunk of a training stage: `ensure_checkpoint(runner, stage, target_step)` returns the target if it is
committed, else trains to it from the newest good checkpoint on a Ray worker group (a warm one reused when it holds
that state) and commits under the run lease, logging metrics to the stage's trackers on the way. A `Chunk` carries
what every step needs (the run, stage, target, plan, store, and the runner's ledger and signals); the commit itself
is `rlhf_core.driver.chunk_commit`. docs/design-notes.md ("One chunk of training") has the details.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

from rlhf_core.driver.chunk_commit import ChunkState, CommitOutcome, Trained, commit_chunk
from rlhf_core.driver.engine import WorkerGroup
from rlhf_core.driver.outage import wait_out_outages
from rlhf_core.driver.plan import StagePlan
from rlhf_core.driver.resume import Lineage, open_store
from rlhf_core.driver.runner import Replacement, StageRunner
from rlhf_core.driver.stop import GraceExpired
from rlhf_core.errors import RankHung, WorkerLost
from rlhf_core.faults import fault_point
from rlhf_core.ops.trackers import StageTrackers, require_tracker_packages, tracking_enabled
from rlhf_core.storage.manifest import CheckpointInfo


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


def train_and_log(group: WorkerGroup, target_step: int, trackers: StageTrackers | None, logging_steps: int,
                  stage: str, total_steps: int) -> list[dict[str, float]]:
    """Train from the group's step to `target_step`; with trackers (or a live console bar), stop at each logged
    step so its metrics show while the chunk runs (steps the group already trained ahead come back together)."""
    from rlhf_core.ops import console

    if trackers is None and not console.live_progress():
        return group.train_until(target_step)
    start_step, ahead = group.step, group.training_ahead_to or 0
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


class Chunk(ChunkState):
    """One chunk of a stage (`ChunkState`: what it carries) and the steps that train and commit it."""

    @classmethod
    def of(cls, runner: StageRunner, stage: str, target_step: int, lineage: Lineage = Lineage(),
           train_ahead: bool = True, plan: StagePlan | None = None) -> Chunk:
        """The chunk of the runner's run to `target_step` (at most the stage's last step); `plan`: the stage's
        (the runner's by default)."""
        plan = plan or runner.plan(stage)
        return cls(runner, stage, min(target_step, plan.total_steps), plan, runner.identity(stage),
                   open_store(runner.run, stage), lineage, train_ahead)

    # ----------------------------------------------------------------- the chunk's steps

    def ensure(self) -> ChunkResult:
        """Make sure a valid checkpoint at the target exists (training only what is missing): find what is
        committed, get a worker group holding the start state, train, commit, retain. A lost or hung rank is
        replaced at once, with no retry delay: the chunk trains again on new ranks from the newest snapshot
        between commits every rank holds, else from the last commit (`StageRunner.replaces_ranks_after`). After a
        stop signal (`rlhf_core.driver.stop`) the ranks stop at the next step boundary, that step commits, and
        StoppedBySignal is raised; one that finds nothing trained since the last commit raises it at once."""
        target = self.target_step
        replacing: Replacement | None = None
        while True:
            # preflight reached the store: an outage now is waited out, as a commit's is
            listing = wait_out_outages(self.store.list, self.outage_wait(
                f"the chunk to step {target}", f"the chunk to step {target} did not start"))
            infos = [info for info in listing if info.step <= target]
            newest = max((info.step for info in infos if info.is_committed), default=0)
            committed = self._committed_result(listing, infos)
            if committed is not None:
                return committed
            warm_group = self.runner.warm_group
            if self.stop_requested() and (warm_group is None or warm_group.training_ahead_to is None):
                raise self.stopped(newest)  # nothing trained since the last commit
            self.ledger.chunk_started(self.stage, newest, target)
            try:
                return self._train_and_commit(infos, newest, replacing)
            except (WorkerLost, RankHung) as error:
                if not self.runner.replaces_ranks_after(error, self.stage, target):
                    raise
                replacing = Replacement(error, self.runner.released_slowest_step_s)

    def _committed_result(self, listing: list[CheckpointInfo], infos: list[CheckpointInfo]) -> ChunkResult | None:
        """The chunk's result when nothing is left to train: its target is committed (the last of `infos`, the listing
        up to the target), or retention removed it once a later checkpoint committed (its work is in there; never
        train it again)."""
        target = self.target_step
        if infos and infos[-1].step == target and infos[-1].is_committed:
            done = infos[-1]
            self._record_commit(target)
            return ChunkResult(self.stage, target, done.uri, done.manifest_digest, 0,
                               self.store.training_metadata(target).metrics, size_bytes=done.size_bytes)
        later = next((info for info in listing if info.is_committed and info.step > target), None)
        if later is not None:
            return ChunkResult(self.stage, target, later.uri, later.manifest_digest, 0)
        return None

    def _train_and_commit(self, infos: list[CheckpointInfo], newest: int,
                          replacing: Replacement | None) -> ChunkResult:
        """Train from the newest good checkpoint in `infos` (committed up to `newest`) to the target and commit.
        On a failure the group is released (its state is unknown) and the ledger told; `replacing`: the loss this
        try replaces the ranks after, whose times it reports."""
        timing, reached = ChunkTiming(), newest
        try:
            trained = self._train(infos, replacing, timing)
            reached = trained.group.step
            self._require_progress(trained)
            outcome = commit_chunk(self, trained)
        except GraceExpired:
            self.trackers.close(self.run, self.stage)
            # kills the ranks: the step in flight, or its half-written checkpoint, is abandoned
            self.runner.release_workers()
            raise self.stopped(newest, abandoned_at=reached) from None
        except BaseException as error:
            self.trackers.close(self.run, self.stage, failed=True)
            self.runner.release_workers()  # the group's state is unknown after a failure: never reuse it
            self.ledger.chunk_failed(self.stage, getattr(error, "lost_to", None))
            raise
        timing.commit_seconds = outcome.seconds
        return self._after_commit(trained, outcome, timing)

    def _train(self, infos: list[CheckpointInfo], replacing: Replacement | None, timing: ChunkTiming) -> Trained:
        """A worker group holding the newest good checkpoint in `infos`, trained to the target (or to a stop)."""
        require_tracker_packages(self.run)  # before the workers start, not after a chunk of training
        timing.prepared = time.perf_counter()
        warm_group = self.runner.warm_group
        group, _ = self.runner.group_at(self.stage, self.plan, self.store, infos, self.lineage,
                                        restore_below=self.target_step if replacing is not None else None)
        # A group started from a snapshot between commits trains on from it; the chunk still counts from the commit.
        restored, group.restored = group.restored, None
        start_step = restored.base_step if restored is not None else group.step
        if replacing is not None:
            replacing.ready(group, restored)
            group.expect_steps_like(replacing.slowest_step_s)
        trackers = self._trackers_at(start_step, warm=group is warm_group, resumed_at=group.step)
        timing.loaded = time.perf_counter()
        step_metrics = (restored.metrics if restored is not None else []) + train_and_log(
            group, self.target_step, trackers, self.config.logging_steps, self.stage, self.plan.total_steps)
        timing.trained = time.perf_counter()
        if replacing is not None:
            replacing.trained(self.ledger, self.stage, group)
        return Trained(group, infos, start_step, step_metrics, trackers,
                       self.train_ahead and not self.stop_requested())

    def _trackers_at(self, start_step: int, warm: bool, resumed_at: int) -> StageTrackers | None:
        """The stage's trackers, ready to log the steps after `resumed_at` (the commit `start_step`, or a snapshot
        after it); reopened when the group started cold, so that TensorBoard hides whatever an earlier attempt
        logged past `resumed_at`."""
        if not tracking_enabled(self.run):
            return None
        trackers = self.trackers.get(self.run, self.stage)
        if trackers is not None and warm:
            return trackers
        return self.trackers.open(self.run, self.stage, self._saved_tracker_ids(start_step), resumed_at)

    def _saved_tracker_ids(self, start_step: int) -> dict:
        """The tracker ids to continue: those open for this stage, else those the start checkpoint recorded
        (else the newest committed checkpoint's, when training starts over below all of them)."""
        trackers = self.trackers.get(self.run, self.stage)
        if trackers is not None:
            return trackers.tracker_ids()
        committed = [info.step for info in self.store.list() if info.is_committed]
        source = start_step or (committed[-1] if committed else 0)
        return self.store.training_metadata(source).trackers if source else {}

    def _require_progress(self, trained: Trained) -> None:
        """The ranks stop short of the target only for a stop signal; one before the first step commits nothing."""
        reached = trained.group.step
        if reached < self.target_step and not self.stop_requested():
            raise RuntimeError(f"the ranks stopped at step {reached}, short of {self.target_step}, "
                               "with no stop requested")
        if reached == trained.start_step and self.stop_requested():
            raise self.stopped(trained.start_step)

    # ----------------------------------------------------------------- after the commit

    def _after_commit(self, trained: Trained, outcome: CommitOutcome, timing: ChunkTiming) -> ChunkResult:
        """After the commit: record it, keep spares and the retention, account the chunk's time, and hand the
        flow its result (or end the stop an emergency checkpoint was for)."""
        reached = outcome.info.step
        self._record_commit(reached)
        self._housekeep(reached)
        seconds = self._account(trained, outcome, timing)
        if reached < self.target_step:  # an emergency checkpoint: the stop is done
            raise self.stopped(reached)
        return ChunkResult(self.stage, reached, outcome.info.uri, outcome.info.manifest_digest,
                           reached - trained.start_step, outcome.summary, seconds, trained.group.world_size,
                           [json.loads(alert.to_json()) for alert in outcome.alerts], outcome.info.size_bytes)

    def _record_commit(self, step: int) -> None:
        """The newest commit, for a stop's last line; the stage's trackers close at its last step."""
        self.runner.signals.record_commit(self.stage, step, self.run.stage_url(self.stage))
        if step == self.plan.total_steps:
            self.trackers.close(self.run, self.stage)

    def _housekeep(self, step: int) -> None:
        """The warm group's spares, then the retention of old checkpoints."""
        self.runner.keep_spares(self.stage)
        fault_point("after_commit", step)
        self.store.retain(self.run.max_ckpt_num, self.run.max_ckpt_mem)

    def _account(self, trained: Trained, outcome: CommitOutcome, timing: ChunkTiming) -> dict[str, float]:
        """The chunk's timers, the ranks' own included (training ahead too), told to the goodput ledger."""
        finished = time.perf_counter()
        seconds = {**timing.seconds(finished), **trained.group.take_step_loop_seconds()}
        trained_ahead_s = 0.0 if outcome.ahead_since is None else finished - outcome.ahead_since
        reached = outcome.info.step
        self.ledger.chunk_committed(self.stage, reached, seconds, num_steps=reached - trained.start_step,
                                    trained_ahead_s=trained_ahead_s)
        return seconds


def ensure_checkpoint(runner: StageRunner, stage: str, target_step: int, lineage: Lineage = Lineage(),
                      train_ahead: bool = True, plan: StagePlan | None = None) -> ChunkResult:
    """Make sure a valid checkpoint at `target_step` of the runner's run exists (`Chunk.ensure`)."""
    return Chunk.of(runner, stage, target_step, lineage, train_ahead, plan).ensure()
