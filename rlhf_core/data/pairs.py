"""Preference pairs (the reward model's and DPO's data): read, tokenized, with their margins, prepared once in the
run's store, split into train and eval; and their count for the planner."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rlhf_core.config import RunConfig
from rlhf_core.data.columns import Columns, column, subset
from rlhf_core.data.preparation import Preparation, prepared_rows, stage_source
from rlhf_core.data.records import Record, split_holdout
from rlhf_core.data.samples import Renderer, TokenizedPair, tokenize_pairs
from rlhf_core.errors import UserError
from rlhf_core.notices import warn_once
from rlhf_core.stages.base import PreferenceConfig
from rlhf_core.stages.dpo import DPOConfig
from rlhf_core.stages.rm import RMConfig
from rlhf_core.storage.locate import load_tokenizer

MARGIN_KEY = "margin"
COLUMNS = {"chosen_ids": "int32[]", "rejected_ids": "int32[]", "prompt_len": "int32", "margin": "float64"}


@dataclass(frozen=True)
class Pair:
    tokens: TokenizedPair
    margin: float


def read_pairs(cfg: PreferenceConfig, run: RunConfig, tokenizer, evaluation: bool = False) -> Sequence[Pair]:
    """The training pairs of a preference stage's config (the dataset mixture), or with `evaluation` those of
    --eval_dataset: prepared once in the run's store (`rlhf_core.data.preparation`) and memory-mapped."""
    if cfg.tokenizer_chat_template:
        tokenizer.chat_template = cfg.tokenizer_chat_template
    source = stage_source(cfg, run.seed, evaluation)
    margin_loss = getattr(cfg, "margin_loss", False)
    job = PairBatches(Renderer(tokenizer, source.url, cfg.apply_chat_template, cfg.input_template), cfg.prompt_key,
                      cfg.chosen_key, cfg.rejected_key, cfg.max_len, margin_loss)
    settings = {"prompt_key": cfg.prompt_key, "chosen_key": cfg.chosen_key, "rejected_key": cfg.rejected_key,
                "apply_chat_template": cfg.apply_chat_template, "input_template": cfg.input_template,
                "max_len": cfg.max_len, "margin_loss": margin_loss}
    return prepared_rows(Preparation("pairs", settings, job, COLUMNS, make_pair, job.no_rows), source, run, tokenizer)


@dataclass
class PairBatches:
    """A batch of preference records as prepared columns (`samples.tokenize_pairs`, and each pair's margin)."""

    renderer: Renderer
    prompt_key: str | None
    chosen_key: str
    rejected_key: str
    max_len: int
    margin_loss: bool

    def __call__(self, records: list[Record]) -> Columns:
        pairs = tokenize_pairs(self.renderer, records, self.prompt_key, self.chosen_key, self.rejected_key,
                               self.max_len)
        return {"chosen_ids": [pair.chosen_ids for pair in pairs],
                "rejected_ids": [pair.rejected_ids for pair in pairs],
                "prompt_len": [pair.prompt_len for pair in pairs],
                "margin": [pair_margin(self.renderer.url, record, self.margin_loss) for record in records]}

    def no_rows(self) -> None:
        raise UserError(f"{self.renderer.url}: the dataset is empty.")


def make_pair(chosen_ids: list[int], rejected_ids: list[int], prompt_len: int, margin: float) -> Pair:
    return Pair(TokenizedPair(chosen_ids, rejected_ids, prompt_len), margin)


def pair_margin(url: str, record, required: bool) -> float:
    if not required:
        return 0.0
    value = record.fields.get(MARGIN_KEY)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise UserError(f"{record.where(url)}: --margin_loss needs a numeric {MARGIN_KEY!r} field in every pair "
                        f"(got {value!r}); add it or drop --margin_loss.")
    return float(value)


def load_pairs(cfg: PreferenceConfig, run: RunConfig, tokenizer) -> tuple[Sequence[Pair], Sequence[Pair]]:
    """(train, eval) preference pairs: eval from --eval_dataset, else held out of the training data."""
    pairs = read_pairs(cfg, run, tokenizer)
    if cfg.eval_dataset:
        return pairs, read_pairs(cfg, run, tokenizer, evaluation=True)
    return split_holdout(pairs, cfg.eval_holdout, run.seed)


def trainable_pairs(pairs: Sequence[Pair], max_len: int, where: str) -> Sequence[Pair]:
    """OpenRLHF's filter: a pair whose prompt takes max_len - 2 tokens or more leaves no response to learn. Read
    from the prepared column: no pair is built to be filtered."""
    kept = subset(pairs, np.flatnonzero(column(pairs, "prompt_len", lambda pair: pair.tokens.prompt_len)
                                        < max_len - 2))
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
