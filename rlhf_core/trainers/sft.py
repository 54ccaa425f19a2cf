"""Supervised fine-tuning: next-token cross-entropy on response tokens only (as OpenRLHF's SFT).

Step `s` trains on the global batch `step_sample_indices(s, ...)`, split across ranks in micro-batches;
dropout is seeded from (seed, stage, step, rank), so a resumed run replays exactly the same step.
"""

from __future__ import annotations

import torch

from rlhf_core.config import RunConfig
from rlhf_core.data import TokenizedSample, collate_sft, rank_micro_batches, read_records, tokenize_sft
from rlhf_core.determinism import derive_seed, step_sample_indices
from rlhf_core.models import load_causal_lm, load_tokenizer
from rlhf_core.trainers.base import DeepSpeedTrainer


def load_sft_samples(run: RunConfig, tokenizer) -> list[TokenizedSample]:
    cfg = run.sft
    records = read_records(cfg.dataset, max_samples=cfg.max_samples)
    return tokenize_sft(cfg.dataset, records, tokenizer, cfg.input_key, cfg.output_key, cfg.max_len,
                        cfg.apply_chat_template)


class SFTTrainer(DeepSpeedTrainer):
    stage = "sft"
    export_model_dir = "actor_model"

    @staticmethod
    def count_items(run: RunConfig) -> int:
        return len(load_sft_samples(run, load_tokenizer(run.sft.pretrain)))

    def __init__(self, run: RunConfig, total_steps: int, rank: int, world_size: int, load_universal: bool = False):
        super().__init__(run, total_steps, rank, world_size, load_universal)
        self.tokenizer = load_tokenizer(self.cfg.pretrain)
        self.samples = load_sft_samples(run, self.tokenizer)
        torch.manual_seed(derive_seed(run.seed, self.stage, "init"))  # LoRA adapters start identical everywhere
        model = load_causal_lm(self.cfg.pretrain, self.cfg.lora_rank, self.cfg.lora_alpha, self.cfg.target_modules,
                               self.cfg.gradient_checkpointing)
        self.engine = self.build_engine("actor_model", model)

    def train_step(self) -> dict[str, float]:
        torch.manual_seed(derive_seed(self.run.seed, self.stage, self.step, self.rank, "dropout"))
        indices = step_sample_indices(self.step, self.cfg.train_batch_size, len(self.samples), self.run.seed)
        self.engine.train()
        losses = []
        for micro_batch in rank_micro_batches(indices, self.rank, self.world_size, self.cfg.micro_train_batch_size):
            batch = collate_sft([self.samples[i] for i in micro_batch], self.tokenizer.pad_token_id)
            batch = {name: tensor.to(self.engine.device) for name, tensor in batch.items()}
            loss = self.engine(**batch).loss
            self.engine.backward(loss)
            self.engine.step()
            losses.append(loss.item())
        self.step += 1
        return {"step": self.step, "loss": self.mean_over_ranks(losses), "lr": self.engine.get_lr()[0]}
