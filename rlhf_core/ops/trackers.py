"""Experiment trackers of a training stage (`--use_tensorboard DIR`, `--use_wandb`), kept on the driver
(`StageTrackers`), which logs the metrics the ranks hand back. Departs from OpenRLHF: both trackers at once, one
wandb run per stage, and a resumed stage continues the same tracker runs. docs/design-notes.md
("Experiment trackers") has the details.
"""

from __future__ import annotations

import importlib.util
import os
import uuid
from typing import TYPE_CHECKING, Any

import fsspec

from rlhf_core.config import RunConfig
from rlhf_core.errors import UserError
from rlhf_core.stages.base import StageConfig

if TYPE_CHECKING:  # the [tracking] extra's packages, imported only when a tracker is on
    from torch.utils.tensorboard import SummaryWriter
    from wandb import Run as WandbRun

EXTRA_HINT = "pip install 'rlhf-pipeline[tracking]'"
EVAL_PREFIX = "eval_"


def tracking_enabled(run: RunConfig) -> bool:
    return bool(run.use_tensorboard or run.use_wandb)


def require_tracker_packages(run: RunConfig) -> None:
    """Refuse a tracker flag whose package is missing, before any training."""
    needed = {"--use_tensorboard": ("tensorboard", run.use_tensorboard), "--use_wandb": ("wandb", run.use_wandb)}
    for flag, (package, enabled) in needed.items():
        if enabled and importlib.util.find_spec(package) is None:
            raise UserError(f"{flag} needs the {package} package, which is not installed; run {EXTRA_HINT}.")


def tensorboard_dir(run: RunConfig, stage: str) -> str:
    root = run.use_tensorboard
    if root is None:
        raise ValueError("no --use_tensorboard folder to log into")
    protocol, _ = fsspec.core.split_protocol(root)
    return f"{root.rstrip('/')}/{run.run_name}/{stage}" if protocol else \
        os.path.join(os.path.abspath(root), run.run_name, stage)


def split_metrics(metrics: dict[str, Any]) -> tuple[dict[str, float], dict[str, float]]:
    """One step's metrics as (train, eval) scalars, without the `step` entry and non-numbers."""
    train, evaluation = {}, {}
    for name, value in metrics.items():
        if name == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if name.startswith(EVAL_PREFIX):
            evaluation[name[len(EVAL_PREFIX):]] = float(value)
        else:
            train[name] = float(value)
    return train, evaluation


