"""Preparation rows/s side by side: ours (`rlhf_core.data`, the stage's own preparation, worker processes as a run
uses them) against OpenRLHF's preprocessing of the same rows, `datasets.map` with `num_proc` = min(8, cores) running
OpenRLHF's per-row function, rewritten here from v0.9.10's `reward_dataset.py` and `prompts_dataset.py` and v0.9.0's
`process_reward_dataset.py` (the `openrlhf` package pins flash-attn and does not install here):

- rm: `preprocess_data` (the chat template on chosen and rejected), then the filter of `prompt is None`;
- dpo: the same with `is_dpo` (the prompt rendered from chosen[:-1] and tokenized to count it, too-long ones dropped);
- ppo: prompts' `preprocess_data` (OpenRLHF runs it in a Python loop; as a map here, on the same processes);
- prm: `ProcessRewardDataset.__getitem__`'s tokenization and labels (OpenRLHF does it per item during training).

OpenRLHF's RM and PPO preprocessing only renders text (their tokens are made per item at training time, every
epoch); ours renders and tokenizes. So a second column adds the tokens OpenRLHF makes per item, once per row
(`openrlhf_item_tokens`): the same output, tokens, on both sides. Both ratios are reported. The time of theirs excludes `load_dataset`; ours includes reading the parquet shards. The
two are timed alternately, `--rounds` times each, and the best time of each side is kept.

    .venv/bin/python bench/prep_side_by_side.py --rows 200000 [--stages rm,dpo,ppo,prm] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.data_scale_stages import SHAPES, write_hub_dataset  # noqa: E402

NUM_PROC = min(8, len(os.sched_getaffinity(0)))


def openrlhf_map(stage: str, dataset, tokenizer, max_len: int):
    """OpenRLHF's preprocessing of `dataset` for `stage` (datasets.map, num_proc = min(8, cores)), done."""
    apply = tokenizer.apply_chat_template

    def pairs(data, is_dpo: bool):
        chosen = apply(data["chosen"], tokenize=False)
        rejected = apply(data["rejected"], tokenize=False)
        prompt, extra = "", 0
        if is_dpo:
            prompt = apply(data["chosen"][:-1], tokenize=False, add_generation_prompt=True)
            chosen, rejected = chosen[len(prompt):], rejected[len(prompt):]
            extra = tokenizer(prompt, max_length=max_len, padding=False, truncation=True, return_tensors="pt",
                              add_special_tokens=False)["attention_mask"].int().sum().item()
            if extra >= max_len - 2:
                prompt = None
        return {"prompt": prompt, "chosen": chosen, "reject": rejected, "extra": extra}

    def prompts(data):
        chat = data["context_messages"]
        chat = [{"role": "user", "content": chat}] if isinstance(chat, str) else chat
        return {"prompt": apply(chat, tokenize=False, add_generation_prompt=True), "label": ""}

    placeholder = tokenizer.convert_tokens_to_ids("user")
    reward_ids = {token: tokenizer.convert_tokens_to_ids(token) for token in ("1", "0")}

    def steps(data):
        ids = tokenizer(data["input"], max_length=max_len, padding=False, truncation=True, return_tensors="pt",
                        add_special_tokens=False)["input_ids"][0]
        values = [reward_ids[value] for value in data["value"]]
        mask = ids == placeholder
        labels = [-100] * len(ids)
        for position, value in zip(mask.nonzero().flatten().tolist(), values):
            labels[position] = value
        return {"input_ids": ids.tolist(), "labels": labels}

    function = {"rm": lambda data: pairs(data, False), "dpo": lambda data: pairs(data, True), "ppo": prompts,
                "prm": steps}[stage]
    mapped = dataset.map(function, remove_columns=dataset.column_names, num_proc=NUM_PROC,
                         load_from_cache_file=False)
    if stage in ("rm", "dpo"):
        mapped = mapped.filter(lambda row: row["prompt"] is not None, num_proc=NUM_PROC, load_from_cache_file=False)
    return mapped


def openrlhf_item_tokens(stage: str, mapped, tokenizer, max_len: int):
    """What OpenRLHF tokenizes later, per item, from `mapped`: RewardDataset.__getitem__'s prompt + chosen and
    prompt + reject (RM, DPO), the prompts as PPO's rollout tokenizes them (a batch at a time there; one call per
    row here, on the map's processes). PRM's map above is already its __getitem__. Run once over every row, as a map
    with the same processes: the cost of having each row as tokens once (an epoch pays it again)."""
    eos = tokenizer.eos_token

    def sequence(text: str) -> list[int]:
        text = text.rstrip("\n")
        text = text if text.endswith(eos) else text + " " + eos
        return tokenizer(text, max_length=max_len, padding=False, truncation=True, return_tensors="pt",
                         add_special_tokens=False)["input_ids"][0].tolist()

    def pair(data):
        return {"chosen_ids": sequence(data["prompt"] + data["chosen"]),
                "reject_ids": sequence(data["prompt"] + data["reject"])}

    def prompt(data):
        return {"ids": tokenizer(data["prompt"], max_length=max_len, truncation=True,
                                 add_special_tokens=False)["input_ids"]}

    if stage == "prm":
        return mapped
    return mapped.map(pair if stage in ("rm", "dpo") else prompt, remove_columns=mapped.column_names,
                      num_proc=NUM_PROC, load_from_cache_file=False)


