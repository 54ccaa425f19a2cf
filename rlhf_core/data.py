"""Datasets from any fsspec URL: read, validate, tokenize, and batch in a deterministic order.

Records come from JSONL, JSON (a list of objects) or Parquet. Every problem a user can fix (missing
file, bad JSON, missing key, nothing left after truncation) stops before training with one sentence
that names the file and line. Tokenization follows OpenRLHF's SFT dataset: the prompt (optionally
through the chat template) followed by the response and EOS; prompt tokens are masked out of the loss.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import fsspec
import torch

from rlhf_core.errors import UserError

IGNORE_INDEX = -100


@dataclass(frozen=True)
class Record:
    line: int  # 1-based line (JSONL), item (JSON) or row (Parquet) number, for messages
    fields: dict[str, Any]


@dataclass(frozen=True)
class TokenizedSample:
    input_ids: list[int]
    loss_mask: list[int]  # 1 where the token is a training target


def _open(url: str, storage_options: dict | None, mode: str = "rb"):
    try:
        return fsspec.open(url, mode, **(storage_options or {})).open()
    except FileNotFoundError:
        raise UserError(f"{url}: dataset file not found.") from None
    except (OSError, ValueError) as error:
        raise UserError(f"{url}: cannot open the dataset ({error}).") from None


def read_records(url: str, storage_options: dict | None = None, max_samples: int | None = None) -> list[Record]:
    """All records of a dataset file; raises UserError on anything unreadable."""
    lower = url.lower()
    if lower.endswith(".parquet"):
        records = _read_parquet(url, storage_options)
    else:
        with _open(url, storage_options) as handle:
            text = handle.read().decode("utf-8", errors="replace")
        records = _parse_json_array(url, text) if lower.endswith(".json") else _parse_jsonl(url, text)
    if not records:
        raise UserError(f"{url}: the dataset is empty.")
    return records[:max_samples] if max_samples else records


def _parse_jsonl(url: str, text: str) -> list[Record]:
    records = []
    for line_number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as error:
            raise UserError(f"{url} line {line_number}: invalid JSON ({error.msg}).") from None
        if not isinstance(value, dict):
            raise UserError(f"{url} line {line_number}: expected a JSON object, got {type(value).__name__}.")
        records.append(Record(line_number, value))
    return records


def _parse_json_array(url: str, text: str) -> list[Record]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise UserError(f"{url} line {error.lineno}: invalid JSON ({error.msg}).") from None
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        raise UserError(f"{url}: a .json dataset must be a list of objects.")
    return [Record(index, item) for index, item in enumerate(value, start=1)]


def _read_parquet(url: str, storage_options: dict | None) -> list[Record]:
    import pyarrow.parquet as parquet

    with _open(url, storage_options) as handle:
        try:
            table = parquet.read_table(handle)
        except Exception as error:  # pyarrow raises several unrelated types for a bad file
            raise UserError(f"{url}: not a readable Parquet file ({error}).") from None
    return [Record(index, row) for index, row in enumerate(table.to_pylist(), start=1)]


def require_text(url: str, record: Record, key: str, flag: str) -> str:
    value = record.fields.get(key)
    if value is None:
        raise UserError(f"{url} line {record.line}: no key {key!r} (choose the key with {flag}).")
    if not isinstance(value, str):
        raise UserError(f"{url} line {record.line}: {key!r} must be a string, got {type(value).__name__}.")
    return value


def render_prompt(tokenizer, prompt: str, apply_chat_template: bool) -> str:
    if not apply_chat_template:
        return prompt
    if not getattr(tokenizer, "chat_template", None):
        raise UserError("--apply_chat_template: the tokenizer of --pretrain has no chat template.")
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )


def _bos_ids(tokenizer) -> list[int]:
    """The BOS token to put before a prompt, or nothing for tokenizers without one."""
    return [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []


def tokenize_sft(url: str, records: list[Record], tokenizer, input_key: str, output_key: str,
                 max_len: int, apply_chat_template: bool) -> list[TokenizedSample]:
    """Prompt + response + EOS, truncated to max_len; samples with no response token left are dropped."""
    samples = []
    bos = _bos_ids(tokenizer)
    for record in records:
        prompt = render_prompt(tokenizer, require_text(url, record, input_key, "--input_key"), apply_chat_template)
        response = require_text(url, record, output_key, "--output_key")
        prompt_ids = bos + tokenizer(prompt, add_special_tokens=False).input_ids
        response_ids = tokenizer(response, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        input_ids = (prompt_ids + response_ids)[:max_len]
        loss_mask = ([0] * len(prompt_ids) + [1] * len(response_ids))[:max_len]
        if sum(loss_mask) > 0:
            samples.append(TokenizedSample(input_ids, loss_mask))
    if not samples:
        raise UserError(
            f"{url}: every sample is truncated away at --max_len {max_len} (no response token fits); raise --max_len."
        )
    return samples


def collate_sft(samples: list[TokenizedSample], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-padded input_ids, attention_mask and labels (IGNORE_INDEX outside the response)."""
    length = max(len(sample.input_ids) for sample in samples)
    input_ids = torch.full((len(samples), length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(samples), length), dtype=torch.long)
    labels = torch.full((len(samples), length), IGNORE_INDEX, dtype=torch.long)
    for row, sample in enumerate(samples):
        ids = torch.tensor(sample.input_ids)
        input_ids[row, : len(ids)] = ids
        attention_mask[row, : len(ids)] = 1
        labels[row, : len(ids)] = torch.where(torch.tensor(sample.loss_mask).bool(), ids, IGNORE_INDEX)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def rank_micro_batches(global_indices: list[int], rank: int, world_size: int, micro_batch_size: int) -> list[list[int]]:
    """This rank's micro-batches of one global batch: rank r takes every world_size-th micro-batch."""
    micro_batches = [
        global_indices[start : start + micro_batch_size]
        for start in range(0, len(global_indices), micro_batch_size)
    ]
    return micro_batches[rank::world_size]


