"""The process reward model's data: texts whose steps end at a placeholder token, each step labelled (a reward
token, or a soft label in [0, 1]); tokenized as OpenRLHF's `train_prm` does, and counted for the planner."""

from __future__ import annotations

from dataclasses import dataclass

from rlhf_core.config import RunConfig
from rlhf_core.data.records import count_with_eval, read_stage_dataset
from rlhf_core.data.samples import IGNORE_INDEX, field_value
from rlhf_core.errors import UserError
from rlhf_core.stages.prm import PRMConfig


@dataclass(frozen=True)
class StepLabelledSample:
    input_ids: list[int]
    labels: list[float]  # per position: the label at a placeholder (a token id, or a soft label), else IGNORE_INDEX
    soft: bool  # the labels are the first reward token's probability, not token ids


def single_token_id(tokenizer, token: str, flag: str) -> int:
    ids = tokenizer.encode(token, add_special_tokens=False)
    if len(ids) != 1:
        raise UserError(f"{flag} {token!r} is {len(ids)} tokens for this tokenizer; it must be one token.")
    return ids[0]


def tokenize_step_labels(url: str, records, tokenizer, cfg) -> list[StepLabelledSample]:
    """One sample per record: its token ids, and its step labels on its placeholder positions."""
    placeholder = single_token_id(tokenizer, cfg.placeholder_token, "--placeholder_token")
    reward_ids = {token: single_token_id(tokenizer, token, "--reward_tokens") for token in cfg.reward_tokens or ()}
    samples, kinds = [], set()
    for record in records:
        text = field_value(url, record, cfg.input_key, "--input_key")
        values = field_value(url, record, cfg.label_key, "--label_key")
        if not isinstance(text, str) or not isinstance(values, list) or not values:
            raise UserError(f"{record.where(url)}: --input_key {cfg.input_key!r} must be a string and --label_key "
                            f"{cfg.label_key!r} a non-empty list of step labels.")
        ids = tokenizer(text, add_special_tokens=False, truncation=True, max_length=cfg.max_len).input_ids
        positions = [index for index, token in enumerate(ids) if token == placeholder]
        labels = [float(IGNORE_INDEX)] * len(ids)
        for position, value in zip(positions, values):
            labels[position] = float(_label_value(url, record, value, cfg, tokenizer, reward_ids))
        kinds.add(not isinstance(values[0], str))
        if len(kinds) > 1:
            raise UserError(f"{record.where(url)}: step labels must all be reward tokens or all numbers in one "
                            "dataset; this record's differ from the ones before.")
        samples.append(StepLabelledSample(ids, labels, soft=not isinstance(values[0], str)))
    return samples


def _label_value(url, record, value, cfg, tokenizer, reward_ids: dict[str, int]) -> float:
    if isinstance(value, str):
        if reward_ids and value not in reward_ids:
            raise UserError(f"{record.where(url)}: step label {value!r} is not one of --reward_tokens "
                            f"{' '.join(cfg.reward_tokens)}.")
        return reward_ids[value] if reward_ids else single_token_id(tokenizer, value, "a step label")
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 1 and len(reward_ids) == 2:
        return value
    raise UserError(f"{record.where(url)}: step label {value!r} must be a reward token, or a number in [0, 1] with "
                    "two --reward_tokens (soft labels).")


def load_step_labelled(run: RunConfig, tokenizer, evaluation: bool = False) -> list[StepLabelledSample]:
    """The training samples, or with `evaluation` those of --eval_dataset."""
    cfg = run.section("prm", PRMConfig)
    url, records = read_stage_dataset(cfg, run.storage_options, run.seed, evaluation)
    return tokenize_step_labels(url, records, tokenizer, cfg)


def count_step_labelled(run: RunConfig) -> int:
    """Usable training samples; the eval dataset is read too, so its keys and labels are checked before training."""
    return count_with_eval(run, run.section("prm", PRMConfig), load_step_labelled)
