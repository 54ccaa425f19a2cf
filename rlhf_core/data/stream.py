"""A dataset's records in batches, streamed: a JSON Lines file is read line by line (the sha256 of its bytes taken on
the way, its drift fingerprint), each line checked as `read_records` (below) checks it, with the same one-sentence
errors; a Parquet file a batch of rows at a time, a dataset read through datasets (hub names, folders) a slice at a
time, a mixture as its sources' streams interleaved; CSV and JSON arrays are read whole and handed on in batches.
docs/design-notes.md ("Prepared data") has the design.
"""

from __future__ import annotations

import codecs
import hashlib
import os
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Iterator

import numpy as np

from rlhf_core.data.records import (Record, TableBlock, as_user_error, interleaved_order, json_line_record, not_utf8, open_data,
                                    parse_probs, source_rows, split_data_dir)
from rlhf_core.errors import UserError
from rlhf_core.storage.locate import is_hub_id, local_path

BATCH_ROWS = 8192
READ_BYTES = 1 << 20  # a read's size: the file is hashed and split in pieces this large, cut after a newline


def streams_line_by_line(url: str) -> bool:
    """Whether `url` is one JSON Lines file (not a mixture, folder or hub name) that can be read a line at a time;
    a .json file holding an array is read whole (`read_records`)."""
    if "," in url or split_data_dir(url, "--dataset")[1] is not None:
        return False
    lower = url.lower()
    if not (lower.endswith(".jsonl") or lower.endswith(".json")):
        return False
    path = local_path(url)
    if path is not None and (os.path.isdir(path) or (not os.path.exists(path) and is_hub_id(url))):
        return False
    return True