class StageTrackers:
    """The open trackers of one (run, stage): a TensorBoard SummaryWriter and/or a wandb run."""

    def __init__(self, run: RunConfig, stage: str, saved_ids: dict[str, Any], start_step: int,
                 wandb_last_steps: dict[str, int] | None = None):
        """`wandb_last_steps`: the last step each wandb run id logged in this process (shared by the stage's
        trackers over its chunks), since a chunk retried after a failure re-trains steps that run already shows."""
        require_tracker_packages(run)
        self.wandb_last_steps = {} if wandb_last_steps is None else wandb_last_steps
        self.settings = tracker_settings(run)
        self.logging_steps = run.section(stage, StageConfig).logging_steps
        self.tensorboard: SummaryWriter | None = None
        self.tensorboard_dir: str | None = None
        self.wandb_run: WandbRun | None = None
        try:
            if run.use_tensorboard:
                self._open_tensorboard(run, stage, start_step)
            if run.use_wandb:
                self._open_wandb(run, stage, saved_ids.get("wandb_run_id"))
        except BaseException:
            self.close(failed=True)
            raise

    def _open_tensorboard(self, run: RunConfig, stage: str, start_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.tensorboard_dir = tensorboard_dir(run, stage)
        # Hides points at or past the first step trained now, logged by an earlier session of this
        # folder that got further than the checkpoint this one starts from.
        self.tensorboard = SummaryWriter(self.tensorboard_dir, purge_step=start_step + 1)

    def _open_wandb(self, run: RunConfig, stage: str, run_id: str | None) -> None:
        import wandb

        run_id = run_id or uuid.uuid4().hex[:12]
        try:
            self.wandb_run = wandb_run = wandb.init(
                project=run.wandb_project, entity=run.wandb_org, group=run.wandb_group,
                name=run.wandb_run_name or f"{run.run_name}-{stage}", id=run_id, resume="allow",
                reinit="create_new", job_type=stage,
            )
        except wandb.errors.UsageError as error:
            raise UserError(f"--use_wandb: wandb refused to start ({error}); set WANDB_API_KEY (or pass "
                            f"--use_wandb TOKEN), or WANDB_MODE=offline to log without network.") from error
        # Operational settings may change on resume; they must not make wandb refuse the run.
        wandb_run.config.update({"run_name": run.run_name, "stage": stage,
                                 **run.stage_config(stage).model_dump(mode="json")}, allow_val_change=True)
        for section in ("train", "eval"):
            wandb_run.define_metric(f"{section}/global_step")
            wandb_run.define_metric(f"{section}/*", step_metric=f"{section}/global_step", step_sync=True)
        logged_before = wandb_run.summary.get("train/global_step") if wandb_run.resumed else None
        self.wandb_last_steps[run_id] = max(self.wandb_last_steps.get(run_id, 0), int(logged_before or 0))

    def tracker_ids(self) -> dict[str, Any]:
        """What a checkpoint records so that a resumed stage continues the same tracker runs."""
        return {"wandb_run_id": self.wandb_run.id if self.wandb_run else None,
                "tensorboard_dir": self.tensorboard_dir}

    def log(self, step_metrics: list[dict[str, Any]]) -> None:
        """Log per-step metrics (each with its `step`): train/* every logging_steps, eval/* when present."""
        for metrics in step_metrics:
            step = int(metrics["step"])
            train, evaluation = split_metrics(metrics)
            if step % self.logging_steps:
                train = {}
            if train or evaluation:
                self._log_step(step, train, evaluation)
        if self.tensorboard is not None:
            self.tensorboard.flush()  # on disk at once: the process may be killed before the next chunk

    def _log_step(self, step: int, train: dict[str, float], evaluation: dict[str, float]) -> None:
        sections = {"train": train, "eval": evaluation}
        if self.tensorboard is not None:
            for section, values in sections.items():
                for name, value in values.items():
                    self.tensorboard.add_scalar(f"{section}/{name}", value, step)
        if self.wandb_run is not None and step > self.wandb_last_steps.get(self.wandb_run.id, 0):
            payload: dict[str, float] = {}
            for section, values in sections.items():
                if values:
                    payload[f"{section}/global_step"] = step
                    payload.update({f"{section}/{name}": value for name, value in values.items()})
            self.wandb_run.log(payload)
            self.wandb_last_steps[self.wandb_run.id] = step

    def close(self, failed: bool = False) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None
        if self.wandb_run is not None:
            self.wandb_run.finish(exit_code=1 if failed else 0)
            self.wandb_run = None


def tracker_settings(run: RunConfig) -> tuple:
    return (run.use_tensorboard, run.use_wandb, run.wandb_org, run.wandb_group, run.wandb_project,
            run.wandb_run_name)


class OpenTrackers:
    """The open trackers of a driver's stages, by stage URL: they outlive a chunk, as the warm worker group does.
    Owned by the stage runner (`rlhf_core.driver.runner`)."""

    def __init__(self) -> None:
        self._by_stage: dict[str, StageTrackers] = {}
        self._wandb_last_steps: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._by_stage)

    def get(self, run: RunConfig, stage: str) -> StageTrackers | None:
        """The trackers already open for this stage, if any (with the same settings)."""
        trackers = self._by_stage.get(run.stage_url(stage))
        if trackers is not None and trackers.settings != tracker_settings(run):
            self.close(run, stage)
            return None
        return trackers

    def open(self, run: RunConfig, stage: str, saved_ids: dict[str, Any], start_step: int) -> StageTrackers:
        """Open (or resume, from a checkpoint's `saved_ids`) the trackers of a stage that trains from start_step."""
        self.close(run, stage)
        trackers = StageTrackers(run, stage, saved_ids, start_step, self._wandb_last_steps)
        self._by_stage[run.stage_url(stage)] = trackers
        return trackers

    def close(self, run: RunConfig | None = None, stage: str | None = None, failed: bool = False) -> None:
        """Close the trackers of one stage, or (no arguments) every open one: end of a stage, failure, end of a run."""
        urls = [run.stage_url(stage)] if run is not None and stage is not None else list(self._by_stage)
        for url in urls:
            trackers = self._by_stage.pop(url, None)
            if trackers is not None:
                trackers.close(failed)
