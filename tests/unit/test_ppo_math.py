"""PPO arithmetic against hand-computed values."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from rlhf_core.rank import ppo_math


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
    settings = ppo_math.AdvantageSettings(estimator, kl_coef=0.0, gamma=1.0, lambd=0.95, group_size=2)
    advantages, returns = ppo_math.advantages_and_returns(settings, scores, torch.zeros(4, 3), mask, torch.zeros(4, 3))
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
    settings = ppo_math.AdvantageSettings(estimator, kl_coef, gamma, 0.95, group_size=2, clip_range=clip_range)
    return ppo_math.advantages_and_returns(settings, torch.tensor(scores), kl, mask, None)


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


class SimulatedRanks:
    """Ranks as threads of one process: `reduce(rank)` is an all-reduce over them (each rank's tensor summed
    in rank order, the same result on every rank), so ppo_math's global statistics run without
    torch.distributed."""

    def __init__(self, num_ranks: int):
        self.barrier = threading.Barrier(num_ranks, timeout=30)
        self.slots: list[torch.Tensor | None] = [None] * num_ranks

    def reduce(self, rank: int):
        def all_reduce(totals: torch.Tensor) -> torch.Tensor:
            assert totals.dtype == torch.float64
            self.slots[rank] = totals.clone()
            self.barrier.wait()
            total = sum(self.slots[1:], self.slots[0].clone())
            self.barrier.wait()  # nobody overwrites a slot before every rank has summed
            return total

        return all_reduce

    def run(self, function, shards: list[tuple]) -> list:
        """function(*shard, reduce) on every rank at once; the ranks' results in rank order."""
        results: list = [None] * len(shards)
        errors: list[BaseException] = []

        def rank_main(rank: int) -> None:
            try:
                results[rank] = function(*shards[rank], self.reduce(rank))
            except Exception as error:  # noqa: BLE001 (re-raised below, not lost in the thread)
                errors.append(error)
                self.barrier.abort()

        threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(len(shards))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        return results


