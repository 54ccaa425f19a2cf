"""The process reward model's loss is read at the placeholder tokens and nowhere else, as OpenRLHF's PRMLoss;
step labels land on the placeholders in order; a PRM is not taken for PPO's reward model."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from rlhf_core.config import RunConfig
from rlhf_core.data.records import Record
from rlhf_core.data.samples import IGNORE_INDEX
from rlhf_core.data.step_labels import tokenize_step_labels
from rlhf_core.rank.trainers.prm import prm_loss
from rlhf_core.stages.prm import PRMConfig
from rlhf_core.toy import build_tokenizer

PLACEHOLDER, GOOD, BAD = "user", "1", "0"  # tokens of the toy vocabulary


def test_only_the_placeholder_positions_carry_loss():
    tokenizer = build_tokenizer()
    placeholder, good, bad = (tokenizer.convert_tokens_to_ids(token) for token in (PLACEHOLDER, GOOD, BAD))
    input_ids = torch.tensor([[4, 9, placeholder, 10, placeholder, 11, 2]])
    labels = torch.full(input_ids.shape, float(IGNORE_INDEX))
    labels[0, 2], labels[0, 4] = good, bad
    torch.manual_seed(0)
    logits = torch.randn(1, 7, len(tokenizer), requires_grad=True)
    loss, accuracy = prm_loss(input_ids, logits, labels, placeholder, [good, bad])
    loss.backward()
    touched = sorted(set(logits.grad.nonzero()[:, 1].tolist()))
    assert touched == [2, 4]  # the two placeholders' own logits, nothing else
    assert set(logits.grad[0, 2].nonzero().flatten().tolist()) == {good, bad}  # over the reward tokens only
    expected = (torch.nn.functional.cross_entropy(logits[0, 2, [good, bad]][None], torch.tensor([0]))
                + torch.nn.functional.cross_entropy(logits[0, 4, [good, bad]][None], torch.tensor([1]))) / 2
    assert loss.item() == pytest.approx(expected.item(), abs=1e-6) and 0 <= accuracy.item() <= 1


def test_soft_labels_are_the_first_reward_tokens_probability():
    input_ids, logits = torch.tensor([[7, 7]]), torch.zeros(1, 2, 5)
    logits[0, :, 3] = 2.0
    labels = torch.tensor([[0.75, 0.25]])
    loss, _ = prm_loss(input_ids, logits, labels, 7, [3, 4], soft=True)
    log_p = torch.log_softmax(torch.tensor([2.0, 0.0]), -1)
    expected = -((0.75 * log_p[0] + 0.25 * log_p[1]) + (0.25 * log_p[0] + 0.75 * log_p[1])) / 2
    assert loss.item() == pytest.approx(expected.item(), abs=1e-6)


def test_step_labels_land_on_the_placeholders_in_order_and_truncation_drops_the_rest():
    tokenizer = build_tokenizer()
    cfg = PRMConfig(pretrain="m", dataset="d", input_key="input", label_key="value", placeholder_token=PLACEHOLDER,
                    reward_tokens=[GOOD, BAD], max_len=9, train_batch_size=1, micro_train_batch_size=1)
    record = Record(1, {"input": "sort : 3 1 = 1 user 3 user", "value": [GOOD, BAD]})
    [sample] = tokenize_step_labels("d.jsonl", [record], tokenizer, cfg)
    tokens = tokenizer.convert_ids_to_tokens(sample.input_ids)
    labelled = {tokens[i] + f"@{i}": tokenizer.convert_ids_to_tokens(int(v)) for i, v in enumerate(sample.labels)
                if v != IGNORE_INDEX}
    assert labelled == {"user@6": GOOD, "user@8": BAD}  # sort : 3 1 = 1 user 3 user
    short = tokenize_step_labels("d.jsonl", [record], tokenizer, cfg.model_copy(update={"max_len": 8}))[0]
    assert [tokenizer.convert_ids_to_tokens(int(v)) for v in short.labels if v != IGNORE_INDEX] == [GOOD]


def test_a_label_outside_the_reward_tokens_names_the_row():
    cfg = PRMConfig(pretrain="m", dataset="d", placeholder_token=PLACEHOLDER, reward_tokens=[GOOD, BAD],
                    label_key="value", train_batch_size=1, micro_train_batch_size=1)
    with pytest.raises(Exception, match=r"d.jsonl line 3: step label '7' is not one of --reward_tokens 1 0"):
        tokenize_step_labels("d.jsonl", [Record(3, {"input": "1 user", "value": ["7"]})], build_tokenizer(), cfg)


def test_a_prm_is_refused_as_ppos_reward_model_in_one_sentence():
    sft = {"pretrain": "m", "dataset": "d", "train_batch_size": 8, "micro_train_batch_size": 4, "save_path": "/o/sft"}
    prm = {"dataset": "steps.jsonl", "placeholder_token": "ки", "reward_tokens": ["+", "-"], "save_path": "/o/prm",
           "train_batch_size": 8, "micro_train_batch_size": 4}
    ppo = {"prompt_data": "p.jsonl", "reward_pretrain": "/o/prm", "advantage_estimator": "reinforce",
           "rollout_batch_size": 8, "train_batch_size": 8, "micro_train_batch_size": 4}
    with pytest.raises(ValidationError, match="ppo.reward_pretrain is the output of prm, a process reward model"):
        RunConfig(stages=["sft", "prm", "ppo"], sft=sft, prm=prm, ppo=ppo)
    run = RunConfig(stages=["sft", "prm"], sft=sft, prm=prm)
    assert run.prm.pretrain == "/o/sft"


def test_a_setting_the_prm_would_ignore_is_refused():
    with pytest.raises(ValidationError, match="input_template is not used by prm"):
        PRMConfig(pretrain="m", dataset="d", placeholder_token=PLACEHOLDER, input_template="Q: {}",
                  train_batch_size=1, micro_train_batch_size=1)