def dataset_fingerprint(cfg) -> str:
    """Fingerprint of a stage's data file (dataset or prompt_data), or "" if it has none."""
    url = getattr(cfg, "dataset", None) or getattr(cfg, "prompt_data", None)
    return fingerprint(url) if url else ""


_FINGERPRINTS: dict[tuple, str] = {}


def _version_of(url: str, storage_options: dict | None) -> tuple | None:
    """(url, size, modification stamp or ETag) of a file, or None when the store tells neither."""
    try:
        filesystem, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
        info = filesystem.info(path)
    except (OSError, ValueError):
        return None
    stamp = info.get("mtime") or info.get("ETag") or info.get("LastModified")
    return (url, info.get("size"), str(stamp)) if stamp is not None else None


def fingerprint(url: str, storage_options: dict | None = None) -> str:
    """sha256 of the dataset file, recorded in each checkpoint's metadata. Hashed once per process
    and file version (size and mtime or ETag): every commit asks, and a dataset can be large."""
    version = _version_of(url, storage_options)
    if version in _FINGERPRINTS:
        return _FINGERPRINTS[version]
    digest = hashlib.sha256()
    with _open(url, storage_options) as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    if version is not None:
        _FINGERPRINTS[version] = digest.hexdigest()
    return digest.hexdigest()


@dataclass(frozen=True)
class TokenizedPair:
    chosen_ids: list[int]
    rejected_ids: list[int]


def tokenize_pairs(url: str, records: list[Record], tokenizer, prompt_key: str, chosen_key: str, rejected_key: str,
                   max_len: int, apply_chat_template: bool) -> list[TokenizedPair]:
    """Prompt + chosen and prompt + rejected, each ending in EOS (the reward is read there)."""
    bos = _bos_ids(tokenizer)
    pairs = []
    for record in records:
        prompt = render_prompt(tokenizer, require_text(url, record, prompt_key, "--prompt_key"), apply_chat_template)
        prompt_ids = bos + tokenizer(prompt, add_special_tokens=False).input_ids

        def completion(key: str, flag: str) -> list[int]:
            response = require_text(url, record, key, flag)
            ids = prompt_ids + tokenizer(response, add_special_tokens=False).input_ids
            return ids[: max_len - 1] + [tokenizer.eos_token_id]

        pairs.append(TokenizedPair(completion(chosen_key, "--chosen_key"), completion(rejected_key, "--rejected_key")))
    return pairs


def collate_pairs(pairs: list[TokenizedPair], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Chosen sequences first, then rejected ones, right-padded into one batch."""
    sequences = [pair.chosen_ids for pair in pairs] + [pair.rejected_ids for pair in pairs]
    length = max(map(len, sequences))
    input_ids = torch.full((len(sequences), length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, ids in enumerate(sequences):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention_mask[row, : len(ids)] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def tokenize_prompts(url: str, records: list[Record], tokenizer, input_key: str, prompt_max_len: int,
                     apply_chat_template: bool) -> list[tuple[str, list[int]]]:
    """(prompt text, token ids) per record; long prompts keep their end, which holds the question."""
    bos = _bos_ids(tokenizer)
    prompts = []
    for record in records:
        text = require_text(url, record, input_key, "--input_key")
        ids = tokenizer(render_prompt(tokenizer, text, apply_chat_template), add_special_tokens=False).input_ids
        prompts.append((text, bos + ids[-(prompt_max_len - len(bos)):]))
    return prompts


def split_holdout(items: list, fraction: float, seed: int) -> tuple[list, list]:
    """A fixed (train, held-out) split: the held-out part is drawn by `seed`, the rest keeps its order."""
    from rlhf_core.determinism import generator

    num_held_out = int(len(items) * fraction)
    held_out = set(torch.randperm(len(items), generator=generator(seed, "holdout")).tolist()[:num_held_out])
    return ([item for i, item in enumerate(items) if i not in held_out],
            [item for i, item in enumerate(items) if i in held_out])
