"""`RunSettings`: the run-wide settings of a run config (which stages run, where checkpoints live, the cluster, the
budgets, alerts and trackers) and the rules that tie its stage sections together; `rlhf_core.config.RunConfig`
adds one section per stage. Field names are OpenRLHF's flag names; each field is documented once, in
`Field(description=...)`, which is also the CLI help and the Prefect form.
"""

from __future__ import annotations

import re
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rlhf_core.errors import UserError
from rlhf_core.stages import KNOWN_STAGES, STAGES, TRAINING_STAGES
from rlhf_core.stages.base import Earlier, StageSettings, operational

SectionT = TypeVar("SectionT", bound=StageSettings)

SECRET_OPTION = re.compile(r"secret|token|password|credential|^key$|_key$", re.IGNORECASE)
# OpenRLHF resumes a given step with --ckpt_path {root}/{run_name}/{stage}/step_N: any training stage's folder.
STEP_DIR_PATH = re.compile(rf"^(.*?)/?([A-Za-z0-9._-]+)/({'|'.join(TRAINING_STAGES)})/step_(\d+)/?$")


class RunSettings(BaseModel):
    """The pipeline: which stages run, where checkpoints live, and the settings all stages share."""

    model_config = ConfigDict(extra="forbid")

    run_name: str = Field(
        "rlhf",
        pattern=r"^[A-Za-z0-9._-]+$",
        description="Name of the run; checkpoints go to {ckpt_path}/{run_name}/{stage}. Same name = same run.",
    )
    stages: list[str] = Field([KNOWN_STAGES[0]], description=f"Stages to run, in order: any of {', '.join(KNOWN_STAGES)}.")
    ckpt_path: str = Field("./ckpt", **operational("Checkpoint root: a local folder or fsspec URL (s3://...)."))
    storage_options: dict[str, Any] = Field(
        default_factory=dict,
        **operational("fsspec storage options for ckpt_path (e.g. endpoint_url); prefer env vars for secrets."),
    )
    load_checkpoint: bool = Field(
        False, **operational("Resume from the newest valid checkpoint; without it a non-empty run is refused.")
    )
    resume_from: int | None = Field(
        None, ge=0,
        **operational("Resume from this step (e.g. 100 for step_100) instead of the newest; newer checkpoints "
                       "are set aside, not deleted. Also set by --ckpt_path .../{run_name}/{stage}/step_100."),
    )
    load_weights_only: bool = Field(
        False, **operational("Restore only the weights of the checkpoint the run starts from, with a fresh "
                              "optimizer (the remedy for a loss spike after resume).")
    )
    allow_config_change: bool = Field(
        False, **operational("Resume even though settings that change the math differ from the checkpoint's.")
    )
    max_ckpt_num: int = Field(3, **operational("Keep at most this many checkpoints per stage (<=0: all)."))
    max_ckpt_mem: float | None = Field(None, gt=0, **operational("Keep at most this many GB of checkpoints per stage."))
    seed: int = Field(42, description="Seed from which every random draw (data order, init, sampling) is derived.")
    num_workers: int = Field(1, ge=1, **operational("DeepSpeed ranks (Ray actors) per training stage."))
    ray_address: str | None = Field(
        None, **operational("Address of an existing Ray cluster (host:port, or ray://host:10001 for a Ray client "
                             "driver off the cluster); default: RAY_ADDRESS, else a local one.")
    )
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_SPREAD"] = Field(
        "PACK", **operational("How Ray's placement group spreads the ranks over nodes: PACK (fewest nodes), "
                               "SPREAD (as many as it can) or STRICT_SPREAD (one rank per node).")
    )
    placement_timeout_s: float = Field(
        120.0, gt=0,
        **operational("Seconds to wait for the worker group's resources before failing with what is missing "
                       "(a retried chunk waits this long for a lost node's resources to return)."),
    )
    num_cpus_per_worker: float | None = Field(
        None, gt=0, **operational("CPUs Ray reserves for each rank; default: 1, or an equal share of the "
                                   "cluster's CPUs when it has fewer than num_workers.")
    )
    allow_fewer_workers: bool = Field(
        False, **operational("When the cluster cannot place num_workers ranks within placement_timeout_s (a "
                              "node was lost), go on with as many as fit, resuming through DeepSpeed's "
                              "universal checkpoint; the change is recorded in the checkpoint metadata.")
    )
    sync_checkpoint: bool = Field(
        False, **operational("Write each checkpoint while training waits. By default the ranks snapshot it to "
                              "memory, train the next chunk, and upload it meanwhile (a crash during the upload "
                              "loses that checkpoint only, never a committed one).")
    )
    max_chunks_per_run: int | None = Field(
        None, ge=1, **operational("Train at most this many chunks in this flow run, then stop cleanly at a chunk "
                                   "boundary; the next run of the same run_name continues (scheduled runs).")
    )
    time_budget_minutes: float | None = Field(
        None, gt=0, **operational("Start no new chunk once this many minutes have passed since the flow run "
                                   "began; stop cleanly at a chunk boundary (the next run continues).")
    )
    stop_grace_s: float = Field(
        25.0, gt=0, **operational("On SIGTERM or Ctrl-C, the ranks finish their step and it commits as an "
                                   "emergency checkpoint within this many seconds (less a fifth, at least 3 s, kept "
                                   "for leaving), else the last commit stands; a second signal leaves at once. 25 "
                                   "fits Kubernetes' default 30 s terminationGracePeriodSeconds.")
    )
    hang_timeout_s: float | None = Field(
        None, gt=0, **operational("Seconds a rank may go without progress (a step, a load, a snapshot, a write) "
                                   "before the run takes it for hung: its stacks go to the run's log, the ranks "
                                   "are replaced and the chunk goes on from the newest snapshot (--snapshot_steps) "
                                   "or commit. Default: "
                                   "max(60, 5x the slowest step so far), 900 during a checkpoint's write. Before "
                                   "the ranks' first step (imports, set-up, the load) at least 900.")
    )
    snapshot_steps: int = Field(
        0, ge=-1, **operational("Steps between the snapshots each rank copies into its node's memory (tmpfs) "
                                 "between commits: a lost or hung rank's replacement, and its peers, go on from the "
                                 "newest one every rank holds instead of the last commit. 0: the fewest steps over "
                                 "which a snapshot's copy costs at most 5% of the training time (every step when a "
                                 "step takes 20 times the copy); -1: none. Each rank holds at most two, each the "
                                 "size of its share of a checkpoint's DeepSpeed state.")
    )
    num_spare_workers: int | None = Field(
        None, ge=0, **operational("Rank processes kept warm beside the worker group (torch, DeepSpeed and the trainer "
                                   "imported, no resources held): a lost or hung rank's replacement takes them and "
                                   "trains within seconds. Default: as many as the ranks when they use no GPU, "
                                   "else 0.")
    )
    spare_idle_s: float = Field(
        600.0, ge=0, **operational("On a running Ray cluster (--ray_address or RAY_ADDRESS), the CPU ranks' processes "
                                    "outlive the command as warm spares (reset, no resources held, at most one per "
                                    "CPU of a node) for this many seconds: the next command with the same "
                                    "environment starts its ranks from them. 0: they end with the command.")
    )
    store_outage_s: float = Field(
        600.0, gt=0, **operational("How long a commit waits for an unreachable checkpoint store (an S3 outage, a "
                                    "network cut), trying again with backoff while the ranks keep the snapshot and "
                                    "train on; past it the run stops and resumes from the last commit later.")
    )
    max_restarts: int = Field(
        10, ge=0, **operational("A deployment's run that crashes (its process or worker died) or fails on a fault "
                                 "that passes (a lost rank, a hang, a store outage) is rescheduled by itself, at "
                                 "most this many times per --restart_window_minutes, waiting 10 s doubling to 5 min "
                                 "from the second; past it the run stays Crashed (OutOfRestarts) with an alert.")
    )
    restart_window_minutes: float = Field(
        60.0, gt=0, **operational("The window --max_restarts counts restarts in.")
    )
    verbose: bool = Field(
        False, **operational("Show Ray's and DeepSpeed's full logs on the console (they always go to the log "
                              "file in the run folder).")
    )
    alert_reward_window: int = Field(
        3, ge=1, **operational("Alert (rlhf.alert.reward-stagnant) when the headline metric (PPO reward; SFT/RM "
                                "eval or training loss) has not improved across this many committed checkpoints.")
    )
    alert_reward_min_delta: float = Field(
        0.0, ge=0, **operational("How much a checkpoint's headline metric must beat the best so far to count as "
                                  "an improvement.")
    )
    alert_size_tolerance: float = Field(
        0.5, gt=0, **operational("Alert (rlhf.alert.checkpoint-size) when a checkpoint's size is off the size "
                                  "its models predict by more than this fraction.")
    )
    alert_size_jump: float = Field(
        0.2, gt=0, **operational("... or off the median size of the stage's earlier checkpoints by more than "
                                  "this fraction.")
    )
    use_tensorboard: str | None = Field(None, **operational("TensorBoard log folder; each stage writes its "
                                                             "metrics under {use_tensorboard}/{run_name}/{stage}."))
    use_wandb: bool = Field(False, **operational("Log metrics to Weights & Biases (WANDB_API_KEY from the "
                                                  "environment; WANDB_MODE=offline works without network). A "
                                                  "resumed run continues the same wandb run."))
    wandb_org: str | None = Field(None, **operational("wandb entity (organization or user)."))
    wandb_group: str | None = Field(None, **operational("wandb group."))
    wandb_project: str = Field("rlhf", **operational("wandb project."))
    wandb_run_name: str | None = Field(None, **operational("wandb run name; default: {run_name}-{stage}."))

    @model_validator(mode="before")
    @classmethod
    def _step_dir_as_ckpt_path(cls, data: Any) -> Any:
        """OpenRLHF users resume a given step with --ckpt_path .../step_100: read it as resume_from."""
        if isinstance(data, dict) and isinstance(data.get("ckpt_path"), str):
            found = STEP_DIR_PATH.match(data["ckpt_path"])
            if found and data.get("resume_from") is None:
                root, run_name, stage, step = found.groups()
                if data.get("run_name", run_name) != run_name:
                    raise ValueError(f"ckpt_path names run {run_name!r} but run_name is {data['run_name']!r}")
                data = {**data, "ckpt_path": root or ".", "run_name": run_name, "resume_from": int(step),
                        "load_checkpoint": True}
        return data

    @field_validator("storage_options")
    @classmethod
    def _no_secrets(cls, options: dict[str, Any]) -> dict[str, Any]:
        for name in options:
            if SECRET_OPTION.search(name):
                raise ValueError(
                    f"must not hold the secret {name!r}: it would be stored in Prefect parameters; "
                    "set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or your store's variables) instead"
                )
        return options

    @field_validator("stages")
    @classmethod
    def _known_stages(cls, stages: list[str]) -> list[str]:
        for stage in stages:
            if stage not in KNOWN_STAGES:
                raise ValueError(f"unknown stage {stage!r}; choose from {', '.join(KNOWN_STAGES)}")
        if not stages:
            raise ValueError("name at least one stage")
        return stages

    @model_validator(mode="after")
    def _stages_configured(self) -> RunSettings:
        if [KNOWN_STAGES.index(stage) for stage in self.stages] != sorted(KNOWN_STAGES.index(s) for s in set(self.stages)):
            raise ValueError(f"stages must be distinct and in pipeline order ({' -> '.join(KNOWN_STAGES)})")
        for stage in self.stages:
            if getattr(self, stage) is None:
                if STAGES[stage].kind == "train":
                    raise ValueError(f"stage {stage!r} is requested but has no settings (add a '{stage}:' section)")
                setattr(self, stage, STAGES[stage].config())
        # Each stage's inputs default to what the stages before it produce, in pipeline order.
        configs = {stage: getattr(self, stage) for stage in self.stages}
        for stage in self.stages:
            configs[stage] = configs[stage].chained(Earlier(stage, self.stages, configs, STAGES))
            setattr(self, stage, configs[stage])
        for stage in self.stages:
            configs[stage].check_in_run(stage, self.num_workers)
        return self

    def stage_config(self, stage: str) -> StageSettings:
        return getattr(self, stage)

    def section(self, stage: str, kind: type[SectionT]) -> SectionT:
        """The settings of `stage` as `kind`: its own config class (`SFTConfig`), or `StageConfig` where any
        training stage will do. A clear error when the run has no such section, or it is not a `kind`."""
        settings = getattr(self, stage, None)
        if settings is None:
            raise UserError(f"this run has no settings for stage {stage!r}: add a '{stage}:' section")
        if not isinstance(settings, kind):
            raise TypeError(f"stage {stage!r} has {type(settings).__name__} settings, not {kind.__name__}")
        return settings

    def run_url(self) -> str:
        return f"{self.ckpt_path.rstrip('/')}/{self.run_name}"

    def stage_url(self, stage: str) -> str:
        return f"{self.run_url()}/{stage}"
