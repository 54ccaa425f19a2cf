"""Datasets from files, folders or hub names: read (what OpenRLHF's `blending_datasets` reads, mixed as it mixes
them), validate, and batch in a deterministic order (their fingerprints: `rlhf_core.data.fingerprints`); a problem
a user can fix stops before training with one sentence naming the file and line. docs/design-notes.md ("Datasets
and their sources") lists the sources and where this departs from OpenRLHF.
"""

from __future__ import annotations

import codecs
import json
import logging
import os
import re
from dataclasses import dataclass
from collections.abc import Sequence
from typing import Any, Callable, Iterator

import fsspec
import numpy as np

from rlhf_core.data.columns import subset
from rlhf_core.errors import UserError
from rlhf_core.storage.locate import is_hub_id, is_local_url, local_path, not_cached, store_unreachable

SPLIT_FLAGS = {"--dataset": "--dataset_split", "--prompt_data": "--prompt_split", "--eval_dataset": "--eval_split"}
SAVED_DATASET_FILES = ("dataset_dict.json", "state.json")  # what `save_to_disk` writes at the top

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Record:
    line: int  # 1-based line (JSONL), item (JSON array) or row (Parquet, datasets) number, for messages
    fields: dict[str, Any]
    unit: str = "line"  # what `line` counts: "line", "item" or "row"
    source: str | None = None  # the dataset it came from, when several are mixed

    def where(self, url: str) -> str:
        """`file line N` (or item/row), for messages."""
        return f"{self.source or url} {self.unit} {self.line}"


def open_data(url: str, storage_options: dict | None, mode: str = "rb", flag: str = "--dataset"):
    try:
        return fsspec.open(url, mode, **(storage_options or {})).open()
    except FileNotFoundError:
        raise UserError(f"{url}: dataset file not found.") from None
    except IsADirectoryError:
        raise UserError(f"{flag}: {url} is a folder that holds no dataset saved by datasets.") from None
    except Exception as error:  # noqa: BLE001 - a store's own error types; re-raised unless understood
        raise as_user_error(error, url, flag, storage_options) from None


def as_user_error(error: Exception, url: str, flag: str, storage_options: dict | None) -> Exception:
    if isinstance(error, UserError):
        return error
    unreachable = store_unreachable(error, flag, url, storage_options)
    if unreachable is not None:
        return unreachable
    if isinstance(error, (OSError, ValueError)):
        return UserError(f"{url}: cannot open the dataset ({error}).")
    return error


def parse_probs(probs: str | None, num_sources: int) -> list[float] | None:
    if probs is None or (isinstance(probs, str) and not probs.strip()):
        return None
    try:
        weights = [float(part) for part in str(probs).split(",")]
    except ValueError:
        raise UserError(f"--dataset_probs {probs!r}: expected comma-separated numbers such as 0.7,0.3.") from None
    if len(weights) != num_sources:
        raise UserError(f"--dataset_probs {probs!r} has {len(weights)} weights for {num_sources} comma-separated "
                        "datasets; give one weight per dataset.")
    if any(weight < 0 for weight in weights) or sum(weights) <= 0:
        raise UserError(f"--dataset_probs {probs!r}: weights must be non-negative and not all zero.")
    return [weight / sum(weights) for weight in weights]


def interleaved_order(lengths: list[int], weights: list[float], seed: int):
    """OpenRLHF's mixture: `interleave_datasets` with these probabilities, run on (source, row) indices so
    that sources with different columns mix; (source, row) of each mixed row as numpy arrays. Each source's rows
    come in their order, from the first again once it is exhausted, until every source is."""
    import datasets

    indices = [datasets.Dataset.from_dict({"source": np.full(length, k), "row": np.arange(length)})
               for k, length in enumerate(lengths)]
    mixed = datasets.interleave_datasets(indices, probabilities=weights, seed=seed,
                                         stopping_strategy="all_exhausted").with_format("numpy")
    return mixed["source"], mixed["row"]


