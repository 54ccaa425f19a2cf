"""Preference pairs (the reward model's and DPO's data): read, tokenized, with their margins, split into
train and eval; and their count for the planner."""

from __future__ import annotations

from dataclasses import dataclass

from rlhf_core.config import RunConfig
from rlhf_core.data.records import read_stage_dataset, split_holdout
from rlhf_core.data.samples import Renderer, TokenizedPair, tokenize_pairs
from rlhf_core.errors import UserError
from rlhf_core.notices import warn_once
from rlhf_core.stages.base import PreferenceConfig
from rlhf_core.stages.dpo import DPOConfig
from rlhf_core.stages.rm import RMConfig
from rlhf_core.storage.locate import load_tokenizer

MARGIN_KEY = "margin"


@dataclass(frozen=True)
class Pair:
    tokens: TokenizedPair
    margin: float


def read_pairs(cfg: PreferenceConfig, run: RunConfig, tokenizer, evaluation: bool = False) -> list[Pair]:
    """The training pairs of a preference stage's config (the dataset mixture), or with `evaluation` those of
    --eval_dataset."""
    url, records = read_stage_dataset(cfg, run.storage_options, run.seed, evaluation)
    if cfg.tokenizer_chat_template:
        tokenizer.chat_template = cfg.tokenizer_chat_template
    renderer = Renderer(tokenizer, url, cfg.apply_chat_template, cfg.input_template)
    tokenized = tokenize_pairs(renderer, records, cfg.prompt_key, cfg.chosen_key, cfg.rejected_key, cfg.max_len)
    margin_loss = getattr(cfg, "margin_loss", False)
    return [Pair(tokens, pair_margin(url, record, margin_loss)) for tokens, record in zip(tokenized, records)]


def pair_margin(url: str, record, required: bool) -> float:
    if not required:
        return 0.0
    value = record.fields.get(MARGIN_KEY)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise UserError(f"{record.where(url)}: --margin_loss needs a numeric {MARGIN_KEY!r} field in every pair "
                        f"(got {value!r}); add it or drop --margin_loss.")
    return float(value)


def load_pairs(cfg: PreferenceConfig, run: RunConfig, tokenizer) -> tuple[list[Pair], list[Pair]]:
    """(train, eval) preference pairs: eval from --eval_dataset, else held out of the training data."""
    pairs = read_pairs(cfg, run, tokenizer)
    if cfg.eval_dataset:
        return pairs, read_pairs(cfg, run, tokenizer, evaluation=True)
    return split_holdout(pairs, cfg.eval_holdout, run.seed)


def trainable_pairs(pairs: list[Pair], max_len: int, where: str) -> list[Pair]:
    """OpenRLHF's filter: a pair whose prompt takes max_len - 2 tokens or more leaves no response to learn."""
    kept = [pair for pair in pairs if pair.tokens.prompt_len < max_len - 2]
    if pairs and not kept:
        raise UserError(f"{where}: every prompt takes --max_len {max_len} - 2 tokens or more, so no response is "
                        "left to learn from; raise --max_len.")
    if len(kept) < len(pairs):
        warn_once(f"{where}: {len(pairs) - len(kept)} of {len(pairs)} pairs dropped: their prompt takes --max_len "
                  f"{max_len} - 2 tokens or more (as OpenRLHF drops them).")
    return kept


def count_rm_pairs(run: RunConfig) -> int:
    """Training pairs of the reward model (after the held-out split)."""
    cfg = run.section("rm", RMConfig)
    return len(load_pairs(cfg, run, load_tokenizer(cfg.start_model, run.storage_options))[0])


def count_dpo_pairs(run: RunConfig) -> int:
    """Training pairs of DPO that leave a response to learn from."""
    cfg = run.section("dpo", DPOConfig)
    pairs, _ = load_pairs(cfg, run, load_tokenizer(cfg.start_model, run.storage_options))
    return len(trainable_pairs(pairs, cfg.max_len, "--dataset"))
