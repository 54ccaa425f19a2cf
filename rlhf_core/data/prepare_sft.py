"""SFT's prepared samples: the dataset streamed in batches, each batch's texts rendered per record (today's checks
and one-sentence errors, `rlhf_core.data.samples`) and tokenized as one call of the fast tokenizer, in the driver
or in a worker process per core (`rlhf_core.data.workers`), written once into the run's store
(`rlhf_core.data.preparation`) and read back as a lazy sequence of `TokenizedSample`. docs/design-notes.md
("Prepared data") has the design.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlhf_core.data.columns import Columns, PreparedRows
from rlhf_core.data.encoding import BatchEncoder
from rlhf_core.data.preparation import Preparation, prepared_rows, stage_source
from rlhf_core.data.records import Record
from rlhf_core.data.samples import (Renderer, TokenizedSample, assistant_spans, multiturn_conversation, require_text,
                                    sft_texts, tokenize_pretraining, tokenize_sft)
from rlhf_core.notices import warn_once

COLUMNS = {"input_ids": "int32[]", "loss_mask": "int8[]"}


def prepared_sft_samples(cfg, run, tokenizer, evaluation: bool = False) -> PreparedRows:
    """The SFT samples of `cfg` (its --dataset, or --eval_dataset), prepared once in the run's store and
    memory-mapped; the tokenizer's chat template must already be the stage's."""
    source = stage_source(cfg, run.seed, evaluation)
    settings = {"input_key": cfg.input_key, "output_key": cfg.output_key, "input_template": cfg.input_template,
                "apply_chat_template": cfg.apply_chat_template, "max_len": cfg.max_len, "multiturn": cfg.multiturn,
                "pretrain_mode": cfg.pretrain_mode, "packing_samples": cfg.packing_samples}
    job = SFTBatches(Renderer(tokenizer, source.url, cfg.apply_chat_template and not cfg.pretrain_mode,
                              cfg.input_template), cfg.input_key, cfg.output_key, cfg.max_len, cfg.multiturn,
                     cfg.pretrain_mode)
    return prepared_rows(Preparation("sft", settings, job, COLUMNS, TokenizedSample, job.no_rows), source, run,
                         tokenizer)


@dataclass
class SFTBatches:
    """The job of a preparation's batches (`workers.map_batches`): a batch of records as SFT's columns, as
    `samples.tokenize_sft` (or `tokenize_pretraining`) makes them, the texts tokenized as one call. Picklable: a
    worker process gets it once."""

    renderer: Renderer
    input_key: str
    output_key: str | None
    max_len: int
    multiturn: bool
    pretrain_mode: bool
    encode: BatchEncoder | None = field(default=None, repr=False)

    def __call__(self, records: list[Record]) -> Columns:
        if self.encode is None:
            self.encode = BatchEncoder(self.renderer.tokenizer, self.max_len)
        if self.pretrain_mode:
            return _pretraining_batch(self.renderer, self.encode, records, self.input_key)
        return _sft_batch(self.renderer, self.encode, records, self.input_key, self.output_key, self.multiturn)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "encode": None}  # a worker builds its own from the tokenizer

    def no_rows(self) -> None:
        """Raise the sentence today's per-row functions give for a dataset that leaves no sample."""
        renderer = self.renderer
        if self.pretrain_mode:
            tokenize_pretraining(renderer.url, [], renderer.tokenizer, self.input_key, self.max_len)
        tokenize_sft(renderer, [], self.input_key, self.output_key, self.max_len, self.multiturn)


def _sft_batch(renderer: Renderer, encode: BatchEncoder, records: list[Record], input_key: str,
               output_key: str | None, multiturn: bool) -> Columns:
    """`samples.tokenize_sft` of a batch of records, the texts tokenized as one call."""
    max_len = encode.max_len
    assert max_len is not None  # SFT's encoder always truncates at --max_len
    keys = (input_key,) if output_key is None else (input_key, output_key)  # named by a template's refusal
    texts, conversations, kept = [], [], []
    for record in records:
        conversation = None
        if multiturn:
            conversation = multiturn_conversation(renderer, record, input_key, output_key)
            prompt, response = renderer.split(record, conversation[:-1], conversation, keys)
        else:
            prompt, response = sft_texts(renderer, record, input_key, output_key)
        if prompt and response:
            texts.append((prompt, response))
            conversations.append(conversation)
            kept.append(record)
    prompt_ids = encode([prompt for prompt, _ in texts])
    whole_ids = encode.sequences([prompt + response for prompt, response in texts])
    columns: Columns = {"input_ids": [], "loss_mask": []}
    for record, conversation, own_ids, input_ids in zip(kept, conversations, prompt_ids, whole_ids):
        num_prompt = len(own_ids)
        if num_prompt >= max_len - 2:
            continue
        if input_ids[:num_prompt] != own_ids:
            _warn_merge(renderer, record)
        spans = (assistant_spans(renderer, conversation, max_len, record, keys) if conversation is not None
                 else [(num_prompt, len(input_ids) - 1)])
        loss_mask = [0] * len(input_ids)
        for start, end in spans:
            loss_mask[start:end + 1] = [1] * len(loss_mask[start:end + 1])
        columns["input_ids"].append(input_ids)
        columns["loss_mask"].append(loss_mask)
    return columns


def _warn_merge(renderer: Renderer, record: Record) -> None:
    """`samples.tokenize_sft`'s warning, through the same record: it warns once per dataset."""
    warn_once(f"{renderer.url}: the prompt's last token merges with the response's first when tokenized "
              f"together ({record.where(renderer.url)} and maybe others); as in OpenRLHF, the loss starts "
              "after the prompt's own token count, so that first response token is not trained (a template "
              "or --input_template ending in a space does this).", key=f"prompt-token-merges:{renderer.url}")


def _pretraining_batch(renderer: Renderer, encode: BatchEncoder, records: list[Record], input_key: str) -> Columns:
    """`samples.tokenize_pretraining` of a batch of records, tokenized as one call."""
    texts = [renderer.begin(require_text(renderer.url, record, input_key, "--input_key")) for record in records]
    columns: Columns = {"input_ids": [], "loss_mask": []}
    for input_ids in encode(texts):
        if len(input_ids) > 1:  # the first token is never predicted
            columns["input_ids"].append(input_ids)
            columns["loss_mask"].append([1] * len(input_ids))
    return columns
