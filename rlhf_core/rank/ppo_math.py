"""The arithmetic of PPO and its critic-free variants (gae, reinforce, rloo, reinforce_baseline, group_norm,
dr_grpo) as pure tensor functions, following OpenRLHF 0.9.10; batch statistics are the global batch's through the
caller's `reduce` (no torch.distributed here). Departure: gae advantages are not whitened.
docs/design-notes.md ("PPO's arithmetic") has each estimator, the KL and entropy terms, and the shapes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

Reduce = Callable[[torch.Tensor], torch.Tensor]  # sums a float64 tensor over the ranks


def summed(totals: torch.Tensor, reduce: Reduce | None) -> torch.Tensor:
    """`totals` (float64) summed over the ranks with `reduce`; as they are for one process."""
    return totals if reduce is None else reduce(totals)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / mask.sum().clamp(min=1)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8,
                  reduce: Reduce | None = None) -> torch.Tensor:
    """(values - mean) / sqrt(variance + eps) on the masked tokens, 0 elsewhere; mean and (biased)
    variance over the masked tokens of every rank. Two passes in float64 (the global mean first, then
    the squared deviations from it), which stays accurate where sum-of-squares minus squared mean cancels.
    Every rank must call it (it reduces twice) even when its mask is empty."""
    values64, mask64 = values.double(), mask.double()
    first = summed(torch.stack([(values64 * mask64).sum(), mask64.sum()]), reduce)
    count = first[1].clamp(min=1)
    mean = first[0] / count
    variance = summed((((values64 - mean) ** 2) * mask64).sum().reshape(1), reduce)[0] / count
    return ((values64 - mean) * torch.rsqrt(variance + eps) * mask64).to(values.dtype)


def batch_kl(kl: torch.Tensor, mask: torch.Tensor, reduce: Reduce | None = None) -> tuple[float, int]:
    """(mean KL per response token, number of samples) over the global batch: what the adaptive KL
    controller is fed, so every rank holds the same coefficient. The mean is over every rank's tokens
    (a rank's mean weighted by its token count), as OpenRLHF's length-weighted `kl` status."""
    totals = summed(torch.stack([(kl.double() * mask.double()).sum(), mask.double().sum(),
                                 torch.tensor(float(len(kl)), dtype=torch.float64)]), reduce)
    return (totals[0] / totals[1].clamp(min=1)).item(), int(totals[2].item())


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled tokens (Schulman's k1, k2, k3)."""
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        pass  # the log ratio itself
    elif estimator == "k2":
        log_ratio = 0.5 * log_ratio**2
    elif estimator == "k3":
        log_ratio = torch.exp(-log_ratio) - 1 + log_ratio
    else:
        raise ValueError(f"unknown KL estimator {estimator!r}")
    return log_ratio.clamp(-10, 10)  # as OpenRLHF: one wild token must not dominate the penalty


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of the last real token of each row (responses are right-padded)."""
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    return (positions * mask).argmax(dim=1)


def shaped_rewards(scores: torch.Tensor, kl: torch.Tensor, kl_coef: float, mask: torch.Tensor) -> torch.Tensor:
    """-kl_coef * KL on every token, plus the sequence score on its last token."""
    rewards = -kl_coef * kl * mask
    rewards[torch.arange(len(scores)), last_token_index(mask)] += scores
    return rewards


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    rewards = rewards * mask
    returns = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0], dtype=rewards.dtype)
    for t in reversed(range(rewards.shape[1])):
        running = rewards[:, t] + gamma * running
        returns[:, t] = running
    return returns * mask


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lambd: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation; returns (advantages, returns). Rewards and values off the mask count as 0,
    so right padding adds nothing, and across a hole in the mask (an agent's environment tokens) the running
    advantage carries on, decayed by gamma * lambda per token, as OpenRLHF's: a first turn's actions see the
    reward of the last."""
    values, rewards = values * mask, rewards * mask
    advantages = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0], dtype=rewards.dtype)
    for t in reversed(range(rewards.shape[1])):
        next_value = values[:, t + 1] if t + 1 < rewards.shape[1] else torch.zeros_like(running)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = delta + gamma * lambd * running
        advantages[:, t] = running
    advantages = advantages * mask
    return advantages, advantages + values


