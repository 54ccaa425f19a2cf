"""A training stage laid out before it trains: its paths made absolute (`resolve_paths`) and its chunks
(`plan_stage`: how many usable samples, how many steps, where each chunk ends). Both are pure functions of the
run's config and data, so the CLI, preflight, the flow and the chunks agree on them; counting reads and
tokenizes the data, so a run plans each stage once (`StageRunner.plan`). What every checkpoint of a stage records of
what trained it (`stage_identity`) is found once per stage too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import fsspec

from rlhf_core.config import RunConfig, semantic_fields, semantic_hash
from rlhf_core.data.fingerprints import dataset_fingerprint
from rlhf_core.data.prepared import recorded_hashes
from rlhf_core.stages import STAGES
from rlhf_core.stages.base import StageConfig, fields_with_role
from rlhf_core.errors import UserError
from rlhf_core.storage.locate import input_model_fingerprints, is_hub_id


@dataclass(frozen=True)
class StagePlan:
    stage: str
    num_samples: int
    total_steps: int
    targets: list[int]  # the step each chunk ends at


@dataclass(frozen=True)
class StageIdentity:
    """What each checkpoint of a stage records of what trains it, the drift check's inputs (`CheckpointMetadata`):
    the config's semantic hash and fields, the data's and the input models' fingerprints, the libraries' versions."""

    config_hash: str
    config: dict
    dataset_fingerprint: str
    input_models: dict[str, str]
    versions: dict[str, str]


@dataclass(frozen=True)
class Checked:
    """A run preflight resolved and checked (`rlhf_core.driver.preflight`), with the plans it counted."""

    run: RunConfig
    plans: dict[str, StagePlan] = field(default_factory=dict)


def resolve_paths(run: RunConfig) -> RunConfig:
    """Make local paths absolute, so Ray workers (other working directories) see the same files. The fields
    to resolve are those `rlhf_core.stages.STAGES` tags with a role; several comma-separated datasets are
    resolved one by one, and a hub id (`org/name`, no such local path) stays a hub id."""

    outputs = {run.stage_config(stage).output() for stage in run.stages}

    def absolute(url: str, may_name_a_hub_repo: bool = False) -> str:
        protocol, _ = fsspec.core.split_protocol(url)
        if protocol or (may_name_a_hub_repo and url not in outputs and is_hub_id(url)):
            return url
        return os.path.abspath(url)

    updates: dict = {"ckpt_path": absolute(run.ckpt_path)}
    for stage in run.stages:
        cfg, config_class = run.stage_config(stage), STAGES[stage].config
        paths = {name: absolute(getattr(cfg, name), role == "model") for role in ("model", "path", "output")
                 for name in fields_with_role(config_class, role) if getattr(cfg, name, None)}
        paths |= {name: ",".join(absolute(part, True) for part in getattr(cfg, name).split(","))
                  for name in fields_with_role(config_class, "data") if getattr(cfg, name, None)}
        updates[stage] = cfg.model_copy(update=paths)
    return run.model_copy(update=updates)


def chunk_ends(total_steps: int, save_steps: int) -> list[int]:
    """The steps a stage's chunks end at, where a checkpoint commits: every `save_steps` (OpenRLHF's
    --save_steps; -1 or 0: one chunk) and the last step. The one statement of the rule: the plan holds its result
    (`StagePlan.targets`), and the driver hands that to the ranks (`WorkerGroup.setup`), which evaluate there."""
    every = save_steps if save_steps > 0 else total_steps
    return list(range(every, total_steps, every)) + [total_steps]


def plan_stage(run: RunConfig, stage: str) -> StagePlan:
    """Validate the stage's inputs and lay out its chunks; raises UserError before any training. Reads and
    tokenizes the whole dataset: ask the run's `StageRunner.plan`, which plans each stage once."""
    cfg = run.section(stage, StageConfig)
    num_items, per_step = STAGES[stage].num_items(run), cfg.items_per_step()
    steps_per_pass = num_items // per_step
    if steps_per_pass == 0:
        source = cfg.data_source()
        raise UserError(
            f"--{cfg.step_size_field} {per_step} is larger than the {num_items} usable samples of "
            f"{source.url if source else 'its data'}; lower it or add data."
        )
    total_steps = steps_per_pass * cfg.num_passes()
    return StagePlan(stage, num_items, total_steps, chunk_ends(total_steps, cfg.save_steps))


def stage_identity(run: RunConfig, stage: str) -> StageIdentity:
    """The stage's identity, after its data is prepared (the preparation recorded its files' hashes, so the data is
    not read again). Ask the run's `StageRunner.identity`, which finds it once per stage, not at each commit."""
    from importlib.metadata import version  # not the imports: deepspeed's alone costs the driver ~0.6 s

    cfg = run.section(stage, StageConfig)
    return StageIdentity(
        config_hash=semantic_hash(run, stage), config=semantic_fields(cfg),
        dataset_fingerprint=dataset_fingerprint(cfg, run.storage_options,
                                                recorded_hashes(run.ckpt_path, run.storage_options)),
        input_models=input_model_fingerprints(cfg, run.storage_options),
        versions={package: version(package) for package in ("torch", "deepspeed", "transformers")})
