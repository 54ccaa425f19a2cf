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
import uuid
from dataclasses import dataclass, field
from typing import Callable, Iterator

from rlhf_core.config import RunConfig, semantic_hash
from rlhf_core.driver.engine import WorkerGroup
from rlhf_core.driver.placement import group_settings
from rlhf_core.driver.interim import InterimStart
from rlhf_core.driver.plan import Checked, StageIdentity, StagePlan, plan_stage, stage_identity
from rlhf_core.driver.repeats import ChunkTries
from rlhf_core.driver.spares import SPARES_AFTER_S, SparePool, num_spares
from rlhf_core.driver.stop import StopSignals
from rlhf_core.errors import RankHung, WorkerLost
from rlhf_core.driver.resume import Lineage, StageCheckpoints, StartState, load_start
from rlhf_core.ops.goodput import GoodputLedger
from rlhf_core.ops.trackers import OpenTrackers
from rlhf_core.storage.interim import remove_for_driver
from rlhf_core.storage.checkpoint import CheckpointStore
from rlhf_core.storage.lease import RunLease
from rlhf_core.storage.manifest import CheckpointInfo
from rlhf_core.storage.metadata import WorldSizeChange
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
    world_size_changes: tuple[WorldSizeChange, ...] = ()


@dataclass
class Replacement:
    """A chunk training again on new ranks after `error` (a lost or hung rank), seen at `seen_at` (time.time())."""

    error: BaseException
    slowest_step_s: float = 0.0  # of the failed group: the new one's steady hang deadline (`expect_steps_like`)
    seen_at: float = field(default_factory=time.time)
    ready_at: float = 0.0

    def ready(self, group: WorkerGroup, restored: InterimStart | None) -> None:
        """The new ranks hold the start state (`restored`: a snapshot between commits): the run's one console
        line for the loss."""
        self.ready_at = time.time()
        source = f" ({restored.describe()})" if restored is not None else " (the last commit)"
        logger.warning("%s Replaced the ranks in %.1f s (%d of %d from warm spares); training again from step %d%s.",
                       self.error, self.ready_at - self.seen_at, group.num_spares_taken, group.world_size, group.step,
                       source)

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

    def discard(self, retire: bool = False) -> None:
        """Stop the started group (waiting for its start to end); a failed start leaves nothing. `retire`: its
        ranks may serve the next command (`WorkerGroup.shutdown`)."""
        self.thread.join()
        if isinstance(self.outcome, WorkerGroup):
            self.outcome.shutdown(retire)


@dataclass
class _Held:
    """What a runner and the copies made of it (`with_run`) share: the processes and records of the run in this
    process, which the runner's own methods change as chunks come and go."""

    ledger: GoodputLedger
    trackers: OpenTrackers = field(default_factory=OpenTrackers)
    spares: SparePool = field(default_factory=SparePool)
    tries: ChunkTries = field(default_factory=ChunkTries)  # each chunk's failed tries (stage, target step)
    plans: dict[tuple, StagePlan] = field(default_factory=dict)
    identities: dict[tuple, StageIdentity] = field(default_factory=dict)
    warm: WarmGroup | None = None
    prestart: Prestart | None = None
    lease: RunLease | None = None
    # Names this command's snapshots between commits (rlhf_core.storage.interim): never read by another command.
    interim_token: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    released_slowest_step_s: float = 0.0


