"""Prepared rows as Arrow holds them: a batch's columns flattened (a list column as offsets and values), written
into one Arrow file batch by batch with the preparation's progress, and read back memory-mapped as a lazy sequence
(`PreparedRows`), each item built on demand.

A column's kind is a numpy type with "[]" ("int32[]": a list of numbers per row), a numpy type ("int32",
"float64": one number per row), or "json" (any JSON value per row, as written in the data: a prompt's messages, a label).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from typing import Any, Callable, Iterable, Iterator, overload

import numpy as np

from rlhf_core.faults import fault_point

PROGRESS_EVERY_S = 10.0  # a log line this often while preparing
PROGRESS_DELAY_S = 3.0  # a preparation shorter than this shows no bar

logger = logging.getLogger(__name__)

Columns = dict[str, list]  # a batch of prepared rows: column name -> one value per row
FlatColumns = dict[str, tuple[Any, Any]]  # the same as Arrow holds it: name -> (offsets or None, values)
Position = Callable[[], tuple[int, int | None, str]]  # how far the source is read: done, total, unit


def flatten(columns: Columns, kinds: dict[str, str]) -> FlatColumns:
    """Each column as (offsets, values) numpy arrays for a list kind, (None, values) for a number or JSON: what
    Arrow stores, and cheap to send between processes."""
    flat: FlatColumns = {}
    for name, kind in kinds.items():
        rows = columns[name]
        if kind == "json":
            flat[name] = (None, [json.dumps(value) for value in rows])
        elif kind.endswith("[]"):
            offsets = np.zeros(len(rows) + 1, dtype=np.int32)
            np.cumsum([len(row) for row in rows], out=offsets[1:])
            values = np.fromiter((value for row in rows for value in row), dtype=kind[:-2], count=int(offsets[-1]))
            flat[name] = (offsets, values)
        else:
            flat[name] = (None, np.asarray(rows, dtype=kind))
    return flat


def _arrow_type(kind: str):
    import pyarrow as pa

    if kind == "json":
        return pa.string()
    return pa.list_(getattr(pa, kind[:-2])()) if kind.endswith("[]") else getattr(pa, kind)()


def write_batches(path: str, kinds: dict[str, str], batches: Iterable[FlatColumns], label: str,
                  position: Position | None = None) -> int:
    """Write prepared rows into an Arrow file at `path`, a batch at a time; the fault point `prepare@N` fires
    before batch N. The number of rows written. `position` tells how far the source is read, for the progress."""
    import pyarrow as pa

    schema = pa.schema([(name, _arrow_type(kind)) for name, kind in kinds.items()])
    rows, progress = 0, Progress(label, position)
    with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
        for number, batch in enumerate(batches, start=1):
            fault_point("prepare", number)
            offsets, values = batch[next(iter(kinds))]
            num_rows = len(values) if offsets is None else len(offsets) - 1
            if num_rows == 0:
                continue
            arrays = [pa.ListArray.from_arrays(offsets, values, type=schema.field(name).type) if offsets is not None
                      else pa.array(values, type=schema.field(name).type)
                      for name, (offsets, values) in batch.items()]
            writer.write_batch(pa.record_batch(arrays, schema=schema))
            rows += num_rows
            progress.update(rows)
    progress.close(rows)
    return rows


class Progress:
    """A preparation's progress: a bar with rows per second on a terminal once it has taken PROGRESS_DELAY_S
    (tqdm), and a log line every PROGRESS_EVERY_S for the log file and for runs without a terminal. The bar is
    made at the first batch: a stream knows its size (bytes of a file, rows of a table) only once it is read."""

    def __init__(self, label: str, position: Position | None):
        self.label, self.position = label, position or (lambda: (0, None, "B"))
        self.started = self.reported = time.monotonic()
        self.bar: Any = None

    def _make_bar(self, total: int, unit: str):
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=f"preparing {os.path.basename(self.label)}", unit=unit, unit_scale=True,
                    delay=PROGRESS_DELAY_S, disable=None, leave=False, dynamic_ncols=True)

    def update(self, rows: int) -> None:
        now = time.monotonic()
        done, total, unit = self.position()
        if self.bar is None and total:
            self.bar = self._make_bar(total, unit)
        if self.bar is not None:
            self.bar.set_postfix_str(f"{rows:,} rows, {rows / max(now - self.started, 1e-9):,.0f} rows/s",
                                     refresh=False)
            self.bar.update(done - self.bar.n)
        if now - self.reported > PROGRESS_EVERY_S:
            self.reported = now
            with self._above_bar():
                logger.info("preparing %s: %d rows (%.0f rows/s)", self.label, rows, rows / (now - self.started))

    def _above_bar(self):
        """The log line printed above the bar (tqdm clears it, then draws it again), not through it."""
        import contextlib

        if self.bar is None or self.bar.disable:
            return contextlib.nullcontext()
        return self.bar.external_write_mode()

    def close(self, rows: int) -> None:
        if self.bar is not None:
            self.bar.close()
        elapsed = time.monotonic() - self.started
        # a short one is for the log file only: preflight's console (Prefect's handler, before ours) shows INFO
        logger.log(logging.INFO if elapsed >= PROGRESS_DELAY_S else logging.DEBUG, "prepared %s: %d rows in %.1f s",
                   self.label, rows, elapsed)

class PreparedRows(Sequence):
    """The rows of a prepared Arrow file, memory-mapped: `make(values of one row)` builds each item on demand;
    nothing is held per row."""

    def __init__(self, path: str, make: Callable[..., Any]):
        import pyarrow as pa

        self.path, self.make = path, make
        table = pa.ipc.open_file(pa.memory_map(path, "r")).read_all()
        self.names = table.column_names
        batches = table.to_batches()
        self._chunks = [[_ColumnReader(batch.column(i)) for i in range(batch.num_columns)] for batch in batches]
        self._starts = np.cumsum([0] + [batch.num_rows for batch in batches])
        self._length = int(self._starts[-1])

    def __len__(self) -> int:
        return self._length

    @overload
    def __getitem__(self, index: int) -> Any: ...

    @overload
    def __getitem__(self, index: slice) -> list: ...

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._length))]
        if index < 0:
            index += self._length
        if not 0 <= index < self._length:
            raise IndexError(index)
        chunk = int(np.searchsorted(self._starts, index, side="right")) - 1
        row = index - int(self._starts[chunk])
        return self.make(*(read(row) for read in self._chunks[chunk]))

    def __iter__(self) -> Iterator[Any]:
        return (self[i] for i in range(self._length))

    def __reduce__(self):
        return PreparedRows, (self.path, self.make)

    def column(self, name: str) -> np.ndarray:
        """A number column's values for every row, in order (for a filter over all rows without building items)."""
        index = self.names.index(name)
        return np.concatenate([chunk[index].values for chunk in self._chunks]) if self._chunks else np.array([])


