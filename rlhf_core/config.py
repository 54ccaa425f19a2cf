"""One pydantic model per stage, plus `RunConfig`, the pipeline that chains them.

Field names are OpenRLHF's flag names, so `--pretrain`, `--save_steps`, `--ckpt_path` ... move over
unchanged. Each field is documented once, in `Field(description=...)`: that text is the `rlhf` CLI
help and the Prefect UI form. Fields tagged `affects_training=False` (paths, logging, retention,
cluster address) never change the weights, so they stay out of the semantic hash that keys the
Prefect cache and guards a resume against config drift.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from rlhf_core.errors import UserError

SECRET_OPTION = re.compile(r"secret|token|password|credential|^key$|_key$", re.IGNORECASE)


def _operational(description: str, role: str | None = None) -> dict[str, Any]:
    """Field kwargs for a setting that does not change the math (kept out of the semantic hash)."""
    return {"description": description, "json_schema_extra": {"affects_training": False, **({"role": role} if role else {})}}


def _input(description: str, role: str) -> dict[str, Any]:
    """Field kwargs for an input location: `role` is "model", "data" or "path" (see `fields_with_role`)."""
    return {"description": description, "json_schema_extra": {"role": role}}


class StageConfig(BaseModel):
    """Settings every training stage shares: model, optimisation, chunking, export."""

    model_config = ConfigDict(extra="forbid")

    pretrain: str = Field(**_input("Model to start from: a local folder, an fsspec URL, or a Hugging Face hub id "
                                      "(resolved from the local cache when offline) in Hugging Face format.", role="model"))
    max_len: int = Field(2048, ge=8, description="Maximum tokens per sample; longer samples are truncated.")
    max_samples: int | None = Field(None, ge=1, description="Use at most this many samples of the dataset.")
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
        None, **_operational("DeepSpeed ZeRO stage (0, 1, 2 or 3). Default: the stage the stage's checkpoints were "
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
                          "(e.g. 'User: {}\\nAssistant: '); default: the prompt as is.")
    dataset_probs: str | None = Field(None, description="Sampling weights of several comma-separated datasets "
                                                        "(e.g. '0.7,0.3'), interleaved until each is exhausted; "
                                                        "default: concatenated.")
    dataset_split: str = Field("train", description="Split of a dataset given by hub name (or a dataset dict).")
    eval_dataset: str | None = Field(None, **_operational("Evaluation data (path, URL or hub name); evaluated every "
                                                          "eval_steps and at each checkpoint.", role="data"))
    eval_split: str = Field("train", **_operational("Split of eval_dataset to evaluate on."))
    eval_steps: int = Field(-1, **_operational("Evaluate every N steps; -1: at each checkpoint only."))
    save_steps: int = Field(
        -1, description="Optimizer steps per chunk; each chunk ends with a committed checkpoint. -1: one chunk."
    )
    save_path: str = Field("./out/model", **_operational("Where the final Hugging Face model is exported (any fsspec "
                                                         "URL).", role="output"))
    save_hf_ckpt: bool = Field(
        False, **_operational("Make each checkpoint's actor_model/hf a standalone HF model (adds tokenizer).")
    )
    disable_ds_ckpt: bool = Field(
        False, **_operational("Checkpoints keep the weights only (no DeepSpeed optimizer state); a resume restores "
                              "the weights with a fresh optimizer, as --load_weights_only.")
    )
    logging_steps: int = Field(1, ge=1, **_operational("Log training metrics to the trackers (--use_tensorboard, "
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

    dataset: str = Field(**_input("Training data (prompt, response): JSONL, JSON, CSV or Parquet at a local path or "
                                  "fsspec URL, a `datasets` folder, a hub dataset name, or OpenRLHF's name@data_dir; "
                                  "several, comma-separated, are mixed by dataset_probs.", role="data"))
    input_key: str = Field("input", description="Key of the prompt in each sample: a string, or with "
                                                "apply_chat_template a list of {role, content} messages (without "
                                                "output_key: the whole conversation, its last message the response).")
    output_key: str | None = Field(None, description="Key of the response in each sample (a string or messages); "
                                                     "none: input_key holds whole conversations (apply_chat_template).")
    apply_chat_template: bool = Field(False, description="Render prompt and response with the tokenizer's chat "
                                                         "template, as OpenRLHF does.")
    multiturn: bool = Field(False, description="Put loss on every assistant turn of the conversation in input_key "
                                               "(with apply_chat_template), not only on the last.")
    tokenizer_chat_template: str | None = Field(None, description="A Jinja chat template that replaces the "
                                                                  "tokenizer's own (with apply_chat_template).")
    pretrain_mode: bool = Field(False, description="Continued pre-training: the loss covers every token of each "
                                                   "sample's input_key text (no template, output_key unused).")
    save_path: str = Field("./out/sft", **_operational("Where the final Hugging Face model is exported (any fsspec "
                                                       "URL).", role="output"))


class RMConfig(StageConfig):
    """Reward model: a causal-LM backbone with a scalar `score` head, trained on preference pairs
    with the Bradley-Terry loss; accuracy is measured on a held-out split."""

    pretrain: str | None = Field(None, **_input("Backbone to start from; default: the SFT output of this run.",
                                                role="model"))
    dataset: str = Field(**_input("Preference data (prompt, chosen, rejected), in any form --dataset of SFT takes.",
                                  role="data"))
    prompt_key: str | None = Field(None, description="Key of the prompt in each sample; none (OpenRLHF's default): "
                                                     "chosen and rejected each hold the whole text or conversation.")
    chosen_key: str = Field("chosen", description="Key of the preferred response (a string, or messages).")
    rejected_key: str = Field("rejected", description="Key of the dispreferred response (a string, or messages).")
    apply_chat_template: bool = Field(False, description="Render prompt and replies with the tokenizer's chat "
                                                         "template, as OpenRLHF does.")
    tokenizer_chat_template: str | None = Field(None, description="A Jinja chat template that replaces the "
                                                                  "tokenizer's own (with apply_chat_template).")
    eval_holdout: float = Field(0.1, ge=0, lt=1, description="Without eval_dataset: fraction of the pairs held out "
                                                             "to measure accuracy.")
    loss: Literal["sigmoid", "logexploss"] = Field("sigmoid", description="Pairwise loss: sigmoid (Bradley-Terry, "
                                                                         "-log sigmoid(r_c - r_r)) or logexploss "
                                                                         "(log(1 + exp(r_r - r_c))).")
    margin_loss: bool = Field(False, description="Subtract each pair's 'margin' field from r_c - r_r in the loss.")
    save_path: str = Field("./out/rm", **_operational("Where the final reward model is exported (any fsspec URL).",
                                                      role="output"))


class PPOConfig(StageConfig):
    """PPO and its critic-free variants (REINFORCE++, RLOO, GRPO) on prompts, rewarded by a reward
    model or a Python function. One optimizer "step" here is one PPO step: a rollout and its update."""

    pretrain: str | None = Field(None, **_input("Actor (and reference) to start from; default: the SFT output.",
                                                role="model"))
    reward_pretrain: str | None = Field(None, **_input("Reward model; default: the RM output of this run.",
                                                       role="model"))
    reward_fn: str | None = Field(None, description="A Python reward function 'package.module:function', used instead "
                                                    "of a reward model (verifiable rewards): OpenRLHF's form "
                                                    "(queries, prompts, labels, **kwargs) or fn(prompts, responses), "
                                                    "told apart by its signature.")
    critic_pretrain: str | None = Field(None, **_input("Critic to start from (gae only); default: the reward model, "
                                                       "else the actor (a new value head).", role="model"))
    prompt_data: str = Field(**_input("Prompts, in any form --dataset takes (several, comma-separated, are mixed by "
                                      "dataset_probs).", role="data"))
    input_key: str = Field("input", description="Key of the prompt in each sample.")
    apply_chat_template: bool = Field(False, description="Wrap the prompt in the tokenizer's chat template.")
    advantage_estimator: Literal["gae", "reinforce", "rloo", "reinforce_baseline", "group_norm", "dr_grpo"] = Field(
        "gae", description="gae (PPO with a critic), reinforce (REINFORCE++), rloo, reinforce_baseline, group_norm "
                           "(GRPO), dr_grpo (GRPO without std normalization).")
    n_samples_per_prompt: int = Field(1, ge=1, description="Responses sampled per prompt.")
    rollout_batch_size: int = Field(16, ge=1, description="Prompts per PPO step (all ranks).")
    micro_rollout_batch_size: int = Field(8, ge=1, description="Sequences per generation / scoring pass per rank.")
    num_episodes: int = Field(1, ge=1, description="Passes over the prompt data.")
    max_epochs: int = Field(1, ge=1, description="Optimisation passes over each rollout.")
    prompt_max_len: int = Field(128, ge=1, description="Prompts are truncated to this many tokens (from the left).")
    max_new_tokens: int = Field(64, ge=1, description="Maximum tokens generated per response.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling threshold.")
    init_kl_coef: float = Field(0.01, ge=0, description="KL penalty coefficient (initial, if kl_target is set).")
    kl_target: float | None = Field(None, gt=0, description="Adaptive KL controller target; default: fixed coefficient.")
    kl_horizon: int = Field(10000, ge=1, description="Adaptive KL controller horizon (samples).")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k1", description="KL estimator: k1 (log ratio), k2, k3 (Schulman).")
    eps_clip: float = Field(0.2, gt=0, description="PPO policy ratio clip.")
    eps_clip_low_high: tuple[float, float] | None = Field(
        None, description="Asymmetric ratio clip (low high), e.g. DAPO's clip-higher 0.2 0.28; default: eps_clip "
                          "both ways.")
    entropy_loss_coef: float | None = Field(
        None, allow_inf_nan=False,
        description="Entropy bonus of the actor loss (OpenRLHF's): unset, none; 0, the policy's mean entropy over "
                    "the response tokens is logged as entropy_loss and the loss is unchanged; otherwise the loss "
                    "minus coef x that entropy.")
    value_clip: float = Field(0.2, gt=0, description="PPO value clip (gae).")
    gamma: float = Field(1.0, gt=0, le=1, description="Discount factor.")
    lambd: float = Field(0.95, ge=0, le=1, description="GAE lambda.")
    critic_learning_rate: float = Field(9e-6, gt=0, description="Critic learning rate (gae).")
    remote_rm_url: str | None = Field(None, **_input("OpenRLHF's reward function: a .py file defining "
                                                        "reward_func(queries, prompts, labels, **kwargs) (or "
                                                        "reward_func(prompts, responses)), or an HTTP reward server "
                                                        "URL (as serve_remote_rm.sh); replaces the reward model.",
                                                        role="path"))
    label_key: str | None = Field(None, description="Key of each prompt's label (e.g. the answer), passed to the "
                                                    "reward function as `labels`.")
    prompt_split: str = Field("train", description="Split of prompt_data when it is a hub dataset name.")
    normalize_reward: bool = Field(False, description="Normalize reward-model scores with the mean and std the "
                                                      "reward model recorded in its config at training time.")
    reward_clip_range: tuple[float, float] = Field((-10.0, 10.0), description="Rewards are clipped to [low, high].")
    use_kl_loss: bool = Field(False, description="Put the KL to the reference in the loss (GRPO style, with "
                                                 "kl_estimator) instead of in the reward.")
    dynamic_filtering: bool = Field(False, description="Drop prompts whose samples' mean score lies outside "
                                                       "dynamic_filtering_reward_range (all right or all wrong).")
    dynamic_filtering_reward_range: tuple[float, float] = Field(
        (0.0, 1.0), description="Keep a prompt only when its samples' mean score is strictly inside (low, high).")
    freezing_actor_steps: int = Field(-1, description="Train only the critic for the first N PPO steps (gae).")
    save_value_network: bool = Field(False, **_operational("Also export the critic, to {save_path}_critic."))
    eval_temperature: float = Field(0.6, gt=0, **_operational("Sampling temperature of the evaluation rollouts."))
    eval_n_samples_per_prompt: int = Field(1, ge=1, **_operational("Samples per evaluation prompt."))
    vllm_num_engines: int = Field(0, ge=0, description="vLLM engines for generation (GPU, `[vllm]` extra), one per rank: "
                                                        "equal to num_workers; 0: transformers generate.")
    vllm_tensor_parallel_size: int = Field(1, ge=1, description="Tensor parallel size of each vLLM engine "
                                                                      "(1: engines are colocated one per rank).")
    vllm_gpu_memory_utilization: float = Field(0.5, gt=0, le=1, description="GPU memory fraction vLLM may take.")
    vllm_enable_sleep: bool = Field(False, description="Let vLLM release GPU memory while the models train.")
    save_path: str = Field("./out/ppo", **_operational("Where the final policy is exported (an adapter if LoRA).",
                                                       role="output"))

    @model_validator(mode="after")
    def _cross_field_checks(self) -> "PPOConfig":
        if self.reward_fn is not None and not re.fullmatch(r"[\w.]+:\w+", self.reward_fn):
            raise ValueError(f"reward_fn {self.reward_fn!r} must look like 'package.module:function'")
        low, high = self.dynamic_filtering_reward_range
        if self.dynamic_filtering and (self.n_samples_per_prompt < 2 or not low < high):
            raise ValueError("dynamic_filtering compares the samples of one prompt: set n_samples_per_prompt >= 2 "
                             "and dynamic_filtering_reward_range LOW HIGH with LOW < HIGH")
        if self.reward_fn is not None and self.remote_rm_url is not None:
            raise ValueError("reward_fn and remote_rm_url both replace the reward model: give one of them")
        if self.advantage_estimator in ("rloo", "reinforce_baseline", "group_norm", "dr_grpo") and self.n_samples_per_prompt < 2:
            raise ValueError(f"{self.advantage_estimator} compares samples of one prompt: set n_samples_per_prompt >= 2")
        if self.vllm_num_engines and self.vllm_tensor_parallel_size != 1:
            raise ValueError("vllm_tensor_parallel_size must be 1: each rank hosts a whole vLLM engine next to its "
                             "models (use more num_workers for more engines)")
        if (self.rollout_batch_size * self.n_samples_per_prompt) % self.train_batch_size:
            raise ValueError(f"rollout_batch_size x n_samples_per_prompt ({self.rollout_batch_size * self.n_samples_per_prompt})"
                             f" must be a multiple of train_batch_size ({self.train_batch_size})")
        return self


class MergeConfig(BaseModel):
    """LoRA merge: base model + adapter -> one model, checked against base+adapter logits before writing."""

    model_config = ConfigDict(extra="forbid")

    model_path: str | None = Field(None, **_input("Base model; default: the policy's pretrain in this run.",
                                                  role="model"))
    lora_path: str | None = Field(None, **_input("Adapter; default: the last policy stage's output in this run.",
                                                 role="model"))
    output_path: str = Field("./out/merged", **_operational("Where the merged model is written (any fsspec URL).",
                                                            role="output"))
    bf16: bool = Field(False, description="Write the merged weights in bfloat16.")


class ExportConfig(BaseModel):
    """Final Hugging Face export of the policy: config, tokenizer and safetensors, checked to load and generate."""

    model_config = ConfigDict(extra="forbid")

    model_path: str | None = Field(None, **_input("Model to export; default: the merged or last policy of this run.",
                                                  role="model"))
    save_path: str = Field("./out/final", **_operational("Where the final model is exported (any fsspec URL).",
                                                         role="output"))


@dataclass(frozen=True)
class Stage:
    """One pipeline stage, declared once. The CLI (`rlhf train NAME`), path resolution, input fingerprints,
    preflight checks and the flow's dispatch all read this table; a stage's fields carry their roles
    (`role`: model, data, path, output) in their metadata, as `affects_training` marks the semantic ones."""

    name: str
    config: type[BaseModel]
    kind: Literal["train", "merge", "export"]
    trainer: str = ""  # "module:Class" of the rank-side trainer (train stages), imported where ranks run
    output_field: str = "save_path"  # the field naming where the stage's result is written
    openrlhf_module: str = ""  # OpenRLHF's CLI module this stage's flags come from (`openrlhf.cli.NAME`)
    # The metrics its stagnation alert watches, in order of preference (held-out first), whether higher is
    # better, and what to check when they stall.
    headline_metrics: tuple[str, ...] = ("eval_loss", "mean_loss", "loss")
    higher_is_better: bool = False
    stall_hint: str = "the learning rate or the data"
    is_policy: bool = False  # its output is a policy a merge or an export takes (the last one run)
    world_size_dependent: bool = False  # each rank samples with its own seed: the math depends on the rank count

    def trainer_class(self):
        module_name, class_name = self.trainer.split(":")
        return getattr(importlib.import_module(module_name), class_name)


STAGES: dict[str, Stage] = {stage.name: stage for stage in (
    Stage("sft", SFTConfig, "train", "rlhf_core.rank.trainers.sft:SFTTrainer", openrlhf_module="train_sft",
          is_policy=True),
    Stage("rm", RMConfig, "train", "rlhf_core.rank.trainers.rm:RewardModelTrainer", openrlhf_module="train_rm"),
    Stage("ppo", PPOConfig, "train", "rlhf_core.rank.trainers.ppo:PPOTrainer", openrlhf_module="train_ppo_ray",
          headline_metrics=("eval_reward", "mean_reward", "reward"), higher_is_better=True,
          stall_hint="the learning rate, the KL coefficient or the reward", is_policy=True,
          world_size_dependent=True),
    Stage("merge", MergeConfig, "merge", output_field="output_path", openrlhf_module="lora_combiner"),
    Stage("export", ExportConfig, "export"),
)}
KNOWN_STAGES = tuple(STAGES)
TRAINING_STAGES = tuple(name for name, stage in STAGES.items() if stage.kind == "train")
# Stages whose math depends on the number of ranks (PPO: each rank samples its share with its own seed).
WORLD_SIZE_DEPENDENT_STAGES = tuple(name for name, stage in STAGES.items() if stage.world_size_dependent)
# OpenRLHF resumes a given step with --ckpt_path {root}/{run_name}/{stage}/step_N: any training stage's folder.
STEP_DIR_PATH = re.compile(rf"^(.*?)/?([A-Za-z0-9._-]+)/({'|'.join(TRAINING_STAGES)})/step_(\d+)/?$")


def chunk_ends(total_steps: int, save_steps: int) -> list[int]:
    """The steps a stage's chunks end at, where a checkpoint commits: every `save_steps` (OpenRLHF's
    --save_steps; -1 or 0: one chunk) and the last step. The one statement of the rule: the driver's plan
    (`driver.plan.plan_stage`) and the ranks' evaluation at chunk ends (`DeepSpeedTrainer.is_chunk_end`) read it."""
    every = save_steps if save_steps > 0 else total_steps
    return list(range(every, total_steps, every)) + [total_steps]


