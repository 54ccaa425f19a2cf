"""What every DeepSpeed stage trainer shares: the engine, saving and loading a checkpoint.

A checkpoint of one model is a folder (`actor_model/`, `critic_model/`) holding DeepSpeed's own state
under `ds/` (weights, optimizer, LR schedule, per rank) and a Hugging Face copy of the weights under
`hf/` (safetensors), which export and inspection read without unpickling anything.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from rlhf_core.config import RunConfig, StageConfig
from rlhf_core.engine import deepspeed_config
from rlhf_core.faults import fault_point

from rlhf_core.resume import DEEPSPEED_STATE_DIR, UNIVERSAL_STATE_DIR


class DeepSpeedTrainer:
    """One rank of a stage: a DeepSpeed engine over one model, at optimizer step `self.step`."""

    stage: str = ""
    model_dir_name = "actor_model"

    def __init__(self, run: RunConfig, total_steps: int, rank: int, world_size: int, load_universal: bool = False):
        self.run, self.cfg = run, run.stage_config(self.stage)
        self.total_steps, self.rank, self.world_size = total_steps, rank, world_size
        self.load_universal = load_universal
        self.step = 0

    def build_engine(self, model: torch.nn.Module) -> None:
        import deepspeed

        trainable = [param for param in model.parameters() if param.requires_grad]
        config = deepspeed_config(self.cfg, self.world_size, self.total_steps, self.load_universal)
        self.engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=trainable, config=config)

    def save(self, directory: str) -> None:
        """All ranks write DeepSpeed state; rank 0 adds the HF weights (and tokenizer if save_hf_ckpt)."""
        model_dir = os.path.join(directory, self.model_dir_name)
        client_state = {"step": self.step, "universal_checkpoint_info": {"universal_checkpoint_version": 0.2}}
        self.engine.save_checkpoint(model_dir, tag=DEEPSPEED_STATE_DIR, client_state=client_state, save_latest=False)
        fault_point("local_save", self.step)
        if self.rank == 0:
            hf_dir = os.path.join(model_dir, "hf")
            self.engine.module.save_pretrained(hf_dir, safe_serialization=True)
            if self.cfg.save_hf_ckpt:
                self.tokenizer.save_pretrained(hf_dir)
        dist.barrier()

    def load(self, directory: str, universal: bool = False, weights_only: bool = False) -> int:
        """Restore the state saved in `directory`; with `weights_only`, a fresh optimizer whose LR schedule
        continues at the saved step (a restarted warmup would be a second shock)."""
        model_dir = os.path.join(directory, self.model_dir_name)
        _, client_state = self.engine.load_checkpoint(
            model_dir, tag=UNIVERSAL_STATE_DIR if universal else DEEPSPEED_STATE_DIR,
            load_optimizer_states=not weights_only, load_lr_scheduler_states=not weights_only,
            load_module_only=weights_only,
        )
        self.step = int(client_state["step"])
        if weights_only:
            self.engine.lr_scheduler.step(self.step - 1)  # the index of the last step taken, as when saved
        return self.step

    def mean_over_ranks(self, values: list[float]) -> float:
        total = torch.tensor([sum(values), len(values)], dtype=torch.float64)
        dist.all_reduce(total)
        return (total[0] / total[1]).item()
