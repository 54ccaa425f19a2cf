"""The arithmetic of PPO and its critic-free variants, as pure tensor functions.

Shapes: [batch, response_len] per token, with `mask` marking real response tokens (1) and padding (0);
`scores` is one reward per sequence. Follows OpenRLHF's conventions:
- the KL penalty is folded into per-token rewards (`init_kl_coef`), except for group_norm (GRPO), which
  keeps it out of the reward and adds it to the loss, as the GRPO paper does;
- gae: advantages by GAE(gamma, lambda) over the critic's values, returns = advantages + values;
- reinforce (REINFORCE++): discounted returns of the shaped rewards, whitened over the batch;
- rloo: each sample's score minus the mean score of the other samples of its prompt;
- group_norm: score normalised by its prompt group's mean and std, broadcast to every token.
"""

from __future__ import annotations

import torch


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / mask.sum().clamp(min=1)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    return (values - mean) * torch.rsqrt(variance + eps) * mask


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled tokens (Schulman's k1, k2, k3)."""
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        return torch.exp(-log_ratio) - 1 + log_ratio
    raise ValueError(f"unknown KL estimator {estimator!r}")


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
    """Generalised advantage estimation; returns (advantages, returns)."""
    values = values * mask
    advantages = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0], dtype=rewards.dtype)
    for t in reversed(range(rewards.shape[1])):
        next_value = values[:, t + 1] if t + 1 < rewards.shape[1] else torch.zeros_like(running)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = delta + gamma * lambd * running * (mask[:, t + 1] if t + 1 < rewards.shape[1] else 0)
        advantages[:, t] = running
    advantages = advantages * mask
    return advantages, advantages + values


def rloo_scores(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """Leave-one-out baseline: each score minus the mean of the other samples of its prompt."""
    grouped = scores.view(-1, group_size)
    baseline = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
    return (grouped - baseline).flatten()


def group_norm_scores(scores: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    grouped = scores.view(-1, group_size)
    return ((grouped - grouped.mean(dim=1, keepdim=True)) / (grouped.std(dim=1, keepdim=True) + eps)).flatten()


def advantages_and_returns(estimator: str, scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor,
                           values: torch.Tensor | None, kl_coef: float, gamma: float, lambd: float,
                           group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token (advantages, returns) for one rollout batch; returns are the critic's targets (gae)."""
    if estimator == "gae":
        return gae(shaped_rewards(scores, kl, kl_coef, mask), values, mask, gamma, lambd)
    if estimator == "reinforce":
        returns = discounted_returns(shaped_rewards(scores, kl, kl_coef, mask), mask, gamma)
        return masked_whiten(returns, mask), returns
    if estimator == "rloo":
        returns = discounted_returns(shaped_rewards(rloo_scores(scores, group_size), kl, kl_coef, mask), mask, gamma)
        return returns, returns
    if estimator == "group_norm":
        advantages = group_norm_scores(scores, group_size)[:, None] * mask
        return advantages, advantages
    raise ValueError(f"unknown advantage estimator {estimator!r}")


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                eps_clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate; returns (loss, fraction of tokens clipped)."""
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - eps_clip, 1 + eps_clip) * advantages
    loss = masked_mean(-torch.min(unclipped, clipped), mask)
    return loss, masked_mean((unclipped > clipped).float(), mask)


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               value_clip: float) -> torch.Tensor:
    clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)
    return 0.5 * masked_mean(torch.max((values - returns) ** 2, (clipped - returns) ** 2), mask)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log p(token_t | tokens_<t) for each position, from logits of the previous positions."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


class KLController:
    """Fixed coefficient, or the adaptive controller of Ziegler et al. when `target` is set."""

    def __init__(self, init_coef: float, target: float | None, horizon: int = 10000):
        self.coef, self.target, self.horizon = init_coef, target, horizon

    def update(self, observed_kl: float, num_samples: int) -> None:
        if self.target is None:
            return
        error = max(-0.2, min(0.2, observed_kl / self.target - 1))
        self.coef *= 1 + error * num_samples / self.horizon