def fields_with_role(config: type[BaseModel], role: str) -> list[str]:
    """The fields of a stage config tagged with `role` (model: an input model; data: a dataset; path: another
    input file; output: where the stage writes)."""
    return [name for name, field in config.model_fields.items()
            if isinstance(field.json_schema_extra, dict) and field.json_schema_extra.get("role") == role]


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
        None, **_operational("Address of an existing Ray cluster (host:port, or ray://host:10001 for a Ray client "
                             "driver off the cluster); default: RAY_ADDRESS, else a local one.")
    )
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_SPREAD"] = Field(
        "PACK", **_operational("How Ray's placement group spreads the ranks over nodes: PACK (fewest nodes), "
                               "SPREAD (as many as it can) or STRICT_SPREAD (one rank per node).")
    )
    placement_timeout_s: float = Field(
        120.0, gt=0,
        **_operational("Seconds to wait for the worker group's resources before failing with what is missing "
                       "(a retried chunk waits this long for a lost node's resources to return)."),
    )
    num_cpus_per_worker: float | None = Field(
        None, gt=0, **_operational("CPUs Ray reserves for each rank; default: 1, or an equal share of the "
                                   "cluster's CPUs when it has fewer than num_workers.")
    )
    allow_fewer_workers: bool = Field(
        False, **_operational("When the cluster cannot place num_workers ranks within placement_timeout_s (a "
                              "node was lost), go on with as many as fit, resuming through DeepSpeed's "
                              "universal checkpoint; the change is recorded in the checkpoint metadata.")
    )
    sync_checkpoint: bool = Field(
        False, **_operational("Write each checkpoint while training waits. By default the ranks snapshot it to "
                              "memory, train the next chunk, and upload it meanwhile (a crash during the upload "
                              "loses that checkpoint only, never a committed one).")
    )
    max_chunks_per_run: int | None = Field(
        None, ge=1, **_operational("Train at most this many chunks in this flow run, then stop cleanly at a chunk "
                                   "boundary; the next run of the same run_name continues (scheduled runs).")
    )
    time_budget_minutes: float | None = Field(
        None, gt=0, **_operational("Start no new chunk once this many minutes have passed since the flow run "
                                   "began; stop cleanly at a chunk boundary (the next run continues).")
    )
    stop_grace_s: float = Field(
        25.0, gt=0, **_operational("On SIGTERM or Ctrl-C, the ranks finish their step and it commits as an "
                                   "emergency checkpoint within this many seconds (less a fifth, at least 3 s, kept "
                                   "for leaving), else the last commit stands; a second signal leaves at once. 25 "
                                   "fits Kubernetes' default 30 s terminationGracePeriodSeconds.")
    )
    verbose: bool = Field(
        False, **_operational("Show Ray's and DeepSpeed's full logs on the console (they always go to the log "
                              "file in the run folder).")
    )
    alert_reward_window: int = Field(
        3, ge=1, **_operational("Alert (rlhf.alert.reward-stagnant) when the headline metric (PPO reward; SFT/RM "
                                "eval or training loss) has not improved across this many committed checkpoints.")
    )
    alert_reward_min_delta: float = Field(
        0.0, ge=0, **_operational("How much a checkpoint's headline metric must beat the best so far to count as "
                                  "an improvement.")
    )
    alert_size_tolerance: float = Field(
        0.5, gt=0, **_operational("Alert (rlhf.alert.checkpoint-size) when a checkpoint's size is off the size "
                                  "its models predict by more than this fraction.")
    )
    alert_size_jump: float = Field(
        0.2, gt=0, **_operational("... or off the median size of the stage's earlier checkpoints by more than "
                                  "this fraction.")
    )
    use_tensorboard: str | None = Field(None, **_operational("TensorBoard log folder; each stage writes its "
                                                             "metrics under {use_tensorboard}/{run_name}/{stage}."))
    use_wandb: bool = Field(False, **_operational("Log metrics to Weights & Biases (WANDB_API_KEY from the "
                                                  "environment; WANDB_MODE=offline works without network). A "
                                                  "resumed run continues the same wandb run."))
    wandb_org: str | None = Field(None, **_operational("wandb entity (organization or user)."))
    wandb_group: str | None = Field(None, **_operational("wandb group."))
    wandb_project: str = Field("rlhf", **_operational("wandb project."))
    wandb_run_name: str | None = Field(None, **_operational("wandb run name; default: {run_name}-{stage}."))
    sft: SFTConfig | None = Field(None, description="Settings of the SFT stage.")
    rm: RMConfig | None = Field(None, description="Settings of the reward-model stage.")
    ppo: PPOConfig | None = Field(None, description="Settings of the PPO stage.")
    merge: MergeConfig | None = Field(None, description="Settings of the LoRA merge stage.")
    export: ExportConfig | None = Field(None, description="Settings of the final export stage.")

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
    def _stages_configured(self) -> "RunConfig":
        if [KNOWN_STAGES.index(stage) for stage in self.stages] != sorted(KNOWN_STAGES.index(s) for s in set(self.stages)):
            raise ValueError(f"stages must be distinct and in pipeline order ({' -> '.join(KNOWN_STAGES)})")
        for stage in self.stages:
            if getattr(self, stage) is None:
                if STAGES[stage].kind == "train":
                    raise ValueError(f"stage {stage!r} is requested but has no settings (add a '{stage}:' section)")
                setattr(self, stage, STAGES[stage].config())
        self._chain_stage_inputs()
        for stage in (stage for stage in self.stages if stage in TRAINING_STAGES):
            stage_cfg = getattr(self, stage)
            per_pass = stage_cfg.micro_train_batch_size * self.num_workers
            if stage_cfg.train_batch_size % per_pass:
                raise ValueError(
                    f"{stage}.train_batch_size ({stage_cfg.train_batch_size}) must be a multiple of "
                    f"micro_train_batch_size x num_workers ({per_pass})"
                )
        if self.ppo is not None and "ppo" in self.stages and self.ppo.rollout_batch_size % self.num_workers:
            raise ValueError(f"ppo.rollout_batch_size ({self.ppo.rollout_batch_size}) must be a multiple of num_workers")
        if self.ppo is not None and "ppo" in self.stages and self.ppo.vllm_num_engines not in (0, self.num_workers):
            raise ValueError(f"ppo.vllm_num_engines ({self.ppo.vllm_num_engines}) must be 0 or num_workers "
                             f"({self.num_workers}): each rank hosts its own vLLM engine")
        return self

    def _upstream(self, stage: str, field: str, producer: str) -> str:
        """`field` of an earlier stage's output, or a clear error when no earlier stage produces it."""
        if producer in self.stages and self.stages.index(producer) < self.stages.index(stage):
            return getattr(getattr(self, producer), field)
        raise ValueError(f"{stage} needs its input: set it, or run {producer} before {stage}")

    def _chain_stage_inputs(self) -> None:
        """Each stage's output feeds the next: SFT -> RM and PPO actor; RM -> PPO reward and critic."""
        if "rm" in self.stages and self.rm.pretrain is None:
            self.rm = self.rm.model_copy(update={"pretrain": self._upstream("rm", "save_path", "sft")})
        if "ppo" in self.stages:
            ppo = self.ppo
            updates = {}
            if ppo.pretrain is None:
                updates["pretrain"] = self._upstream("ppo", "save_path", "sft")
            if ppo.reward_pretrain is None and ppo.reward_fn is None and ppo.remote_rm_url is None:
                updates["reward_pretrain"] = self._upstream("ppo", "save_path", "rm")
            reward_model = updates.get("reward_pretrain", ppo.reward_pretrain)
            if ppo.advantage_estimator == "gae" and ppo.critic_pretrain is None:
                # As OpenRLHF: the critic starts from the reward model, or from the actor when a function rewards.
                produced_rm = self.rm.save_path if "rm" in self.stages[: self.stages.index("ppo")] else None
                updates["critic_pretrain"] = reward_model or produced_rm or updates.get("pretrain", ppo.pretrain)
            self.ppo = ppo.model_copy(update=updates)
        policy = next((stage for stage in reversed(self.stages) if STAGES[stage].is_policy), None)
        if "merge" in self.stages:
            if policy is None and (self.merge.model_path is None or self.merge.lora_path is None):
                raise ValueError("merge needs model_path and lora_path, or a policy stage (sft, ppo) before it")
            if policy is not None and self.merge.lora_path is None and not getattr(self, policy).lora_rank:
                raise ValueError(f"merge needs LoRA adapters: set {policy}.lora_rank > 0, or give merge.lora_path")
            self.merge = self.merge.model_copy(update={
                "model_path": self.merge.model_path or getattr(self, policy).pretrain,
                "lora_path": self.merge.lora_path or getattr(self, policy).save_path,
            })
        if "export" in self.stages and self.export.model_path is None:
            source = self.merge.output_path if "merge" in self.stages else None
            if source is None and policy is None:
                raise ValueError("export needs model_path, or a policy stage (sft, ppo) or merge before it")
            self.export = self.export.model_copy(update={"model_path": source or getattr(self, policy).save_path})

    def stage_config(self, stage: str) -> StageConfig:
        return getattr(self, stage)

    def run_url(self) -> str:
        return f"{self.ckpt_path.rstrip('/')}/{self.run_name}"

    def stage_url(self, stage: str) -> str:
        return f"{self.run_url()}/{stage}"


