"""The process reward model's data: texts whose steps end at a placeholder token, each step labelled (a reward
token, or a soft label in [0, 1]); tokenized as OpenRLHF's `train_prm` does, prepared once in the run's store,
and counted for the planner."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from rlhf_core.config import RunConfig
from rlhf_core.data.columns import Columns, FlatColumns
from rlhf_core.data.encoding import BatchEncoder
from rlhf_core.data.preparation import Preparation, prepared_rows, stage_source
from rlhf_core.data.records import Record
from rlhf_core.data.tokenizer_ref import count_with_eval
from rlhf_core.data.samples import IGNORE_INDEX, field_value
from rlhf_core.errors import UserError
from rlhf_core.stages.prm import PRMConfig


COLUMNS = {"input_ids": "int32[]", "labels": "float64[]", "soft": "int8"}


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
    return step_labelled_batch(url, records, tokenizer, cfg, lambda texts: [
        tokenizer(text, add_special_tokens=False, truncation=True, max_length=cfg.max_len).input_ids
        for text in texts])


def step_labelled_batch(url: str, records, tokenizer, cfg,
                        encode: Callable[[list[str]], list[list[int]]]) -> list[StepLabelledSample]:
    """`tokenize_step_labels` with the texts tokenized by `encode` (one call for the batch): each record is
    checked, then the texts of those before the first bad one are tokenized and labelled in order, so the error
    raised is the first bad record's, as one record at a time would raise it."""
    placeholder = single_token_id(tokenizer, cfg.placeholder_token, "--placeholder_token")
    reward_ids = {token: single_token_id(tokenizer, token, "--reward_tokens") for token in cfg.reward_tokens or ()}
    checked, bad = [], None
    for record in records:
        try:
            checked.append((record, *_text_and_labels(url, record, cfg)))
        except UserError as error:
            bad = error
            break
    samples, kinds = [], set()
    for (record, text, values), ids in zip(checked, encode([text for _, text, _ in checked])):
        positions = [index for index, token in enumerate(ids) if token == placeholder]
        labels = [float(IGNORE_INDEX)] * len(ids)
        for position, value in zip(positions, values):
            labels[position] = float(_label_value(url, record, value, cfg, tokenizer, reward_ids))
        kinds.add(not isinstance(values[0], str))
        if len(kinds) > 1:
            raise UserError(f"{record.where(url)}: step labels must all be reward tokens or all numbers in one "
                            "dataset; this record's differ from the ones before.")
        samples.append(StepLabelledSample(ids, labels, soft=not isinstance(values[0], str)))
    if bad is not None:
        raise bad
    return samples


def _text_and_labels(url: str, record: Record, cfg) -> tuple[str, list]:
    text = field_value(url, record, cfg.input_key, "--input_key")
    values = field_value(url, record, cfg.label_key, "--label_key")
    if not isinstance(text, str) or not isinstance(values, list) or not values:
        raise UserError(f"{record.where(url)}: --input_key {cfg.input_key!r} must be a string and --label_key "
                        f"{cfg.label_key!r} a non-empty list of step labels.")
    return text, values


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


def load_step_labelled(run: RunConfig, tokenizer, evaluation: bool = False) -> Sequence[StepLabelledSample]:
    """The training samples, or with `evaluation` those of --eval_dataset: prepared once in the run's store
    (`rlhf_core.data.preparation`) and memory-mapped."""
    cfg = run.section("prm", PRMConfig)
    source = stage_source(cfg, run.seed, evaluation)
    job = StepLabelBatches(source.url, tokenizer, cfg)
    settings = {"input_key": cfg.input_key, "label_key": cfg.label_key, "max_len": cfg.max_len,
                "placeholder_token": cfg.placeholder_token, "reward_tokens": cfg.reward_tokens}
    preparation = Preparation("step_labels", settings, job, COLUMNS, make_sample, job.no_rows,
                              OneLabelKind(lambda: job.todays_error(source.stream(run.storage_options))))
    return prepared_rows(preparation, source, run, tokenizer)


@dataclass
class StepLabelBatches:
    """A batch of step-labelled records as prepared columns (`tokenize_step_labels`, the batch's texts tokenized
    as one call). Picklable: a worker process gets it once and builds its own encoder."""

    url: str
    tokenizer: Any
    cfg: Any
    encode: BatchEncoder | None = field(default=None, repr=False)

    def __call__(self, records: list[Record]) -> Columns:
        if self.encode is None:
            self.encode = BatchEncoder(self.tokenizer, self.cfg.max_len)
        samples = step_labelled_batch(self.url, records, self.tokenizer, self.cfg, self.encode)
        return {"input_ids": [sample.input_ids for sample in samples], "labels": [sample.labels for sample in samples],
                "soft": [sample.soft for sample in samples]}

    def __getstate__(self) -> dict:
        return {**self.__dict__, "encode": None}  # a worker builds its own from the tokenizer

    def no_rows(self) -> None:
        raise UserError(f"{self.url}: the dataset is empty.")

    def todays_error(self, records: Iterable[list[Record]]) -> None:
        """Read the whole dataset as one batch, in this process: `tokenize_step_labels` raises its sentence for
        the first record whose labels are of the other kind."""
        tokenize_step_labels(self.url, [record for batch in records for record in batch], self.tokenizer, self.cfg)


class OneLabelKind:
    """The rule across batches: all reward tokens or all soft labels. A batch of the other kind than the first
    calls `fail`, which names the row."""

    def __init__(self, fail: Callable[[], None]):
        self.fail = fail
        self.soft: bool | None = None  # the first batch's kind

    def __call__(self, batch: FlatColumns) -> None:
        soft = batch["soft"][1]
        if not len(soft):
            return
        self.soft = bool(soft[0]) if self.soft is None else self.soft
        if (soft != self.soft).any():
            self.fail()
            raise AssertionError("step labels of two kinds, but no record named")  # fail raises first


def make_sample(input_ids: list[int], labels: list[float], soft: int) -> StepLabelledSample:
    return StepLabelledSample(input_ids, labels, bool(soft))


def count_step_labelled(run: RunConfig) -> int:
    """Usable training samples; the eval dataset is read too, so its keys and labels are checked before training."""
    return count_with_eval(run, run.section("prm", PRMConfig), load_step_labelled)
