"""What every stage declares (`Stage`: its config, trainer, inputs from earlier stages, checks, headline metric and
OpenRLHF command) and the settings every training stage shares (`StageConfig`, its fields named as OpenRLHF's
flags). docs/design-notes.md ("Stages and their settings") says who reads a stage and where fields are documented.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rlhf_core.errors import UserError


def operational(description: str, role: str | None = None) -> dict[str, Any]:
    """Field kwargs for a setting that does not change the math (kept out of the semantic hash)."""
    return {"description": description, "json_schema_extra": {"affects_training": False, **({"role": role} if role else {})}}


def input_location(description: str, role: str) -> dict[str, Any]:
    """Field kwargs for an input location: `role` is "model", "data" or "path" (see `fields_with_role`)."""
    return {"description": description, "json_schema_extra": {"role": role}}


def fields_with_role(config: type[BaseModel], role: str, semantic_only: bool = False) -> list[str]:
    """The fields of a stage config tagged with `role` (model: an input model; data: a dataset; path: another
    input file; output: where the stage writes); with `semantic_only`, those that change the math (not an
    evaluation's data)."""
    return [name for name, field in config.model_fields.items()
            if isinstance(field.json_schema_extra, dict) and field.json_schema_extra.get("role") == role
            and not (semantic_only and field.json_schema_extra.get("affects_training") is False)]


@dataclass(frozen=True)
class Ref:
    """A lazy reference to an object in a layer the stages may not import (a trainer in `rlhf_core.rank`, which
    imports torch; a counting function in `rlhf_core.data`): its module and name, imported where it is used."""

    module: str
    name: str

    @classmethod
    def parse(cls, spec: str) -> Ref:
        """`Ref.parse("package.module:name")`."""
        module, separator, name = spec.partition(":")
        if not (module and separator and name):
            raise ValueError(f"{spec!r} must look like 'package.module:name'")
        return cls(module, name)

    def load(self) -> Any:
        return getattr(importlib.import_module(self.module), self.name)


@dataclass(frozen=True)
class Stage:
    """One pipeline stage, declared once, in its own module: what the driver needs to know of it besides its
    settings. What depends on a run's settings (items per step, passes, its data, its output, extra exports, the
    defaults of earlier versions) is a method or class attribute of its config (`StageSettings`, `StageConfig`).
    A stage's fields carry their roles (`role`: model, data, path, output) in their metadata, as
    `affects_training` marks the semantic ones."""

    name: str
    config: type[StageSettings]
    kind: Literal["train", "merge", "export"]
    position: int  # where it runs in a pipeline: stages run in increasing position
    description: str  # the help of its section in a run config (`sft:` in run.yaml)
    trainer: Ref | str | None = None  # the rank-side trainer class (train stages), imported where ranks run
    count_items: Ref | str | None = None  # counts the usable items of its data (the planner's), below rank
    openrlhf_module: str = ""  # OpenRLHF's CLI module this stage's flags come from (`openrlhf.cli.NAME`)
    # The metrics its stagnation alert watches, in order of preference (held-out first), whether higher is
    # better, and what to check when they stall.
    headline_metrics: tuple[str, ...] = ("eval_loss", "mean_loss", "loss")
    higher_is_better: bool = False
    stall_hint: str = "the learning rate or the data"
    is_policy: bool = False  # its output is a policy a merge or an export takes (the last one run)
    world_size_dependent: bool = False  # each rank samples with its own seed: the math depends on the rank count
    export_model_dir: str = "actor_model"  # the checkpoint folder whose `hf/` is the stage's output

    def __post_init__(self) -> None:
        for name in ("trainer", "count_items"):  # "module:name", as a package's own stage may still give it
            if isinstance(getattr(self, name), str):
                object.__setattr__(self, name, Ref.parse(getattr(self, name)) if getattr(self, name) else None)

    @property
    def output_field(self) -> str:
        """The name of the setting that says where the stage writes its result (its field with role "output")."""
        return self.config.output_field()

    def items_per_step(self, cfg: StageConfig) -> int:
        return cfg.items_per_step()

    def num_passes(self, cfg: StageConfig) -> int:
        return cfg.num_passes()

    def trainer_class(self):
        if not isinstance(self.trainer, Ref):
            raise ValueError(f"stage {self.name!r} has no trainer")
        return self.trainer.load()

    def num_items(self, run) -> int:
        """Usable items (samples, pairs or prompts) of the stage's data in `run`; reads and tokenizes it all."""
        if not isinstance(self.count_items, Ref):
            raise ValueError(f"stage {self.name!r} has no data to count")
        return self.count_items.load()(run)


@dataclass(frozen=True)
class DataSource:
    """The data a stage trains on, as its settings name it: where, which split, and the flag that gives it."""

    url: str
    split: str
    flag: str


class Earlier:
    """The stages of one run as one of them sees them: what the stages before it produce, for its defaults."""

    def __init__(self, stage: str, stages: list[str], configs: Mapping[str, StageSettings],
                 table: Mapping[str, Stage]):
        self.stage, self._before, self._configs, self._table = stage, stages[: stages.index(stage)], configs, table

    def ran(self, producer: str) -> bool:
        return producer in self._before

    def output(self, producer: str) -> str:
        """Where `producer`, run before this stage, writes its result; a clear error when it does not run."""
        if not self.ran(producer):
            raise ValueError(f"{self.stage} needs its input: set it, or run {producer} before {self.stage}")
        return self._configs[producer].output()

    def policy(self) -> tuple[str, StageConfig] | None:
        """The last stage before this one whose output is a policy, and its config (a training stage's)."""
        name = next((name for name in reversed(self._before) if self._table[name].is_policy), None)
        if name is None:
            return None
        config = self._configs[name]
        if not isinstance(config, StageConfig):
            raise TypeError(f"stage {name!r} makes a policy, so its settings must be a StageConfig")
        return name, config

    def policy_stages(self) -> str:
        """The stages that produce a policy, for a message: "sft, ppo"."""
        return ", ".join(name for name, stage in self._table.items() if stage.is_policy)


class StageSettings(BaseModel):
    """The settings of any stage: unknown keys are refused, and two hooks `RunConfig` calls."""

    model_config = ConfigDict(extra="forbid")

    # The defaults of semantic settings before `rlhf` took OpenRLHF's (issue 44). A run whose checkpoints recorded
    # one of them, resumed by a command or config that leaves the setting out, keeps the recorded value
    # (`rlhf_core.driver.resume.keep_recorded_defaults`): neither refused as drifted nor changed.
    earlier_defaults: ClassVar[Mapping[str, Any]] = {}

    def chained(self, earlier: Earlier) -> StageSettings:
        """These settings with their inputs defaulted from the stages run before (`earlier`)."""
        return self

    def check_in_run(self, stage: str, num_workers: int) -> None:
        """Raise ValueError when these settings do not fit the run (its rank count)."""

    @classmethod
    def output_field(cls) -> str:
        """The setting that says where the stage writes its result: its one field with the role "output"."""
        (name,) = fields_with_role(cls, "output")
        return name

    def output(self) -> str:
        """Where the stage writes its result."""
        return getattr(self, self.output_field())

    def data_source(self) -> DataSource | None:
        """The data the stage trains on; none (the default): it has none (a merge, an export)."""
        return None


PRETRAIN_HELP = ("Model to start from: a local folder, an fsspec URL, or a Hugging Face hub id (resolved from the "
                 "local cache when offline) in Hugging Face format.")


class StageConfig(StageSettings):
    """Settings every training stage shares: model, optimisation, chunking, export."""

    # Required, but a stage may default it to an earlier stage's output (`chained`): read it as `start_model`.
    pretrain: str | None = Field(**input_location(PRETRAIN_HELP, role="model"))
    max_len: int = Field(2048, ge=8, description="Maximum tokens per sample; longer samples are truncated.")
    max_samples: int | None = Field(1_000_000, ge=1, description="Use at most this many samples of the dataset "
                                                                "(the first ones); none: all of them.")
    train_batch_size: int = Field(128, ge=1, description="Global batch size: samples per optimizer step, all ranks.")
    micro_train_batch_size: int = Field(8, ge=1, description="Samples per rank per forward/backward pass.")
    max_epochs: int = Field(1, ge=1, description="Passes over the dataset.")
    learning_rate: float = Field(5e-6, gt=0, description="Peak learning rate of the schedule (PPO: the actor's).")
    lr_warmup_ratio: float = Field(0.03, ge=0, le=1, description="Fraction of the steps spent warming the LR up.")
    lr_scheduler: Literal["cosine_with_min_lr", "cosine", "linear", "constant", "constant_with_warmup"] = Field(
        "cosine_with_min_lr", description="LR schedule after warmup: cosine_with_min_lr (down to min_lr_ratio of "
                                          "the peak, OpenRLHF's default), cosine (down to 0), linear (to 0), "
                                          "constant.")
    l2: float = Field(0.0, ge=0, description="AdamW weight decay.")
    adam_betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW betas (beta1 beta2).")
    adam_eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="cosine_with_min_lr decays to this fraction of the "
                                                             "peak learning rate.")
    max_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    zero_stage: Literal[0, 1, 2, 3] | None = Field(
        None, **operational("DeepSpeed ZeRO stage (0, 1, 2 or 3). Default: the stage the stage's checkpoints were "
                             "written with when resuming; else 0 on one rank (ZeRO has nothing to partition "
                             "there), 2 (OpenRLHF's default) on more ranks or with --adam_offload.")
    )
    param_dtype: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32", description="Training precision: fp32; bf16 (bf16 weights on a GPU, bf16 autocast on a CPU with "
                            "bf16 support, else fp32 with a warning); fp16 needs a GPU.")
    attn_implementation: str | None = Field(
        None, description="Attention kernel (eager, sdpa, flash_attention_2, ...); default: transformers' choice. "
                          "flash_attention_* without flash-attn falls back to sdpa with a warning.")
    adam_offload: bool = Field(False, description="Keep the AdamW states on the CPU (DeepSpeed optimizer offload).")
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward to save memory.")
    gradient_checkpointing_use_reentrant: bool = Field(False, description="Use torch's reentrant activation "
                                                                          "checkpointing variant.")
    packing_samples: bool = Field(False, description="Pack several samples into one row without padding "
                                                     "(attention kept within each sample).")
    lora_rank: int = Field(0, ge=0, description="LoRA rank; 0 trains the full model.")
    lora_alpha: int = Field(16, ge=1, description="LoRA scaling numerator (alpha / rank).")
    lora_dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the LoRA adapters' input.")
    target_modules: list[str] | None = Field(
        None, description="Modules that get LoRA adapters; default: all linear layers."
    )
    input_template: str | None = Field(
        None, description="Template with one '{}' that wraps each prompt when no chat template is applied "
                          "(e.g. 'User: {}\\nAssistant: ', SFT's default as in OpenRLHF); none: the prompt as is.")
    dataset_probs: str | None = Field(None, description="Sampling weights of several comma-separated datasets "
                                                        "(e.g. '0.7,0.3'), interleaved until each is exhausted; "
                                                        "default: concatenated.")
    dataset_split: str = Field("train", description="Split of a dataset given by hub name (or a dataset dict).")
    eval_dataset: str | None = Field(None, **operational("Evaluation data (path, URL or hub name); evaluated every "
                                                          "eval_steps steps.", role="data"))
    eval_split: str = Field("train", **operational("Split of eval_dataset to evaluate on."))
    eval_steps: int = Field(-1, **operational("Evaluate every N steps; -1: once per epoch, at its last step (PPO: "
                                              "never), as OpenRLHF. Independent of save_steps."))
    save_steps: int = Field(
        -1, description="Optimizer steps per chunk; each chunk ends with a committed checkpoint. -1: one chunk."
    )
    save_path: str = Field("./out/model", **operational("Where the final Hugging Face model is exported (any fsspec "
                                                         "URL).", role="output"))
    save_hf_ckpt: bool = Field(
        False, **operational("Make each checkpoint's actor_model/hf a standalone HF model (adds tokenizer).")
    )
    disable_ds_ckpt: bool = Field(
        False, **operational("Checkpoints keep the weights only (no DeepSpeed optimizer state); a resume restores "
                              "the weights with a fresh optimizer, as --load_weights_only.")
    )
    logging_steps: int = Field(1, ge=1, **operational("Log training metrics to the trackers (--use_tensorboard, "
                                                       "--use_wandb) every N steps."))

    @model_validator(mode="before")
    @classmethod
    def _bf16_flag(cls, data: Any) -> Any:
        """`bf16: true`, the older spelling (OpenRLHF <= 0.8 and the seed guide), means param_dtype bf16."""
        if isinstance(data, dict) and "bf16" in data:
            data = dict(data)
            if data.pop("bf16"):
                data.setdefault("param_dtype", "bf16")
        return data

    @property
    def bf16(self) -> bool:
        return self.param_dtype == "bf16"

    @property
    def start_model(self) -> str:
        """`pretrain` as the run filled it: a section may leave it to an earlier stage's output (`chained`)."""
        if self.pretrain is None:
            raise UserError("pretrain is not set: give it, or run the stage that produces it before this one")
        return self.pretrain

    # The setting that says how many items (samples, pairs or prompts) one step consumes, named when the data
    # cannot fill one step: `items_per_step`'s value.
    step_size_field: ClassVar[str] = "train_batch_size"

    def items_per_step(self) -> int:
        return self.train_batch_size

    def num_passes(self) -> int:
        """Passes over the data."""
        return self.max_epochs

    def data_source(self) -> DataSource | None:
        """The data the stage trains on: its one semantic field with the role "data" (not an evaluation's), in
        its `dataset_split`; none without one. A stage whose data has a split setting of its own says so."""
        names = fields_with_role(type(self), "data", semantic_only=True)
        if len(names) != 1:
            return None
        return DataSource(getattr(self, names[0]), self.dataset_split, f"--{names[0]}")

    def extra_exports(self) -> dict[str, str]:
        """Models of the final checkpoint exported besides the stage's own (`Stage.export_model_dir`): where each
        goes, by its checkpoint folder. None by default."""
        return {}

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

    def check_in_run(self, stage: str, num_workers: int) -> None:
        per_pass = self.micro_train_batch_size * num_workers
        if self.train_batch_size % per_pass:
            raise ValueError(f"{stage}.train_batch_size ({self.train_batch_size}) must be a multiple of "
                             f"micro_train_batch_size x num_workers ({per_pass})")


