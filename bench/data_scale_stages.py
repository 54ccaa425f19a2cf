"""The stages of bench/data_scale.py: each one's data in its hub shape, written as a dataset repository in a local
Hugging Face cache (huggingface_hub's layout: `datasets--bench--{shape}-{rows}/snapshots/{rev}/data/*.parquet`,
8 shards from 100,000 rows, `refs/main`), and the command that trains on it, with every size OpenRLHF's defaults
would get wrong for a toy run set explicitly (`--max_epochs`, `--max_samples`, PPO's `--rollout_batch_size`).

- sft: OpenOrca's shape, strings (`prompt`, `response`) and OpenRLHF's `--input_template`;
- rm, dpo: preference_dataset_mixture2_and_safe_pku's shape, `chosen`/`rejected` conversations, `--apply_chat_template`;
- ppo: prompt-collection-v0.1's shape, `context_messages`, `--apply_chat_template`, the toy's gold reward function;
- prm: Math-Shepherd's shape (`input` with a placeholder ending each step, `value` labels).
"""

from __future__ import annotations

import os
import sys

RLHF = os.path.join(os.path.dirname(sys.executable), "rlhf")
REVISION = "0" * 40
STAGES = ("sft", "rm", "dpo", "ppo", "prm")
SHAPES = {"sft": "sft", "rm": "prefs", "dpo": "prefs", "ppo": "prompts", "prm": "steps"}
ROWS_PER_WRITE = 65536


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


def _assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


def shape_rows(shape: str) -> list[dict]:
    """The toy's rows of one shape (256 of them), as the hub's dataset of that kind holds them."""
    from rlhf_core.toy import make_datasets, step_labelled_rows

    toy = make_datasets(0)
    if shape == "sft":
        return [{"prompt": row["prompt"], "response": row["response"]} for row in toy["sft"]]
    if shape == "prefs":
        return [{"chosen": [_user(row["prompt"]), _assistant(row["chosen"])],
                 "rejected": [_user(row["prompt"]), _assistant(row["rejected"])]} for row in toy["prefs"]]
    if shape == "prompts":
        return [{"context_messages": [_user(row["prompt"])]} for row in toy["prompts"]]
    return step_labelled_rows(256, seed=0)


def hub_name(shape: str, num_rows: int) -> str:
    return f"bench/{shape}-{num_rows}"


def write_hub_dataset(hf_home: str, shape: str, num_rows: int) -> str:
    """`num_rows` rows of `shape` (the toy's repeated, each with its row number) as a cached hub dataset; its name."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    name = hub_name(shape, num_rows)
    repo = os.path.join(hf_home, "hub", "datasets--" + name.replace("/", "--"))
    data = os.path.join(repo, "snapshots", REVISION, "data")
    if os.path.isdir(data):
        return name
    os.makedirs(data)
    os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
    with open(os.path.join(repo, "refs", "main"), "w") as handle:
        handle.write(REVISION)
    rows, shards = shape_rows(shape), 8 if num_rows >= 100_000 else 1
    per_shard = -(-num_rows // shards)
    for shard in range(shards):
        path = os.path.join(data, f"train-{shard:05d}-of-{shards:05d}.parquet")
        with pq.ParquetWriter(path, pa.Table.from_pylist([{**rows[0], "row": 0}]).schema) as writer:
            end = min((shard + 1) * per_shard, num_rows)
            for start in range(shard * per_shard, end, ROWS_PER_WRITE):
                writer.write_table(pa.Table.from_pylist([{**rows[i % len(rows)], "row": i}
                                                         for i in range(start, min(start + ROWS_PER_WRITE, end))]))
    return name


def command(stage: str, model: str, data: str, num_rows: int, ckpt: str, out: str, run_name: str) -> list[str]:
    """The stage's command on `data`, `--save_steps 8`, one epoch of at most `num_rows` rows."""
    common = ["--pretrain", model, "--max_epochs", "1", "--max_samples", str(num_rows), "--save_steps", "8",
              "--ckpt_path", ckpt, "--max_ckpt_num", "3", "--save_path", out, "--seed", "42", "--load_checkpoint",
              "--run_name", run_name]
    if stage == "sft":
        own = ["--dataset", data, "--input_key", "prompt", "--output_key", "response",
               "--input_template", "User: {}\nAssistant: ", "--max_len", "128", "--train_batch_size", "8",
               "--micro_train_batch_size", "4", "--learning_rate", "1e-3"]
    elif stage in ("rm", "dpo"):
        own = ["--dataset", data, "--chosen_key", "chosen", "--rejected_key", "rejected", "--apply_chat_template",
               "--max_len", "64", "--train_batch_size", "8", "--micro_train_batch_size", "4",
               "--learning_rate", "1e-3" if stage == "rm" else "5e-4"] + (["--beta", "0.1"] if stage == "dpo" else [])
    elif stage == "ppo":
        own = ["--prompt_data", data, "--input_key", "context_messages", "--apply_chat_template",
               "--reward_fn", "rlhf_core.toy:gold_reward", "--advantage_estimator", "group_norm",
               "--n_samples_per_prompt", "4", "--rollout_batch_size", "8", "--train_batch_size", "16",
               "--micro_train_batch_size", "8", "--max_new_tokens", "8", "--learning_rate", "1e-3"]
    else:
        own = ["--dataset", data, "--input_key", "input", "--label_key", "value", "--placeholder_token", "user",
               "--reward_tokens", "1", "0", "--max_len", "32", "--train_batch_size", "16",
               "--micro_train_batch_size", "8", "--learning_rate", "2e-3"]
    return [RLHF, "train", stage, *own, *common]
