"""Where a stage resumes from, and whether it may: `validate_run_start` (the refusals, before Prefect starts),
`begin_stage` (applies --resume_from, returns the stage's `Lineage`) and `load_start` (the newest good committed
checkpoint, checked for drift; bad ones set aside). docs/design-notes.md ("Resuming a stage") has the rules and how
the ranks load.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass

from rlhf_core.storage.checkpoint import CheckpointStore
from rlhf_core.storage.manifest import CheckpointInfo
from rlhf_core.storage.metadata import CheckpointMetadata
from rlhf_core.config import RunConfig, semantic_fields
from rlhf_core.stages import STAGES, TRAINING_STAGES, WORLD_SIZE_DEPENDENT_STAGES
from rlhf_core.stages.base import StageConfig
from rlhf_core.data.prepared import recorded_hashes
from rlhf_core.data.fingerprints import dataset_fingerprint
from rlhf_core.errors import CorruptCheckpoint, RankHung, UserError, WorkerLost
from rlhf_core.storage.locate import input_model_fingerprints, model_fingerprint

logger = logging.getLogger(__name__)

LINEAGE_MARKER = "RESUMED_FROM.json"

@dataclass(frozen=True)
class Lineage:
    """How this run's line of checkpoints starts: from an explicit step, and with weights only."""

    start_step: int = 0
    start_digest: str = ""
    weights_only: bool = False

    def cache_token(self) -> str:
        if self == Lineage():
            return ""
        return f"from{self.start_step}-{self.start_digest[:12]}{'-weights' if self.weights_only else ''}"


@dataclass(frozen=True)
class StartState:
    """The committed checkpoint a worker group loaded, with its (verified) metadata."""

    info: CheckpointInfo
    metadata: CheckpointMetadata
    universal: bool
    weights_only: bool


@dataclass(frozen=True)
class StageCheckpoints:
    """Where a stage resumes from: its checkpoint store, the checkpoints in it (oldest first), and the line of
    checkpoints this run starts (`begin_stage`)."""

    store: CheckpointStore
    infos: list[CheckpointInfo]
    lineage: Lineage


def open_store(run: RunConfig, stage: str) -> CheckpointStore:
    return CheckpointStore(run.stage_url(stage), run.storage_options)


def config_drift(run: RunConfig, stage: str, metadata: CheckpointMetadata) -> list[str]:
    """Semantic settings that differ between `run` and a checkpoint's metadata, as 'field: old -> new'. Only
    settings both know are compared: a checkpoint written by another version of this package may record a
    setting that is no longer semantic (--zero_stage became operational) or lack one added since."""
    cfg = run.stage_config(stage)
    current = {**semantic_fields(cfg), "seed": run.seed}
    saved = {**metadata.config, "seed": metadata.seed}
    changes = [f"{name}: {saved[name]!r} -> {current[name]!r}"
               for name in sorted(set(current) & set(saved)) if saved[name] != current[name]]
    saved_world_size = metadata.world_size
    if stage in WORLD_SIZE_DEPENDENT_STAGES and saved_world_size not in (None, run.num_workers) \
            and not run.allow_fewer_workers:
        changes.append(f"num_workers: {saved_world_size} -> {run.num_workers} (each {stage.upper()} rank samples "
                       "with its own seed)")
    saved_fingerprint = metadata.dataset_fingerprint
    if saved_fingerprint and saved_fingerprint != dataset_fingerprint(
            cfg, run.storage_options, recorded_hashes(run.ckpt_path, run.storage_options)):
        changes.append("dataset contents: changed")
    # Same path, other model: e.g. an earlier stage retrained into the save_path this stage started from.
    current_models = input_model_fingerprints(cfg, run.storage_options)
    for name, saved_model in sorted(metadata.input_models.items()):
        if saved_model and current_models.get(name, saved_model) != saved_model:
            changes.append(f"{name} model contents: changed")
    return changes


def keep_recorded_defaults(run: RunConfig, stage: str, metadata: CheckpointMetadata) -> None:
    """Give each setting of `stage` in `run` that its command or config left out, and whose default changed since
    (its config's `earlier_defaults`), the value the checkpoint's metadata recorded when that was the earlier
    default; said once.
    `run` changes in place (as `RunSettings` fills its sections), before anything reads it for training: the CLI's
    preflight and a deployment's flow both check the resume first."""
    cfg = run.stage_config(stage)
    saved = metadata.config
    kept = {name: saved[name] for name, earlier in type(cfg).earlier_defaults.items()
            if name in saved and saved[name] == earlier and name not in cfg.model_fields_set
            and name in type(cfg).model_fields and getattr(cfg, name) != earlier}
    if not kept:
        return
    try:
        resumed = type(cfg).model_validate({**dict(cfg), **kept})
        resumed.check_in_run(stage, run.num_workers)
    except ValueError:  # the recorded values no longer fit the settings given: the drift check says which differ
        return
    logger.warning("%s: its checkpoints were trained with %s, the default%s before rlhf took OpenRLHF's; the run "
                   "keeps %s (set %s to change %s, with --allow_config_change).", stage,
                   ", ".join(f"{name} {value!r}" for name, value in kept.items()), "s" if len(kept) > 1 else "",
                   "them" if len(kept) > 1 else "it", " ".join(f"--{name}" for name in kept),
                   "them" if len(kept) > 1 else "it")
    setattr(run, stage, resumed)