def rollout_batch(num_rows: int = 16, width: int = 7, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns-like values with an offset far from zero (where a one-pass variance would cancel) and
    right-padded rows of different lengths, two of them empty (filtered)."""
    rows = torch.Generator().manual_seed(seed)
    values = 1000.0 + torch.randn(num_rows, width, generator=rows)
    lengths = torch.randint(1, width + 1, (num_rows,), generator=rows)
    lengths[[3, 12]] = 0
    mask = (torch.arange(width) < lengths[:, None]).float()
    return values, mask


def whiten_shards(values: torch.Tensor, mask: torch.Tensor, num_ranks: int) -> torch.Tensor:
    shards = list(zip(values.chunk(num_ranks), mask.chunk(num_ranks)))
    parts = SimulatedRanks(num_ranks).run(lambda v, m, reduce: ppo_math.masked_whiten(v, m, reduce=reduce), shards)
    return torch.cat(parts)


def test_whitening_over_ranks_equals_whitening_of_the_whole_batch():
    values, mask = rollout_batch()
    whole = ppo_math.masked_whiten(values, mask)
    kept = mask.bool()
    assert whole[kept].double().mean().abs() < 1e-6 and (whole[kept].double().std(unbiased=False) - 1).abs() < 1e-5
    assert torch.equal(whole[~kept], torch.zeros_like(whole[~kept]))
    for num_ranks in (2, 4):
        # float64 statistics, summed in another order: equal up to one float32 rounding of the result
        difference = (whiten_shards(values, mask, num_ranks) - whole).abs().max().item()
        assert difference <= 1e-6, (num_ranks, difference)
    rank_local = torch.cat([ppo_math.masked_whiten(v, m) for v, m in zip(values.chunk(2), mask.chunk(2))])
    assert (rank_local - whole).abs().max() > 1e-2  # what per-rank statistics gave: a different batch


def test_a_rank_with_nothing_left_after_filtering_still_joins_the_whitening():
    values, mask = rollout_batch()
    mask[:8] = 0  # rank 0's samples all filtered out
    whole = ppo_math.masked_whiten(values, mask)
    assert torch.allclose(whiten_shards(values, mask, 2), whole, atol=1e-6, rtol=0)
    assert torch.equal(whiten_shards(values, torch.zeros_like(mask), 2), torch.zeros_like(values))


@pytest.mark.parametrize("estimator", ppo_math.ESTIMATORS)
def test_every_estimator_gives_each_rank_its_share_of_the_whole_batch_advantages(estimator):
    """World-size independence of the advantage math, given the same samples: ranks holding whole prompt
    groups (as the trainer's shares do) get the rows one process computes for the whole batch."""
    values, mask = rollout_batch()
    scores = values[:, 0] - 1000.0
    kl = 0.01 * values.sub(1000.0).abs() * mask
    critic_values = 0.1 * (values - 1000.0)

    def estimate(scores, kl, mask, critic_values, reduce=None):
        settings = ppo_math.AdvantageSettings(estimator, kl_coef=0.05, gamma=0.9, lambd=0.95, group_size=2)
        return ppo_math.advantages_and_returns(settings, scores, kl, mask, critic_values, reduce=reduce)[0]

    whole = estimate(scores, kl, mask, critic_values)
    shards = list(zip(scores.chunk(2), kl.chunk(2), mask.chunk(2), critic_values.chunk(2)))  # whole groups of 2
    assert torch.allclose(torch.cat(SimulatedRanks(2).run(estimate, shards)), whole, atol=1e-6, rtol=0)


def test_the_kl_controller_is_fed_the_global_batch_so_every_rank_holds_one_coefficient():
    values, mask = rollout_batch()
    kl = (values - 1000.0).abs() * mask
    kl[8:] *= 3  # rank 1's samples drift further: per-rank KLs differ
    whole_kl, whole_count = ppo_math.batch_kl(kl, mask)
    assert whole_kl == pytest.approx(((kl * mask).sum() / mask.sum()).item()) and whole_count == 16
    observed = SimulatedRanks(2).run(ppo_math.batch_kl, list(zip(kl.chunk(2), mask.chunk(2))))
    assert observed[0] == observed[1]  # bit-identical on both ranks
    assert observed[0][0] == pytest.approx(whole_kl, rel=1e-12) and observed[0][1] == 16
    rank_local = [ppo_math.batch_kl(k, m)[0] for k, m in zip(kl.chunk(2), mask.chunk(2))]
    assert abs(rank_local[0] - rank_local[1]) > 0.1
    controllers = [ppo_math.KLController(0.05, target=whole_kl / 2, horizon=100) for _ in range(2)]
    for controller, (kl_value, num_samples) in zip(controllers, observed):
        controller.update(kl_value, num_samples)
    # twice the target: error clipped at +0.2, times 16 samples over a horizon of 100
    assert controllers[0].coef == controllers[1].coef == pytest.approx(0.05 * (1 + 0.2 * 16 / 100))


def test_token_entropy_is_minus_sum_p_log_p_of_each_position():
    logits = torch.tensor([[[0.0, 0.0], [2.0, -1.0]], [[5.0, 1.0], [0.5, 0.25]]])
    probabilities = torch.softmax(logits, dim=-1)
    direct = -(probabilities * probabilities.log()).sum(-1)
    assert torch.allclose(ppo_math.token_entropy(logits), direct, atol=1e-6)
    assert ppo_math.token_entropy(logits)[0, 0].item() == pytest.approx(math.log(2))  # uniform over two tokens
    assert ppo_math.token_entropy(logits.to(torch.bfloat16)).dtype == torch.float32


def test_entropy_bonus_subtracts_coef_times_the_mean_response_token_entropy():
    entropy = torch.tensor([[1.0, 2.0, 9.0], [3.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])  # padding's entropy must not count
    loss = torch.tensor(0.5)
    bonused, mean_entropy = ppo_math.entropy_bonus(loss, entropy, mask, 0.01)
    assert mean_entropy.item() == pytest.approx(2.0)  # (1 + 2 + 3) / 3 tokens
    assert bonused.item() == pytest.approx(0.5 - 0.01 * 2.0)
    measured, mean_entropy = ppo_math.entropy_bonus(loss, entropy, mask, 0.0)
    assert measured is loss and mean_entropy.item() == pytest.approx(2.0)  # 0: logged, the loss untouched


def test_the_entropy_bonus_gradient_raises_the_entropy():
    logits = torch.tensor([[[2.0, 0.0, -1.0]]], requires_grad=True)
    mask = torch.ones(1, 1)
    loss, _ = ppo_math.entropy_bonus(torch.tensor(0.0), ppo_math.token_entropy(logits), mask, 0.1)
    loss.backward()
    probabilities = torch.softmax(logits.detach(), dim=-1)
    log_probabilities = probabilities.log()
    entropy = -(probabilities * log_probabilities).sum()
    # d(-0.1 * H)/d logit_i = 0.1 * p_i * (log p_i + H), by hand
    assert torch.allclose(logits.grad, 0.1 * probabilities * (log_probabilities + entropy), atol=1e-6)
    stepped = logits.detach() - logits.grad  # one gradient-descent step on the loss: the entropy goes up
    assert ppo_math.token_entropy(stepped).item() > entropy.item()


class GradientRecordingEngine:
    """What PPO's update uses of a DeepSpeed engine, around a plain module; `step` keeps each step's gradients."""

    device = torch.device("cpu")

    def __init__(self, module: torch.nn.Module):
        self.module, self.gradients = module, []

    def __call__(self, **batch):
        return self.module(**batch)

    def train(self):
        self.module.train()

    def backward(self, loss):
        loss.backward()

    def step(self):
        self.gradients.append([param.grad.clone() for param in self.module.parameters()])
        self.module.zero_grad()


def ppo_update_with_entropy_coef(coef):
    """One actor update of a bare PPOTrainer (no DeepSpeed, no torch.distributed) on two fixed samples:
    (its losses, the gradients it stepped with, the module)."""
    from rlhf_core.config import RunConfig
    from rlhf_core.stages.ppo import PPOConfig
    from rlhf_core.models.precision import Precision
    from rlhf_core.toy import build_model, build_tokenizer
    from rlhf_core.rank.experience import Experience
    from rlhf_core.rank.trainers.ppo import PPOTrainer

    run = RunConfig(stages=["ppo"], ppo=PPOConfig(pretrain="m", reward_pretrain="rm", prompt_data="p.jsonl",
                                                  rollout_batch_size=2,
                                                  train_batch_size=2, micro_train_batch_size=2,
                                                  advantage_estimator="reinforce", entropy_loss_coef=coef))
    trainer = PPOTrainer.__new__(PPOTrainer)
    trainer.run, trainer.cfg, trainer.rank, trainer.world_size, trainer.step = run, run.ppo, 0, 1, 0
    trainer.precision, trainer.tokenizer = Precision(), build_tokenizer()
    trainer.actor = GradientRecordingEngine(build_model(len(trainer.tokenizer), seed=0))
    trainer.reference, trainer.critic, trainer.scores_old_logprobs = None, None, False
    responses = [[5, 6, 7, 2], [8, 9]]
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    experience = Experience([[1, 4, 5], [1, 6]], responses, rewards=torch.tensor([1.0, -1.0]), mask=mask,
                            keep=torch.ones(2), kl=torch.zeros_like(mask), extra_logs={}).with_advantages(
        torch.tensor([[1.0, 1.0, 1.0, 1.0], [-1.0, -1.0, 0.0, 0.0]]), returns=torch.zeros_like(mask), loss_mask=mask)
    losses = trainer.update(experience)
    return losses, trainer.actor.gradients, trainer.actor.module


def test_entropy_loss_coef_0_logs_the_entropy_and_trains_as_without_it_and_above_0_adds_the_bonus():
    from rlhf_core.rank.rollout import collate_sequences

    plain, plain_gradients, _ = ppo_update_with_entropy_coef(None)
    logged, logged_gradients, module = ppo_update_with_entropy_coef(0.0)
    bonus, bonus_gradients, _ = ppo_update_with_entropy_coef(0.5)
    assert "entropy_loss" not in plain and set(logged) == set(bonus) == set(plain) | {"entropy_loss"}
    assert logged["policy_loss"] == plain["policy_loss"] == bonus["policy_loss"]  # the surrogate, before the bonus
    assert all(torch.equal(a, b) for a, b in zip(plain_gradients[0], logged_gradients[0]))
    assert any(not torch.allclose(a, b) for a, b in zip(plain_gradients[0], bonus_gradients[0]))

    # OpenRLHF's entropy_loss by hand: -sum p log p of each response position, averaged over the response tokens.
    batch = collate_sequences([[1, 4, 5], [1, 6]], [[5, 6, 7, 2], [8, 9]], 0)
    with torch.no_grad():
        logits = module(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                        position_ids=batch["position_ids"]).logits[:, batch["prompt_len"] - 1 : -1]
    probabilities = torch.softmax(logits, dim=-1)
    entropy = -(probabilities * probabilities.log()).sum(-1)
    by_hand = ((entropy * batch["action_mask"]).sum() / batch["action_mask"].sum()).item()
    assert logged["entropy_loss"] == [pytest.approx(by_hand, rel=1e-5)] == bonus["entropy_loss"]
