"""What the driver holds for one run in this process, in one object: the worker group kept warm between chunks
(or started ahead of the first), the stages' open trackers, the goodput ledger, the run lease and the stage plans.

The flow `rlhf` (or the CLI that starts it, or `train_stage`) creates a `StageRunner`, hands it to every chunk,
and closes it: the ranks stop and the trackers close. Nothing of it lives in class attributes or module globals.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

from rlhf_core.config import RunConfig, semantic_hash
from rlhf_core.driver.engine import WorkerGroup, group_settings
from rlhf_core.driver.plan import Checked, StagePlan, plan_stage
from rlhf_core.driver.repeats import ChunkTries
from rlhf_core.driver.spares import SPARES_AFTER_S, SparePool, num_spares
from rlhf_core.driver.stop import StopSignals
from rlhf_core.errors import RankHung, WorkerLost
from rlhf_core.driver.resume import Lineage, StartState, load_start
from rlhf_core.ops.goodput import GoodputLedger
from rlhf_core.ops.trackers import OpenTrackers
from rlhf_core.storage.checkpoint import CheckpointStore
from rlhf_core.storage.lease import RunLease
from rlhf_core.storage.manifest import CheckpointInfo
from rlhf_core.stages.base import StageConfig

logger = logging.getLogger(__name__)
# How many times one chunk replaces its ranks in place before the failure goes to the chunk task's retries (which
# wait between tries); after as many, the same failure at the same place stops the run (`driver/repeats.py`).
MAX_REPLACEMENTS_PER_CHUNK = 3

@dataclass
class WarmGroup:
    """The worker group of the last chunk, the identity of the state it holds, and the world-size changes of the
    line of checkpoints it continues."""

    group: WorkerGroup
    identity: tuple
    world_size_changes: list[dict] = field(default_factory=list)


@dataclass
class Replacement:
    """A chunk training again on new ranks after `error` (a lost or hung rank), seen at `seen_at` (time.time())."""

    error: BaseException
    seen_at: float = field(default_factory=time.time)
    ready_at: float = 0.0

    def ready(self, group: WorkerGroup) -> None:
        """The new ranks hold the start state: the run's one console line for the loss."""
        self.ready_at = time.time()
        logger.warning("%s Replaced the ranks in %.1f s (%d of %d from warm spares); training again from step %d.",
                       self.error, self.ready_at - self.seen_at, group.num_spares_taken, group.world_size, group.step)

    def trained(self, ledger: GoodputLedger, stage: str, group: WorkerGroup) -> None:
        """The new ranks trained: the replacement's times go to the goodput ledger."""
        ledger.ranks_replaced(stage, getattr(self.error, "lost_to", "lost ranks"), self.seen_at, self.ready_at,
                              group.first_step_seconds)


class Prestart:
    """A worker group being started in a thread, and the settings it was started with."""

    def __init__(self, run: RunConfig, stage: str, signals: StopSignals):
        self.settings, self.signals = group_settings(run), signals
        self.outcome: WorkerGroup | BaseException | None = None
        self.thread = threading.Thread(target=self._build, args=(run, stage), name="rlhf-prestart-workers",
                                       daemon=True)
        self.thread.start()

    def _build(self, run: RunConfig, stage: str) -> None:
        try:
            group = WorkerGroup(run, self.signals)
            group.warm_up(run, stage)
            self.outcome = group
        except BaseException as error:  # noqa: BLE001 - handed to the chunk that adopts the group
            self.outcome = error

    def wait(self) -> WorkerGroup | BaseException | None:
        """The started group, or its start's error, once the start has ended (the group stays here)."""
        self.thread.join()
        return self.outcome

    def take(self, run: RunConfig) -> WorkerGroup | None:
        """The started group if it suits `run` (raising its start's error, if that failed); None when it does not
        suit `run` (then stopped)."""
        self.thread.join()
        if isinstance(self.outcome, BaseException):
            if self.settings == group_settings(run):
                raise self.outcome
            return None
        if self.settings != group_settings(run):
            self.discard()
            return None
        return self.outcome

    def discard(self) -> None:
        """Stop the started group (waiting for its start to end); a failed start leaves nothing."""
        self.thread.join()
        if isinstance(self.outcome, WorkerGroup):
            self.outcome.shutdown()


