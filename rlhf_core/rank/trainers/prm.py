"""Process reward model, as OpenRLHF v0.9.0's `train_prm`: a causal LM trained to predict, at each placeholder
token that ends a step, that step's label (cross-entropy over --reward_tokens or the vocabulary, or soft for numeric
labels); `accuracy`, and with --eval_dataset `eval_loss` and `eval_accuracy`.
docs/design-notes.md ("The PRM trainer") has the tokenization and the loss.
"""

from __future__ import annotations

from collections.abc import Sequence
import torch
import torch.nn.functional as F

from rlhf_core.config import RunConfig
from rlhf_core.data.determinism import derive_seed
from rlhf_core.models.load import LoadOptions, load_causal_lm
from rlhf_core.data.tokenizer_ref import lazy_tokenizer
from rlhf_core.rank.packing import pack_sequences
from rlhf_core.data.samples import IGNORE_INDEX
from rlhf_core.data.step_labels import StepLabelledSample, load_step_labelled, single_token_id
from rlhf_core.stages.prm import PRMConfig
from rlhf_core.rank.trainers.base import DeepSpeedTrainer


def prm_loss(input_ids: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor, placeholder_id: int,
             reward_token_ids: list[int] | None, soft: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, accuracy) over the labelled placeholder positions of `input_ids`, as OpenRLHF's PRMLoss: `labels`
    hold token ids, or with `soft` the first reward token's probability."""
    mask = (input_ids == placeholder_id) & (labels != IGNORE_INDEX)
    logits, labels = logits[mask].float(), labels[mask]
    if reward_token_ids is not None:
        logits = logits[:, reward_token_ids]
    if soft:
        targets = torch.stack([labels, 1 - labels], dim=-1)
        loss = -(targets * torch.log_softmax(logits, dim=-1)).sum(-1).mean()
        classes = (labels < 0.5).long()
    else:
        classes = labels.long()
        if reward_token_ids is not None:  # token id -> its index among the reward tokens
            classes = (classes[:, None] == torch.tensor(reward_token_ids, device=classes.device)).long().argmax(-1)
        loss = F.cross_entropy(logits, classes)
    return loss, (logits.argmax(-1) == classes).float().mean()


class PRMTrainer(DeepSpeedTrainer[PRMConfig]):
    stage, config_class = "prm", PRMConfig

    def __init__(self, run: RunConfig, chunk_ends: list[int], rank: int, world_size: int, load_universal: bool = False):
        super().__init__(run, chunk_ends, rank, world_size, load_universal)
        cfg = self.cfg
        self.tokenizer = lazy_tokenizer(cfg.start_model, run)
        self.samples = load_step_labelled(run, self.tokenizer)
        self.eval_samples = load_step_labelled(run, self.tokenizer, evaluation=True) if cfg.eval_dataset else []
        self.placeholder_id = single_token_id(self.tokenizer, cfg.placeholder_token, "--placeholder_token")
        self.reward_ids = ([single_token_id(self.tokenizer, token, "--reward_tokens") for token in cfg.reward_tokens]
                           if cfg.reward_tokens else None)
        torch.manual_seed(derive_seed(run.seed, self.stage, "init"))  # LoRA adapters start identical everywhere
        model = load_causal_lm(cfg.start_model, LoadOptions.trained(cfg), storage_options=run.storage_options)
        self.engine = self.build_engine(self.export_model_dir, model)

    def loss(self, samples: list[StepLabelledSample]) -> tuple[torch.Tensor, torch.Tensor]:
        device = self.engine.device
        if self.cfg.packing_samples:
            packed = pack_sequences([sample.input_ids for sample in samples])
            input_ids = packed["input_ids"].to(device)
            with self.autocast():
                logits = self.engine(input_ids=input_ids, position_ids=packed["position_ids"].to(device),
                                     use_cache=False).logits
            labels = torch.tensor([value for sample in samples for value in sample.labels], device=device)[None]
        else:
            length = max(len(sample.input_ids) for sample in samples)
            input_ids = torch.full((len(samples), length), self.tokenizer.pad_token_id, dtype=torch.long)
            attention_mask = torch.zeros_like(input_ids)
            labels = torch.full((len(samples), length), float(IGNORE_INDEX))
            for row, sample in enumerate(samples):
                input_ids[row, : len(sample.input_ids)] = torch.tensor(sample.input_ids)
                attention_mask[row, : len(sample.input_ids)] = 1
                labels[row, : len(sample.labels)] = torch.tensor(sample.labels)
            input_ids, labels = input_ids.to(device), labels.to(device)
            with self.autocast():
                logits = self.engine(input_ids=input_ids, attention_mask=attention_mask.to(device)).logits
        return prm_loss(input_ids, logits, labels, self.placeholder_id, self.reward_ids, samples[0].soft)

    def train_step(self) -> dict[str, float]:
        return self.train_on(self.samples)

    def train_loss(self, samples: list[StepLabelledSample]) -> tuple[torch.Tensor, dict[str, float]]:
        loss, accuracy = self.loss(samples)
        return loss, {"accuracy": accuracy.item()}

    def eval_items(self) -> Sequence[StepLabelledSample]:
        return self.eval_samples

    def eval_sums(self, samples: list[StepLabelledSample]) -> dict[str, float]:
        """Loss and accuracy weighted by sample."""
        loss, accuracy = self.loss(samples)
        return {"eval_loss": loss.item() * len(samples), "eval_accuracy": accuracy.item() * len(samples),
                "count": len(samples)}