def check_drift(run: RunConfig, stage: str, info: CheckpointInfo, metadata: CheckpointMetadata) -> None:
    keep_recorded_defaults(run, stage, metadata)
    changes = config_drift(run, stage, metadata)
    if changes and not run.allow_config_change:
        raise UserError(
            f"{info.uri} was trained with other settings ({'; '.join(changes)}); resume with the original "
            f"settings, pass --allow_config_change to accept the change, or start a new --run_name."
        )
    check_zero_stage(run.section(stage, StageConfig).zero_stage, run.load_weights_only, info, metadata)


def check_zero_stage(configured: int | None, weights_only: bool, info: CheckpointInfo,
                     metadata: CheckpointMetadata) -> None:
    """Refuse an explicit --zero_stage that cannot read the checkpoint's optimizer state (DeepSpeed loads
    another stage's layout only as weights, and ZeRO-3's partitioned weights not even so)."""
    saved = metadata.zero_stage
    if configured is None or saved is None or configured == saved or (weights_only and 3 not in (configured, saved)):
        return
    raise UserError(
        f"{info.uri} was written with ZeRO stage {saved} and --zero_stage {configured} cannot load it; pass "
        f"--zero_stage {saved} (or leave it unset to keep it)"
        + (", or --load_weights_only to start fresh optimizers." if 3 not in (configured, saved) else ".")
    )


def validate_run_start(run: RunConfig) -> None:
    """Refuse a run start that would overwrite, silently change the math, or resume from nowhere."""
    for stage in (stage for stage in run.stages if stage in TRAINING_STAGES):
        store = open_store(run, stage)
        committed = [info for info in store.list() if info.is_committed]
        if committed and not run.load_checkpoint:
            raise UserError(
                f"{run.stage_url(stage)} already holds checkpoints; pass --load_checkpoint to resume it, "
                f"or choose another --run_name or --ckpt_path."
            )
        if run.resume_from is not None and stage == run.stages[0]:
            if run.resume_from not in {info.step for info in committed}:
                available = ", ".join(info.name for info in committed) or "none"
                raise UserError(f"--resume_from {run.resume_from}: {store.uri(run.resume_from)} is not a committed "
                                f"checkpoint (committed: {available}).")
            committed = [info for info in committed if info.step <= run.resume_from]
        if committed and run.load_checkpoint:
            check_drift(run, stage, committed[-1], store.training_metadata(committed[-1].step))


def begin_stage(run: RunConfig, stage: str) -> Lineage:
    """Check the stage's checkpoints against its inputs as they are now (an earlier stage of this run
    may have rewritten them since the run began), apply --resume_from (set newer checkpoints aside,
    once) and return the stage's lineage."""
    store = open_store(run, stage)
    listing = store.list()
    committed = [info for info in listing if info.is_committed]
    explicit_step = run.resume_from if stage == run.stages[0] else None  # --resume_from's step, in its first stage
    usable = [info for info in committed if explicit_step is None or info.step <= explicit_step]
    if usable and run.load_checkpoint:
        check_drift(run, stage, usable[-1], store.training_metadata(usable[-1].step))
    elif run.load_checkpoint and not listing:
        # The seed's `if [ -d ckpt ]; then --load_checkpoint` and a plain --load_checkpoint on a new folder both
        # land here: a fresh start, said once (as OpenRLHF 0.11 does), never an error.
        logger.info("%s: --load_checkpoint found no checkpoint in %s; starting from %s.", stage,
                    run.stage_url(stage), getattr(run.stage_config(stage), "pretrain", None) or "the model")
    if explicit_step is not None:
        start = next(info for info in committed if info.step == explicit_step)
        marker = store.read_json(LINEAGE_MARKER)
        if marker != {"step": start.step, "manifest_digest": start.manifest_digest}:
            for newer in (info for info in store.list() if info.step > start.step):
                logger.warning("--resume_from %d: setting %s aside (moved to %s)", start.step, newer.name,
                               store.set_aside(newer))
            store.write_json(LINEAGE_MARKER, {"step": start.step, "manifest_digest": start.manifest_digest})
    elif run.load_weights_only and committed:
        start = committed[-1]
    else:
        return Lineage()
    return Lineage(start.step, start.manifest_digest, run.load_weights_only)


