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


@pytest.mark.parametrize("estimator", ppo_math.ESTIMATORS)
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


def test_kl_estimates_are_clamped_like_openrlhf():
    assert ppo_math.kl_estimate(torch.tensor([[0.0]]), torch.tensor([[-20.0]]), "k1").item() == 10.0
    assert ppo_math.kl_estimate(torch.tensor([[-20.0]]), torch.tensor([[0.0]]), "k3").item() == 10.0


def advantages(estimator, scores, mask=None, kl=None, kl_coef=0.0, gamma=1.0, clip_range=None):
    mask = torch.ones(len(scores), 3) if mask is None else mask
    kl = torch.zeros_like(mask) if kl is None else kl
    return ppo_math.advantages_and_returns(estimator, torch.tensor(scores), kl, mask, None, kl_coef, gamma, 0.95,
                                           group_size=2, clip_range=clip_range)


def test_dr_grpo_is_the_score_minus_its_group_mean_on_every_token_without_std_or_discount():
    adv, returns = advantages("dr_grpo", [1.0, 0.0, 4.0, 2.0], gamma=0.5)  # gamma is forced to 1, as OpenRLHF
    assert torch.allclose(adv, torch.tensor([[0.5] * 3, [-0.5] * 3, [1.0] * 3, [-1.0] * 3]))
    assert torch.equal(adv, returns)


def test_group_norm_divides_by_the_group_std():
    adv, _ = advantages("group_norm", [1.0, 0.0, 4.0, 2.0])
    expected = 0.5 / math.sqrt(0.5)  # unbiased std of a pair (a, b) is |a - b| / sqrt(2)
    assert torch.allclose(adv[:, 0], torch.tensor([expected, -expected, expected, -expected]))


def test_reinforce_baseline_subtracts_the_group_mean_then_whitens_over_the_batch():
    adv, returns = advantages("reinforce_baseline", [1.0, 0.0, 4.0, 2.0])
    assert torch.allclose(returns[:, 0], torch.tensor([0.5, -0.5, 1.0, -1.0]))
    assert adv.mean().abs() < 1e-6 and adv.std(unbiased=False).sub(1).abs() < 1e-4
    assert adv[2, 0] > adv[0, 0] > 0 > adv[1, 0] > adv[3, 0]


def test_group_estimators_fold_the_kl_into_the_reward_unless_it_is_zeroed():
    kl = torch.ones(4, 3)
    with_kl, _ = advantages("group_norm", [1.0, 0.0, 1.0, 0.0], kl=kl, kl_coef=0.1)
    without, _ = advantages("group_norm", [1.0, 0.0, 1.0, 0.0])
    # each token's return carries the KL penalty of itself and every later token
    assert torch.allclose(with_kl - without, torch.tensor([[-0.3, -0.2, -0.1]] * 4))


def test_rewards_are_clipped_after_the_group_baseline():
    _, returns = advantages("reinforce", [5.0, -5.0, 0.5, 0.0], clip_range=(-1.0, 1.0))
    assert torch.allclose(returns[:, 0], torch.tensor([1.0, -1.0, 0.5, 0.0]))
    _, returns = advantages("dr_grpo", [10.0, 0.0, 0.0, 0.0], clip_range=(-2.0, 2.0))  # +-5 around the mean of 5
    assert torch.allclose(returns[:, 0], torch.tensor([2.0, -2.0, 0.0, 0.0]))


def test_dynamic_filtering_keeps_groups_whose_mean_score_is_strictly_inside_the_range():
    keep = ppo_math.group_filter(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0]), 2, 0.0, 1.0)
    assert keep.tolist() == [0.0, 0.0, 1.0, 1.0, 0.0, 0.0]


def test_filtered_rows_get_no_advantage_and_stay_out_of_the_whitening():
    mask = torch.tensor([[1.0] * 3, [1.0] * 3, [0.0] * 3, [0.0] * 3])
    adv, _ = advantages("reinforce", [1.0, 0.0, 100.0, -100.0], mask=mask)
    assert torch.equal(adv[2:], torch.zeros(2, 3))
    assert torch.allclose(adv[0], torch.ones(3), atol=1e-4) and torch.allclose(adv[1], -torch.ones(3), atol=1e-4)


def test_clip_higher_clips_the_ratio_asymmetrically():
    """--eps_clip_low_high 0.2 0.28 (DAPO): a ratio of 1.25 with a positive advantage is inside [0.8, 1.28]."""
    mask = torch.ones(1, 1)
    old, advantage = torch.zeros(1, 1), torch.ones(1, 1)
    new = torch.full((1, 1), math.log(1.25))
    symmetric, clipped_symmetric = ppo_math.policy_loss(new, old, advantage, mask, 0.2)
    higher, clipped_higher = ppo_math.policy_loss(new, old, advantage, mask, 0.2, 0.28)
    assert symmetric.item() == pytest.approx(-1.2) and clipped_symmetric.item() == 1.0
    assert higher.item() == pytest.approx(-1.25) and clipped_higher.item() == 0.0
    low, _ = ppo_math.policy_loss(torch.full((1, 1), math.log(0.5)), old, -advantage, mask, 0.2, 0.28)
    assert low.item() == pytest.approx(0.8)  # a negative advantage is clipped at 1 - low
