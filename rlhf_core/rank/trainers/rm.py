"""Reward model on preference pairs, as OpenRLHF: backbone + scalar `score` head read at the last token (EOS), loss
`sigmoid` (Bradley-Terry, margins with --margin_loss) or `logexploss`. Evaluation gives accuracy, loss and the
rewards' mean/std, which go into the model config for PPO's --normalize_reward.
docs/design-notes.md ("The reward-model trainer") has the details.
"""

from __future__ import annotations

from collections.abc import Sequence
import torch
import torch.nn.functional as F

from rlhf_core.config import RunConfig
from rlhf_core.data.pairs import Pair, eval_pairs_of_rm, load_pairs
from rlhf_core.data.determinism import derive_seed
from rlhf_core.notices import warn_once
from rlhf_core.models.load import LoadOptions, load_scalar_model, sequence_scores
from rlhf_core.data.tokenizer_ref import lazy_tokenizer
from rlhf_core.rank.packing import pack_sequences, packed_scores
from rlhf_core.data.samples import collate_pairs
from rlhf_core.stages.rm import RMConfig
from rlhf_core.rank.trainers.base import DeepSpeedTrainer

def pairwise_loss(kind: str, chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor) -> torch.Tensor:
    if kind == "logexploss":
        return torch.log(1 + torch.exp(rejected - chosen)).mean()
    return -F.logsigmoid(chosen - rejected - margin).mean()


class RewardModelTrainer(DeepSpeedTrainer[RMConfig]):
    stage, config_class = "rm", RMConfig
    evaluates_at_epoch_end = True  # as OpenRLHF's RewardModelTrainer, with --eval_steps N too

    def __init__(self, run: RunConfig, chunk_ends: list[int], rank: int, world_size: int, load_universal: bool = False):
        super().__init__(run, chunk_ends, rank, world_size, load_universal)
        self.tokenizer = lazy_tokenizer(self.cfg.start_model, run)
        self.train_pairs, self.eval_pairs = load_pairs(self.cfg, run, self.tokenizer)
        if self.cfg.margin_loss and self.cfg.loss == "logexploss":
            warn_once("--margin_loss has no effect with --loss logexploss (as in OpenRLHF).")
        torch.manual_seed(derive_seed(run.seed, self.stage, "init"))  # the new score head starts identical everywhere
        cfg = self.cfg
        model = load_scalar_model(cfg.start_model, self.tokenizer.pad_token_id, LoadOptions.trained(cfg),
                                  storage_options=run.storage_options)
        self.engine = self.build_engine(self.export_model_dir, model)

    def rewards(self, pairs: list[Pair]) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen, rejected) rewards of `pairs`, from one padded batch or one packed row."""
        sequences = [pair.tokens.chosen_ids for pair in pairs] + [pair.tokens.rejected_ids for pair in pairs]
        with self.autocast():
            if self.cfg.packing_samples:
                packed = pack_sequences(sequences)
                scores = packed_scores(self.engine.module, packed["input_ids"], packed["position_ids"], packed["ends"])
            else:  # read at each sequence's last token, its EOS, also when the pad token is the EOS (GPT-2)
                batch = collate_pairs([pair.tokens for pair in pairs], self.tokenizer.pad_token_id)
                scores = sequence_scores(self.engine.module, batch["input_ids"], batch["attention_mask"])
        scores = scores.float()
        return scores[: len(pairs)], scores[len(pairs):]

    def loss(self, pairs: list[Pair], chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
        margins = torch.tensor([pair.margin for pair in pairs], device=chosen.device)
        return pairwise_loss(self.cfg.loss, chosen, rejected, margins)

    def train_step(self) -> dict[str, float]:
        return self.train_on(self.train_pairs)

    def train_loss(self, pairs: list[Pair]) -> tuple[torch.Tensor, dict[str, float]]:
        chosen, rejected = self.rewards(pairs)
        return self.loss(pairs, chosen, rejected), {"accuracy": (chosen > rejected).float().mean().item()}

    def eval_items(self) -> Sequence[Pair]:
        """The eval pairs; without any, as OpenRLHF, the first 1% of the training pairs, for the rewards' mean/std."""
        return self.eval_pairs or eval_pairs_of_rm(self.train_pairs)

    def eval_sums(self, pairs: list[Pair]) -> dict[str, float]:
        chosen, rejected = self.rewards(pairs)
        rewards = torch.cat([chosen, rejected]).double()
        return {"correct": (chosen > rejected).sum().item(),
                "loss": self.loss(pairs, chosen, rejected).item() * len(pairs), "reward": rewards.sum().item(),
                "reward_square": rewards.square().sum().item(), "count": len(pairs)}

    def eval_metrics(self, totals: dict[str, float]) -> dict[str, float]:
        """Accuracy and loss on the eval pairs, and the rewards' mean/std (chosen and rejected), which go into the
        model config, so each checkpoint's hf/config.json carries them."""
        num_pairs, num_rewards = totals["count"], 2 * totals["count"]
        mean = totals["reward"] / num_rewards
        variance = (totals["reward_square"] - num_rewards * mean**2) / max(num_rewards - 1, 1)  # unbiased, as torch.std
        std = max(variance, 0.0) ** 0.5
        config = (self.engine.module.get_base_model() if hasattr(self.engine.module, "get_base_model")
                  else self.engine.module).config
        config.mean, config.std = mean, max(std, 1e-8)
        metrics = {"reward_mean": mean, "reward_std": std}
        if self.eval_pairs:
            metrics.update(eval_accuracy=totals["correct"] / num_pairs, eval_loss=totals["loss"] / num_pairs)
        return metrics