def rloo_scores(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """Leave-one-out baseline: each score minus the mean of the other samples of its prompt."""
    grouped = scores.view(-1, group_size)
    baseline = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
    return (grouped - baseline).flatten()


def group_mean_scores(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """Each score minus the mean score of its prompt group (reinforce_baseline, dr_grpo)."""
    grouped = scores.view(-1, group_size)
    return (grouped - grouped.mean(dim=1, keepdim=True)).flatten()


def group_norm_scores(scores: torch.Tensor, group_size: int, eps: float = 1e-9) -> torch.Tensor:
    """Each score minus its group's mean, over its group's (unbiased) std (GRPO)."""
    grouped = scores.view(-1, group_size)
    return ((grouped - grouped.mean(dim=1, keepdim=True)) / (grouped.std(dim=1, keepdim=True) + eps)).flatten()


GROUP_BASELINES = {"rloo": rloo_scores, "reinforce_baseline": group_mean_scores, "group_norm": group_norm_scores,
                   "dr_grpo": group_mean_scores}
WHITENED_ESTIMATORS = ("reinforce", "reinforce_baseline")
ESTIMATORS = ("gae", "reinforce") + tuple(GROUP_BASELINES)


def group_filter(scores: torch.Tensor, group_size: int, low: float, high: float) -> torch.Tensor:
    """Dynamic filtering: 1.0 for each sample whose prompt group's mean score lies strictly inside
    (low, high), else 0.0 (groups all right or all wrong teach nothing to a group baseline)."""
    means = scores.view(-1, group_size).mean(dim=1, keepdim=True)
    keep = (means > low) & (means < high)
    return keep.expand(-1, group_size).flatten().float()


@dataclass(frozen=True)
class AdvantageSettings:
    """How one rollout batch's advantages are estimated: the estimator (ESTIMATORS), the KL penalty's
    coefficient this step, the discount and GAE lambda, the samples per prompt (group baselines) and the
    range the scores are clipped to (None: not clipped)."""

    estimator: str
    kl_coef: float
    gamma: float
    lambd: float
    group_size: int
    clip_range: tuple[float, float] | None = None


def advantages_and_returns(settings: AdvantageSettings, scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor,
                           values: torch.Tensor | None, reduce: Reduce | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token (advantages, returns) for one rollout batch; returns are the critic's targets (gae).
    Rows whose `mask` is all zero (padding, or filtered out) get zero advantages and stay out of the
    whitening statistics, which are over every rank's batch with `reduce` (see `masked_whiten`)."""
    estimator = settings.estimator
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}")
    rewards = GROUP_BASELINES[estimator](scores, settings.group_size) if estimator in GROUP_BASELINES else scores
    if settings.clip_range is not None:
        rewards = rewards.clamp(*settings.clip_range)
    shaped = shaped_rewards(rewards, kl, settings.kl_coef, mask)
    if estimator == "gae":
        if values is None:
            raise ValueError("the gae estimator needs the critic's values")
        return gae(shaped, values, mask, settings.gamma, settings.lambd)
    returns = discounted_returns(shaped, mask, 1.0 if estimator in GROUP_BASELINES else settings.gamma)
    if estimator in WHITENED_ESTIMATORS:
        return masked_whiten(returns, mask, reduce=reduce), returns
    return returns, returns


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                eps_clip: float, eps_clip_high: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate, the ratio clipped to [1 - eps_clip, 1 + eps_clip_high] (DAPO's clip-higher when
    eps_clip_high > eps_clip; symmetric by default); returns (loss, fraction of tokens clipped)."""
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - eps_clip, 1 + (eps_clip if eps_clip_high is None else eps_clip_high)) * advantages
    loss = masked_mean(-torch.min(unclipped, clipped), mask)
    return loss, masked_mean((unclipped > clipped).float(), mask)


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of each position's next-token distribution, from its logits, in fp32: logsumexp(logits) minus
    sum(softmax(logits) * logits), as OpenRLHF's compute_entropy (untempered logits, as OpenRLHF's)."""
    logits = logits.float()
    return torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(dim=-1)


def entropy_bonus(loss: torch.Tensor, entropy: torch.Tensor, mask: torch.Tensor,
                  coef: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss - coef * mean entropy, mean entropy), the mean over the masked response tokens as the policy
    loss's (OpenRLHF's `entropy_loss` metric); coef 0 leaves the loss as it is: the entropy is only measured."""
    mean_entropy = masked_mean(entropy, mask)
    return (loss if coef == 0 else loss - coef * mean_entropy), mean_entropy


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               value_clip: float) -> torch.Tensor:
    clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)
    return 0.5 * masked_mean(torch.max((values - returns) ** 2, (clipped - returns) ** 2), mask)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log p(token_t | tokens_<t) for each position, from logits of the previous positions."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


class KLController:
    """Fixed coefficient, or the adaptive controller of Ziegler et al. when `target` is set. As OpenRLHF's
    AdaptiveKLController, `num_samples` is the number of samples of the step (OpenRLHF passes
    rollout_batch_size x n_samples_per_prompt); feed it the global batch's KL and count (`batch_kl`)."""

    def __init__(self, init_coef: float, target: float | None, horizon: int = 10000):
        self.coef, self.target, self.horizon = init_coef, target, horizon

    def update(self, observed_kl: float, num_samples: int) -> None:
        if self.target is None:
            return
        error = max(-0.2, min(0.2, observed_kl / self.target - 1))
        self.coef *= 1 + error * num_samples / self.horizon
