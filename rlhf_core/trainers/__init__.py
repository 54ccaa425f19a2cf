"""Stage trainers. Each runs inside one DeepSpeed rank and advances its stage one optimizer step at a time."""

from __future__ import annotations


def trainer_class(stage: str):
    if stage == "sft":
        from rlhf_core.trainers.sft import SFTTrainer

        return SFTTrainer
    raise ValueError(f"no trainer for stage {stage!r}")