def split_data_dir(source: str, flag: str) -> tuple[str, str | None]:
    """OpenRLHF's `name@data_dir`: (name, data_dir), or (source, None) without '@' (or for an fsspec URL)."""
    if "@" not in source or "://" in source:
        return source, None
    name, data_dir = (part.strip() for part in source.split("@", 1))
    if not data_dir or not (os.path.isdir(name) or is_hub_id(name)):
        raise UserError(f"{flag}: {source}: name@data_dir needs a hub name or a local folder before '@' and a "
                        "folder inside it after.")
    return name, data_dir


@dataclass
class SourceRows:
    """One source's records: how many (after `max_samples`, for a dataset read through datasets), and the records
    in batches, read as they are asked for (`batches(batch_rows)`) so that no record is held for the whole."""

    length: int
    batches: Callable[[int], Iterator[list[Record] | TableBlock]]
    available: int = -1  # rows before `max_samples` cut a dataset (-1: `length`, none cut)

    def __post_init__(self) -> None:
        self.available = max(self.available, self.length)


def source_rows(source: str, storage_options: dict | None, max_samples: int | None, split: str,
                flag: str) -> SourceRows:
    """The records of one source (a hub name, name@data_dir, a folder or a file), streamed where its format
    allows: a dataset (memory-mapped Arrow) a slice at a time, a Parquet file a batch of its row groups at a time;
    CSV and JSON files are read whole (a JSON Lines file streams through `stream.RecordStream` instead)."""
    name, data_dir = split_data_dir(source, flag)
    if data_dir is not None:
        dataset = (_load_dataset(name, split, flag, data_dir=data_dir) if os.path.isdir(name)
                   else hub_dataset(name, split, flag, data_dir))
        return _dataset_rows(dataset, max_samples)
    path = local_path(source)
    if path is not None and not os.path.exists(path) and is_hub_id(source):
        return _dataset_rows(hub_dataset(source, split, flag), max_samples)
    filesystem, fs_path = fsspec.core.url_to_fs(source, **(storage_options or {}))
    if filesystem.isdir(fs_path):
        return _dataset_rows(_folder_dataset(source, filesystem, fs_path, split, storage_options, flag), max_samples)
    if source.lower().endswith(".parquet"):
        return _parquet_rows(source, storage_options)
    records = _read_file(source, storage_options, flag)
    return SourceRows(len(records), lambda size: (records[start:start + size]
                                                  for start in range(0, len(records), size)))


def _dataset_rows(dataset, max_samples: int | None) -> SourceRows:
    """A datasets Dataset's rows a slice at a time, each slice as Arrow (`TableBlock`: its records are made where
    the batch is prepared, in a worker process for a large dataset)."""
    length = min(max_samples, len(dataset)) if max_samples else len(dataset)
    arrow = dataset.with_format("arrow")

    def batches(size: int) -> Iterator[TableBlock]:
        for start in range(0, length, size):
            yield TableBlock.of(arrow[start:min(start + size, length)], start + 1)

    return SourceRows(length, batches, len(dataset))


def _parquet_rows(url: str, storage_options: dict | None) -> SourceRows:
    """A Parquet file's rows a batch at a time (pyarrow's `iter_batches`): the file is never held whole."""
    import pyarrow.parquet

    def unreadable(error: Exception) -> UserError:
        return UserError(f"{url}: not a readable Parquet file ({error}).")

    with open_data(url, storage_options) as handle:
        try:
            length = pyarrow.parquet.ParquetFile(handle).metadata.num_rows
        except Exception as error:  # pyarrow raises several unrelated types for a bad file
            raise unreadable(error) from None

    def batches(size: int) -> Iterator[TableBlock]:
        with open_data(url, storage_options) as handle:
            done = 0
            try:
                for batch in pyarrow.parquet.ParquetFile(handle).iter_batches(batch_size=size):
                    yield TableBlock.of(pyarrow.Table.from_batches([batch]), done + 1)
                    done += batch.num_rows
            except (OSError, ValueError, pyarrow.ArrowException) as error:
                raise unreadable(error) from None

    return SourceRows(length, batches)


