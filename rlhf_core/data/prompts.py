"""PPO's prompts: each prompt of `--prompt_data` (or `--eval_dataset`) as the model sees it, with its label."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlhf_core.config import RunConfig
from rlhf_core.errors import UserError
from rlhf_core.data.records import Record, read_records
from rlhf_core.data.samples import Renderer, tokenize_prompts


@dataclass(frozen=True)
class PromptItem:
    text: Any  # the prompt field as written in the data: a string, or a list of {role, content} messages
    ids: list[int]  # the tokens the model sees (template or BOS, truncated from the left)
    label: Any  # the --label_key value; "" without --label_key, as OpenRLHF
    bos_added: bool = False  # ids[0] is a BOS added here, not written by the chat template

    @property
    def written_ids(self) -> list[int]:
        """The tokens the text or chat template wrote, without the BOS added here: what OpenRLHF decodes as the
        prompt (its reward function's `prompts`, its agent's observation)."""
        return self.ids[self.bos_added:]


def record_label(url: str, record: Record, label_key: str | None) -> Any:
    if label_key is None:
        return ""
    if label_key not in record.fields:
        raise UserError(f"{record.where(url)}: no key {label_key!r} (choose the key with --label_key).")
    return record.fields[label_key]


def load_prompts(run: RunConfig, tokenizer, eval_data: bool = False) -> list[PromptItem]:
    """The prompts (or with `eval_data`, the evaluation prompts) with their labels."""
    cfg = run.ppo
    if eval_data:
        url = cfg.eval_dataset
        records = read_records(url, run.storage_options, split=cfg.eval_split, flag="--eval_dataset")
    else:
        url = cfg.prompt_data
        records = read_records(url, run.storage_options, cfg.max_samples, split=cfg.prompt_split,
                               probs=cfg.dataset_probs, seed=run.seed, flag="--prompt_data")
    renderer = Renderer(tokenizer, url, cfg.apply_chat_template, cfg.input_template)
    tokenized = tokenize_prompts(renderer, records, cfg.input_key, cfg.prompt_max_len)
    assert len(tokenized) == len(records), "tokenize_prompts must keep one prompt per record"
    return [PromptItem(prompt.value, prompt.ids, record_label(url, record, cfg.label_key), prompt.bos_added)
            for prompt, record in zip(tokenized, records)]
