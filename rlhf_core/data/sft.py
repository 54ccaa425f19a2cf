"""SFT's data: the samples of `--dataset` (or `--eval_dataset`) tokenized as the trainer reads them, and their
count for the planner; both read the preparation in the run's store (`rlhf_core.data.prepare_sft`), built once."""

from __future__ import annotations

from collections.abc import Sequence

from rlhf_core.config import RunConfig
from rlhf_core.data.prepare_sft import prepared_sft_samples
from rlhf_core.data.tokenizer_ref import count_with_eval
from rlhf_core.data.samples import TokenizedSample
from rlhf_core.stages.sft import SFTConfig


def load_sft_samples(run: RunConfig, tokenizer, evaluation: bool = False) -> Sequence[TokenizedSample]:
    """The training samples (the dataset mixture), or with `evaluation` those of --eval_dataset: a lazy sequence
    over the prepared data, memory-mapped."""
    cfg = run.section("sft", SFTConfig)
    if cfg.tokenizer_chat_template:
        tokenizer.chat_template = cfg.tokenizer_chat_template
    return prepared_sft_samples(cfg, run, tokenizer, evaluation)


def count_sft_samples(run: RunConfig) -> int:
    """Usable training samples; the eval dataset is read too, so its keys are checked before training."""
    return count_with_eval(run, run.section("sft", SFTConfig), load_sft_samples)