@dataclass
class TableBlock:
    """Rows of a Parquet file or a dataset as Arrow IPC bytes (a slice's own bytes, compact to send to a worker
    process), and the 1-based number of the first; `records` makes their Records where they are prepared."""

    first_number: int
    arrow: bytes
    num_rows: int

    @classmethod
    def of(cls, table, first_number: int) -> TableBlock:
        import pyarrow

        sink = pyarrow.BufferOutputStream()
        with pyarrow.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        return cls(first_number, sink.getvalue().to_pybytes(), table.num_rows)

    def __len__(self) -> int:
        return self.num_rows

    def head(self, num_rows: int) -> TableBlock:
        """The first `num_rows` rows (a dataset cut at --max_samples)."""
        if num_rows >= self.num_rows:
            return self
        import pyarrow

        return TableBlock.of(pyarrow.ipc.open_stream(self.arrow).read_all().slice(0, num_rows), self.first_number)

    def records(self, url: str) -> list[Record]:
        import pyarrow

        rows = pyarrow.ipc.open_stream(self.arrow).read_all().to_pylist()
        return [Record(self.first_number + index, row, "row") for index, row in enumerate(rows)]


def _read_file(url: str, storage_options: dict | None, flag: str) -> list[Record]:
    lower = url.lower()
    if lower.endswith(".csv"):
        return _read_csv(url, storage_options)
    with open_data(url, storage_options, flag=flag) as handle:
        text = _decode(url, handle.read())
    if lower.endswith(".json") and text.lstrip().startswith("["):
        return _parse_json_array(url, text)
    return _parse_jsonl(url, text)  # JSONL, and JSON lines in a .json file (as datasets' json loader reads)


def _decode(url: str, data: bytes) -> str:
    """UTF-8 text (a BOM is skipped); bytes that are not UTF-8 are an error naming line and byte offset."""
    start = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
    try:
        return data[start:].decode("utf-8")
    except UnicodeDecodeError as error:
        offset = start + error.start
        line = data.count(b"\n", 0, offset) + 1
        raise not_utf8(url, line, offset, data[offset:start + error.end]) from None


def not_utf8(url: str, line: int, offset: int, bad: bytes) -> UserError:
    """The error of bytes that are not UTF-8 at byte `offset` of `url` (on its `line`)."""
    return UserError(f"{url} line {line}: bytes that are not UTF-8 at byte offset {offset} ({bad!r}); save the file "
                     "as UTF-8.")


def _parse_jsonl(url: str, text: str) -> list[Record]:
    return [json_line_record(url, line, line_number)
            for line_number, line in enumerate(text.splitlines(), start=1) if line.strip()]


def json_line_record(url: str, text: str, line_number: int) -> Record:
    """The record of one line of a JSON Lines file: a JSON object, else one sentence naming the line."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise UserError(f"{url} line {line_number}: invalid JSON ({error.msg}).") from None
    return object_record(url, value, line_number, "line")


def _parse_json_array(url: str, text: str) -> list[Record]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise UserError(f"{url} line {error.lineno}: invalid JSON ({error.msg}).") from None
    if not isinstance(value, list):
        raise UserError(f"{url}: a .json dataset must be a list of objects (or one object per line).")
    return [object_record(url, item, index, "item") for index, item in enumerate(value, start=1)]


def object_record(url: str, value: object, index: int, unit: str) -> Record:
    """A record of a JSON dataset, which must be an object (`unit`: "line" of JSON Lines, "item" of an array)."""
    if not isinstance(value, dict):
        raise UserError(f"{url} {unit} {index}: expected a JSON object, got {type(value).__name__}.")
    return Record(index, value, unit)


def _read_csv(url: str, storage_options: dict | None) -> list[Record]:
    import pyarrow.csv

    with open_data(url, storage_options) as handle:
        try:
            table = pyarrow.csv.read_csv(handle)
        except Exception as error:  # pyarrow raises several unrelated types for a bad file
            raise UserError(f"{url}: not a readable Csv file ({error}).") from None
    return [Record(index, row, "row") for index, row in enumerate(table.to_pylist(), start=1)]


def _pick_split(name: str, dataset, split: str, flag: str):
    """The `split` of a DatasetDict; a plain Dataset is used whole (OpenRLHF does the same)."""
    if not hasattr(dataset, "keys"):
        return dataset
    if split not in dataset:
        raise UserError(f"{flag}: {name} has no split {split!r} (it has {', '.join(dataset.keys())}); "
                        f"choose one with {SPLIT_FLAGS.get(flag, '--dataset_split')}.")
    return dataset[split]


def _load_dataset(path: str, split: str, flag: str, name: str | None = None, data_dir: str | None = None):
    """`datasets.load_dataset(path, split=split)`, an unknown split named with the user's flag and `name`."""
    import datasets

    try:
        return datasets.load_dataset(path, split=split, data_dir=data_dir)
    except ValueError as error:
        if "split" not in str(error).lower():
            raise
        choices = re.search(r"one of \[(.*)\]", str(error))
        has = f"it has {choices.group(1)}" if choices else str(error).rstrip(".")
        raise UserError(f"{flag}: {name or path} has no split {split!r} ({has}); choose one with "
                        f"{SPLIT_FLAGS.get(flag, '--dataset_split')}.") from None


