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

from flows.flag_table import (IMPLEMENTED, MAPPED, REFUSED, SFT, RM, PPO, DPO, PRM, COMBINER, TRAIN, OPENRLHF_MODULES,
                              Flag, same, noop, refuse, dotted_in, wandb_key_to_env, target_modules_value,
                              dataset_probs_value, TRAIN_LR_SCHEDULE, COLOCATED, VLLM_ONLY)

FP32_HERE = ("OpenRLHF's default is bf16; fp32 here, where most runs train on CPUs: bf16 there is an autocast, "
             "slower and less exact; give --param_dtype bf16 on GPUs, as OpenRLHF's scripts do")

FLAGS: tuple[Flag, ...] = (
    # checkpoints and outputs
    same("save_path", dotted_in("ckpt.output_dir", SFT, RM, DPO, PPO), (SFT, RM, DPO, PPO, PRM),
          departs="OpenRLHF's default is ./ckpt; here each stage exports to its own folder (./out/sft, ./out/rm, "
                  "...), apart from the checkpoints, so that the stages of a pipeline feed each other and overwrite "
                  "nothing"),
    same("save_steps", "ckpt.save_steps", value_type=int),
    same("save_hf_ckpt", "ckpt.save_hf", takes="switch"),
    same("disable_ds_ckpt", "ckpt.disable_ds", takes="switch"),
    same("logging_steps", "logger.logging_steps", value_type=int),
    same("eval_steps", "eval.steps", value_type=int),
    same("ckpt_path", "ckpt.path", departs="OpenRLHF's default is ./ckpt/checkpoints_{command}; here ./ckpt is the "
          "root, under which each run and stage has its folder (./ckpt/rlhf/sft with --run_name rlhf)", note="the checkpoint root: stages write {ckpt_path}/{run_name}/{stage}/step_N; a "
                                         "path ending in .../{run_name}/{stage}/step_N resumes that step"),
    same("max_ckpt_num", "ckpt.max_num", value_type=int),
    same("max_ckpt_mem", "ckpt.max_mem", value_type=float, note="in GB, as OpenRLHF"),
    same("load_checkpoint", "ckpt.load_enable", takes="switch"),
    noop("use_ds_universal_ckpt", "ds.use_universal_ckpt", "a checkpoint written at another world size is converted "
          "to DeepSpeed's universal format automatically on resume", takes="switch"),
    noop("best_metric_key", "ckpt.best_metric_key", "every chunk commits its checkpoint; retention keeps the newest "
          "--max_ckpt_num, not the best", (PPO,)),
    # batches and optimisation
    same("micro_train_batch_size", "train.micro_batch_size", value_type=int, dotted_default={PPO: 1}),
    same("train_batch_size", "train.batch_size", value_type=int),
    same("max_norm", {SFT: "max_norm", RM: "max_norm", DPO: "max_norm", PPO: "actor.max_norm|critic.max_norm"},
          value_type=float,
          note=f"PPO: {TRAIN_LR_SCHEDULE}"),
    same("max_epochs", "train.max_epochs", value_type=int),
    same("seed", "train.seed", value_type=int),
    noop("full_determinism", "train.full_determinism_enable", "runs are always deterministic here: every random draw "
          "is derived from (seed, stage, step, rank)", takes="switch"),
    same("learning_rate", dotted_in("adam.lr", SFT, RM, DPO), (SFT, RM, DPO, PRM), value_type=float),
    Flag("actor_learning_rate", MAPPED, (PPO,), "actor.adam.lr", field="learning_rate", value_type=float,
         note="the actor's learning rate is --learning_rate here"),
    same("critic_learning_rate", "critic.adam.lr", (PPO,), value_type=float),
    same("lr_warmup_ratio", {SFT: "lr_warmup_ratio", RM: "lr_warmup_ratio", DPO: "lr_warmup_ratio",
                              PPO: "actor.lr_warmup_ratio|critic.lr_warmup_ratio"}, value_type=float),
    same("lr_scheduler", {SFT: "lr_scheduler", RM: "lr_scheduler", DPO: "lr_scheduler",
                           PPO: "actor.lr_scheduler|critic.lr_scheduler"}),
    same("l2", {SFT: "adam.weight_decay", RM: "adam.weight_decay", DPO: "adam.weight_decay",
                 PPO: "actor.adam.weight_decay|critic.adam.weight_decay"}, value_type=float),
    same("adam_betas", {SFT: "adam.betas", RM: "adam.betas", DPO: "adam.betas",
                         PPO: "actor.adam.betas|critic.adam.betas"}, takes="pair", value_type=float),
    Flag("", IMPLEMENTED, TRAIN, {SFT: "adam.eps", RM: "adam.eps", DPO: "adam.eps",
                                  PPO: "actor.adam.eps|critic.adam.eps"},
         field="adam_eps", value_type=float, note="PPO: one value for actor and critic here"),
    Flag("", IMPLEMENTED, (SFT, RM, PPO), {SFT: "min_lr_ratio", RM: "min_lr_ratio",
                                          PPO: "actor.min_lr_ratio|critic.min_lr_ratio"},
         field="min_lr_ratio", value_type=float, note="PPO: one value for actor and critic here"),
    same("min_lr_ratio", "min_lr_ratio", (DPO,), value_type=float),  # train_dpo has it since 0.9, same name
    refuse("", {SFT: "optim", RM: "optim", DPO: "optim", PPO: "actor.optim|critic.optim"},
            "only AdamW is built here (Muon is not)", default="adam"),
    noop("", {SFT: "muon.lr|muon.momentum|muon.ns_steps", RM: "muon.lr|muon.momentum|muon.ns_steps",
               DPO: "muon.lr|muon.momentum|muon.ns_steps",
               PPO: "actor.muon.lr|critic.muon.lr|actor.muon.momentum|critic.muon.momentum|actor.muon.ns_steps|"
                    "critic.muon.ns_steps"}, "a Muon setting; only AdamW is built here", value_type=float),
    noop("", {SFT: "muon.nesterov|muon.no_nesterov", RM: "muon.nesterov|muon.no_nesterov",
               DPO: "muon.nesterov|muon.no_nesterov",
               PPO: "actor.muon.nesterov|critic.muon.nesterov|actor.muon.no_nesterov|critic.muon.no_nesterov"},
          "a Muon setting; only AdamW is built here", takes="switch"),
    # DeepSpeed and precision
    same("zero_stage", "ds.zero_stage", value_type=int, note="same stages", departs_if=lambda run: run.num_workers == 1,
          departs="OpenRLHF's default is 2; unset here: 0 on one rank, where ZeRO has nothing to partition (the same "
                  "training), 2 on more, and a resume keeps its checkpoints' stage"),
    same("param_dtype", "ds.param_dtype", departs={cli: FP32_HERE for cli in (SFT, RM, DPO, PPO)},  # train_prm: fp32
          note="bf16 is bf16 autocast on a CPU with bf16 support (fp32 with a warning otherwise); fp16 needs a GPU"),
    same("bf16", "", (COMBINER,), takes="switch", note="the seed's spelling; OpenRLHF 0.9 says --param_dtype bf16"),
    Flag("bf16", MAPPED, TRAIN, takes="switch", note="the seed's spelling of --param_dtype bf16",
         convert=lambda value: {"param_dtype": "bf16"} if value else {}),
    same("attn_implementation", "ds.attn_implementation",
          departs="OpenRLHF's default, flash_attention_2, needs a GPU and the flash-attn package; unset here: "
                  "transformers' choice (sdpa where the model has it)",
          note="flash_attention_* without flash-attn (or a GPU) falls back to sdpa with a warning"),
    Flag("flash_attn", MAPPED, TRAIN, takes="switch", note="the seed's spelling of --attn_implementation "
         "flash_attention_2", convert=lambda value: {"attn_implementation": "flash_attention_2"} if value else {}),
    same("adam_offload", "ds.adam_offload", takes="switch"),
    noop("deepcompile", "ds.deepcompile", "DeepSpeed's compiler is a GPU optimisation; training runs uncompiled",
          takes="switch"),
    refuse("zpg", "ds.zpg", "ZeRO++ hierarchical partitioning is for multi-node GPU groups", value_type=int,
            default=1),
    noop("local_rank", "local_rank", "set by the deepspeed launcher; ranks are Ray actors here", value_type=int),
    noop("use_liger_kernel", dotted_in("ds.use_liger_kernel", SFT, DPO, PPO), "Liger's Triton kernels need a GPU; "
          "standard kernels are used", (SFT, DPO, PPO, PRM), takes="switch"),
    noop("grad_accum_dtype", "ds.grad_accum_dtype", "gradients accumulate in the training precision here"),
    noop("overlap_comm", "ds.overlap_comm", "a communication/compute overlap for GPUs; gloo on CPU does not overlap",
          takes="switch"),
    same("gradient_checkpointing", {SFT: "model.gradient_checkpointing_enable",
                                     RM: "model.gradient_checkpointing_enable",
                                     DPO: "model.gradient_checkpointing_enable",
                                     PPO: "actor.gradient_checkpointing_enable"}, takes="switch"),
    same("gradient_checkpointing_use_reentrant", {SFT: "model.gradient_checkpointing_reentrant",
                                                   RM: "model.gradient_checkpointing_reentrant",
                                                   DPO: "model.gradient_checkpointing_reentrant",
                                                   PPO: "actor.gradient_checkpointing_reentrant"}, takes="switch"),
    noop("disable_fast_tokenizer", "data.disable_fast_tokenizer", "the tokenizer is loaded as transformers "
          "chooses (fast when the folder has tokenizer.json)", takes="switch"),
    noop("dataloader_num_workers", "data.dataloader_num_workers", "datasets are tokenized once into memory; there "
          "is no loader to parallelise", value_type=int),
    refuse("ds_tensor_parallel_size", "ds.tensor_parallel_size", "DeepSpeed tensor parallelism (AutoTP) is not "
            "built; use ZeRO stages", value_type=int, default=1),
    refuse("ring_attn_size", "ds.ring_attn_size", "ring attention needs flash-attn on GPUs", value_type=int,
            default=1),
    refuse("ring_head_stride", "ds.ring_attn_head_stride", "ring attention needs flash-attn on GPUs",
            value_type=int, default=1),
    refuse("load_in_4bit", "ds.load_in_4bit", "4-bit loading needs bitsandbytes on a GPU", takes="switch",
            default=False),
    refuse("aux_loss_coef", {SFT: "model.aux_loss_coef", RM: "model.aux_loss_coef", DPO: "model.aux_loss_coef",
                              PPO: "actor.aux_loss_coef"},
            "the MoE balancing loss is not built (dense models only)", value_type=float, default=0.0),
    noop("", "ds.experts_implementation", "dense models only here; there are no experts to implement"),
    same("packing_samples", "ds.packing_samples", takes="switch"),
    # LoRA
    same("lora_rank", "ds.lora.rank", value_type=int),
    same("lora_alpha", "ds.lora.alpha", value_type=int),
    same("target_modules", "ds.lora.target_modules", takes="list", convert=target_modules_value),
    same("lora_dropout", "ds.lora.dropout", value_type=float),
    # data
    same("pretrain", {SFT: "model.model_name_or_path", RM: "model.model_name_or_path",
                       DPO: "model.model_name_or_path", PPO: "actor.model_name_or_path"}),
    same("dataset", dotted_in("data.dataset", SFT, RM, DPO), (SFT, RM, DPO, PRM)),
    same("dataset_probs", dotted_in("data.dataset_probs", SFT, RM, DPO), (SFT, RM, DPO, PRM)),
    same("dataset_split", dotted_in("data.dataset_split", SFT, RM, DPO), (SFT, RM, DPO, PRM)),
    Flag("train_split", MAPPED, (SFT,), field="dataset_split", note="the older name of --dataset_split"),
    same("eval_dataset", "eval.dataset"),
    same("eval_split", "eval.split"),
    same("max_samples", "data.max_samples", value_type=lambda text: int(float(text)),
          convert=lambda value: {"max_samples": value}),
    same("max_len", "data.max_len", value_type=int,
          note="PPO: prompt + response; responses stop at max_len minus the prompt's length"),
    same("input_key", dotted_in("data.input_key", SFT, PPO), (SFT, PPO, PRM)),
    same("output_key", "data.output_key", (SFT,)),
    same("input_template", "data.input_template"),
    same("apply_chat_template", "data.apply_chat_template", (SFT, RM, DPO, PPO), takes="switch"),  # not train_prm
    same("tokenizer_chat_template", "data.tokenizer_chat_template", (SFT, RM, DPO)),
    same("pretrain_mode", "model.pretrain_mode_enable", (SFT,), takes="switch"),
    same("multiturn", "data.multiturn", (SFT,), takes="switch"),
    same("prompt_key", "data.prompt_key", (RM, DPO)),
    same("chosen_key", "data.chosen_key", (RM, DPO)),
    same("rejected_key", "data.rejected_key", (RM, DPO)),
    same("loss", "model.loss_type", (RM,)),
    same("margin_loss", "model.margin_loss_enable", (RM,), takes="switch"),
    noop("compute_fp32_loss", "model.compute_fp32_loss_enable", "the reward loss is always computed in fp32 here",
          (RM,), takes="switch"),
    refuse("value_head_prefix", "ds.value_head_prefix", "reward models and critics keep their head as `score` "
            "(transformers' sequence-classification layout)", (RM, PPO), default="score"),
    # DPO
    same("ref_pretrain", "ref.model_name_or_path", (DPO,)),
    same("ref_offload", "ref.offload", (DPO,), takes="switch"),
    same("beta", "model.beta", (DPO,), value_type=float),
    same("ipo", "model.ipo_enable", (DPO,), takes="switch"),
    same("label_smoothing", "model.label_smoothing", (DPO,), value_type=float),
    same("nll_loss_coef", "model.nll_loss_coef", (DPO,), value_type=float),
    # PRM (OpenRLHF v0.9.0's train_prm; no 0.11 spelling)
    same("placeholder_token", "", (PRM,)),
    same("reward_tokens", "", (PRM,), takes="list",
          note="none: the whole vocabulary (hard labels only); soft labels need two, the positive one first"),
    # trackers
    Flag("use_wandb", MAPPED, TRAIN, "logger.wandb.key", field="use_wandb", convert=wandb_key_to_env,
         note="logs to wandb; the value (OpenRLHF's API key) goes to WANDB_API_KEY, never into the run config; "
              "'True' uses the logged-in key"),
    same("wandb_org", "logger.wandb.org"),
    same("wandb_group", "logger.wandb.group"),
    same("wandb_project", "logger.wandb.project", departs_if=lambda run: run.use_wandb,
          departs="OpenRLHF's default is openrlhf_train_{command}; here one project, rlhf, holds every stage of a "
                  "pipeline"),
    same("wandb_run_name", "logger.wandb.run_name", departs_if=lambda run: run.use_wandb,
          departs="OpenRLHF's default is {command}_{the start's date and time}; here {run_name}-{stage}, so that "
                  "a resumed run continues its wandb run"),
    same("use_tensorboard", "logger.tensorboard_dir"),
    refuse("use_ms", "use_ms", "ModelScope's hub is not reachable; give a local folder or a Hugging Face cache id",
            takes="switch", default=False),
    # PPO: placement (Ray)
    Flag("actor_num_nodes", MAPPED, (PPO,), "actor.num_nodes", value_type=int,
         note="actor_num_nodes x actor_num_gpus_per_node is the number of ranks (--num_workers)",
         convert=lambda value: {"_num_nodes": value}),
    Flag("actor_num_gpus_per_node", MAPPED, (PPO,), "actor.num_gpus_per_node", value_type=int,
         note="actor_num_nodes x actor_num_gpus_per_node is the number of ranks (--num_workers)",
         convert=lambda value: {"_num_gpus_per_node": value}),
    noop("ref_num_nodes", "ref.num_nodes", COLOCATED, (PPO,), value_type=int),
    noop("ref_num_gpus_per_node", "ref.num_gpus_per_node", COLOCATED, (PPO,), value_type=int),
    noop("reward_num_nodes", "reward.num_nodes", COLOCATED, (PPO,), value_type=int),
    noop("reward_num_gpus_per_node", "reward.num_gpus_per_node", COLOCATED, (PPO,), value_type=int),
    noop("critic_num_nodes", "critic.num_nodes", COLOCATED, (PPO,), value_type=int),
    noop("critic_num_gpus_per_node", "critic.num_gpus_per_node", COLOCATED, (PPO,), value_type=int),
    noop("colocate_actor_ref", "train.colocate_actor_ref", COLOCATED, (PPO,), takes="switch"),
    noop("colocate_critic_reward", "train.colocate_critic_reward", COLOCATED, (PPO,), takes="switch"),
    noop("colocate_all_models", "train.colocate_all", COLOCATED, (PPO,), takes="switch"),
    noop("ref_reward_offload", "ref.offload|reward.offload", "the frozen reference and reward models stay where "
          "the actor is", (PPO,), takes="switch"),
    noop("actor_init_on_gpu", "", "models are placed on the rank's device when they load", (PPO,), takes="switch"),
    # PPO: vLLM
    same("vllm_num_engines", "vllm.num_engines", (PPO,), value_type=int,
          note="one colocated engine per rank (0 or --num_workers); needs a GPU and the [vllm] extra"),
    same("vllm_tensor_parallel_size", "vllm.tensor_parallel_size", (PPO,), value_type=int,
          note="only 1 with vLLM engines (each rank hosts a whole engine); ignored without them"),
    same("vllm_gpu_memory_utilization", "vllm.gpu_memory_utilization", (PPO,), value_type=float,
          departs_if=lambda run: run.ppo.vllm_num_engines > 0,
          departs="OpenRLHF's default, 0.95, is for engines on GPUs of their own; here each engine shares its rank's "
                  "GPU with the models it trains (as OpenRLHF's hybrid-engine scripts, which set 0.5 to 0.8), so 0.5"),
    same("vllm_enable_sleep", "vllm.enable_sleep", (PPO,), takes="switch"),
    noop("vllm_sync_backend", "vllm.sync_backend", "weights reach the colocated engine in process, with no "
          "collective to choose", (PPO,)),
    noop("vllm_sync_with_ray", "vllm.sync_with_ray", "weights reach the colocated engine in process", (PPO,),
          takes="switch"),
    Flag("enable_prefix_caching", MAPPED, (PPO,), "vllm.enable_prefix_caching", field="enable_prefix_caching",
         takes="switch", note="passed to each rank's colocated vLLM engine (with --vllm_num_engines); transformers "
                              "generation has no prefix cache"),
    noop("enforce_eager", "vllm.enforce_eager", VLLM_ONLY, (PPO,), takes="switch"),
    noop("vllm_generate_batch_size", "rollout.vllm_generate_batch_size", VLLM_ONLY, (PPO,), value_type=int),
    noop("enable_vllm_is_correction", "algo.advantage.is_correction_enable", "samples come from the actor's own "
          "weights (or an engine loaded with them before each rollout), so there is no mismatch to correct",
          (PPO,), takes="switch"),
    noop("vllm_is_truncated_threshold", "algo.advantage.is_correction_threshold", "see --enable_vllm_is_correction",
          (PPO,), takes="pair", value_type=float),
    noop("vllm_is_correction_type", "algo.advantage.is_correction_type", "see --enable_vllm_is_correction", (PPO,)),
    noop("deepspeed_enable_sleep", "ds.enable_sleep", "has no effect on a CPU, where the models' states already "
          "live in CPU memory, nor on a GPU: offloading DeepSpeed's states around vLLM generation is not built, so "
          "leave vLLM its room with --vllm_gpu_memory_utilization", (PPO,), takes="switch"),
    # PPO: schedule and algorithm
    refuse("async_train", "train.async_enable", "asynchronous (off-policy) PPO is not built; each step samples with "
            "the current actor", (PPO,), takes="switch", default=False),
    noop("async_queue_size", "train.async_queue_size", "see --async_train", (PPO,), value_type=int),
    refuse("partial_rollout", "train.partial_rollout_enable", "partial rollouts belong to asynchronous PPO, which "
            "is not built", (PPO,), takes="switch", default=False),
    refuse("enable_ema", "train.enable_ema", "an EMA copy of the actor is not built", (PPO,), takes="switch",
            default=False),
    noop("ema_beta", "train.ema_beta", "see --enable_ema", (PPO,), value_type=float),
    noop("use_dynamic_batch", "train.dynamic_batch_enable", "batches count samples, not tokens, here", (PPO,),
          takes="switch"),
    noop("rollout_max_tokens_per_gpu", "rollout.max_tokens_per_gpu", "see --use_dynamic_batch", (PPO,),
          value_type=int),
    noop("train_max_tokens_per_gpu", "train.max_tokens_per_gpu", "see --use_dynamic_batch", (PPO,), value_type=int),
    same("num_episodes", "train.num_episodes", (PPO,), value_type=int),
    same("rollout_batch_size", "rollout.batch_size", (PPO,), value_type=int),
    same("micro_rollout_batch_size", "rollout.micro_batch_size", (PPO,), value_type=int, dotted_default={PPO: 1}),
    same("max_new_tokens", "rollout.max_new_tokens", (PPO,), value_type=int,
          departs="OpenRLHF's default (none: up to --max_len minus the prompt's length) is not built; 64 here, "
                  "which keeps a CPU's generation short"),
    Flag("generate_max_len", MAPPED, (PPO,), field="max_new_tokens", value_type=int,
         note="the seed's spelling of --max_new_tokens"),
    same("prompt_max_len", "", (PPO,), value_type=int, note="OpenRLHF <= 0.9.0's prompt cap; kept here"),
    noop("ptx_coef", "", "there is no pre-training data flag in OpenRLHF 0.9 to mix in, so the ptx loss is 0",
          (PPO,), value_type=float),
    same("eps_clip", "actor.eps_clip", (PPO,), value_type=float),
    same("eps_clip_low_high", "actor.eps_clip_low_high", (PPO,), takes="pair", value_type=float),
    refuse("dual_clip", "actor.dual_clip", "dual-clip PPO is not built", (PPO,), value_type=float),
    same("value_clip", "critic.value_clip", (PPO,), value_type=float),
    same("lambd", "algo.advantage.lambd", (PPO,), value_type=float),
    same("gamma", "algo.advantage.gamma", (PPO,), value_type=float),
    same("normalize_reward", "reward.normalize_enable", (PPO,), takes="switch"),
    same("top_p", "rollout.top_p", (PPO,), value_type=float),
    same("temperature", "rollout.temperature", (PPO,), value_type=float),
    same("freezing_actor_steps", "critic.freezing_steps", (PPO,), value_type=int),
    same("n_samples_per_prompt", "rollout.n_samples_per_prompt", (PPO,), value_type=int),
    same("save_value_network", "critic.save_value_network", (PPO,), takes="switch"),
    same("kl_target", "algo.kl.target", (PPO,), value_type=float),
    same("kl_horizon", "algo.kl.horizon", (PPO,), value_type=int),
    same("init_kl_coef", "algo.kl.init_coef", (PPO,), value_type=float),
    refuse("policy_loss_type", "actor.policy_loss_type", "only the PPO clipped surrogate is built", (PPO,),
            default="ppo"),
    same("kl_estimator", "algo.kl.estimator", (PPO,)),
    same("entropy_loss_coef", "actor.entropy_coef", (PPO,), value_type=float,
          note="unset: no entropy; 0: the entropy is logged as entropy_loss; otherwise loss - coef x entropy"),
    same("reward_clip_range", "reward.clip_range", (PPO,), takes="pair", value_type=float),
    same("advantage_estimator", "algo.advantage.estimator", (PPO,)),
    same("use_kl_loss", "algo.kl.use_loss", (PPO,), takes="switch"),
    refuse("no_advantage_std_norm", "algo.advantage.no_std_norm", "the std normalization of the critic-free "
            "estimators cannot be turned off here (--advantage_estimator dr_grpo is GRPO without it)", (PPO,), takes="switch", default=False),
    refuse("overlong_buffer_len", "reward.overlong_buffer_len", "the DAPO overlong penalty is not built", (PPO,),
            value_type=float),
    noop("overlong_penalty_factor", "reward.overlong_penalty_factor", "see --overlong_buffer_len", (PPO,),
          value_type=float),
    refuse("stop_properly_penalty_coef", "reward.stop_properly_penalty_coef", "the truncation penalty is not built",
            (PPO,), value_type=float),
    same("reward_pretrain", "reward.model_name_or_path", (PPO,)),
    same("remote_rm_url", "reward.remote_url", (PPO,)),
    same("critic_pretrain", "critic.model_name_or_path", (PPO,)),
    same("agent_func_path", "train.agent_func_path", (PPO,)),
    same("prompt_data", "data.prompt_dataset", (PPO,)),
    Flag("prompt_data_probs", MAPPED, (PPO,), "data.prompt_probs", convert=dataset_probs_value,
         note="the sampling weights of several comma-separated --prompt_data (our --dataset_probs)"),
    same("prompt_split", "data.prompt_split", (PPO,)),
    same("eval_temperature", "eval.temperature", (PPO,), value_type=float),
    same("eval_n_samples_per_prompt", "eval.n_samples_per_prompt", (PPO,), value_type=int),
    same("label_key", dotted_in("data.label_key", PPO), (PPO, PRM)),
    same("dynamic_filtering", "algo.dynamic_filtering_enable", (PPO,), takes="switch"),
    same("dynamic_filtering_reward_range", "algo.dynamic_filtering_range", (PPO,), takes="pair", value_type=float),
    noop("perf", "", "timings are printed per chunk and written to the metrics", (PPO,), takes="switch"),
    refuse("", "data.image_key", "vision-language models are not built", (PPO,), default="images"),
    refuse("", "data.max_images_per_prompt", "vision-language models are not built", (PPO,), value_type=int,
            default=0),
    refuse("", "actor.freeze_visual_encoder", "vision-language models are not built", (PPO,), takes="switch",
            default=False),
    # lora_combiner
    same("model_path", "model_path", (COMBINER,)),
    same("lora_path", "lora_path", (COMBINER,), note="also a checkpoint folder: .../{stage}/latest or .../step_N"),
    same("output_path", "output_path", (COMBINER,)),
    Flag("param_dtype", MAPPED, (COMBINER,), "ds.param_dtype", note="bf16 writes the merged weights in bfloat16",
         convert=lambda value: {"bf16": value == "bf16"}),
    refuse("is_rm", "is_rm", "merging a reward model's adapter is not built; merge policy adapters", (COMBINER,),
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
             "accepted; anything else exits 2 with the reason).", "",
             "Defaults are OpenRLHF's: v0.9.10's (`train_prm`'s: v0.9.0's). OpenRLHF 0.11 changed two, PPO's micro "
             "batch sizes (to 1): a command line that spells any flag the 0.11 way (dotted, as `--ckpt.save_steps`) "
             "gets 0.11's defaults, even when its other flags keep their 0.9 names; one in 0.9 names only gets "
             "0.9.10's. A value given always wins. A YAML run config (`rlhf run`) and a deployment's parameters name "
             "our fields, not OpenRLHF's flags, and get 0.9.10's. Where our default departs from OpenRLHF's, the row "
             "says why, and `rlhf train` says it once (`rlhf: note:`) when the command leaves the flag out.", ""]
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
            if flag.departure(cli):
                here += f"; **default departs:** {flag.departure(cli)}"
            if cli in flag.dotted_default:
                here += f"; default {flag.dotted_default[cli]} with 0.11's spellings (0.11's)"
            lines.append(f"| {old} | {dotted} | {flag.kind} | {here} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(render_markdown(), end="")
