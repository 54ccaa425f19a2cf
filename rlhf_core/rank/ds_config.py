"""What the driver and the ranks agree on about DeepSpeed: the config (`deepspeed_config`), the ZeRO stage, the LR
schedule (`lr_scheduler_factory`, OpenRLHF's), the universal-checkpoint conversion; small, so both sides import it.
It departs from DeepSpeed's defaults for small models and CPUs (ZeRO-3's whole-parameter threshold, torch's fused CPU
AdamW, no optimizer offload on a CPU): docs/design-notes.md ("The DeepSpeed config") says how and why.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from typing import Any, Callable

from rlhf_core.notices import warn_once
from rlhf_core.storage.manifest import DEEPSPEED_STATE_DIR, UNIVERSAL_STATE_DIR


COSINE_MIN_LR_RATE = 0.1  # cosine_with_min_lr ends at 10% of the peak, as OpenRLHF


def resolve_zero_stage(configured: int | None, num_workers: int, adam_offload: bool, saved: int | None = None) -> int:
    """The ZeRO stage a worker group runs: the configured one; else the one the stage's checkpoints were
    written with (a resumed line keeps its layout, whatever its world size now); else 0 on one rank, where
    ZeRO partitions nothing and its flat buffers cost ~30% of a CPU step, and 2 (OpenRLHF's default) on
    more ranks or with --adam_offload (DeepSpeed offloads the optimizer with ZeRO 1-3 only)."""
    if configured is not None:
        return configured
    if saved is not None:
        return saved
    return 0 if num_workers == 1 and not adam_offload else 2


def deepspeed_config(cfg, num_workers: int, load_universal: bool = False, on_gpu: bool = False,
                     hidden_size: int | None = None) -> dict[str, Any]:
    """DeepSpeed settings for one stage's engine (the LR schedule is passed separately)."""
    zero_stage = resolve_zero_stage(cfg.zero_stage, num_workers, cfg.adam_offload)
    zero: dict[str, Any] = {"stage": zero_stage}
    if zero_stage == 3 and hidden_size:
        zero["stage3_param_persistence_threshold"] = 10 * hidden_size
    offload = cfg.adam_offload and on_gpu and zero_stage > 0
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    elif cfg.adam_offload:
        warn_once("--adam_offload has no effect here: " + ("the optimizer states already live in CPU memory "
                  "(no GPU)." if not on_gpu else "DeepSpeed offloads the optimizer with ZeRO stage 1-3 only."))
    return {
        "train_batch_size": cfg.train_batch_size,
        "train_micro_batch_size_per_gpu": cfg.micro_train_batch_size,
        "gradient_accumulation_steps": cfg.train_batch_size // (cfg.micro_train_batch_size * num_workers),
        "gradient_clipping": cfg.max_norm,
        "zero_optimization": zero,
        # On a CPU, bf16 is autocast in the trainers (resolve_precision), never DeepSpeed's bf16 weights.
        "bf16": {"enabled": on_gpu and cfg.param_dtype == "bf16"},
        "fp16": {"enabled": on_gpu and cfg.param_dtype == "fp16"},
        "optimizer": {
            "type": "AdamW",
            # FusedAdam needs CUDA and offload needs DeepSpeedCPUAdam; torch's AdamW is the CPU path, in
            # its fused CPU kernel: one pass over the weights instead of ~6 (>10x faster on 24M parameters).
            "params": {"lr": cfg.learning_rate, "betas": list(cfg.adam_betas), "eps": cfg.adam_eps,
                       "weight_decay": cfg.l2, "torch_adam": not on_gpu, **({} if on_gpu else {"fused": True})},
        },
        "checkpoint": {"load_universal": load_universal},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def warmup_steps(lr_warmup_ratio: float, total_steps: int) -> int:
    return math.ceil(lr_warmup_ratio * total_steps)


def lr_scheduler_factory(lr_scheduler: str, lr_warmup_ratio: float, total_steps: int,
                         min_lr_ratio: float = COSINE_MIN_LR_RATE) -> Callable:
    """`optimizer -> LambdaLR` for deepspeed.initialize: OpenRLHF's schedule by name."""
    from transformers import get_scheduler

    total_steps = max(total_steps, 1)
    extra = {"min_lr_rate": min_lr_ratio} if lr_scheduler == "cosine_with_min_lr" else None

    def build(optimizer):
        return get_scheduler(lr_scheduler, optimizer, num_warmup_steps=warmup_steps(lr_warmup_ratio, total_steps),
                             num_training_steps=total_steps, scheduler_specific_kwargs=extra)

    return build


def convert_to_universal(local_dir: str) -> bool:
    """Rewrite each model's per-rank ZeRO state as DeepSpeed's world-size-free universal checkpoint; False
    when there was none to convert (a checkpoint saved with --disable_ds_ckpt holds weights only)."""
    converted = False
    for model_dir in sorted(os.listdir(local_dir)):
        source = os.path.join(local_dir, model_dir, DEEPSPEED_STATE_DIR)
        if not os.path.isdir(source):
            continue
        command = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", source,
                   "--output_folder", os.path.join(local_dir, model_dir, UNIVERSAL_STATE_DIR)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"universal checkpoint conversion of {model_dir} failed:\n{done.stderr[-2000:]}")
        converted = True
    return converted
