"""A dataset's records in batches, streamed: a JSON Lines file is read line by line (the sha256 of its bytes taken on
the way, its drift fingerprint), each line checked as `records.read_records` checks it, with the same one-sentence
errors; any other source (mixtures, folders, hub names, CSV, Parquet, JSON arrays) is read whole by `read_records`
and handed on in batches. docs/design-notes.md ("Prepared data") has the design.
"""

from __future__ import annotations

import codecs
import hashlib
from dataclasses import dataclass, field
from typing import Iterator

from rlhf_core.data.records import (Record, as_user_error, json_line_record, not_utf8, open_data, read_records,
                                    split_data_dir)
from rlhf_core.errors import UserError
from rlhf_core.storage.locate import is_hub_id, local_path

BATCH_ROWS = 8192


def streams_line_by_line(url: str) -> bool:
    """Whether `url` is one JSON Lines file (not a mixture, folder or hub name) that can be read a line at a time;
    a .json file holding an array is read whole (`read_records`)."""
    import os

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
    of a streamed file's bytes (all of them, past `max_samples` too), else None."""

    url: str
    storage_options: dict | None
    max_samples: int | None = None
    split: str = "train"
    probs: str | None = None
    seed: int = 0
    flag: str = "--dataset"
    batch_rows: int = BATCH_ROWS
    sha256: str | None = field(default=None, init=False)

    def __iter__(self) -> Iterator[list[Record]]:
        if not streams_line_by_line(self.url) or _starts_with_array(self.url, self.storage_options, self.flag):
            records = read_records(self.url, self.storage_options, self.max_samples, split=self.split,
                                   probs=self.probs, seed=self.seed, flag=self.flag)
            for start in range(0, len(records), self.batch_rows):
                yield records[start:start + self.batch_rows]
            return
        try:
            yield from self._lines()
        except UserError:
            raise
        except Exception as error:  # noqa: BLE001 - a store's own error types: translated when understood
            raise as_user_error(error, self.url, self.flag, self.storage_options) from None

    def _lines(self) -> Iterator[list[Record]]:
        digest, batch, count, line_number, offset = hashlib.sha256(), [], 0, 0, 0
        with open_data(self.url, self.storage_options, flag=self.flag) as handle:
            for byte_line, raw in enumerate(handle, start=1):
                digest.update(raw)
                line_start, offset = offset, offset + len(raw)
                if self.max_samples and count >= self.max_samples:
                    continue  # hashed to the end: the fingerprint is the whole file's
                skip = len(codecs.BOM_UTF8) if line_start == 0 and raw.startswith(codecs.BOM_UTF8) else 0
                text = _decode_line(self.url, raw, skip, line_start, byte_line)
                for piece in text.splitlines():  # as read_records splits the whole text
                    line_number += 1
                    if not piece.strip() or (self.max_samples and count >= self.max_samples):
                        continue
                    batch.append(json_line_record(self.url, piece, line_number))
                    count += 1
                    if len(batch) >= self.batch_rows:
                        yield batch
                        batch = []
        self.sha256 = digest.hexdigest()
        if batch:
            yield batch
        if count == 0:
            raise UserError(f"{self.url}: the dataset is empty.")


def _starts_with_array(url: str, storage_options: dict | None, flag: str) -> bool:
    if not url.lower().endswith(".json"):
        return False
    with open_data(url, storage_options, flag=flag) as handle:
        head = handle.read(4096)
    return head[len(codecs.BOM_UTF8) if head.startswith(codecs.BOM_UTF8) else 0:].lstrip().startswith(b"[")


def _decode_line(url: str, raw: bytes, skip: int, line_start: int, line: int) -> str:
    """One line's text; bytes that are not UTF-8 are `records.not_utf8`'s error (its line and byte offset)."""
    try:
        return raw[skip:].decode("utf-8")
    except UnicodeDecodeError as error:
        raise not_utf8(url, line, line_start + skip + error.start, raw[skip + error.start:skip + error.end]) from None
