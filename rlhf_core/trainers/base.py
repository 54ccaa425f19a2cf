"""What every DeepSpeed stage trainer shares: its engines, saving and loading one checkpoint.

A checkpoint holds one folder per trained model (`actor_model/`, `critic_model/`, `reward_model/`):
DeepSpeed's own state under `ds/` (weights, optimizer, LR schedule, per rank) and a Hugging Face copy
of the weights under `hf/` (safetensors; the adapter alone with LoRA), which export and inspection read
without unpickling anything. The step and any controller state ride in the first engine's client state,
so all models of a step commit together under one manifest.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from rlhf_core.config import RunConfig
from rlhf_core.engine import deepspeed_config
from rlhf_core.faults import fault_point
from rlhf_core.resume import DEEPSPEED_STATE_DIR, UNIVERSAL_STATE_DIR


class DeepSpeedTrainer:
    """One rank of a stage: DeepSpeed engines over its trained models, at optimizer step `self.step`."""

    stage: str = ""
    step_size_flag = "train_batch_size"  # the flag named when the data cannot fill one step

    @staticmethod
    def items_per_step(cfg) -> int:
        """Samples (or pairs) one step consumes; PPO counts prompts instead."""
        return cfg.train_batch_size

    @staticmethod
    def num_passes(cfg) -> int:
        return cfg.max_epochs

    def __init__(self, run: RunConfig, total_steps: int, rank: int, world_size: int, load_universal: bool = False):
        self.run, self.cfg = run, run.stage_config(self.stage)
        self.total_steps, self.rank, self.world_size = total_steps, rank, world_size
        self.load_universal = load_universal
        self.engines: dict[str, Any] = {}
        self.step = 0

    def build_engine(self, name: str, model: torch.nn.Module, learning_rate: float | None = None,
                     num_optimizer_steps: int | None = None):
        """A DeepSpeed engine for `model`, saved under `{name}/` in each checkpoint."""
        import deepspeed

        cfg = self.cfg if learning_rate is None else self.cfg.model_copy(update={"learning_rate": learning_rate})
        config = deepspeed_config(cfg, self.world_size, num_optimizer_steps or self.total_steps, self.load_universal)
        trainable = [param for param in model.parameters() if param.requires_grad]
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=trainable, config=config)
        self.engines[name] = engine
        return engine

    def controller_state(self) -> dict[str, Any]:
        """Extra state saved with the step (e.g. the KL controller); stages override both methods."""
        return {}

    def restore_controller_state(self, state: dict[str, Any]) -> None:
        pass

    def save(self, directory: str) -> None:
        """All ranks write DeepSpeed state; rank 0 adds the HF copies (and tokenizer if save_hf_ckpt)."""
        client_state = {"step": self.step, "controller": self.controller_state(),
                        "universal_checkpoint_info": {"universal_checkpoint_version": 0.2}}
        for name, engine in self.engines.items():
            engine.save_checkpoint(os.path.join(directory, name), tag=DEEPSPEED_STATE_DIR,
                                   client_state=client_state, save_latest=False)
        fault_point("local_save", self.step)
        if self.rank == 0:
            for name, engine in self.engines.items():
                hf_dir = os.path.join(directory, name, "hf")
                engine.module.save_pretrained(hf_dir, safe_serialization=True)
                if self.cfg.save_hf_ckpt:
                    self.tokenizer.save_pretrained(hf_dir)
        dist.barrier()

    def load(self, directory: str, universal: bool = False, weights_only: bool = False) -> int:
        """Restore the state saved in `directory`; with `weights_only`, fresh optimizers whose LR schedules
        continue at the saved step (a restarted warmup would be a second shock)."""
        client_states = []
        for name, engine in self.engines.items():
            _, client_state = engine.load_checkpoint(
                os.path.join(directory, name), tag=UNIVERSAL_STATE_DIR if universal else DEEPSPEED_STATE_DIR,
                load_optimizer_states=not weights_only, load_lr_scheduler_states=not weights_only,
                load_module_only=weights_only,
            )
            client_states.append(client_state)
            if weights_only:  # DeepSpeed leaves the step count in the client state when loading the module only
                engine.global_steps = int(client_state["global_steps"])
                engine.lr_scheduler.step(engine.global_steps - 1)  # the index of the last step taken
        self.step = int(client_states[0]["step"])
        self.restore_controller_state(client_states[0].get("controller", {}))
        return self.step

    def mean_over_ranks(self, values: list[float]) -> float:
        total = torch.tensor([sum(values), len(values)], dtype=torch.float64)
        dist.all_reduce(total)
        return (total[0] / total[1]).item()
