"""Reward model: Bradley-Terry on preference pairs, loss = -log sigmoid(r_chosen - r_rejected).

The model is the backbone with a scalar `score` head read at the last token (EOS), as in OpenRLHF.
A fixed held-out split (`eval_split`, drawn from the seed) measures pairwise accuracy after every
chunk; training steps walk the rest in the usual (seed, epoch) order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlhf_core.config import RunConfig
from rlhf_core.data import TokenizedPair, collate_pairs, rank_micro_batches, read_records, split_holdout, tokenize_pairs
from rlhf_core.determinism import derive_seed, step_sample_indices
from rlhf_core.models import load_scalar_model, load_tokenizer
from rlhf_core.trainers.base import DeepSpeedTrainer


def load_pairs(run: RunConfig, tokenizer) -> tuple[list[TokenizedPair], list[TokenizedPair]]:
    """(train, held-out) preference pairs."""
    cfg = run.rm
    records = read_records(cfg.dataset, max_samples=cfg.max_samples)
    pairs = tokenize_pairs(cfg.dataset, records, tokenizer, cfg.prompt_key, cfg.chosen_key, cfg.rejected_key,
                           cfg.max_len, cfg.apply_chat_template)
    return split_holdout(pairs, cfg.eval_split, run.seed)


class RewardModelTrainer(DeepSpeedTrainer):
    stage = "rm"
    export_model_dir = "reward_model"

    @staticmethod
    def count_items(run: RunConfig) -> int:
        return len(load_pairs(run, load_tokenizer(run.rm.pretrain))[0])

    def __init__(self, run: RunConfig, total_steps: int, rank: int, world_size: int, load_universal: bool = False):
        super().__init__(run, total_steps, rank, world_size, load_universal)
        self.tokenizer = load_tokenizer(self.cfg.pretrain)
        self.train_pairs, self.eval_pairs = load_pairs(run, self.tokenizer)
        torch.manual_seed(derive_seed(run.seed, self.stage, "init"))  # the new score head starts identical everywhere
        model = load_scalar_model(self.cfg.pretrain, self.tokenizer.pad_token_id, self.cfg.lora_rank,
                                  self.cfg.lora_alpha, self.cfg.target_modules, self.cfg.gradient_checkpointing)
        self.engine = self.build_engine(self.export_model_dir, model)

    def rewards(self, pairs: list[TokenizedPair]) -> tuple[torch.Tensor, torch.Tensor]:
        batch = collate_pairs(pairs, self.tokenizer.pad_token_id)
        scores = self.engine(**{name: t.to(self.engine.device) for name, t in batch.items()}).logits.squeeze(-1)
        return scores[: len(pairs)], scores[len(pairs):]

    def train_step(self) -> dict[str, float]:
        torch.manual_seed(derive_seed(self.run.seed, self.stage, self.step, self.rank, "dropout"))
        indices = step_sample_indices(self.step, self.cfg.train_batch_size, len(self.train_pairs), self.run.seed)
        self.engine.train()
        losses, accuracies = [], []
        for micro_batch in rank_micro_batches(indices, self.rank, self.world_size, self.cfg.micro_train_batch_size):
            chosen, rejected = self.rewards([self.train_pairs[i] for i in micro_batch])
            loss = -F.logsigmoid(chosen - rejected).mean()
            self.engine.backward(loss)
            self.engine.step()
            losses.append(loss.item())
            accuracies.append((chosen > rejected).float().mean().item())
        self.step += 1
        metrics = {"step": self.step, "loss": self.mean_over_ranks(losses), "lr": self.engine.get_lr()[0],
                   "accuracy": self.mean_over_ranks(accuracies)}
        if self.step == self.total_steps or self.step % max(self.cfg.save_steps, 1) == 0:
            metrics["eval_accuracy"] = self.eval_accuracy()
        return metrics

    @torch.no_grad()
    def eval_accuracy(self) -> float:
        """Pairwise accuracy on the held-out split (each rank scores a share of it)."""
        self.engine.eval()
        share = self.eval_pairs[self.rank :: self.world_size]
        correct = []
        for start in range(0, len(share), self.cfg.micro_train_batch_size):
            chosen, rejected = self.rewards(share[start : start + self.cfg.micro_train_batch_size])
            correct += (chosen > rejected).float().tolist()
        return self.mean_over_ranks(correct) if self.eval_pairs else float("nan")
