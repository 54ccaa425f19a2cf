"""Stage trainers. Each runs inside one DeepSpeed rank and advances its stage one step at a time.

A trainer class also tells the planner how big its stage is: `count_items(run)` (samples, pairs or
prompts), `items_per_step(cfg)` and `num_passes(cfg)`.
"""

from __future__ import annotations


def trainer_class(stage: str):
    if stage == "sft":
        from rlhf_core.trainers.sft import SFTTrainer

        return SFTTrainer
    if stage == "rm":
        from rlhf_core.trainers.rm import RewardModelTrainer

        return RewardModelTrainer
    if stage == "ppo":
        from rlhf_core.trainers.ppo import PPOTrainer

        return PPOTrainer
    raise ValueError(f"no trainer for stage {stage!r}")