class _ColumnReader:
    """One column of one record batch: the value of a row, from numpy views of the mapped file."""

    def __init__(self, column):
        import pyarrow as pa

        self.kind = "list" if pa.types.is_list(column.type) else "json" if pa.types.is_string(column.type) else "number"
        self.column = column
        if self.kind == "list":
            self.offsets = column.offsets.to_numpy(zero_copy_only=True)
            self.values = column.values.to_numpy(zero_copy_only=True)
        elif self.kind == "number":
            self.values = column.to_numpy(zero_copy_only=True)

    def __call__(self, row: int) -> Any:
        if self.kind == "list":
            return self.values[self.offsets[row]:self.offsets[row + 1]].tolist()
        if self.kind == "number":
            return self.values[row].item()
        return json.loads(self.column[row].as_py())



class Subset(Sequence):
    """Some items of a sequence, by index, in the indices' order: a held-out split or a filter of prepared rows
    that builds no item to choose it."""

    def __init__(self, base: Sequence, indices: np.ndarray):
        self.base, self.indices = base, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self.base[int(i)] for i in self.indices[index]]
        return self.base[int(self.indices[index])]

    def column(self, name: str) -> np.ndarray:
        return column(self.base, name)[self.indices]


def subset(items: Sequence, indices: np.ndarray) -> Sequence:
    """`items` at `indices` (ascending): `items` itself when that is all of them."""
    if len(indices) == len(items):
        return items
    if isinstance(items, Subset):
        return Subset(items.base, items.indices[indices])
    return Subset(items, indices)


def column(items: Sequence, name: str, value_of: Callable[[Any], Any] | None = None) -> np.ndarray:
    """A number column of prepared rows (or of a subset of them) without building items; of any other sequence,
    `value_of` each item."""
    if hasattr(items, "column"):
        return items.column(name)
    if value_of is None:
        raise TypeError(f"{type(items).__name__} has no column {name!r}")
    return np.array([value_of(item) for item in items])