def ours(stage: str, name: str, model: str, ckpt: str, tokenizer):
    """The stage's own preparation of the hub dataset `name`, into a fresh store."""
    from rlhf_core.config import RunConfig

    if stage in ("rm", "dpo"):
        from rlhf_core.data.pairs import read_pairs
        from rlhf_core.stages.dpo import DPOConfig
        from rlhf_core.stages.rm import RMConfig

        config = (RMConfig if stage == "rm" else DPOConfig)(pretrain=model, dataset=name, chosen_key="chosen",
                                                           rejected_key="rejected", apply_chat_template=True,
                                                           max_len=64, max_samples=10**9)
        return read_pairs(config, RunConfig(stages=[stage], ckpt_path=ckpt, **{stage: config}), tokenizer)
    if stage == "ppo":
        from rlhf_core.data.prompts import load_prompts
        from rlhf_core.stages.ppo import PPOConfig

        config = PPOConfig(pretrain=model, prompt_data=name, input_key="context_messages", apply_chat_template=True,
                           reward_fn="rlhf_core.toy:gold_reward", advantage_estimator="group_norm",
                           n_samples_per_prompt=4, rollout_batch_size=8, train_batch_size=16,
                           micro_train_batch_size=8, max_samples=10**9, save_path=os.path.join(ckpt, "out"))
        return load_prompts(RunConfig(stages=["ppo"], ckpt_path=ckpt, ppo=config), tokenizer)
    from rlhf_core.data.step_labels import load_step_labelled
    from rlhf_core.stages.prm import PRMConfig

    config = PRMConfig(pretrain=model, dataset=name, input_key="input", label_key="value", placeholder_token="user",
                       reward_tokens=["1", "0"], max_len=32, max_samples=10**9)
    return load_step_labelled(RunConfig(stages=["prm"], ckpt_path=ckpt, prm=config), tokenizer)


def compare(stage: str, num_rows: int, workdir: str, model: str, rounds: int) -> dict:
    from rlhf_core.data.records import hub_dataset
    from rlhf_core.storage.locate import load_tokenizer

    name = write_hub_dataset(os.environ["HF_HOME"], SHAPES[stage], num_rows)
    tokenizer = load_tokenizer(model)
    dataset = hub_dataset(name, "train", "--dataset")  # datasets.load_dataset of the cached snapshot, untimed
    theirs_s = ours_s = tokens_s = float("inf")
    for _ in range(rounds):  # alternated, the best of each: a machine shared with other work slows either side
        started = time.perf_counter()
        mapped = openrlhf_map(stage, dataset, tokenizer, 64 if stage != "prm" else 32)
        theirs_rows, mapped_at = len(mapped), time.perf_counter()
        theirs_s = min(theirs_s, mapped_at - started)
        openrlhf_item_tokens(stage, mapped, tokenizer, 64 if stage != "prm" else 32)
        tokens_s = min(tokens_s, time.perf_counter() - started)
        started = time.perf_counter()
        ours_rows = len(ours(stage, name, model, tempfile.mkdtemp(dir=workdir), tokenizer))
        ours_s = min(ours_s, time.perf_counter() - started)
    return {"stage": stage, "rows": num_rows, "ours_rows_per_s": ours_rows / ours_s,
            "openrlhf_map_rows_per_s": theirs_rows / theirs_s, "ratio": (ours_rows / ours_s) / (theirs_rows / theirs_s),
            "openrlhf_with_tokens_rows_per_s": theirs_rows / tokens_s,
            "ratio_with_tokens": (ours_rows / ours_s) / (theirs_rows / tokens_s),
            "ours_s": ours_s, "openrlhf_map_s": theirs_s, "openrlhf_with_tokens_s": tokens_s, "num_proc": NUM_PROC}


def format_rows(results: list[dict]) -> str:
    lines = ["| stage | rows | ours (rows/s) | OpenRLHF's datasets.map (rows/s) | ours / map | map + its per-item "
             "tokens (rows/s) | ours / (map + tokens) |", "|---|---|---|---|---|---|---|"]
    for row in results:
        lines.append(f"| {row['stage']} | {row['rows']:,} | {row['ours_rows_per_s']:,.0f} | "
                     f"{row['openrlhf_map_rows_per_s']:,.0f} | {row['ratio']:.2f}x | "
                     f"{row['openrlhf_with_tokens_rows_per_s']:,.0f} | {row['ratio_with_tokens']:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--stages", default="rm,dpo,ppo,prm")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--rounds", type=int, default=2, help="Each side timed this many times, alternated; the best.")
    args = parser.parse_args()
    workdir = args.workdir or tempfile.mkdtemp(prefix="bench-prep-")
    os.environ.update(HF_HOME=os.path.join(workdir, "hf"), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    from rlhf_core.toy import init_toy

    model = init_toy(os.path.join(workdir, "toy"))["model"]
    print(f"load average at start: {os.getloadavg()}", flush=True)
    results = []
    for stage in args.stages.split(","):
        results.append(compare(stage, args.rows, workdir, model, args.rounds))
        print(json.dumps(results[-1]), flush=True)
    print(f"load average at end: {os.getloadavg()}")
    print(format_rows(results))


if __name__ == "__main__":
    main()
