"""Preference pairs and PPO prompts are prepared once too (issue 33): the items are today's per-row functions'
(`tokenize_pairs` and margins, `tokenize_prompts` and labels), the held-out split and the trainable filter are
today's without building an item per row, and a second load does not read the raw file."""

from __future__ import annotations

import json
import os

import pytest
import torch

from rlhf_core.config import RunConfig
from rlhf_core.data import records, stream
from rlhf_core.data.determinism import generator
from rlhf_core.data.pairs import load_pairs, pair_margin, trainable_pairs
from rlhf_core.data.prompts import load_prompts, record_label
from rlhf_core.data.stream import read_records
from rlhf_core.data.samples import PairKeys, Renderer, tokenize_pairs, tokenize_prompts
from rlhf_core.stages.rm import RMConfig
from rlhf_core.stages.ppo import PPOConfig
from rlhf_core.storage.locate import load_tokenizer
from tests.unit.test_prepared_data import preparations, write_rows

PAIRS = [{"prompt": f"sort :{' 1' * (a % 3)} {a} {b} =", "chosen": f"{min(a, b)} {max(a, b)}", "rejected": f"{a} {b}",
          "margin": a / 7} for a in range(10) for b in range(5)]
CHAT_PROMPTS = [{"messages": [{"role": "user", "content": f"sort : {a} 2 ="}], "answer": [min(a, 2), max(a, 2)]}
                for a in range(12)]


def no_raw_reads(monkeypatch):
    def refuse(*args, **kwargs):
        pytest.fail("the raw file was read again")
    monkeypatch.setattr(records, "open_data", refuse)
    monkeypatch.setattr(stream, "open_data", refuse)


def todays_split(items: list, fraction: float, seed: int) -> tuple[list, list]:
    """The held-out split as it was written before prepared pairs: lists, a set of drawn indices."""
    held_out = set(torch.randperm(len(items), generator=generator(seed, "holdout")).tolist()[:int(len(items) * fraction)])
    return ([item for i, item in enumerate(items) if i not in held_out],
            [item for i, item in enumerate(items) if i in held_out])


def test_pairs_are_todays_pairs_split_and_filtered_as_today(toy_assets, tmp_path, monkeypatch):
    data = write_rows(tmp_path / "pairs.jsonl", PAIRS)
    cfg = RMConfig(pretrain=toy_assets["model"], dataset=data, prompt_key="prompt", max_len=9, eval_holdout=0.2,
                   margin_loss=True)
    run = RunConfig(stages=["rm"], ckpt_path=str(tmp_path / "ckpt"), rm=cfg)
    tokenizer = load_tokenizer(toy_assets["model"])
    train, held_out = load_pairs(cfg, run, tokenizer)
    rows = read_records(data)
    tokens = tokenize_pairs(Renderer(tokenizer, data, False), rows, PairKeys("prompt", "chosen", "rejected"), 9)
    todays = [(pair, pair_margin(data, row, True)) for pair, row in zip(tokens, rows)]
    expected_train, expected_held_out = todays_split(todays, 0.2, run.seed)
    assert [(pair.tokens, pair.margin) for pair in train] == expected_train
    assert [(pair.tokens, pair.margin) for pair in held_out] == expected_held_out
    kept = trainable_pairs(train, 9, "--dataset")
    assert [(pair.tokens, pair.margin) for pair in kept] == [item for item in expected_train
                                                             if item[0].prompt_len < 9 - 2]
    assert 0 < len(kept) < len(train)  # the filter is exercised both ways
    no_raw_reads(monkeypatch)
    again, _ = load_pairs(cfg, run, load_tokenizer(toy_assets["model"]))
    assert [pair.tokens for pair in again] == [pair.tokens for pair in train]


