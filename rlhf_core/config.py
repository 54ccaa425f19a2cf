"""One pydantic model per stage, plus `RunConfig`, the pipeline that chains them.

Field names are OpenRLHF's flag names, so `--pretrain`, `--save_steps`, `--ckpt_path` ... move over
unchanged. Each field is documented once, in `Field(description=...)`: that text is the `rlhf` CLI
help and the Prefect UI form. Fields tagged `affects_training=False` (paths, logging, retention,
cluster address) never change the weights, so they stay out of the semantic hash that keys the
Prefect cache and guards a resume against config drift.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from rlhf_core.errors import UserError

KNOWN_STAGES = ("sft", "rm", "ppo", "merge", "export")
IMPLEMENTED_STAGES = ("sft",)
STEP_DIR_PATH = re.compile(r"^(.*?)/?([A-Za-z0-9._-]+)/(sft|rm|ppo)/step_(\d+)/?$")
SECRET_OPTION = re.compile(r"secret|token|password|credential|^key$|_key$", re.IGNORECASE)


def _operational(description: str) -> dict[str, Any]:
    """Field kwargs for a setting that does not change the math (kept out of the semantic hash)."""
    return {"description": description, "json_schema_extra": {"affects_training": False}}


class StageConfig(BaseModel):
    """Settings every training stage shares: model, optimisation, chunking, export."""

    model_config = ConfigDict(extra="forbid")

    pretrain: str = Field(description="Model to start from: a local folder or fsspec URL in Hugging Face format.")
    max_len: int = Field(2048, ge=8, description="Maximum tokens per sample; longer samples are truncated.")
    max_samples: int | None = Field(None, ge=1, description="Use at most this many samples of the dataset.")
    train_batch_size: int = Field(128, ge=1, description="Global batch size: samples per optimizer step, all ranks.")
    micro_train_batch_size: int = Field(8, ge=1, description="Samples per rank per forward/backward pass.")
    max_epochs: int = Field(1, ge=1, description="Passes over the dataset.")
    learning_rate: float = Field(5e-6, gt=0, description="Peak learning rate of the warmup-cosine schedule.")
    lr_warmup_ratio: float = Field(0.03, ge=0, le=1, description="Fraction of the steps spent warming the LR up.")
    l2: float = Field(0.0, ge=0, description="AdamW weight decay.")
    max_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    zero_stage: Literal[0, 1, 2] = Field(2, description="DeepSpeed ZeRO stage (0, 1 or 2).")
    bf16: bool = Field(False, description="Train in bfloat16 (needs a GPU; ignored with a warning on CPU).")
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward to save memory.")
    lora_rank: int = Field(0, ge=0, description="LoRA rank; 0 trains the full model.")
    lora_alpha: int = Field(16, ge=1, description="LoRA scaling numerator (alpha / rank).")
    target_modules: list[str] | None = Field(
        None, description="Modules that get LoRA adapters; default: all linear layers."
    )
    save_steps: int = Field(
        -1, description="Optimizer steps per chunk; each chunk ends with a committed checkpoint. -1: one chunk."
    )
    save_path: str = Field("./out/model", **_operational("Where the final Hugging Face model is exported (any fsspec URL)."))
    save_hf_ckpt: bool = Field(
        False, **_operational("Make each checkpoint's actor_model/hf a standalone HF model (adds tokenizer).")
    )
    logging_steps: int = Field(1, ge=1, **_operational("Log training metrics every N steps."))

    @field_validator("save_steps")
    @classmethod
    def _positive_or_whole_stage(cls, value: int) -> int:
        if value == 0 or value < -1:
            raise ValueError("must be a positive number of steps, or -1 for one chunk per stage")
        return value

    @model_validator(mode="after")
    def _micro_fits_global(self) -> "StageConfig":
        if self.train_batch_size % self.micro_train_batch_size:
            raise ValueError(
                f"train_batch_size ({self.train_batch_size}) must be a multiple of "
                f"micro_train_batch_size ({self.micro_train_batch_size})"
            )
        return self


class SFTConfig(StageConfig):
    """Supervised fine-tuning on (prompt, response) pairs; the loss covers response tokens only."""

    dataset: str = Field(description="Training data: JSONL, JSON or Parquet, a local path or any fsspec URL.")
    input_key: str = Field("input", description="Key of the prompt in each sample.")
    output_key: str = Field("output", description="Key of the response in each sample.")
    apply_chat_template: bool = Field(False, description="Wrap the prompt in the tokenizer's chat template.")
    save_path: str = Field("./out/sft", **_operational("Where the final Hugging Face model is exported (any fsspec URL)."))


class RunConfig(BaseModel):
    """The pipeline: which stages run, where checkpoints live, and the settings all stages share."""

    model_config = ConfigDict(extra="forbid")

    run_name: str = Field(
        "rlhf",
        pattern=r"^[A-Za-z0-9._-]+$",
        description="Name of the run; checkpoints go to {ckpt_path}/{run_name}/{stage}. Same name = same run.",
    )
    stages: list[str] = Field(["sft"], description="Stages to run, in order: any of sft, rm, ppo, merge, export.")
    ckpt_path: str = Field("./ckpt", **_operational("Checkpoint root: a local folder or fsspec URL (s3://...)."))
    storage_options: dict[str, Any] = Field(
        default_factory=dict,
        **_operational("fsspec storage options for ckpt_path (e.g. endpoint_url); prefer env vars for secrets."),
    )
    load_checkpoint: bool = Field(
        False, **_operational("Resume from the newest valid checkpoint; without it a non-empty run is refused.")
    )
    resume_from: int | None = Field(
        None, ge=0,
        **_operational("Resume from this step (e.g. 100 for step_100) instead of the newest; newer checkpoints "
                       "are set aside, not deleted. Also set by --ckpt_path .../{run_name}/{stage}/step_100."),
    )
    load_weights_only: bool = Field(
        False, **_operational("Restore only the weights of the checkpoint the run starts from, with a fresh "
                              "optimizer (the remedy for a loss spike after resume).")
    )
    allow_config_change: bool = Field(
        False, **_operational("Resume even though settings that change the math differ from the checkpoint's.")
    )
    max_ckpt_num: int = Field(3, **_operational("Keep at most this many checkpoints per stage (<=0: all)."))
    max_ckpt_mem: float | None = Field(None, gt=0, **_operational("Keep at most this many GB of checkpoints per stage."))
    seed: int = Field(42, description="Seed from which every random draw (data order, init, sampling) is derived.")
    num_workers: int = Field(1, ge=1, **_operational("DeepSpeed ranks (Ray actors) per training stage."))
    ray_address: str | None = Field(
        None, **_operational("Address of an existing Ray cluster; default: RAY_ADDRESS, else a local one.")
    )
    sft: SFTConfig | None = Field(None, description="Settings of the SFT stage.")

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
            if stage not in IMPLEMENTED_STAGES:
                raise ValueError(f"stage {stage!r} is not available yet; available: {', '.join(IMPLEMENTED_STAGES)}")
        if not stages:
            raise ValueError("name at least one stage")
        return stages

    @model_validator(mode="after")
    def _stages_configured(self) -> "RunConfig":
        for stage in self.stages:
            stage_cfg = getattr(self, stage)
            if stage_cfg is None:
                raise ValueError(f"stage {stage!r} is requested but has no settings (add a '{stage}:' section)")
            per_pass = stage_cfg.micro_train_batch_size * self.num_workers
            if stage_cfg.train_batch_size % per_pass:
                raise ValueError(
                    f"{stage}.train_batch_size ({stage_cfg.train_batch_size}) must be a multiple of "
                    f"micro_train_batch_size x num_workers ({per_pass})"
                )
        return self

    def stage_config(self, stage: str) -> StageConfig:
        return getattr(self, stage)

    def run_url(self) -> str:
        return f"{self.ckpt_path.rstrip('/')}/{self.run_name}"

    def stage_url(self, stage: str) -> str:
        return f"{self.run_url()}/{stage}"


def semantic_fields(model: BaseModel) -> dict[str, Any]:
    """The fields of `model` that change the trained weights, as plain JSON values."""
    values = {}
    for name, field in type(model).model_fields.items():
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        if extra.get("affects_training", True):
            value = getattr(model, name)
            values[name] = value.model_dump(mode="json") if isinstance(value, BaseModel) else value
    return values


def semantic_hash(run: RunConfig, stage: str) -> str:
    """Hash of everything that changes one stage's weights: its settings and the run seed."""
    payload = {"stage": stage, "seed": run.seed, "settings": semantic_fields(run.stage_config(stage))}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def describe_validation_error(error: ValidationError, source: str, flag_style: bool) -> str:
    """One sentence naming the offending field (as `--flag` on the CLI, as `a.b` in a file)."""
    first = error.errors()[0]
    location = [str(part) for part in first["loc"]]
    if flag_style:
        name = "--" + location[-1] if location else "the command line"
    else:
        name = ".".join(location) or "the top level"
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "missing":
        message = "is required"
    elif first["type"] == "extra_forbidden":
        message = "is not a known setting"
    more = f" (and {len(error.errors()) - 1} more problem(s))" if len(error.errors()) > 1 else ""
    return f"{source}: {name} {message}{more}."


def load_run_config(path: str) -> RunConfig:
    """Read a YAML run config; any problem becomes a UserError naming the file and field."""
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise UserError(f"{path}: cannot read the config file ({error.strerror}).") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise UserError(f"{path}{where}: not valid YAML ({getattr(error, 'problem', error)}).") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: the config must be a mapping of settings, not {type(data).__name__}.")
    try:
        return RunConfig.model_validate(data)
    except ValidationError as error:
        raise UserError(describe_validation_error(error, path, flag_style=False)) from None