class StageRunner:
    """The driver's state for one run in this process; a context manager that releases it all on exit. Made whole
    by its constructor: what changes between flows (the run resolved again, resumed by a retry) is a new runner
    (`with_run`) on the same processes, never a write into this one."""

    # Slots, not a __dict__: a Prefect flow stores its parameters' JSON, and an object it cannot encode it stores
    # as its type name only (the runner is a subflow's and a task's argument; it holds processes, not data).
    __slots__ = ("_run", "_checked", "_signals", "_announce", "_held")

    def __init__(self, run: RunConfig, checked: Checked | None = None, command_started: float | None = None,
                 signals: StopSignals | None = None, announce: Callable[[dict], None] | None = None):
        """`run`: the run, its paths resolved (`resolve_paths`); every chunk reads it here. `checked`: the run as
        preflight resolved and checked it, with its plans; `command_started`: when the command began (its goodput
        attempt counts the start-up from there); `signals`: the command's stop signals (by default the run's own,
        obeyed inside the flow); `announce`: where an alert raised inside a chunk goes at once (the flow's Prefect
        event; None: only its log)."""
        self._run, self._checked, self._announce = run, checked, announce
        self._signals = signals or StopSignals(run.stop_grace_s)
        self._held = _Held(GoodputLedger(run.run_url(), run.storage_options, command_started=command_started))
        if checked is not None:
            for stage, plan in checked.plans.items():
                self._held.plans[_plan_key(checked.run, stage)] = plan

    def with_run(self, run: RunConfig) -> StageRunner:
        """This runner (its worker group, trackers, ledger, lease and plans) on `run`, the same run resolved again
        or changed by the flow (a retry resumes)."""
        runner = object.__new__(StageRunner)
        runner._run, runner._checked, runner._signals, runner._announce, runner._held = (
            run, self._checked, self._signals, self._announce, self._held)
        return runner

    @property
    def run(self) -> RunConfig:
        return self._run

    @property
    def checked(self) -> Checked | None:
        return self._checked

    @property
    def signals(self) -> StopSignals:
        return self._signals

    @property
    def announce(self) -> Callable[[dict], None] | None:
        return self._announce

    @property
    def ledger(self) -> GoodputLedger:
        return self._held.ledger

    @property
    def trackers(self) -> OpenTrackers:
        return self._held.trackers

    @property
    def spares(self) -> SparePool:
        return self._held.spares

    @property
    def lease(self) -> RunLease | None:
        return self._held.lease

    def __enter__(self) -> StageRunner:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close(clean=exc_info[0] is None)

    def close(self, clean: bool = False) -> None:
        """Stop the warm and any prestarted worker group and the spares, and close every open tracker. `clean`: the
        run ended well, so ranks that may outlive the command become spares (`driver/lingering.py`)."""
        self.release_workers(retire=clean)
        self.spares.close(retire=clean)
        self.trackers.close()
        remove_for_driver()  # this command's snapshots between commits, on its own host

    def is_checked(self, run: RunConfig) -> bool:
        """Whether preflight resolved and checked exactly this run (then the flow does neither again)."""
        return self.checked is not None and self.checked.run.model_dump_json() == run.model_dump_json()

    def plan(self, stage: str) -> StagePlan:
        """The stage's plan, counted once per run: counting reads and tokenizes the whole dataset."""
        key = _plan_key(self.run, stage)
        if key not in self._held.plans:
            self._held.plans[key] = plan_stage(self.run, stage)
        return self._held.plans[key]

    def identity(self, stage: str) -> StageIdentity:
        """What each of the stage's checkpoints records of what trains it, found once per run (fingerprinting
        reads the data's and the models' file versions): after `plan`, which prepares the data."""
        key = _plan_key(self.run, stage)
        if key not in self._held.identities:
            self._held.identities[key] = stage_identity(self.run, stage)
        return self._held.identities[key]

    # ----------------------------------------------------------------- the lease

    @contextlib.contextmanager
    def holding_lease(self) -> Iterator[RunLease]:
        """Hold the run's lease for the block; commits inside it are fenced with it."""
        with RunLease(self.run.run_url(), self.run.storage_options) as lease:
            self._held.lease = lease
            try:
                yield lease
            finally:
                self._held.lease = None

    @contextlib.contextmanager
    def commit_fence(self) -> Iterator[RunLease]:
        """The lease a commit is fenced with: the one held, else one taken for the commit."""
        if self._held.lease is not None:
            yield self._held.lease
            return
        with RunLease(self.run.run_url(), self.run.storage_options) as lease:
            yield lease

    # ----------------------------------------------------------------- the worker group

    @property
    def warm_group(self) -> WorkerGroup | None:
        """The worker group the last chunk trained on, kept for the next one."""
        return self._held.warm.group if self._held.warm else None

    @property
    def prestarted(self) -> Prestart | None:
        """The group being started ahead of the first chunk, until a chunk adopts or stops it."""
        return self._held.prestart

    @property
    def world_size_changes(self) -> tuple[WorldSizeChange, ...]:
        return self._held.warm.world_size_changes if self._held.warm else ()

    def prestart(self, stage: str, run: RunConfig | None = None) -> Prestart | None:
        """Start the worker group of the first chunk in a thread: placement, rank processes, DeepSpeed's process
        group and the imports of `stage`'s trainer (`WorkerGroup.warm_up`), about 4 s on a CPU, while the caller
        starts Prefect. The first chunk that needs a new group adopts it, or stops it when the settings differ.
        Ray must be connected. Nothing when a group with the same settings is starting, or one is warm. `run`:
        settings to start it with other than the runner's (a test of a group that will not suit)."""
        run = run or self.run
        held = self._held
        if held.warm is not None or (held.prestart is not None and held.prestart.settings == group_settings(run)):
            return held.prestart
        if held.prestart is not None:
            held.prestart.discard()
        held.prestart = Prestart(run, stage, self.signals)
        return held.prestart

    def group_at(self, stage: str, plan: StagePlan, store: CheckpointStore, infos: list[CheckpointInfo],
                 lineage: Lineage, restore_below: int | None = None) -> tuple[WorkerGroup, StartState | None]:
        """A worker group holding the state of the newest good checkpoint in `infos` (or the pretrained model),
        and that checkpoint (None when the warm group of the last chunk already holds it). `restore_below`: ranks
        were lost or hung in the chunk to this step, so a newer snapshot between commits this command took below it
        is loaded where every rank has it (`WorkerGroup.restored` then says which)."""
        run = self.run
        self._held.tries.try_starts()
        identity = (run.stage_url(stage), semantic_hash(run, stage), run.num_workers,
                    run.section(stage, StageConfig).zero_stage, tuple(plan.targets))
        warm = self._held.warm
        if warm is not None and warm.identity == identity and infos and infos[-1].is_committed \
                and warm.group.step == infos[-1].step:
            return warm.group, None
        self._release_warm(retire=True)  # no failure since it trained (one releases it): its ranks may serve again
        group = self._take_prestarted(run) or WorkerGroup(run, self.signals, self.spares.take)
        group.log_placement()
        group.interim_token = self._held.interim_token
        self._held.warm = WarmGroup(group, identity)
        start = load_start(run, stage, StageCheckpoints(store, infos, lineage), group, plan.targets, restore_below)
        self._held.warm.world_size_changes = _world_size_changes(group, start)
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
        num_failed = self._held.tries.failed(error, stage, target_step)
        repeated = self._held.tries.repeated(stage, target_step, MAX_REPLACEMENTS_PER_CHUNK + 1)
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
        prestart, self._held.prestart = self._held.prestart, None
        return prestart.take(run) if prestart is not None else None

    def release_workers(self, retire: bool = False) -> None:
        """Stop the warm worker group and any prestarted one (after a failure its state is unknown; `retire`: there
        was none, and their ranks may serve the next command)."""
        prestart, self._held.prestart = self._held.prestart, None
        if prestart is not None:
            prestart.discard(retire)
        self._release_warm(retire)

    @property
    def released_slowest_step_s(self) -> float:
        """The slowest step of the last worker group released (0: none yet, or it returned no step)."""
        return self._held.released_slowest_step_s

    def _release_warm(self, retire: bool = False) -> None:
        warm, self._held.warm = self._held.warm, None
        if warm is not None:
            self._held.released_slowest_step_s = warm.group.slowest_step_s
            warm.group.shutdown(retire)


def _plan_key(run: RunConfig, stage: str) -> tuple:
    return stage, run.seed, run.stage_config(stage).model_dump_json()


def _world_size_changes(group: WorkerGroup, start: StartState | None) -> tuple[WorldSizeChange, ...]:
    """Every change of world size in this stage's line of checkpoints, the one at `start` included."""
    if start is None:
        return ()
    saved = start.metadata.saved_world_size(group.world_size)
    now = (WorldSizeChange(start.info.step, saved, group.world_size),) if saved != group.world_size else ()
    return (*start.metadata.world_size_changes, *now)