def restated(name: str, default: Any) -> Any:
    """StageConfig's field `name` with another default, for a stage whose OpenRLHF command has its own (train_rm's
    learning rate is 9e-6, train_sft's 5e-6): the same description and bounds, written once, in StageConfig."""
    shared = StageConfig.model_fields[name]
    bounds = {bound: getattr(item, bound) for item in shared.metadata for bound in ("ge", "gt", "le", "lt")
              if hasattr(item, bound)}
    return Field(default, description=shared.description, json_schema_extra=shared.json_schema_extra, **bounds)


class PreferenceConfig(StageConfig):
    """The preference data a stage trains on (the reward model, DPO): OpenRLHF's reward dataset and its keys."""

    dataset: str = Field(**input_location("Preference data (prompt, chosen, rejected), in any form --dataset of SFT takes.",
                                  role="data"))
    max_len: int = restated("max_len", 512)  # train_rm's and train_dpo's
    prompt_key: str | None = Field(None, description="Key of the prompt in each sample; none (OpenRLHF's default): "
                                                     "chosen and rejected each hold the whole text or conversation.")
    chosen_key: str = Field("chosen", description="Key of the preferred response (a string, or messages).")
    rejected_key: str = Field("rejected", description="Key of the dispreferred response (a string, or messages).")
    apply_chat_template: bool = Field(False, description="Render prompt and replies with the tokenizer's chat "
                                                         "template, as OpenRLHF does.")
    tokenizer_chat_template: str | None = Field(None, description="A Jinja chat template that replaces the "
                                                                  "tokenizer's own (with apply_chat_template).")
    eval_holdout: float = Field(0.0, ge=0, lt=1, description="Without eval_dataset: fraction of the pairs held out "
                                                             "of training to evaluate on (0: none, as OpenRLHF; the "
                                                             "reward model then evaluates on its first 1%).")