def hub_dataset(name: str, split: str, flag: str, data_dir: str | None = None):
    """A hub dataset from `datasets`' cache (or the hub when online), else from a cached hub snapshot."""
    from rlhf_core.storage.locate import hub_snapshot

    try:
        return _load_dataset(name, split, flag, data_dir=data_dir)
    except (ConnectionError, FileNotFoundError) as error:  # offline / not on the hub / unreachable
        snapshot = hub_snapshot(name, repo_type="dataset", download=False)
        if snapshot is None:
            raise not_cached(flag, name, "dataset") from error
    if data_dir is not None and not os.path.isdir(os.path.join(snapshot, data_dir)):
        raise UserError(f"{flag}: {name}@{data_dir}: the cached dataset has no folder {data_dir!r}.")
    return _load_dataset(snapshot, split, flag, name, data_dir)


def _folder_dataset(url: str, filesystem, path: str, split: str, storage_options: dict | None, flag: str):
    """A folder written by `save_to_disk` (any store), or a local folder of data files."""
    import datasets

    if any(filesystem.exists(f"{path.rstrip('/')}/{name}") for name in SAVED_DATASET_FILES):
        try:
            return _pick_split(url, datasets.load_from_disk(url, storage_options=storage_options), split, flag)
        except (FileNotFoundError, ValueError) as error:
            raise UserError(f"{flag}: {url} is not a readable dataset saved by datasets ({error}).") from None
    if not is_local_url(url):
        raise UserError(f"{flag}: {url} is a folder that holds no dataset saved by datasets (save_to_disk); "
                        "give a file or a hub name.")
    try:
        return _load_dataset(path, split, flag)
    except FileNotFoundError as error:
        raise UserError(f"{flag}: {url} is a folder without data files datasets can read ({error}).") from None


def rank_micro_batches(global_indices: list[int], rank: int, world_size: int, micro_batch_size: int) -> list[list[int]]:
    """This rank's micro-batches of one global batch: rank r takes every world_size-th micro-batch."""
    micro_batches = [
        global_indices[start : start + micro_batch_size]
        for start in range(0, len(global_indices), micro_batch_size)
    ]
    return micro_batches[rank::world_size]


def split_holdout(items: Sequence, fraction: float, seed: int) -> tuple[Sequence, Sequence]:
    """A fixed (train, held-out) split: the held-out part is drawn by `seed`; both keep the items' order. Views
    by index (`columns.subset`): no item is built to split them."""
    import torch  # here, not at the top: a preparation's worker processes import this module and need no torch

    from rlhf_core.data.determinism import generator

    num_held_out = int(len(items) * fraction)
    held_out = np.zeros(len(items), dtype=bool)
    held_out[torch.randperm(len(items), generator=generator(seed, "holdout")).numpy()[:num_held_out]] = True
    return subset(items, np.flatnonzero(~held_out)), subset(items, np.flatnonzero(held_out))
