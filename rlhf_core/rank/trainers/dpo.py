"""DPO, as OpenRLHF's `train_dpo`: the policy learns from preference pairs against a frozen reference model, with
IPO (--ipo), conservative DPO (--label_smoothing) and an NLL term (--nll_loss_coef). Departures: the pairs OpenRLHF
drops (too long a prompt) go with one warning; the reference stays outside DeepSpeed (on the CPU with --ref_offload).
docs/design-notes.md ("The DPO trainer") has the losses and the evaluation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rlhf_core.config import RunConfig
from rlhf_core.data.pairs import Pair, load_pairs, trainable_pairs
from rlhf_core.data.determinism import derive_seed
from rlhf_core.models.load import LoadOptions, load_causal_lm
from rlhf_core.data.tokenizer_ref import lazy_tokenizer
from rlhf_core.rank.packing import pack_sft
from rlhf_core.rank.ppo_math import token_logprobs
from rlhf_core.data.samples import IGNORE_INDEX, TokenizedSample, collate_sft
from rlhf_core.stages.dpo import DPOConfig
from rlhf_core.rank.trainers.base import DeepSpeedTrainer, chained_model


@dataclass(frozen=True)
class PreferenceObjective:
    """Which preference loss `dpo_loss` computes: DPO with `beta`, conservative DPO with `label_smoothing` > 0,
    or IPO's squared loss (`ipo`, which ignores `label_smoothing`, as OpenRLHF)."""

    beta: float
    label_smoothing: float = 0.0
    ipo: bool = False


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, reference_chosen: torch.Tensor,
             reference_rejected: torch.Tensor,
             objective: PreferenceObjective) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mean loss, chosen rewards, rejected rewards) of a batch of pairs' summed response log-probabilities."""
    beta, label_smoothing = objective.beta, objective.label_smoothing
    logits = (policy_chosen - policy_rejected) - (reference_chosen - reference_rejected)
    if objective.ipo:
        losses = (logits - 1 / (2 * beta)) ** 2
    else:
        losses = (-F.logsigmoid(beta * logits) * (1 - label_smoothing)
                  - F.logsigmoid(-beta * logits) * label_smoothing)
    return (losses.mean(), beta * (policy_chosen - reference_chosen).detach(),
            beta * (policy_rejected - reference_rejected).detach())


