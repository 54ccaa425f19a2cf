"""Every flag of OpenRLHF's `train_sft`, `train_rm`, `train_dpo`, `train_ppo_ray`, `train_prm` (v0.9.0) and
`lora_combiner`: what it does here.

One row per OpenRLHF 0.9.x flag (plus the older spellings of the seed guide and the flags only 0.11 has). Each
row is in one class:
- implemented: the same meaning as in OpenRLHF; the value lands in our config field of the same meaning;
- mapped: accepted, with the effect the note states (often: nothing to do on this layout), printed once as a
  one-line note when the flag is given;
- refused: accepted only at OpenRLHF's default value; any other value exits 2 with the note's reason.

The CLI (`flows/cli.py`) builds its OpenRLHF spellings and 0.11's dotted aliases (`--ckpt.save_steps`) from this
table alone, and `docs/openrlhf-flags.md` is rendered from it (`python -m flows.openrlhf_flags`). A test holds the
table against OpenRLHF's own parsers (tests/data/openrlhf/flags.json) and against `rlhf train --help`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

from rlhf_core.stages import STAGES, TRAINING_STAGES

IMPLEMENTED, MAPPED, REFUSED = "implemented", "mapped", "refused"


def _command_speaking(module: str) -> str:
    """Our command for OpenRLHF's `module`: the stage that declares it speaks that module's flags."""
    return next(name for name, stage in STAGES.items() if stage.openrlhf_module == module)


# The table is written in OpenRLHF's commands; each stage declares which one it speaks (rlhf_core.stages).
SFT, RM, PPO = _command_speaking("train_sft"), _command_speaking("train_rm"), _command_speaking("train_ppo_ray")
DPO = _command_speaking("train_dpo")
PRM = _command_speaking("train_prm")  # OpenRLHF v0.9.0 .. v0.9.5 only: it has no 0.11 (dotted) spellings
COMBINER = "lora-combiner"  # `rlhf lora-combiner`, the merge stage's command
TRAIN = TRAINING_STAGES  # a flag every OpenRLHF trainer has applies to every training stage, a new one too
OPENRLHF_MODULES = {**{name: STAGES[name].openrlhf_module for name in TRAINING_STAGES},
                    COMBINER: next(stage.openrlhf_module for stage in STAGES.values() if stage.kind == "merge")}


@dataclass(frozen=True)
class Flag:
    """One OpenRLHF flag: its spellings, its class here, and where its value goes."""

    name: str  # the 0.9.x spelling ("" when only 0.11 has the flag)
    kind: str
    clis: tuple[str, ...]
    dotted: str | dict[str, str] = ""  # 0.11 spelling(s), per command when they differ; "a|b" gives two
    field: str | None = None  # our config field that receives the value
    note: str = ""  # mapped: what it does here; refused: why not
    takes: str = "value"  # "switch" (store_true), "value", "pair" (nargs 2) or "list" (nargs *)
    value_type: Callable[[str], Any] = str
    default: Any = None  # OpenRLHF's default: a refused flag given at this value is accepted silently
    convert: Callable[[Any], dict[str, Any]] | None = None  # value -> {field: value} (default: {field: value})

    def dotted_names(self, cli: str) -> list[str]:
        spelled = self.dotted.get(cli, "") if isinstance(self.dotted, dict) else self.dotted
        return [name for name in spelled.split("|") if name]

    def spellings(self, cli: str) -> list[str]:
        names = ([self.name] if self.name else []) + self.dotted_names(cli)
        return list(dict.fromkeys(names))

    def updates(self, value: Any) -> dict[str, Any]:
        """The config values a given flag value sets."""
        if self.convert is not None:
            return self.convert(value)
        return {self.field: value} if self.field else {}


def _same(name: str, dotted: str | dict[str, str], clis: tuple[str, ...] = TRAIN, **kwargs: Any) -> Flag:
    """A flag implemented by our field of the same name."""
    return Flag(name, IMPLEMENTED, clis, dotted, field=kwargs.pop("field", name), **kwargs)


def _noop(name: str, dotted: str | dict[str, str], note: str, clis: tuple[str, ...] = TRAIN, **kwargs: Any) -> Flag:
    """A flag accepted with a note saying why it has nothing to do here."""
    return Flag(name, MAPPED, clis, dotted, note=note, **kwargs)


def _refuse(name: str, dotted: str | dict[str, str], note: str, clis: tuple[str, ...] = TRAIN, **kwargs: Any) -> Flag:
    return Flag(name, REFUSED, clis, dotted, note=note, **kwargs)


def _dotted(name: str, *clis: str) -> dict[str, str]:
    """A 0.11 spelling for `clis` only: a row that also names PRM gives it none (train_prm never reached 0.11)."""
    return {cli: name for cli in clis}


def _wandb_key(value: str) -> dict[str, Any]:
    """OpenRLHF takes the wandb API key as the flag's value: it goes to the environment, never into the config
    (which Prefect stores as parameters)."""
    if value.lower() not in ("true", "1", "yes"):
        os.environ["WANDB_API_KEY"] = value
    return {"use_wandb": True}


def _target_modules(value: list[str]) -> dict[str, Any]:
    return {"target_modules": None if value in ([], ["all-linear"]) else value}


def _probs(value: str) -> dict[str, Any]:
    return {"dataset_probs": value}


TRAIN_LR_SCHEDULE = "one schedule for actor and critic here"
COLOCATED = "actor, critic, reference and reward always share each rank here (colocated), so placement flags have nothing to place"
VLLM_ONLY = "a vLLM engine setting; without --vllm_num_engines (generation by transformers) it has nothing to set"

FLAGS: tuple[Flag, ...] = (
    # checkpoints and outputs
    _same("save_path", _dotted("ckpt.output_dir", SFT, RM, DPO, PPO), (SFT, RM, DPO, PPO, PRM)),
    _same("save_steps", "ckpt.save_steps", value_type=int),
    _same("save_hf_ckpt", "ckpt.save_hf", takes="switch"),
    _same("disable_ds_ckpt", "ckpt.disable_ds", takes="switch"),
    _same("logging_steps", "logger.logging_steps", value_type=int),
    _same("eval_steps", "eval.steps", value_type=int),
    _same("ckpt_path", "ckpt.path", note="the checkpoint root: stages write {ckpt_path}/{run_name}/{stage}/step_N; a "
                                         "path ending in .../{run_name}/{stage}/step_N resumes that step"),
    _same("max_ckpt_num", "ckpt.max_num", value_type=int),
    _same("max_ckpt_mem", "ckpt.max_mem", value_type=float, note="in GB, as OpenRLHF"),
    _same("load_checkpoint", "ckpt.load_enable", takes="switch"),
    _noop("use_ds_universal_ckpt", "ds.use_universal_ckpt", "a checkpoint written at another world size is converted "
          "to DeepSpeed's universal format automatically on resume", takes="switch"),
    _noop("best_metric_key", "ckpt.best_metric_key", "every chunk commits its checkpoint; retention keeps the newest "
          "--max_ckpt_num, not the best", (PPO,)),
    # batches and optimisation
    _same("micro_train_batch_size", "train.micro_batch_size", value_type=int),
    _same("train_batch_size", "train.batch_size", value_type=int),
    _same("max_norm", {SFT: "max_norm", RM: "max_norm", DPO: "max_norm", PPO: "actor.max_norm|critic.max_norm"},
          value_type=float,
          note=f"PPO: {TRAIN_LR_SCHEDULE}"),
    _same("max_epochs", "train.max_epochs", value_type=int),
    _same("seed", "train.seed", value_type=int),
    _noop("full_determinism", "train.full_determinism_enable", "runs are always deterministic here: every random draw "
          "is derived from (seed, stage, step, rank)", takes="switch"),
    _same("learning_rate", _dotted("adam.lr", SFT, RM, DPO), (SFT, RM, DPO, PRM), value_type=float),
    Flag("actor_learning_rate", MAPPED, (PPO,), "actor.adam.lr", field="learning_rate", value_type=float,
         note="the actor's learning rate is --learning_rate here"),
    _same("critic_learning_rate", "critic.adam.lr", (PPO,), value_type=float),
    _same("lr_warmup_ratio", {SFT: "lr_warmup_ratio", RM: "lr_warmup_ratio", DPO: "lr_warmup_ratio",
                              PPO: "actor.lr_warmup_ratio|critic.lr_warmup_ratio"}, value_type=float),
    _same("lr_scheduler", {SFT: "lr_scheduler", RM: "lr_scheduler", DPO: "lr_scheduler",
                           PPO: "actor.lr_scheduler|critic.lr_scheduler"}),
    _same("l2", {SFT: "adam.weight_decay", RM: "adam.weight_decay", DPO: "adam.weight_decay",
                 PPO: "actor.adam.weight_decay|critic.adam.weight_decay"}, value_type=float),
    _same("adam_betas", {SFT: "adam.betas", RM: "adam.betas", DPO: "adam.betas",
                         PPO: "actor.adam.betas|critic.adam.betas"}, takes="pair", value_type=float),
    Flag("", IMPLEMENTED, TRAIN, {SFT: "adam.eps", RM: "adam.eps", DPO: "adam.eps",
                                  PPO: "actor.adam.eps|critic.adam.eps"},
         field="adam_eps", value_type=float, note="PPO: one value for actor and critic here"),
    Flag("", IMPLEMENTED, (SFT, RM, PPO), {SFT: "min_lr_ratio", RM: "min_lr_ratio",
                                          PPO: "actor.min_lr_ratio|critic.min_lr_ratio"},
         field="min_lr_ratio", value_type=float, note="PPO: one value for actor and critic here"),
    _same("min_lr_ratio", "min_lr_ratio", (DPO,), value_type=float),  # train_dpo has it since 0.9, same name
    _refuse("", {SFT: "optim", RM: "optim", DPO: "optim", PPO: "actor.optim|critic.optim"},
            "only AdamW is built here (Muon is not)", default="adam"),
    _noop("", {SFT: "muon.lr|muon.momentum|muon.ns_steps", RM: "muon.lr|muon.momentum|muon.ns_steps",
               DPO: "muon.lr|muon.momentum|muon.ns_steps",
               PPO: "actor.muon.lr|critic.muon.lr|actor.muon.momentum|critic.muon.momentum|actor.muon.ns_steps|"
                    "critic.muon.ns_steps"}, "a Muon setting; only AdamW is built here", value_type=float),
    _noop("", {SFT: "muon.nesterov|muon.no_nesterov", RM: "muon.nesterov|muon.no_nesterov",
               DPO: "muon.nesterov|muon.no_nesterov",
               PPO: "actor.muon.nesterov|critic.muon.nesterov|actor.muon.no_nesterov|critic.muon.no_nesterov"},
          "a Muon setting; only AdamW is built here", takes="switch"),
    # DeepSpeed and precision
    _same("zero_stage", "ds.zero_stage", value_type=int, note="same stages; unset, 0 on one rank (nothing to partition) "
          "and 2 (OpenRLHF's default) on more, and a resume keeps its checkpoints' stage"),
    _same("param_dtype", "ds.param_dtype",
          note="bf16 is bf16 autocast on a CPU with bf16 support (fp32 with a warning otherwise); fp16 needs a GPU"),
    _same("bf16", "", (COMBINER,), takes="switch", note="the seed's spelling; OpenRLHF 0.9 says --param_dtype bf16"),
    Flag("bf16", MAPPED, TRAIN, takes="switch", note="the seed's spelling of --param_dtype bf16",
         convert=lambda value: {"param_dtype": "bf16"} if value else {}),
    _same("attn_implementation", "ds.attn_implementation",
          note="flash_attention_* without flash-attn (or a GPU) falls back to sdpa with a warning"),
    Flag("flash_attn", MAPPED, TRAIN, takes="switch", note="the seed's spelling of --attn_implementation "
         "flash_attention_2", convert=lambda value: {"attn_implementation": "flash_attention_2"} if value else {}),
    _same("adam_offload", "ds.adam_offload", takes="switch"),
    _noop("deepcompile", "ds.deepcompile", "DeepSpeed's compiler is a GPU optimisation; training runs uncompiled",
          takes="switch"),
    _refuse("zpg", "ds.zpg", "ZeRO++ hierarchical partitioning is for multi-node GPU groups", value_type=int,
            default=1),
    _noop("local_rank", "local_rank", "set by the deepspeed launcher; ranks are Ray actors here", value_type=int),
    _noop("use_liger_kernel", _dotted("ds.use_liger_kernel", SFT, DPO, PPO), "Liger's Triton kernels need a GPU; "
          "standard kernels are used", (SFT, DPO, PPO, PRM), takes="switch"),
    _noop("grad_accum_dtype", "ds.grad_accum_dtype", "gradients accumulate in the training precision here"),
    _noop("overlap_comm", "ds.overlap_comm", "a communication/compute overlap for GPUs; gloo on CPU does not overlap",
          takes="switch"),
    _same("gradient_checkpointing", {SFT: "model.gradient_checkpointing_enable",
                                     RM: "model.gradient_checkpointing_enable",
                                     DPO: "model.gradient_checkpointing_enable",
                                     PPO: "actor.gradient_checkpointing_enable"}, takes="switch"),
    _same("gradient_checkpointing_use_reentrant", {SFT: "model.gradient_checkpointing_reentrant",
                                                   RM: "model.gradient_checkpointing_reentrant",
                                                   DPO: "model.gradient_checkpointing_reentrant",
                                                   PPO: "actor.gradient_checkpointing_reentrant"}, takes="switch"),
    _noop("disable_fast_tokenizer", "data.disable_fast_tokenizer", "the tokenizer is loaded as transformers "
          "chooses (fast when the folder has tokenizer.json)", takes="switch"),
    _noop("dataloader_num_workers", "data.dataloader_num_workers", "datasets are tokenized once into memory; there "
          "is no loader to parallelise", value_type=int),
    _refuse("ds_tensor_parallel_size", "ds.tensor_parallel_size", "DeepSpeed tensor parallelism (AutoTP) is not "
            "built; use ZeRO stages", value_type=int, default=1),
    _refuse("ring_attn_size", "ds.ring_attn_size", "ring attention needs flash-attn on GPUs", value_type=int,
            default=1),
    _refuse("ring_head_stride", "ds.ring_attn_head_stride", "ring attention needs flash-attn on GPUs",
            value_type=int, default=1),
    _refuse("load_in_4bit", "ds.load_in_4bit", "4-bit loading needs bitsandbytes on a GPU", takes="switch",
            default=False),
    _refuse("aux_loss_coef", {SFT: "model.aux_loss_coef", RM: "model.aux_loss_coef", DPO: "model.aux_loss_coef",
                              PPO: "actor.aux_loss_coef"},
            "the MoE balancing loss is not built (dense models only)", value_type=float, default=0.0),
    _noop("", "ds.experts_implementation", "dense models only here; there are no experts to implement"),
    _same("packing_samples", "ds.packing_samples", takes="switch"),
    # LoRA
    _same("lora_rank", "ds.lora.rank", value_type=int),
    _same("lora_alpha", "ds.lora.alpha", value_type=int),
    _same("target_modules", "ds.lora.target_modules", takes="list", convert=_target_modules),
    _same("lora_dropout", "ds.lora.dropout", value_type=float),
    # data
    _same("pretrain", {SFT: "model.model_name_or_path", RM: "model.model_name_or_path",
                       DPO: "model.model_name_or_path", PPO: "actor.model_name_or_path"}),
    _same("dataset", _dotted("data.dataset", SFT, RM, DPO), (SFT, RM, DPO, PRM)),
    _same("dataset_probs", _dotted("data.dataset_probs", SFT, RM, DPO), (SFT, RM, DPO, PRM)),
    _same("dataset_split", _dotted("data.dataset_split", SFT, RM, DPO), (SFT, RM, DPO, PRM)),
    Flag("train_split", MAPPED, (SFT,), field="dataset_split", note="the older name of --dataset_split"),
    _same("eval_dataset", "eval.dataset"),
    _same("eval_split", "eval.split"),
    _same("max_samples", "data.max_samples", value_type=lambda text: int(float(text)),
          convert=lambda value: {"max_samples": value}),
    _same("max_len", "data.max_len", value_type=int,
          note="PPO: prompt + response; responses stop at max_len minus the prompt's length"),
    _same("input_key", _dotted("data.input_key", SFT, PPO), (SFT, PPO, PRM)),
    _same("output_key", "data.output_key", (SFT,)),
    _same("input_template", "data.input_template"),
    _same("apply_chat_template", "data.apply_chat_template", (SFT, RM, DPO, PPO), takes="switch"),  # not train_prm
    _same("tokenizer_chat_template", "data.tokenizer_chat_template", (SFT, RM, DPO)),
    _same("pretrain_mode", "model.pretrain_mode_enable", (SFT,), takes="switch"),
    _same("multiturn", "data.multiturn", (SFT,), takes="switch"),
    _same("prompt_key", "data.prompt_key", (RM, DPO)),
    _same("chosen_key", "data.chosen_key", (RM, DPO)),
    _same("rejected_key", "data.rejected_key", (RM, DPO)),
    _same("loss", "model.loss_type", (RM,)),
    _same("margin_loss", "model.margin_loss_enable", (RM,), takes="switch"),
    _noop("compute_fp32_loss", "model.compute_fp32_loss_enable", "the reward loss is always computed in fp32 here",
          (RM,), takes="switch"),
    _refuse("value_head_prefix", "ds.value_head_prefix", "reward models and critics keep their head as `score` "
            "(transformers' sequence-classification layout)", (RM, PPO), default="score"),
    # DPO
    _same("ref_pretrain", "ref.model_name_or_path", (DPO,)),
    _same("ref_offload", "ref.offload", (DPO,), takes="switch"),
    _same("beta", "model.beta", (DPO,), value_type=float),
    _same("ipo", "model.ipo_enable", (DPO,), takes="switch"),
    _same("label_smoothing", "model.label_smoothing", (DPO,), value_type=float),
    _same("nll_loss_coef", "model.nll_loss_coef", (DPO,), value_type=float),
    # PRM (OpenRLHF v0.9.0's train_prm; no 0.11 spelling)
    _same("placeholder_token", "", (PRM,)),
    _same("reward_tokens", "", (PRM,), takes="list",
          note="none: the whole vocabulary (hard labels only); soft labels need two, the positive one first"),
    # trackers
    Flag("use_wandb", MAPPED, TRAIN, "logger.wandb.key", field="use_wandb", convert=_wandb_key,
         note="logs to wandb; the value (OpenRLHF's API key) goes to WANDB_API_KEY, never into the run config; "
              "'True' uses the logged-in key"),
    _same("wandb_org", "logger.wandb.org"),
    _same("wandb_group", "logger.wandb.group"),
    _same("wandb_project", "logger.wandb.project"),
    _same("wandb_run_name", "logger.wandb.run_name"),
    _same("use_tensorboard", "logger.tensorboard_dir"),
    _refuse("use_ms", "use_ms", "ModelScope's hub is not reachable; give a local folder or a Hugging Face cache id",
            takes="switch", default=False),
    # PPO: placement (Ray)
    Flag("actor_num_nodes", MAPPED, (PPO,), "actor.num_nodes", value_type=int,
         note="actor_num_nodes x actor_num_gpus_per_node is the number of ranks (--num_workers)",
         convert=lambda value: {"_num_nodes": value}),
    Flag("actor_num_gpus_per_node", MAPPED, (PPO,), "actor.num_gpus_per_node", value_type=int,
         note="actor_num_nodes x actor_num_gpus_per_node is the number of ranks (--num_workers)",
         convert=lambda value: {"_num_gpus_per_node": value}),
    _noop("ref_num_nodes", "ref.num_nodes", COLOCATED, (PPO,), value_type=int),
    _noop("ref_num_gpus_per_node", "ref.num_gpus_per_node", COLOCATED, (PPO,), value_type=int),
    _noop("reward_num_nodes", "reward.num_nodes", COLOCATED, (PPO,), value_type=int),
    _noop("reward_num_gpus_per_node", "reward.num_gpus_per_node", COLOCATED, (PPO,), value_type=int),
    _noop("critic_num_nodes", "critic.num_nodes", COLOCATED, (PPO,), value_type=int),
    _noop("critic_num_gpus_per_node", "critic.num_gpus_per_node", COLOCATED, (PPO,), value_type=int),
    _noop("colocate_actor_ref", "train.colocate_actor_ref", COLOCATED, (PPO,), takes="switch"),
    _noop("colocate_critic_reward", "train.colocate_critic_reward", COLOCATED, (PPO,), takes="switch"),
    _noop("colocate_all_models", "train.colocate_all", COLOCATED, (PPO,), takes="switch"),
    _noop("ref_reward_offload", "ref.offload|reward.offload", "the frozen reference and reward models stay where "
          "the actor is", (PPO,), takes="switch"),
    _noop("actor_init_on_gpu", "", "models are placed on the rank's device when they load", (PPO,), takes="switch"),
    # PPO: vLLM
    _same("vllm_num_engines", "vllm.num_engines", (PPO,), value_type=int,
          note="one colocated engine per rank (0 or --num_workers); needs a GPU and the [vllm] extra"),
    _same("vllm_tensor_parallel_size", "vllm.tensor_parallel_size", (PPO,), value_type=int,
          note="only 1 with vLLM engines (each rank hosts a whole engine); ignored without them"),
    _same("vllm_gpu_memory_utilization", "vllm.gpu_memory_utilization", (PPO,), value_type=float),
    _same("vllm_enable_sleep", "vllm.enable_sleep", (PPO,), takes="switch"),
    _noop("vllm_sync_backend", "vllm.sync_backend", "weights reach the colocated engine in process, with no "
          "collective to choose", (PPO,)),
    _noop("vllm_sync_with_ray", "vllm.sync_with_ray", "weights reach the colocated engine in process", (PPO,),
          takes="switch"),
    Flag("enable_prefix_caching", MAPPED, (PPO,), "vllm.enable_prefix_caching", field="enable_prefix_caching",
         takes="switch", note="passed to each rank's colocated vLLM engine (with --vllm_num_engines); transformers "
                              "generation has no prefix cache"),
    _noop("enforce_eager", "vllm.enforce_eager", VLLM_ONLY, (PPO,), takes="switch"),
    _noop("vllm_generate_batch_size", "rollout.vllm_generate_batch_size", VLLM_ONLY, (PPO,), value_type=int),
    _noop("enable_vllm_is_correction", "algo.advantage.is_correction_enable", "samples come from the actor's own "
          "weights (or an engine loaded with them before each rollout), so there is no mismatch to correct",
          (PPO,), takes="switch"),
    _noop("vllm_is_truncated_threshold", "algo.advantage.is_correction_threshold", "see --enable_vllm_is_correction",
          (PPO,), takes="pair", value_type=float),
    _noop("vllm_is_correction_type", "algo.advantage.is_correction_type", "see --enable_vllm_is_correction", (PPO,)),
    _noop("deepspeed_enable_sleep", "ds.enable_sleep", "has no effect on a CPU, where the models' states already "
          "live in CPU memory, nor on a GPU: offloading DeepSpeed's states around vLLM generation is not built, so "
          "leave vLLM its room with --vllm_gpu_memory_utilization", (PPO,), takes="switch"),
    # PPO: schedule and algorithm
    _refuse("async_train", "train.async_enable", "asynchronous (off-policy) PPO is not built; each step samples with "
            "the current actor", (PPO,), takes="switch", default=False),
    _noop("async_queue_size", "train.async_queue_size", "see --async_train", (PPO,), value_type=int),
    _refuse("partial_rollout", "train.partial_rollout_enable", "partial rollouts belong to asynchronous PPO, which "
            "is not built", (PPO,), takes="switch", default=False),
    _refuse("enable_ema", "train.enable_ema", "an EMA copy of the actor is not built", (PPO,), takes="switch",
            default=False),
    _noop("ema_beta", "train.ema_beta", "see --enable_ema", (PPO,), value_type=float),
    _noop("use_dynamic_batch", "train.dynamic_batch_enable", "batches count samples, not tokens, here", (PPO,),
          takes="switch"),
    _noop("rollout_max_tokens_per_gpu", "rollout.max_tokens_per_gpu", "see --use_dynamic_batch", (PPO,),
          value_type=int),
    _noop("train_max_tokens_per_gpu", "train.max_tokens_per_gpu", "see --use_dynamic_batch", (PPO,), value_type=int),
    _same("num_episodes", "train.num_episodes", (PPO,), value_type=int),
    _same("rollout_batch_size", "rollout.batch_size", (PPO,), value_type=int),
    _same("micro_rollout_batch_size", "rollout.micro_batch_size", (PPO,), value_type=int),
    _same("max_new_tokens", "rollout.max_new_tokens", (PPO,), value_type=int),
    Flag("generate_max_len", MAPPED, (PPO,), field="max_new_tokens", value_type=int,
         note="the seed's spelling of --max_new_tokens"),
    _same("prompt_max_len", "", (PPO,), value_type=int, note="OpenRLHF <= 0.9.0's prompt cap; kept here"),
    _noop("ptx_coef", "", "there is no pre-training data flag in OpenRLHF 0.9 to mix in, so the ptx loss is 0",
          (PPO,), value_type=float),
    _same("eps_clip", "actor.eps_clip", (PPO,), value_type=float),
    _same("eps_clip_low_high", "actor.eps_clip_low_high", (PPO,), takes="pair", value_type=float),
    _refuse("dual_clip", "actor.dual_clip", "dual-clip PPO is not built", (PPO,), value_type=float),
    _same("value_clip", "critic.value_clip", (PPO,), value_type=float),
    _same("lambd", "algo.advantage.lambd", (PPO,), value_type=float),
    _same("gamma", "algo.advantage.gamma", (PPO,), value_type=float),
    _same("normalize_reward", "reward.normalize_enable", (PPO,), takes="switch"),
    _same("top_p", "rollout.top_p", (PPO,), value_type=float),
    _same("temperature", "rollout.temperature", (PPO,), value_type=float),
    _same("freezing_actor_steps", "critic.freezing_steps", (PPO,), value_type=int),
    _same("n_samples_per_prompt", "rollout.n_samples_per_prompt", (PPO,), value_type=int),
    _same("save_value_network", "critic.save_value_network", (PPO,), takes="switch"),
    _same("kl_target", "algo.kl.target", (PPO,), value_type=float),
    _same("kl_horizon", "algo.kl.horizon", (PPO,), value_type=int),
    _same("init_kl_coef", "algo.kl.init_coef", (PPO,), value_type=float),
    _refuse("policy_loss_type", "actor.policy_loss_type", "only the PPO clipped surrogate is built", (PPO,),
            default="ppo"),
    _same("kl_estimator", "algo.kl.estimator", (PPO,)),
    _same("entropy_loss_coef", "actor.entropy_coef", (PPO,), value_type=float,
          note="unset: no entropy; 0: the entropy is logged as entropy_loss; otherwise loss - coef x entropy"),
    _same("reward_clip_range", "reward.clip_range", (PPO,), takes="pair", value_type=float),
    _same("advantage_estimator", "algo.advantage.estimator", (PPO,)),
    _same("use_kl_loss", "algo.kl.use_loss", (PPO,), takes="switch"),
    _refuse("no_advantage_std_norm", "algo.advantage.no_std_norm", "the std normalization of the critic-free "
            "estimators cannot be turned off here (--advantage_estimator dr_grpo is GRPO without it)", (PPO,), takes="switch", default=False),
    _refuse("overlong_buffer_len", "reward.overlong_buffer_len", "the DAPO overlong penalty is not built", (PPO,),
            value_type=float),
    _noop("overlong_penalty_factor", "reward.overlong_penalty_factor", "see --overlong_buffer_len", (PPO,),
          value_type=float),
    _refuse("stop_properly_penalty_coef", "reward.stop_properly_penalty_coef", "the truncation penalty is not built",
            (PPO,), value_type=float),
    _same("reward_pretrain", "reward.model_name_or_path", (PPO,)),
    _same("remote_rm_url", "reward.remote_url", (PPO,)),
    _same("critic_pretrain", "critic.model_name_or_path", (PPO,)),
    _same("agent_func_path", "train.agent_func_path", (PPO,)),
    _same("prompt_data", "data.prompt_dataset", (PPO,)),
    Flag("prompt_data_probs", MAPPED, (PPO,), "data.prompt_probs", convert=_probs,
         note="the sampling weights of several comma-separated --prompt_data (our --dataset_probs)"),
    _same("prompt_split", "data.prompt_split", (PPO,)),
    _same("eval_temperature", "eval.temperature", (PPO,), value_type=float),
    _same("eval_n_samples_per_prompt", "eval.n_samples_per_prompt", (PPO,), value_type=int),
    _same("label_key", _dotted("data.label_key", PPO), (PPO, PRM)),
    _same("dynamic_filtering", "algo.dynamic_filtering_enable", (PPO,), takes="switch"),
    _same("dynamic_filtering_reward_range", "algo.dynamic_filtering_range", (PPO,), takes="pair", value_type=float),
    _noop("perf", "", "timings are printed per chunk and written to the metrics", (PPO,), takes="switch"),
    _refuse("", "data.image_key", "vision-language models are not built", (PPO,)),
    _refuse("", "data.max_images_per_prompt", "vision-language models are not built", (PPO,), value_type=int,
            default=1),
    _refuse("", "actor.freeze_visual_encoder", "vision-language models are not built", (PPO,), takes="switch",
            default=False),
    # lora_combiner
    _same("model_path", "model_path", (COMBINER,)),
    _same("lora_path", "lora_path", (COMBINER,), note="also a checkpoint folder: .../{stage}/latest or .../step_N"),
    _same("output_path", "output_path", (COMBINER,)),
    Flag("param_dtype", MAPPED, (COMBINER,), "ds.param_dtype", note="bf16 writes the merged weights in bfloat16",
         convert=lambda value: {"bf16": value == "bf16"}),
    _refuse("is_rm", "is_rm", "merging a reward model's adapter is not built; merge policy adapters", (COMBINER,),
            takes="switch", default=False),
)


def flags_for(cli: str) -> list[Flag]:
    """The flags `cli` takes: those of its rows that spell a name for it (a row may name only some commands)."""
    return [flag for flag in FLAGS if cli in flag.clis and flag.spellings(cli)]


def render_markdown() -> str:
    """docs/openrlhf-flags.md: every flag, its 0.11 spelling, its class and what it does here."""
    lines = ["# OpenRLHF flags in `rlhf`", "",
             "Generated from `flows/openrlhf_flags.py` (`python -m flows.openrlhf_flags > docs/openrlhf-flags.md`); "
             "a test keeps them equal. Classes: **implemented** (OpenRLHF's meaning), **mapped** (accepted; the "
             "note says what it does here, printed once when given), **refused** (only OpenRLHF's default is "
             "accepted; anything else exits 2 with the reason).", ""]
    for cli in (*TRAIN, COMBINER):
        flags = flags_for(cli)
        counts = {kind: sum(flag.kind == kind for flag in flags) for kind in (IMPLEMENTED, MAPPED, REFUSED)}
        command = f"rlhf train {cli}" if cli in TRAIN else f"rlhf {cli}"
        module = f"OpenRLHF `{OPENRLHF_MODULES[cli]}`" if OPENRLHF_MODULES[cli] else "no OpenRLHF command"
        lines += [f"## `{command}` ({module})", "",
                  ", ".join(f"{count} {kind}" for kind, count in counts.items()) + ".", "",
                  "| OpenRLHF 0.9 | OpenRLHF 0.11 | class | here |", "|---|---|---|---|"]
        for flag in flags:
            old = f"`--{flag.name}`" if flag.name else "(0.11 only)"
            dotted = " ".join(f"`--{name}`" for name in flag.dotted_names(cli)) or "(none)"
            here = flag.note or (f"`{flag.field}`" if flag.field and flag.field != flag.name else "same")
            lines.append(f"| {old} | {dotted} | {flag.kind} | {here} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(render_markdown(), end="")