class StageRunner:
    """The driver's state for one run in this process; a context manager that releases it all on exit."""

    # Slots, not a __dict__: a Prefect flow stores its parameters' JSON, and an object it cannot encode it stores
    # as its type name only (the runner is a subflow's and a task's argument; it holds processes, not data).
    __slots__ = ("run", "checked", "signals", "ledger", "trackers", "lease", "announce", "spares", "_warm",
                 "_prestart", "_plans", "_tries")

    def __init__(self, run: RunConfig, checked: Checked | None = None, command_started: float | None = None,
                 signals: StopSignals | None = None):
        """`run`: the run, its paths resolved (`resolve_paths`); every chunk reads it here. `checked`: the run as
        preflight resolved and checked it, with its plans; `command_started`: when the command began (its goodput
        attempt counts the start-up from there); `signals`: the command's stop signals (by default the run's own,
        obeyed inside the flow)."""
        self.run = run
        self.signals = signals or StopSignals(run.stop_grace_s)
        self.checked = checked
        self.ledger = GoodputLedger(run.run_url(), run.storage_options, command_started=command_started)
        self.trackers = OpenTrackers()
        self.lease: RunLease | None = None
        # Where an alert raised inside a chunk goes at once (the flow's Prefect event); None: only its log.
        self.announce: Callable[[dict], None] | None = None
        self.spares = SparePool()
        self._tries = ChunkTries()  # each chunk's failed tries (stage, target step)
        self._warm: WarmGroup | None = None
        self._prestart: Prestart | None = None
        self._plans: dict[tuple, StagePlan] = {}
        if checked is not None:
            for stage, plan in checked.plans.items():
                self._plans[_plan_key(checked.run, stage)] = plan

    def __enter__(self) -> StageRunner:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Stop the warm and any prestarted worker group and the spares, and close every open tracker."""
        self.release_workers()
        self.spares.close()
        self.trackers.close()

    def is_checked(self, run: RunConfig) -> bool:
        """Whether preflight resolved and checked exactly this run (then the flow does neither again)."""
        return self.checked is not None and self.checked.run.model_dump_json() == run.model_dump_json()

    def plan(self, stage: str) -> StagePlan:
        """The stage's plan, counted once per run: counting reads and tokenizes the whole dataset."""
        key = _plan_key(self.run, stage)
        if key not in self._plans:
            self._plans[key] = plan_stage(self.run, stage)
        return self._plans[key]

    # ----------------------------------------------------------------- the lease

    @contextlib.contextmanager
    def holding_lease(self) -> Iterator[RunLease]:
        """Hold the run's lease for the block; commits inside it are fenced with it."""
        with RunLease(self.run.run_url(), self.run.storage_options) as lease:
            self.lease = lease
            try:
                yield lease
            finally:
                self.lease = None

    @contextlib.contextmanager
    def commit_fence(self) -> Iterator[RunLease]:
        """The lease a commit is fenced with: the one held, else one taken for the commit."""
        if self.lease is not None:
            yield self.lease
            return
        with RunLease(self.run.run_url(), self.run.storage_options) as lease:
            yield lease

    # ----------------------------------------------------------------- the worker group

    @property
    def warm_group(self) -> WorkerGroup | None:
        """The worker group the last chunk trained on, kept for the next one."""
        return self._warm.group if self._warm else None

    @property
    def prestarted(self) -> Prestart | None:
        """The group being started ahead of the first chunk, until a chunk adopts or stops it."""
        return self._prestart

    @property
    def world_size_changes(self) -> list[dict]:
        return self._warm.world_size_changes if self._warm else []

    def prestart(self, stage: str, run: RunConfig | None = None) -> Prestart | None:
        """Start the worker group of the first chunk in a thread: placement, rank processes, DeepSpeed's process
        group and the imports of `stage`'s trainer (`WorkerGroup.warm_up`), about 4 s on a CPU, while the caller
        starts Prefect. The first chunk that needs a new group adopts it, or stops it when the settings differ.
        Ray must be connected. Nothing when a group with the same settings is starting, or one is warm. `run`:
        settings to start it with other than the runner's (a test of a group that will not suit)."""
        run = run or self.run
        if self._warm is not None or (self._prestart is not None and self._prestart.settings == group_settings(run)):
            return self._prestart
        if self._prestart is not None:
            self._prestart.discard()
        self._prestart = Prestart(run, stage, self.signals)
        return self._prestart

    def group_at(self, stage: str, plan: StagePlan, store: CheckpointStore, infos: list[CheckpointInfo],
                 lineage: Lineage) -> tuple[WorkerGroup, StartState | None]:
        """A worker group holding the state of the newest good checkpoint in `infos` (or the pretrained model),
        and that checkpoint (None when the warm group of the last chunk already holds it)."""
        run = self.run
        self._tries.try_starts()
        identity = (run.stage_url(stage), semantic_hash(run, stage), run.num_workers,
                    run.section(stage, StageConfig).zero_stage, tuple(plan.targets))
        warm = self._warm
        if warm is not None and warm.identity == identity and infos and infos[-1].is_committed \
                and warm.group.step == infos[-1].step:
            return warm.group, None
        self._release_warm()
        group = self._take_prestarted(run) or WorkerGroup(run, self.signals, self.spares.take)
        group.log_placement()
        self._warm = WarmGroup(group, identity)
        start = load_start(run, stage, store, infos, lineage, group, plan.targets)
        self._warm.world_size_changes = _world_size_changes(group, start)
        return group, start

    def keep_spares(self, stage: str) -> None:
        """After a commit: start the warm group's spares once it is SPARES_AFTER_S old, counted from its start
        (`driver/spares.py`)."""
        group = self.warm_group
        if group is not None and time.monotonic() - group.started_at >= SPARES_AFTER_S:
            self.spares.fill(self.run, stage, num_spares(self.run, group.world_size), group.bundle_nodes)

    def replaces_ranks_after(self, error: BaseException, stage: str, target_step: int) -> bool:
        """Whether the chunk to `target_step` trains again at once, on new ranks, after `error`: yes for a lost or
        hung rank (`WorkerLost`, `RankHung`; the failed group is released already) up to MAX_REPLACEMENTS_PER_CHUNK
        times, with no stop requested. Then the hang's alert is announced; the console line comes once the new
        ranks train (`ranks_replaced`). Raises StallRepeats when the failure after the last replacement is the
        same as every one before it (same step, same frame): no retry or restart is spent on it."""
        if not isinstance(error, (WorkerLost, RankHung)) or self.signals.requested():
            return False
        num_failed = self._tries.failed(error, stage, target_step)
        repeated = self._tries.repeated(stage, target_step, MAX_REPLACEMENTS_PER_CHUNK + 1)
        if repeated is not None:
            raise repeated from error
        if num_failed > MAX_REPLACEMENTS_PER_CHUNK:
            return False
        logger.debug("replacing the ranks of %s after: %s", stage, error)
        if isinstance(error, RankHung) and error.alert and self.announce is not None:
            with contextlib.suppress(Exception):  # the alert must not stop the recovery
                self.announce(error.alert)
        return True

    def _take_prestarted(self, run: RunConfig) -> WorkerGroup | None:
        prestart, self._prestart = self._prestart, None
        return prestart.take(run) if prestart is not None else None

    def release_workers(self) -> None:
        """Stop the warm worker group and any prestarted one (after a failure its state is unknown)."""
        prestart, self._prestart = self._prestart, None
        if prestart is not None:
            prestart.discard()
        self._release_warm()

    def _release_warm(self) -> None:
        warm, self._warm = self._warm, None
        if warm is not None:
            warm.group.shutdown()


def _plan_key(run: RunConfig, stage: str) -> tuple:
    return stage, run.seed, run.stage_config(stage).model_dump_json()


def _world_size_changes(group: WorkerGroup, start: StartState | None) -> list[dict]:
    """Every change of world size in this stage's line of checkpoints, the one at `start` included."""
    if start is None:
        return []
    changes = list(start.metadata.get("world_size_changes", []))
    saved = start.metadata.get("world_size", group.world_size)
    if saved != group.world_size:
        changes.append({"step": start.info.step, "from": saved, "to": group.world_size})
    return changes