@dataclass
class RecordStream:
    """The records of a stage's dataset in batches of `batch_rows`; after iterating, `sha256` holds the sha256
    of a streamed file's bytes (all of them, past `max_samples` too), else None. With `hash_whole_file` False a
    streamed file is read only as far as `max_samples` (a first look at its rows), and `sha256` stays None."""

    url: str
    storage_options: dict | None
    max_samples: int | None = None
    split: str = "train"
    probs: str | None = None
    seed: int = 0
    flag: str = "--dataset"
    batch_rows: int = BATCH_ROWS
    hash_whole_file: bool = True
    dataset_max_samples: int | None = None  # a mixture's source: max_samples that cuts a dataset, not a file
    sha256: str | None = field(default=None, init=False)
    position: tuple[int, int | None, str] = field(default=(0, None, "B"), init=False)  # done, total, unit read
    cut: tuple[int, int] | None = field(default=None, init=False)  # (kept, dropped) when max_samples cut rows

    def __iter__(self) -> Iterator[list[Record]]:
        for block in self.blocks():
            yield block if isinstance(block, list) else block.records(self.url)

    def blocks(self) -> Iterator[list[Record] | LineBlock | TableBlock]:
        """The dataset in batches: a JSON Lines file's as `LineBlock`s, its lines not yet parsed, a Parquet file's
        or a dataset's as `TableBlock`s, Arrow not yet made records (a worker process may do either); any other
        source's as records, read a batch at a time (`records.source_rows`); a mixture's
        as its sources' records, interleaved as OpenRLHF mixes them."""
        sources = [part.strip() for part in self.url.split(",") if part.strip()]
        if not sources:
            raise UserError(f"{self.flag}: no dataset given.")
        weights = parse_probs(self.probs, len(sources))  # checked for one dataset too, as read_records did
        if len(sources) > 1:
            yield from self._mixed(sources, weights)
        elif streams_line_by_line(self.url) and not _starts_with_array(self.url, self.storage_options, self.flag):
            yield from self._guarded(self._line_blocks())
        else:
            yield from self._guarded(self._row_blocks())

    def _guarded(self, blocks: Iterator) -> Iterator:
        try:
            yield from blocks
        except UserError:
            raise
        except Exception as error:  # noqa: BLE001 - a store's own error types: translated when understood
            raise as_user_error(error, self.url, self.flag, self.storage_options) from None

    def _source_rows(self):
        return source_rows(self.url, self.storage_options, self.max_samples or self.dataset_max_samples, self.split,
                           self.flag)

    def _row_blocks(self) -> Iterator[list[Record] | TableBlock]:
        rows = self._source_rows()
        if rows.length == 0:
            raise UserError(f"{self.url}: the dataset is empty.")
        total = min(rows.length, self.max_samples) if self.max_samples else rows.length
        if rows.available > total:
            self.cut = (total, rows.available - total)
        done = 0
        for batch in rows.batches(self.batch_rows):
            batch = batch.head(total - done) if isinstance(batch, TableBlock) else batch[:total - done]
            done += len(batch)
            self.position = (done, total, "rows")
            if batch:
                yield batch
            if done >= total:
                return

    def count(self) -> int:
        """How many records a pass yields (a JSON Lines file is read once to count its lines, nothing parsed)."""
        if streams_line_by_line(self.url) and not _starts_with_array(self.url, self.storage_options, self.flag):
            return sum(len(block.texts) for block in self._guarded(self._line_blocks()))
        try:
            return self._source_rows().length
        except UserError:
            raise
        except Exception as error:  # noqa: BLE001 - a store's own error types: translated when understood
            raise as_user_error(error, self.url, self.flag, self.storage_options) from None

    def _mixed(self, sources: list[str], weights: list[float] | None) -> Iterator[list[Record]]:
        """A mixture as `read_records` mixed it whole: each source read as far as it goes (a dataset read through
        datasets to `max_samples`), concatenated, or interleaved by `probs` (`records.interleaved_order`), the
        mixture cut at `max_samples`; each record names its source. Every source is opened and counted first, so
        one that cannot be read stops the run before anything is prepared."""
        parts = [RecordStream(source, self.storage_options, None, self.split, flag=self.flag,
                              batch_rows=self.batch_rows, dataset_max_samples=self.max_samples) for source in sources]
        lengths = [part.count() for part in parts]
        for part, length in zip(parts, lengths):
            if length == 0:
                raise UserError(f"{part.url}: the dataset is empty.")
        if weights is None:  # OpenRLHF concatenates when no probabilities are given
            order = np.repeat(np.arange(len(parts)), lengths), np.concatenate([np.arange(n) for n in lengths])
        else:
            order = interleaved_order(lengths, weights, self.seed)
        total = min(len(order[0]), self.max_samples) if self.max_samples else len(order[0])
        if len(order[0]) > total:
            self.cut = (total, len(order[0]) - total)
        readers = [_Cycling(part) for part in parts]
        for start in range(0, total, self.batch_rows):
            end = min(start + self.batch_rows, total)
            batch = [readers[k].next_record(row) for k, row in zip(order[0][start:end].tolist(),
                                                                    order[1][start:end].tolist())]
            self.position = (end, total, "rows")
            yield batch
    def _line_blocks(self) -> Iterator[LineBlock]:
        """The file read in large pieces cut after a newline, hashed whole; each piece's text split into lines as
        `read_records` splits the whole text (str.splitlines), numbered, blank ones skipped."""
        digest, count, byte_lines, line_number, offset, rest, dropped = hashlib.sha256(), 0, 0, 0, 0, b"", 0
        block = LineBlock([], [])
        with open_data(self.url, self.storage_options, flag=self.flag) as handle:
            size = getattr(handle, "size", None)
            total = size if isinstance(size, int) else _file_size(handle)
            while True:
                piece = handle.read(READ_BYTES)
                digest.update(piece)
                data = rest + piece
                cut = len(data) if not piece else data.rfind(b"\n") + 1
                data, rest = data[:cut], data[cut:]
                if self.max_samples and count >= self.max_samples:
                    if not self.hash_whole_file:
                        break
                    # hashed to the end (the fingerprint is the whole file's), its rows only counted
                    dropped += sum(1 for line in data.splitlines() if line.strip())
                    data = b""
                if data:
                    text = _decode_block(self.url, data, offset, byte_lines)
                    for line in text.splitlines():
                        line_number += 1
                        if not line.strip():
                            continue
                        if self.max_samples and count >= self.max_samples:
                            dropped += 1
                            continue
                        block.numbers.append(line_number)
                        block.texts.append(line)
                        count += 1
                        if len(block.texts) >= self.batch_rows:
                            yield block
                            block = LineBlock([], [])
                    byte_lines += data.count(b"\n")
                offset += len(data)
                self.position = (offset + len(rest), total, "B")
                if not piece:
                    break
        self.sha256 = digest.hexdigest() if not piece else None
        if dropped and not piece:
            self.cut = (count, dropped)
        if block.texts:
            yield block
        if count == 0:
            raise UserError(f"{self.url}: the dataset is empty.")


