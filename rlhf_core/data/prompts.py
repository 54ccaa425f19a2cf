"""PPO's prompts: each prompt of `--prompt_data` (or `--eval_dataset`) as the model sees it, with its label."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from rlhf_core.agent import load_agent_executor
from rlhf_core.config import RunConfig
from rlhf_core.errors import UserError
from rlhf_core.data.records import Record, read_records
from rlhf_core.data.samples import Renderer, tokenize_prompts
from rlhf_core.rewards import check_reward_setup
from rlhf_core.stages.ppo import PPOConfig, require_vllm
from rlhf_core.storage.locate import load_tokenizer

logger = logging.getLogger(__name__)


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
    cfg = run.section("ppo", PPOConfig)
    if eval_data:
        if cfg.eval_dataset is None:
            raise UserError("--eval_dataset: no dataset given.")
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


def count_ppo_prompts(run: RunConfig) -> int:
    """Usable prompts. Before training it also reads the eval prompts (their keys and labels), scores one prompt
    with the reward function, loads the agent file, and checks vLLM's needs, so a bad input stops the run here."""
    cfg = run.section("ppo", PPOConfig)
    require_vllm(cfg.vllm_num_engines)
    tokenizer = load_tokenizer(cfg.start_model, run.storage_options)
    prompts = load_prompts(run, tokenizer)
    if cfg.eval_dataset:
        load_prompts(run, tokenizer, eval_data=True)
    check_reward_setup(cfg, tokenizer, prompts[0])
    if cfg.agent_func_path:
        load_agent_executor(cfg.agent_func_path)
        if cfg.normalize_reward:
            logger.warning("--normalize_reward has no effect with --agent_func_path: as in OpenRLHF, only "
                           "reward-model scores are normalized; the environment's rewards are used as they are.")
    return len(prompts)
