"""A dataset's records in batches, streamed: a JSON Lines file is read line by line (the sha256 of its bytes taken on
the way, its drift fingerprint), each line checked as `records.read_records` checks it, with the same one-sentence
errors; any other source (mixtures, folders, hub names, CSV, Parquet, JSON arrays) is read whole by `read_records`
and handed on in batches. docs/design-notes.md ("Prepared data") has the design.
"""

from __future__ import annotations

import codecs
import hashlib
import os
from dataclasses import dataclass, field
from typing import Iterator

from rlhf_core.data.records import (Record, as_user_error, json_line_record, not_utf8, open_data, read_records,
                                    split_data_dir)
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
    sha256: str | None = field(default=None, init=False)
    position: tuple[int, int | None, str] = field(default=(0, None, "B"), init=False)  # done, total, unit read

    def __iter__(self) -> Iterator[list[Record]]:
        for block in self.blocks():
            yield block if isinstance(block, list) else block.records(self.url)

    def blocks(self) -> Iterator[list[Record] | LineBlock]:
        """The dataset in batches: a JSON Lines file's as `LineBlock`s, its lines not yet parsed (a worker process
        may parse them); any other source's as records, read whole by `read_records`."""
        if not streams_line_by_line(self.url) or _starts_with_array(self.url, self.storage_options, self.flag):
            records = read_records(self.url, self.storage_options, self.max_samples, split=self.split,
                                   probs=self.probs, seed=self.seed, flag=self.flag)
            for start in range(0, len(records), self.batch_rows):
                self.position = (min(start + self.batch_rows, len(records)), len(records), "rows")
                yield records[start:start + self.batch_rows]
            return
        try:
            yield from self._line_blocks()
        except UserError:
            raise
        except Exception as error:  # noqa: BLE001 - a store's own error types: translated when understood
            raise as_user_error(error, self.url, self.flag, self.storage_options) from None

    def _line_blocks(self) -> Iterator[LineBlock]:
        """The file read in large pieces cut after a newline, hashed whole; each piece's text split into lines as
        `read_records` splits the whole text (str.splitlines), numbered, blank ones skipped."""
        digest, count, byte_lines, line_number, offset, rest = hashlib.sha256(), 0, 0, 0, 0, b""
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
                    data = b""  # hashed to the end: the fingerprint is the whole file's
                if data:
                    text = _decode_block(self.url, data, offset, byte_lines)
                    for line in text.splitlines():
                        line_number += 1
                        if not line.strip() or (self.max_samples and count >= self.max_samples):
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