def semantic_fields(model: BaseModel) -> dict[str, Any]:
    """The fields of `model` that change the trained weights, as plain JSON values."""
    dumped = model.model_dump(mode="json")
    return {name: dumped[name] for name, field in type(model).model_fields.items()
            if (field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}).get("affects_training", True)}




def semantic_hash(run: RunConfig, stage: str) -> str:
    """Hash of everything that changes one stage's weights: its settings and the run seed (and, for PPO,
    the number of ranks)."""
    payload = {"stage": stage, "seed": run.seed, "settings": semantic_fields(run.stage_config(stage))}
    if stage in WORLD_SIZE_DEPENDENT_STAGES:
        payload["num_workers"] = run.num_workers
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def _field_names() -> set[str]:
    """Every setting's name that has an underscore (distinct enough to be spotted inside a message)."""
    models = (RunConfig, *(stage.config for stage in STAGES.values()))
    return {name for model in models for name in model.model_fields if "_" in name}


def _spell_fields(message: str, prefix: str) -> str:
    """Setting names inside a validator's message as the user writes them: `--name` (a stage's `ppo.name` too,
    on the command line) or `sft.name`."""
    known = _field_names()
    stage = "" if prefix != "--" else rf"(?:(?:{'|'.join(STAGES)})\.)?"

    def spell(found: re.Match) -> str:
        return prefix + found.group(1) if found.group(1) in known else found.group(0)

    return re.sub(rf"(?<![\w.-]){stage}([a-z][a-z0-9]*(?:_[a-z0-9]+)+)(?![\w-])", spell, message)


