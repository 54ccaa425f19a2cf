"""Preference pairs (the reward model's and DPO's data): read, tokenized, with their margins, prepared once in the
run's store, split into train and eval; and their count for the planner."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from rlhf_core.config import RunConfig
from rlhf_core.data.columns import Columns, column, subset
from rlhf_core.data.preparation import Preparation, prepared_rows, stage_source
from rlhf_core.data.records import Record, split_holdout
from rlhf_core.data.encoding import BatchEncoder
from rlhf_core.data.samples import Renderer, TokenizedPair, pair_texts, warn_unused_prompt
from rlhf_core.errors import UserError
from rlhf_core.notices import note_once, warn_once
from rlhf_core.stages.base import PreferenceConfig
from rlhf_core.stages.dpo import DPOConfig
from rlhf_core.stages.rm import RMConfig
from rlhf_core.data.tokenizer_ref import lazy_tokenizer

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
    # DPO cuts whole conversations after their prompt (OpenRLHF's is_dpo); the RM scores them whole.
    split_prompt = isinstance(cfg, DPOConfig) and cfg.prompt_key is None and cfg.apply_chat_template
    job = PairBatches(Renderer(tokenizer, source.url, cfg.apply_chat_template, cfg.input_template), cfg.prompt_key,
                      cfg.chosen_key, cfg.rejected_key, cfg.max_len, margin_loss, split_prompt)
    settings = {"prompt_key": cfg.prompt_key, "chosen_key": cfg.chosen_key, "rejected_key": cfg.rejected_key,
                "apply_chat_template": cfg.apply_chat_template, "input_template": cfg.input_template,
                "max_len": cfg.max_len, "margin_loss": margin_loss,
                **({"split_prompt": True} if split_prompt else {})}  # earlier preparations keep their key
    return prepared_rows(Preparation("pairs", settings, job, COLUMNS, make_pair, job.no_rows), source, run, tokenizer)


@dataclass
class PairBatches:
    """A batch of preference records as prepared columns: `samples.tokenize_pairs`' tokens (each record's texts
    rendered, with its checks, then every chosen, every rejected and every prompt text tokenized as one call each),
    and each pair's margin. Picklable: a worker process gets it once and builds its own encoder."""

    renderer: Renderer
    prompt_key: str | None
    chosen_key: str
    rejected_key: str
    max_len: int
    margin_loss: bool
    split_prompt: bool = False  # see samples.pair_texts
    encode: BatchEncoder | None = field(default=None, repr=False)

    def __call__(self, records: list[Record]) -> Columns:
        renderer = self.renderer
        if self.encode is None:
            self.encode = BatchEncoder(renderer.tokenizer, self.max_len)
        prompts, chosen, rejected = [], [], []
        for record in records:
            warn_unused_prompt(renderer, record, self.prompt_key)
            prompt, chosen_text, rejected_text = pair_texts(renderer, record, self.prompt_key, self.chosen_key,
                                                            self.rejected_key, self.split_prompt)
            prompts.append(renderer.begin(prompt))
            chosen.append(renderer.begin(prompt + chosen_text))
            rejected.append(renderer.begin(prompt + rejected_text))
        return {"chosen_ids": self.encode.sequences(chosen), "rejected_ids": self.encode.sequences(rejected),
                "prompt_len": _prompt_lengths(self.encode, prompts),
                "margin": [pair_margin(renderer.url, record, self.margin_loss) for record in records]}

    def __getstate__(self) -> dict:
        return {**self.__dict__, "encode": None}  # a worker builds its own from the tokenizer

    def no_rows(self) -> None:
        raise UserError(f"{self.renderer.url}: the dataset is empty.")


def _prompt_lengths(encode: BatchEncoder, prompts: list[str]) -> list[int]:
    """Each prompt's own token count, each distinct text tokenized once: without --prompt_key every prompt is the
    same (empty, or the BOS alone)."""
    distinct = list(dict.fromkeys(prompts))
    lengths = dict(zip(distinct, map(len, encode(distinct))))
    return [lengths[prompt] for prompt in prompts]


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
    """(train, eval) preference pairs: eval from --eval_dataset; else a fraction held out of the training data when
    --eval_holdout asks for one (said once, with the count); else none, as OpenRLHF (`eval_pairs_of_rm` is the
    reward model's own evaluation then)."""
    pairs = read_pairs(cfg, run, tokenizer)
    if cfg.eval_dataset:
        return pairs, read_pairs(cfg, run, tokenizer, evaluation=True)
    if cfg.eval_holdout <= 0:
        return pairs, []
    train, held_out = split_holdout(pairs, cfg.eval_holdout, run.seed)
    note_once(f"--eval_holdout {cfg.eval_holdout:g}: {len(held_out)} of {len(pairs)} pairs are held out of "
              "training to evaluate on.")
    return train, held_out


RM_EVAL_FRACTION = 0.01  # OpenRLHF's train_rm without --eval_dataset


def eval_pairs_of_rm(train_pairs: Sequence[Pair]) -> Sequence[Pair]:
    """What the reward model evaluates on without an eval set, as OpenRLHF's train_rm: the first 1% of its
    training pairs, which stay in training (none under 100 pairs). That evaluation sets the rewards' mean and std
    in the model's config, which PPO's --normalize_reward reads."""
    return subset(train_pairs, np.arange(int(len(train_pairs) * RM_EVAL_FRACTION)))


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
    tokenizer = lazy_tokenizer(cfg.start_model, run)
    count = len(load_pairs(cfg, run, tokenizer)[0])
    tokenizer.keep_records()
    return count


def count_dpo_pairs(run: RunConfig) -> int:
    """Training pairs of DPO that leave a response to learn from."""
    cfg = run.section("dpo", DPOConfig)
    tokenizer = lazy_tokenizer(cfg.start_model, run)
    pairs, _ = load_pairs(cfg, run, tokenizer)
    count = len(trainable_pairs(pairs, cfg.max_len, "--dataset"))
    tokenizer.keep_records()
    return count
