"""PPO's experience: one rank's rollout batch, sampled and scored (`Experience`), and the rows it is built from."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from rlhf_core.rank.agent_rollout import Episode
from rlhf_core.rewards import RewardBatch


@dataclass(frozen=True)
class Experience:
    """One rank's rollout batch: a row per sample (`n` of them). Per-token tensors are `[n, T]`, a row's response
    positions left-aligned and zero-padded to the longest response `T`; all on the CPU in float32, whatever device
    and precision the models use. Built by `PPOTrainer.make_experience`; `with_advantages` adds the update's."""

    prompts: list[list[int]]
    """Each sample's prompt token ids (with --agent_func_path, the episode's first prompt)."""
    responses: list[list[int]]
    """Each sample's response token ids (with --agent_func_path, the actions and the environment's feedback)."""
    rewards: torch.Tensor
    """`[n]`: each sample's reward (reward model, reward function or environment), before KL and clipping."""
    mask: torch.Tensor
    """`[n, T]`: 1 on the response tokens the policy chose (every token, or the agent's actions), 0 elsewhere."""
    keep: torch.Tensor
    """`[n]`: 1 for a sample in the update, 0 for one --dynamic_filtering drops."""
    kl: torch.Tensor
    """`[n, T]`: per-token KL estimate to the reference, masked (0 without a reference model)."""
    extra_logs: dict[str, list[float]]
    """The reward function's or agent's extra logs, a list of per-sample values by name."""
    old_logprobs: torch.Tensor | None = None
    """`[n, T]`: the actor's log-probs at sampling time; None when the update's own stand in (see `PPOTrainer`)."""
    ref_logprobs: torch.Tensor | None = None
    """`[n, T]`: the reference model's log-probs; None without one (--init_kl_coef 0)."""
    values: torch.Tensor | None = None
    """`[n, T]`: the critic's values; None without a critic (every estimator but gae)."""
    advantages: torch.Tensor | None = None
    """`[n, T]`: the estimator's advantages (set by `with_advantages`)."""
    returns: torch.Tensor | None = None
    """`[n, T]`: the critic's targets (gae; set by `with_advantages`)."""
    loss_mask: torch.Tensor | None = None
    """`[n, T]`: `mask` without the dropped samples, the tokens the losses average over (set by `with_advantages`)."""

    def with_advantages(self, advantages: torch.Tensor, returns: torch.Tensor,
                        loss_mask: torch.Tensor) -> Experience:
        """This experience with the update's tensors."""
        return replace(self, advantages=advantages, returns=returns, loss_mask=loss_mask)

    def update_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(advantages, returns, loss_mask), which `with_advantages` set: what every update reads."""
        if self.advantages is None or self.returns is None or self.loss_mask is None:
            raise ValueError("this experience has no advantages yet (with_advantages)")
        return self.advantages, self.returns, self.loss_mask


def pad_rows(rows: list[torch.Tensor]) -> torch.Tensor:
    """Rows of different lengths as one zero-padded `[n, T]` tensor (`[0, 0]` for no rows)."""
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True) if rows else torch.zeros(0, 0)


def episode_rewards(episodes: list[Episode]) -> RewardBatch:
    """The agent's rewards and scores, and its extra_logs as per-sample lists (a key an episode lacks is left out
    of that key's mean)."""
    logs: dict[str, list[float]] = {}
    for episode in episodes:
        for key, value in episode.extra_logs.items():
            logs.setdefault(key, []).append(value)
    return RewardBatch([e.reward for e in episodes], [e.score for e in episodes], logs)