def test_prompts_are_todays_prompts_with_their_labels(toy_assets, tmp_path, monkeypatch):
    data = write_rows(tmp_path / "prompts.jsonl", CHAT_PROMPTS)
    cfg = PPOConfig(pretrain=toy_assets["model"], prompt_data=data, input_key="messages", label_key="answer",
                    apply_chat_template=True, prompt_max_len=6, rollout_batch_size=4, train_batch_size=4,
                    micro_train_batch_size=4, advantage_estimator="reinforce", reward_pretrain=toy_assets["model"],
                    save_path=str(tmp_path / "out"))
    run = RunConfig(stages=["ppo"], ckpt_path=str(tmp_path / "ckpt"), ppo=cfg)
    tokenizer = load_tokenizer(toy_assets["model"])
    prepared = load_prompts(run, tokenizer)
    rows = read_records(data)
    todays = tokenize_prompts(Renderer(tokenizer, data, True), rows, "messages", 6)
    assert [(item.text, item.ids, item.label, item.bos_added) for item in prepared] == \
        [(prompt.value, prompt.ids, record_label(data, row, "answer"), prompt.bos_added)
         for prompt, row in zip(todays, rows)]
    assert prepared[3].text == CHAT_PROMPTS[3]["messages"] and prepared[3].label == [2, 3]
    no_raw_reads(monkeypatch)
    assert [item.ids for item in load_prompts(run, load_tokenizer(toy_assets["model"]))] == \
        [item.ids for item in prepared]


def test_a_changed_label_key_prepares_the_prompts_again(toy_assets, tmp_path):
    rows = [{**row, "other": json.dumps(row["answer"])} for row in CHAT_PROMPTS]
    data = write_rows(tmp_path / "prompts.jsonl", rows)
    labels = []
    for label_key in ("answer", "other"):
        cfg = PPOConfig(pretrain=toy_assets["model"], prompt_data=data, input_key="messages", label_key=label_key,
                        apply_chat_template=True, rollout_batch_size=4, train_batch_size=4,
                        micro_train_batch_size=4, advantage_estimator="reinforce",
                        reward_pretrain=toy_assets["model"], save_path=str(tmp_path / "out"))
        run = RunConfig(stages=["ppo"], ckpt_path=str(tmp_path / "ckpt"), ppo=cfg)
        labels.append(load_prompts(run, load_tokenizer(toy_assets["model"]))[0].label)
    assert labels == [[0, 2], "[0, 2]"] and len(preparations(tmp_path)) == 2


@pytest.mark.parametrize("in_workers", [False, True])
def test_step_labels_of_two_kinds_across_batches_name_the_row(toy_assets, tmp_path, monkeypatch, in_workers):
    """PRM's rule that a dataset's labels are all reward tokens or all numbers holds across batches (10,000 rows:
    two), with today's sentence naming the first row of the other kind."""
    from rlhf_core.data import workers
    from rlhf_core.data.step_labels import load_step_labelled, tokenize_step_labels
    from rlhf_core.errors import UserError
    from rlhf_core.stages.prm import PRMConfig
    from rlhf_core.toy import STEP_BAD, STEP_GOOD, STEP_PLACEHOLDER, step_labelled_rows

    rows = step_labelled_rows(10_000, seed=0)
    rows[8_192:] = [{**row, "value": [1.0] * len(row["value"])} for row in rows[8_192:]]  # the second batch: soft
    data = write_rows(tmp_path / "steps.jsonl", rows)
    cfg = PRMConfig(pretrain=toy_assets["model"], dataset=data, input_key="input", label_key="value",
                    placeholder_token=STEP_PLACEHOLDER, reward_tokens=[STEP_GOOD, STEP_BAD])
    run = RunConfig(stages=["prm"], ckpt_path=str(tmp_path / "ckpt"), prm=cfg)
    if in_workers:
        monkeypatch.setattr(workers, "IN_PROCESS_BATCHES", 0)
        monkeypatch.setenv(workers.WORKERS_ENV_VAR, "2")
    with pytest.raises(UserError) as prepared:
        load_step_labelled(run, load_tokenizer(toy_assets["model"]))
    with pytest.raises(UserError) as todays:
        tokenize_step_labels(data, read_records(data), load_tokenizer(toy_assets["model"]), cfg)
    assert str(prepared.value) == str(todays.value) and "line 8193" in str(todays.value)
    assert preparations(tmp_path) == set()