@dataclass
class LineBlock:
    """Lines of a JSON Lines file, not yet parsed: their 1-based numbers and their texts."""

    numbers: list[int]
    texts: list[str]

    def records(self, url: str) -> list[Record]:
        return [json_line_record(url, text, number) for number, text in zip(self.numbers, self.texts)]


class _Cycling:
    """One source of a mixture read in order, from its start again once exhausted (as `interleave_datasets`
    takes a source's rows), each record naming its source."""

    def __init__(self, stream: RecordStream):
        self.stream, self.next_row = stream, 0
        self.batches: Iterator[list[Record]] = iter(())
        self.pending: deque[Record] = deque()

    def next_record(self, row: int) -> Record:
        if row == 0 and self.next_row != 0:  # exhausted: read it again from the start (rows come in order)
            self.batches, self.pending = iter(()), deque()
        while not self.pending:
            block = next(self.batches, None)
            if block is None:
                self.batches = iter(self.stream)
                continue
            self.pending.extend(block)
        record = self.pending.popleft()
        self.next_row = row + 1
        return replace(record, source=self.stream.url)


def _file_size(handle) -> int | None:
    try:
        return os.fstat(handle.fileno()).st_size
    except (AttributeError, OSError, ValueError):
        return None


def _starts_with_array(url: str, storage_options: dict | None, flag: str) -> bool:
    if not url.lower().endswith(".json"):
        return False
    with open_data(url, storage_options, flag=flag) as handle:
        head = handle.read(4096)
    return head[len(codecs.BOM_UTF8) if head.startswith(codecs.BOM_UTF8) else 0:].lstrip().startswith(b"[")


def _decode_block(url: str, data: bytes, offset: int, byte_lines: int) -> str:
    """The text of whole lines of the file starting at byte `offset` (after `byte_lines` newlines), its BOM
    dropped at the file's start; bytes that are not UTF-8 are `records.not_utf8`'s error, naming their line and
    byte offset."""
    skip = len(codecs.BOM_UTF8) if offset == 0 and data.startswith(codecs.BOM_UTF8) else 0
    try:
        return data[skip:].decode("utf-8")
    except UnicodeDecodeError as error:
        start = skip + error.start
        line = byte_lines + data.count(b"\n", 0, start) + 1
        raise not_utf8(url, line, offset + start, data[start:skip + error.end]) from None


def read_records(source: str | RecordStream) -> list[Record]:
    """All records of `source`, a RecordStream (its dataset(s), comma-separated for a mixture weighted by its
    `probs`; its split, max_samples and storage options), or a URL read with RecordStream's defaults; raises
    UserError on anything unreadable, naming the stream's `flag` where no file can be named. The records that a
    preparation reads batch by batch, held in one list."""
    stream = RecordStream(source, None) if isinstance(source, str) else source
    return [record for batch in stream for record in batch]
