"""PPO's prompts: each prompt of `--prompt_data` (or `--eval_dataset`) as the model sees it, with its label,
prepared once in the run's store."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rlhf_core.agent import load_agent_executor
from rlhf_core.config import RunConfig
from rlhf_core.errors import UserError
from rlhf_core.data.columns import Columns
from rlhf_core.data.preparation import Preparation, Source, existing_rows, prepared_rows
from rlhf_core.data.records import Record
from rlhf_core.data.encoding import BatchEncoder
from rlhf_core.data.samples import Renderer, prompt_text
from rlhf_core.rewards import check_reward_setup
from rlhf_core.stages.ppo import PPOConfig, require_vllm
from rlhf_core.data.tokenizer_ref import lazy_tokenizer

logger = logging.getLogger(__name__)

COLUMNS = {"text": "json", "ids": "int32[]", "label": "json", "bos_added": "int8"}


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


def load_prompts(run: RunConfig, tokenizer, eval_data: bool = False) -> Sequence[PromptItem]:
    """The prompts (or with `eval_data`, the evaluation prompts) with their labels: prepared once in the run's
    store (`rlhf_core.data.preparation`) and memory-mapped."""
    return prepared_rows(*_preparation(run.section("ppo", PPOConfig), run, tokenizer, eval_data), run, tokenizer)


def first_prompt(run: RunConfig, tokenizer) -> PromptItem:
    """The first training prompt, for checks that must pass before anything is written (the reward
    function's): from the prepared prompts when they are there, else its record read and tokenized alone (the
    file read no further than its first row)."""
    preparation, source = _preparation(run.section("ppo", PPOConfig), run, tokenizer, False)
    prepared = existing_rows(preparation, source, run, tokenizer)
    if prepared is not None:
        return prepared[0]
    columns = preparation.job(next(iter(source.stream(run.storage_options, 1, hash_whole_file=False)))[:1])
    return make_prompt(*(columns[name][0] for name in COLUMNS))


def _preparation(cfg: PPOConfig, run: RunConfig, tokenizer, eval_data: bool) -> tuple[Preparation, Source]:
    if eval_data:
        if cfg.eval_dataset is None:
            raise UserError("--eval_dataset: no dataset given.")
        source = Source(cfg.eval_dataset, "--eval_dataset", cfg.eval_split, seed=run.seed)
    else:
        source = Source(cfg.prompt_data, "--prompt_data", cfg.prompt_split, cfg.max_samples, cfg.dataset_probs,
                        run.seed)
    job = PromptBatches(Renderer(tokenizer, source.url, cfg.apply_chat_template, cfg.input_template), cfg.input_key,
                        cfg.prompt_max_len, cfg.label_key)
    settings = {"input_key": cfg.input_key, "label_key": cfg.label_key, "apply_chat_template": cfg.apply_chat_template,
                "input_template": cfg.input_template, "prompt_max_len": cfg.prompt_max_len}
    return Preparation("prompts", settings, job, COLUMNS, make_prompt, job.no_rows), source


@dataclass
class PromptBatches:
    """A batch of prompt records as prepared columns: `samples.tokenize_prompts`' prompts (each record's text
    rendered, with its checks, then the batch's texts tokenized as one call), and each one's label. Picklable: a
    worker process gets it once and builds its own encoder."""

    renderer: Renderer
    input_key: str
    prompt_max_len: int
    label_key: str | None
    encode: BatchEncoder | None = field(default=None, repr=False)

    def __call__(self, records: list[Record]) -> Columns:
        renderer = self.renderer
        if self.encode is None:
            self.encode = BatchEncoder(renderer.tokenizer, None)  # a long prompt keeps its end: cut below
        texts = [prompt_text(renderer, record, self.input_key) for record in records]
        bos_id, ids = renderer.tokenizer.bos_token_id, []
        bos_added = [renderer.begin(text) != text for text in texts]
        for text_ids, bos in zip(self.encode(texts), bos_added):
            room = self.prompt_max_len - bos
            ids.append([bos_id] * bos + text_ids[max(len(text_ids) - room, 0):])
        return {"text": [record.fields[self.input_key] for record in records], "ids": ids,
                "label": [record_label(renderer.url, record, self.label_key) for record in records],
                "bos_added": bos_added}

    def __getstate__(self) -> dict:
        return {**self.__dict__, "encode": None}  # a worker builds its own from the tokenizer

    def no_rows(self) -> None:
        raise UserError(f"{self.renderer.url}: the dataset is empty.")


def make_prompt(text: Any, ids: list[int], label: Any, bos_added: int) -> PromptItem:
    return PromptItem(text, ids, label, bool(bos_added))


def count_ppo_prompts(run: RunConfig) -> int:
    """Usable prompts. Before training it also reads the eval prompts (their keys and labels), scores one prompt
    with the reward function, loads the agent file, and checks vLLM's needs, so a bad input stops the run here."""
    cfg = run.section("ppo", PPOConfig)
    require_vllm(cfg.vllm_num_engines)
    tokenizer = lazy_tokenizer(cfg.start_model, run)
    check_reward_setup(cfg, tokenizer, first_prompt(run, tokenizer))
    if cfg.agent_func_path:
        load_agent_executor(cfg.agent_func_path)
        if cfg.normalize_reward:
            logger.warning("--normalize_reward has no effect with --agent_func_path: as in OpenRLHF, only "
                           "reward-model scores are normalized; the environment's rewards are used as they are.")
    if cfg.eval_dataset:
        load_prompts(run, tokenizer, eval_data=True)
    # no keep_records: preflight may still refuse after this count (fewer prompts than a step), and a refused run
    # writes nothing
    return len(load_prompts(run, tokenizer))
