"""SFT's data: the samples of `--dataset` (or `--eval_dataset`) tokenized as the trainer reads them, and their
count for the planner."""

from __future__ import annotations

from rlhf_core.config import RunConfig
from rlhf_core.data.records import count_with_eval, read_stage_dataset
from rlhf_core.data.samples import Renderer, TokenizedSample, tokenize_pretraining, tokenize_sft
from rlhf_core.stages.sft import SFTConfig


def load_sft_samples(run: RunConfig, tokenizer, evaluation: bool = False) -> list[TokenizedSample]:
    """The training samples (the dataset mixture), or with `evaluation` those of --eval_dataset."""
    cfg = run.section("sft", SFTConfig)
    url, records = read_stage_dataset(cfg, run.storage_options, run.seed, evaluation)
    if cfg.pretrain_mode:
        return tokenize_pretraining(url, records, tokenizer, cfg.input_key, cfg.max_len)
    if cfg.tokenizer_chat_template:
        tokenizer.chat_template = cfg.tokenizer_chat_template
    renderer = Renderer(tokenizer, url, cfg.apply_chat_template, cfg.input_template)
    return tokenize_sft(renderer, records, cfg.input_key, cfg.output_key, cfg.max_len, cfg.multiturn)


def count_sft_samples(run: RunConfig) -> int:
    """Usable training samples; the eval dataset is read too, so its keys are checked before training."""
    return count_with_eval(run, run.section("sft", SFTConfig), load_sft_samples)