def finished_checkpoint(run: RunConfig, stage: str, total_steps: Callable[[], int]) -> CheckpointInfo | None:
    """The stage's last checkpoint when a resuming run finds the stage done: its export at the stage's output path
    names that checkpoint (`SOURCE_NAME`, which the export writes last), at the stage's last step (`total_steps()`,
    asked last: it may count the data). Such a stage needs no subflow: its chunks would all be cached and its export
    written again (minutes for a large model); a caller skipping it runs its drift guard (`begin_stage`), so that a
    changed setting or input is refused as when entered. None with --resume_from (in the first stage) or
    --load_weights_only: those start over."""
    if not run.load_checkpoint or run.load_weights_only or (stage == run.stages[0] and run.resume_from is not None):
        return None
    committed = [info for info in open_store(run, stage).list() if info.is_committed]
    if not committed:
        return None
    output = getattr(run.stage_config(stage), STAGES[stage].output_field)
    if model_fingerprint(output, run.storage_options) != f"checkpoint:{committed[-1].manifest_digest}":
        return None
    return committed[-1] if committed[-1].step == total_steps() else None


def load_start(run: RunConfig, stage: str, checkpoints: StageCheckpoints, group,
               chunk_ends: list[int], restore_below: int | None = None) -> StartState | None:
    """Set `group` (a rlhf_core.driver.engine.WorkerGroup) up for the stage (`chunk_ends`: the plan's) and load
    the newest good checkpoint of `checkpoints` into it; a bad one is set aside with one log line and the next
    older one is tried. None: no checkpoint, the group starts from the pretrained model. `restore_below` (after a
    lost or hung rank, the chunk's target): first try the newest snapshot between commits below it every rank
    holds (`restore_interim`)."""
    store, lineage = checkpoints.store, checkpoints.lineage
    if restore_below is not None:
        restored, base = restore_interim(run, stage, checkpoints, group, chunk_ends, restore_below)
        if restored:
            return base
    for info in reversed(checkpoints.infos):
        try:
            if not info.is_committed:
                raise CorruptCheckpoint(info.reason, info.step, info.reason)
            metadata = store.verified_training_metadata(info.step)
            check_drift(run, stage, info, metadata)
            start = StartState(info, metadata, needs_universal(metadata, group.world_size),
                               lineage.weights_only and info.step == lineage.start_step)
            group.setup(run, stage, chunk_ends, load_universal=start.universal,
                        saved_zero_stage=metadata.zero_stage)
            group.load(run.stage_url(stage), run.storage_options, info.step, start.universal, start.weights_only)
            return start
        except CorruptCheckpoint as error:
            status = info.status if not info.is_committed else "corrupt"
            logger.warning("skipping checkpoint %s (%s: %s); set aside to %s", info.name, status, error.reason,
                           store.set_aside(CheckpointInfo(**{**asdict(info), "status": status, "reason": error.reason})))
    group.setup(run, stage, chunk_ends, load_universal=False)
    return None


def restore_interim(run: RunConfig, stage: str, checkpoints: StageCheckpoints, group, chunk_ends: list[int],
                    below: int) -> tuple[bool, StartState | None]:
    """After a lost or hung rank: set `group` up and load the newest snapshot between commits (this command's,
    `rlhf_core.rank.interim`) that every rank holds whole on its node, newer than the newest commit and below the
    chunk's target `below` (training ahead leaves snapshots of the next chunk while a commit is written).
    Returns whether it did, and the commit it trained on from (its metadata carries the line's history). A
    snapshot that fails to load is logged and the commits are tried instead (the caller sets the group up again)."""
    base = next((info for info in reversed(checkpoints.infos) if info.is_committed), None)
    try:
        metadata = checkpoints.store.verified_training_metadata(base.step) if base is not None else None
    except CorruptCheckpoint:
        return False, None
    if metadata is not None and needs_universal(metadata, group.world_size):
        return False, None
    base_step, saved_zero_stage = (base.step if base is not None else 0), (metadata.zero_stage if metadata else None)
    newer = [step for step in group.interim_steps(run, stage, saved_zero_stage) if base_step < step < below]
    if not newer:
        return False, None
    group.setup(run, stage, chunk_ends, saved_zero_stage=saved_zero_stage)
    try:
        group.load_interim(newer[-1], base_step)
    except (WorkerLost, RankHung):
        raise  # the new group failed, not the snapshot
    except Exception as error:  # noqa: BLE001 - a bad snapshot costs its steps, never the run
        logger.warning("the snapshot of step %d could not be loaded (%s); loading the last commit instead",
                       newer[-1], error)
        return False, None
    start = StartState(base, metadata, False, False) if base is not None and metadata is not None else None
    return True, start


def needs_universal(metadata: CheckpointMetadata, num_workers: int) -> bool:
    """ZeRO 1-3 partition state by rank (stage 3 the weights too): another world size reads it through the
    universal format. ZeRO-0 state is whole on every rank and loads anywhere as it is."""
    return metadata.saved_world_size(num_workers) != num_workers and (metadata.zero_stage or 0) > 0
