"""PPO arithmetic against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_core import ppo_math


def test_kl_estimators():
    logp, ref = torch.tensor([[-1.0]]), torch.tensor([[-2.0]])
    assert ppo_math.kl_estimate(logp, ref, "k1").item() == pytest.approx(1.0)
    assert ppo_math.kl_estimate(logp, ref, "k2").item() == pytest.approx(0.5)
    assert ppo_math.kl_estimate(logp, ref, "k3").item() == pytest.approx(math.exp(-1) - 1 + 1)
    assert ppo_math.kl_estimate(ref, ref, "k3").item() == 0.0


def test_shaped_rewards_put_the_score_on_the_last_real_token():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    rewards = ppo_math.shaped_rewards(torch.tensor([1.0, 2.0]), torch.ones(2, 3), 0.1, mask)
    assert torch.allclose(rewards, torch.tensor([[-0.1, 0.9, 0.0], [-0.1, -0.1, 1.9]]))


def test_gae_with_lambda_one_and_zero_values_is_the_return():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    mask = torch.ones(1, 3)
    advantages, returns = ppo_math.gae(rewards, torch.zeros(1, 3), mask, gamma=1.0, lambd=1.0)
    assert torch.allclose(advantages, torch.tensor([[1.0, 1.0, 1.0]]))
    advantages, _ = ppo_math.gae(rewards, torch.tensor([[0.5, 0.5, 0.5]]), mask, gamma=1.0, lambd=0.0)
    assert torch.allclose(advantages, torch.tensor([[0.0, 0.0, 0.5]]))  # one-step TD errors


def test_discounted_returns_stop_at_padding():
    returns = ppo_math.discounted_returns(torch.tensor([[1.0, 1.0, 5.0]]), torch.tensor([[1.0, 1.0, 0.0]]), 0.5)
    assert torch.allclose(returns, torch.tensor([[1.5, 1.0, 0.0]]))


def test_group_baselines():
    scores = torch.tensor([1.0, 3.0, 0.0, 0.0])
    assert torch.allclose(ppo_math.rloo_scores(scores, 2), torch.tensor([-2.0, 2.0, 0.0, 0.0]))
    normalized = ppo_math.group_norm_scores(scores, 2)
    assert normalized[0] < 0 < normalized[1] and normalized[2] == normalized[3] == 0


@pytest.mark.parametrize("estimator", ["gae", "reinforce", "rloo", "group_norm"])
def test_every_estimator_rewards_the_better_sample(estimator):
    mask = torch.ones(4, 3)
    scores = torch.tensor([1.0, 0.0, 1.0, 0.0])
    advantages, returns = ppo_math.advantages_and_returns(
        estimator, scores, torch.zeros(4, 3), mask, torch.zeros(4, 3), 0.0, 1.0, 0.95, group_size=2)
    assert advantages.shape == returns.shape == (4, 3)
    assert advantages[0].sum() > advantages[1].sum()


def test_policy_loss_clips_the_ratio():
    mask = torch.ones(1, 1)
    loss, clipped = ppo_math.policy_loss(torch.tensor([[0.5]]), torch.tensor([[0.0]]), torch.tensor([[1.0]]), mask, 0.2)
    assert loss.item() == pytest.approx(-1.2) and clipped.item() == 1.0
    loss, clipped = ppo_math.policy_loss(torch.tensor([[0.1]]), torch.tensor([[0.0]]), torch.tensor([[1.0]]), mask, 0.2)
    assert loss.item() == pytest.approx(-math.exp(0.1)) and clipped.item() == 0.0


def test_value_loss_takes_the_worse_of_clipped_and_unclipped():
    loss = ppo_math.value_loss(torch.tensor([[2.0]]), torch.tensor([[0.0]]), torch.tensor([[2.0]]), torch.ones(1, 1), 0.5)
    assert loss.item() == pytest.approx(0.5 * (0.5 - 2.0) ** 2)


def test_adaptive_kl_controller_moves_towards_the_target():
    controller = ppo_math.KLController(0.1, target=1.0, horizon=10)
    controller.update(observed_kl=2.0, num_samples=10)
    assert controller.coef == pytest.approx(0.12)
    fixed = ppo_math.KLController(0.1, target=None)
    fixed.update(5.0, 10)
    assert fixed.coef == 0.1
