"""Supervised fine-tuning, as OpenRLHF's SFT: next-token cross-entropy on response tokens only; each step's global
batch is split across ranks, dropout seeded by (seed, stage, step, rank), so a resumed run replays it exactly.
docs/design-notes.md ("The SFT trainer") has packing and evaluation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from rlhf_core.config import RunConfig
from rlhf_core.data.sft import load_sft_samples
from rlhf_core.data.determinism import derive_seed
from rlhf_core.models.load import LoadOptions, load_causal_lm
from rlhf_core.data.tokenizer_ref import lazy_tokenizer
from rlhf_core.rank.packing import pack_sft
from rlhf_core.data.samples import IGNORE_INDEX, TokenizedSample, collate_sft
from rlhf_core.stages.sft import SFTConfig
from rlhf_core.rank.trainers.base import DeepSpeedTrainer


class SFTTrainer(DeepSpeedTrainer[SFTConfig]):
    stage, config_class = "sft", SFTConfig

    def __init__(self, run: RunConfig, chunk_ends: list[int], rank: int, world_size: int, load_universal: bool = False):
        super().__init__(run, chunk_ends, rank, world_size, load_universal)
        self.tokenizer = lazy_tokenizer(self.cfg.pretrain, run)
        self.samples = load_sft_samples(run, self.tokenizer)
        self.eval_samples = load_sft_samples(run, self.tokenizer, evaluation=True) if self.cfg.eval_dataset else []
        torch.manual_seed(derive_seed(run.seed, self.stage, "init"))  # LoRA adapters start identical everywhere
        cfg = self.cfg
        model = load_causal_lm(cfg.pretrain, LoadOptions.trained(cfg), storage_options=run.storage_options)
        self.engine = self.build_engine("actor_model", model)

    def batch(self, samples: list[TokenizedSample]) -> dict:
        """Model inputs of a micro-batch: one packed row (no KV cache, see rlhf_core.rank.packing) or a padded batch."""
        if self.cfg.packing_samples:
            return {**{name: t.to(self.engine.device) for name, t in pack_sft(samples).items()}, "use_cache": False}
        batch = collate_sft(samples, self.tokenizer.pad_token_id)
        return {name: tensor.to(self.engine.device) for name, tensor in batch.items()}

    def train_step(self) -> dict[str, float]:
        return self.train_on(self.samples)

    def train_loss(self, samples: list[TokenizedSample]) -> tuple[torch.Tensor, dict[str, float]]:
        with self.autocast():
            loss = self.engine(**self.batch(samples)).loss
        return loss, {}

    def eval_items(self) -> Sequence[TokenizedSample]:
        return self.eval_samples

    def eval_sums(self, samples: list[TokenizedSample]) -> dict[str, float]:
        """The summed cross-entropy of the response tokens, over their count: eval_loss is the mean per token."""
        batch = self.batch(samples)
        labels = batch.pop("labels")
        with self.autocast():
            logits = self.engine(**batch).logits
        token_losses = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                                       ignore_index=IGNORE_INDEX, reduction="sum")
        return {"eval_loss": token_losses.item(), "count": int((labels[:, 1:] != IGNORE_INDEX).sum())}