def describe_validation_error(error: ValidationError, source: str, flag_style: bool,
                              line_of: Callable[[tuple], int | None] | None = None) -> str:
    """One sentence naming the offending field (as `--flag` on the CLI, as `a.b` in a file, with the file's
    line when `line_of` can tell it), the value given, what is wrong and, for a misspelt key, the near miss."""
    import difflib

    first = error.errors()[0]
    location = tuple(first["loc"])
    names = [str(part) for part in location if isinstance(part, str)]
    line = line_of(location) if line_of else None
    where = f"{source} line {line}" if line else source
    if flag_style:
        name, prefix = ("--" + names[-1] if names else ""), "--"
    else:
        name, prefix = ".".join(str(part) for part in location), "".join(f"{part}." for part in names)
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "value_error" and (not location or _model_at(location) is not None):
        name, message = "", _spell_fields(message, prefix)  # a check across fields: they are in the message
    elif first["type"] == "missing":
        message = "is required"
    elif first["type"] == "extra_forbidden":
        message = "is not a known setting"
        model = _model_at(location[:-1])
        near = difflib.get_close_matches(names[-1], list(model.model_fields), n=1) if model and names else []
        if near:
            message += f"; did you mean {prefix.removesuffix(names[-1] + '.')}{near[0]}?"
    elif isinstance(first.get("input"), (str, int, float)) and first["type"] != "value_error":
        message = f"{first['input']!r}: {message[:1].lower()}{message[1:]}"
    more = f" (and {len(error.errors()) - 1} more problem(s))" if len(error.errors()) > 1 else ""
    subject = f"{name} {message}" if name else message
    return f"{where}: {subject}{more}.".replace("?.", "?")


def _model_at(location: tuple) -> type[BaseModel] | None:
    """The config model that holds the field at `location` inside a RunConfig (a stage's, or RunConfig)."""
    if not location:
        return RunConfig
    field = RunConfig.model_fields.get(str(location[0]))
    if len(location) == 1 and field is not None:
        inner = [arg for arg in getattr(field.annotation, "__args__", ()) if isinstance(arg, type)
                 and issubclass(arg, BaseModel)]
        return inner[0] if inner else None
    return None


def yaml_line(text: str, location: tuple) -> int | None:
    """The 1-based line of the YAML key at `location` (a missing key: its nearest parent's line)."""
    try:
        node = yaml.compose(text)
    except yaml.YAMLError:
        return None
    line = None
    for part in location:
        if not isinstance(node, yaml.MappingNode):
            break
        match = next(((key, value) for key, value in node.value if key.value == str(part)), None)
        if match is None:
            break
        line, node = match[0].start_mark.line + 1, match[1]
    return line


def load_run_config(path: str) -> RunConfig:
    """Read a YAML run config; any problem becomes a UserError naming the file, line and field."""
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
        raise UserError(describe_validation_error(error, path, flag_style=False,
                                                  line_of=lambda location: yaml_line(text, location))) from None