def response_logps(logits: torch.Tensor, labels: torch.Tensor,
                   lengths: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence, the summed log-probability of its target tokens (labels other than IGNORE_INDEX) and their
    count: one sequence per row of a padded batch, or the sequences of one packed row (`lengths`)."""
    targets = labels[:, 1:]
    mask = targets != IGNORE_INDEX
    token = token_logprobs(logits[:, :-1], targets.clamp(min=0)) * mask
    if lengths is None:
        return token.sum(-1), mask.sum(-1)
    segment = torch.repeat_interleave(torch.arange(len(lengths), device=token.device),
                                      torch.tensor(lengths, device=token.device))[1:]  # of each target position
    sums = torch.zeros(len(lengths), device=token.device).index_add(0, segment, token[0])
    counts = torch.zeros(len(lengths), device=token.device).index_add(0, segment, mask[0].float())
    return sums, counts


def response_samples(pair: Pair) -> tuple[TokenizedSample, TokenizedSample]:
    """The pair's chosen and rejected sequences, each a target from the prompt's end on."""
    tokens = pair.tokens
    chosen, rejected = (TokenizedSample(ids, [0] * tokens.prompt_len + [1] * (len(ids) - tokens.prompt_len))
                        for ids in (tokens.chosen_ids, tokens.rejected_ids))
    return chosen, rejected


class DPOTrainer(DeepSpeedTrainer[DPOConfig]):
    stage, config_class = "dpo", DPOConfig

    def __init__(self, run: RunConfig, chunk_ends: list[int], rank: int, world_size: int, load_universal: bool = False):
        super().__init__(run, chunk_ends, rank, world_size, load_universal)
        cfg = self.cfg
        self.tokenizer = lazy_tokenizer(cfg.start_model, run)
        train_pairs, eval_pairs = load_pairs(cfg, run, self.tokenizer)
        self.train_pairs = trainable_pairs(train_pairs, cfg.max_len, "--dataset")
        self.eval_pairs = trainable_pairs(eval_pairs, cfg.max_len, "--eval_dataset") if eval_pairs else []
        torch.manual_seed(derive_seed(run.seed, self.stage, "init"))  # LoRA adapters start identical everywhere
        model = load_causal_lm(cfg.start_model, LoadOptions.trained(cfg), storage_options=run.storage_options)
        self.engine = self.build_engine(self.export_model_dir, model)
        reference = load_causal_lm(chained_model(cfg.ref_pretrain, "--ref_pretrain"), LoadOptions.frozen(cfg),
                                   storage_options=run.storage_options, flag="--ref_pretrain")
        self.reference = reference.to("cpu" if cfg.ref_offload else self.engine.device).eval().requires_grad_(False)

    def logps(self, model, pairs: list[Pair]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(chosen, rejected) summed response log-probabilities under `model`, and the chosen responses' mean
        log-probability per token, from one padded batch or one packed row."""
        chosen, rejected = zip(*(response_samples(pair) for pair in pairs))
        samples = list(chosen) + list(rejected)
        device = next(model.parameters()).device
        if self.cfg.packing_samples:
            packed = pack_sft(samples)
            with self.autocast():
                logits = model(input_ids=packed["input_ids"].to(device), position_ids=packed["position_ids"].to(device),
                               use_cache=False).logits
            sums, counts = response_logps(logits, packed["labels"].to(device), [len(s.input_ids) for s in samples])
        else:
            batch = {name: tensor.to(device) for name, tensor in collate_sft(samples, self.tokenizer.pad_token_id).items()}
            labels = batch.pop("labels")
            with self.autocast():
                logits = model(**batch).logits
            sums, counts = response_logps(logits, labels)
        sums, counts = sums.to(self.engine.device), counts.to(self.engine.device)
        num_pairs = len(pairs)
        chosen_mean = sums[:num_pairs] / counts[:num_pairs].clamp(min=1)
        return sums[:num_pairs], sums[num_pairs:], chosen_mean

    def pair_loss(self, pairs: list[Pair]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(loss, chosen rewards, rejected rewards, NLL of the chosen responses) of a micro-batch."""
        cfg = self.cfg
        policy_chosen, policy_rejected, chosen_mean = self.logps(self.engine, pairs)
        with torch.no_grad():
            reference_chosen, reference_rejected, _ = self.logps(self.reference, pairs)
        objective = PreferenceObjective(cfg.beta, cfg.label_smoothing, cfg.ipo)
        loss, chosen_rewards, rejected_rewards = dpo_loss(policy_chosen, policy_rejected, reference_chosen,
                                                          reference_rejected, objective)
        nll = -chosen_mean.mean()
        if cfg.nll_loss_coef > 0:
            loss = loss + cfg.nll_loss_coef * nll
        return loss, chosen_rewards, rejected_rewards, nll

    def train_step(self) -> dict[str, float]:
        return self.train_on(self.train_pairs)

    def train_loss(self, pairs: list[Pair]) -> tuple[torch.Tensor, dict[str, float]]:
        loss, chosen_rewards, rejected_rewards, nll = self.pair_loss(pairs)
        metrics = {"accuracy": (chosen_rewards > rejected_rewards).float().mean().item(),
                   "chosen_reward": chosen_rewards.mean().item(), "rejected_reward": rejected_rewards.mean().item()}
        if self.cfg.nll_loss_coef > 0:
            metrics["nll_loss"] = nll.item()
        return loss, metrics

    def eval_items(self) -> Sequence[Pair]:
        return self.eval_pairs

    def eval_sums(self, pairs: list[Pair]) -> dict[str, float]:
        loss, chosen_rewards, rejected_rewards, _ = self.pair_loss(pairs)
        return {"eval_loss": loss.item() * len(pairs),
                "eval_accuracy": (chosen_rewards > rejected_rewards).sum().item(), "count": len(pairs)}