def test_the_first_prompt_for_preflight_reads_no_raw_file_once_prepared(toy_assets, tmp_path, monkeypatch):
    from rlhf_core.data.prompts import first_prompt

    data = write_rows(tmp_path / "prompts.jsonl", CHAT_PROMPTS)
    cfg = PPOConfig(pretrain=toy_assets["model"], prompt_data=data, input_key="messages", label_key="answer",
                    apply_chat_template=True, rollout_batch_size=4, train_batch_size=4, micro_train_batch_size=4,
                    advantage_estimator="reinforce", reward_pretrain=toy_assets["model"], save_path=str(tmp_path / "out"))
    run = RunConfig(stages=["ppo"], ckpt_path=str(tmp_path / "ckpt"), ppo=cfg)
    alone = first_prompt(run, load_tokenizer(toy_assets["model"]))
    assert preparations(tmp_path) == set()  # read alone, nothing written
    prepared = load_prompts(run, load_tokenizer(toy_assets["model"]))
    no_raw_reads(monkeypatch)
    assert first_prompt(run, load_tokenizer(toy_assets["model"])) == alone == prepared[0]


def test_staging_folders_of_dead_processes_on_this_host_are_removed(tmp_path):
    import socket
    import subprocess
    import sys

    from rlhf_core.data.prepared import remove_stale_staging

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    host = socket.gethostname()
    names = {"dead": f".tmp-{'a' * 32}-0badc0de-{gone.stdout.strip()}@{host}",
             "alive": f".tmp-{'b' * 32}-0badc0de-{os.getpid()}@{host}",
             "elsewhere": f".tmp-{'c' * 32}-0badc0de-{gone.stdout.strip()}@another-host-1",
             "published": "d" * 32}
    for name in names.values():
        (tmp_path / name).mkdir()
    assert remove_stale_staging(str(tmp_path)) == [names["dead"]]
    assert sorted(os.listdir(tmp_path)) == sorted(names[kind] for kind in ("alive", "elsewhere", "published"))


def test_dpo_cuts_whole_conversations_after_their_prompt_where_the_rm_scores_them_whole(toy_assets, tmp_path):
    """OpenRLHF's train_dpo_llama.sh gives no --prompt_key: DPO's prepared pairs carry the prompt's length (every
    message but the last), so its loss covers the replies only; the RM's the same conversations whole."""
    from rlhf_core.data.pairs import read_pairs
    from rlhf_core.stages.dpo import DPOConfig
    from tests.hub_cache import QWEN2_CHATML, assistant, build_tokenizer, user

    rows = [{"chosen": [user(f"sort : {a} 2 ="), assistant(f"{min(a, 2)} {max(a, 2)}")],
             "rejected": [user(f"sort : {a} 2 ="), assistant(f"{a} 2")]} for a in range(8)]
    data = write_rows(tmp_path / "conversations.jsonl", rows)
    settings = {"pretrain": toy_assets["model"], "dataset": data, "apply_chat_template": True, "max_len": 64}
    pairs = {}
    for stage, config in (("dpo", DPOConfig(**settings)), ("rm", RMConfig(**settings))):
        run = RunConfig(stages=[stage], ckpt_path=str(tmp_path / "ckpt"), **{stage: config})
        pairs[stage] = list(read_pairs(config, run, build_tokenizer(QWEN2_CHATML)))
    assert [pair.tokens.chosen_ids for pair in pairs["dpo"]] == [pair.tokens.chosen_ids for pair in pairs["rm"]]
    assert all(pair.tokens.prompt_len == 0 for pair in pairs["rm"])
    assert all(0 < pair.tokens.prompt_len < len(pair.tokens.chosen_ids) for pair in pairs["dpo"])
