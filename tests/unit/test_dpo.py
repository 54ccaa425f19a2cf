"""DPO's loss against the papers' formulas on fixed log-probabilities, and the response mask of its
log-probabilities (tokens after the prompt's own count, padded or packed alike)."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_core.rank.packing import pack_sft
from rlhf_core.data.samples import TokenizedPair, collate_sft
from rlhf_core.rank.trainers.dpo import PreferenceObjective, dpo_loss, response_logps, response_samples
from rlhf_core.data.pairs import Pair

POLICY_C, POLICY_R = [-12.5, -30.0, -7.25, -3.0], [-14.0, -29.0, -9.5, -3.0]
REF_C, REF_R = [-13.0, -28.5, -8.0, -2.5], [-13.5, -29.5, -8.75, -3.5]


def reference_formula(beta: float, label_smoothing: float, ipo: bool) -> float:
    """Eq. 7 of Rafailov et al. (2023) with Mitchell's conservative smoothing, or eq. 17 of Azar et al. (2023),
    written out per pair in float64."""
    losses = []
    for pc, pr, rc, rr in zip(POLICY_C, POLICY_R, REF_C, REF_R):
        h = (pc - rc) - (pr - rr)
        if ipo:
            losses.append((h - 1 / (2 * beta)) ** 2)
        else:
            log_sigmoid = lambda x: -math.log1p(math.exp(-x))  # noqa: E731
            losses.append(-(1 - label_smoothing) * log_sigmoid(beta * h) - label_smoothing * log_sigmoid(-beta * h))
    return sum(losses) / len(losses)


@pytest.mark.parametrize("beta,label_smoothing,ipo", [(0.1, 0.0, False), (0.5, 0.2, False), (0.1, 0.0, True),
                                                      (2.0, 0.0, True)])
def test_the_loss_is_the_papers_formula(beta, label_smoothing, ipo):
    tensors = [torch.tensor(values, dtype=torch.float64) for values in (POLICY_C, POLICY_R, REF_C, REF_R)]
    loss, chosen, rejected = dpo_loss(*tensors, PreferenceObjective(beta, label_smoothing, ipo))
    assert loss.item() == pytest.approx(reference_formula(beta, label_smoothing, ipo), abs=1e-6)
    assert chosen.tolist() == pytest.approx([beta * (pc - rc) for pc, rc in zip(POLICY_C, REF_C)], abs=1e-9)
    assert rejected.tolist() == pytest.approx([beta * (pr - rr) for pr, rr in zip(POLICY_R, REF_R)], abs=1e-9)


def test_the_loss_pulls_the_chosen_up_and_the_rejected_down():
    policy_c = torch.tensor(POLICY_C, requires_grad=True)
    policy_r = torch.tensor(POLICY_R, requires_grad=True)
    loss, _, _ = dpo_loss(policy_c, policy_r, torch.tensor(REF_C), torch.tensor(REF_R), PreferenceObjective(beta=0.1))
    loss.backward()
    assert (policy_c.grad < 0).all() and (policy_r.grad > 0).all()


def pairs() -> list[Pair]:
    return [Pair(TokenizedPair([1, 5, 6, 7, 2], [1, 5, 8, 2], prompt_len=2), 0.0),
            Pair(TokenizedPair([1, 9, 9, 4, 4, 4, 2], [1, 9, 9, 3, 2], prompt_len=3), 0.0)]


def test_only_the_response_tokens_count_padded_or_packed():
    samples = [sample for pair in pairs() for sample in response_samples(pair)]
    vocab = 12
    torch.manual_seed(0)
    logits_of = {id(sample): torch.randn(len(sample.input_ids), vocab) for sample in samples}

    def expected(sample):
        logprobs = torch.log_softmax(logits_of[id(sample)], -1)
        return sum(logprobs[t - 1, sample.input_ids[t]].item() for t in range(len(sample.input_ids))
                   if sample.loss_mask[t]), sum(sample.loss_mask)

    padded = collate_sft(samples, pad_token_id=0)
    logits = torch.zeros(len(samples), padded["input_ids"].shape[1], vocab)
    for row, sample in enumerate(samples):
        logits[row, : len(sample.input_ids)] = logits_of[id(sample)]
    sums, counts = response_logps(logits, padded["labels"])
    packed = pack_sft(samples)
    packed_sums, packed_counts = response_logps(torch.cat([logits_of[id(s)] for s in samples]).unsqueeze(0),
                                                packed["labels"], [len(s.input_ids) for s in samples])
    for row, sample in enumerate(samples):
        total, num_targets = expected(sample)
        assert num_targets == len(sample.input_ids) - (2 if row < 2 else 3)  # the response and its EOS
        assert sums[row].item() == pytest.approx(total, abs=1e-5) and counts[row].item() == num_targets
        assert packed_sums[row].item() == pytest.approx(total, abs=1e-5) and packed_counts[row].item() == num_targets
