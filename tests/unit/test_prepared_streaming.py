"""A preparation streams every kind of source: a Parquet file, a hub dataset (parquet shards in the HF cache) and a
mixture hold no `Record` per row in this process at once, only a few batches of them, and come out in the order
`read_records` gave (for a mixture, `datasets.interleave_datasets`' own order of the rows)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from rlhf_core.data.preparation import Preparation, Source, prepared_rows
from rlhf_core.data.records import Record
from rlhf_core.data.stream import BATCH_ROWS
from rlhf_core.data.workers import WORKERS_ENV_VAR
from rlhf_core.errors import UserError
from rlhf_core.storage.locate import load_tokenizer
from tests.hub_cache import save_dataset
from tests.unit.test_hub import hf_home, write_parquet  # noqa: F401 - the fixture

NUM_ROWS = 5 * BATCH_ROWS


class LiveRecords:
    """How many Records exist at once, at most (each counted from its __init__ to its __del__)."""

    def __init__(self, monkeypatch):
        self.live = self.peak = 0
        init = Record.__init__

        def counted_init(record, *args, **kwargs):
            init(record, *args, **kwargs)
            self.live += 1
            self.peak = max(self.peak, self.live)

        def counted_del(record):
            self.live -= 1

        monkeypatch.setattr(Record, "__init__", counted_init)
        monkeypatch.setattr(Record, "__del__", counted_del, raising=False)


def ids_of(records: list[Record]) -> dict[str, list]:
    return {"id": [record.fields["id"] for record in records]}


def no_rows() -> None:
    raise UserError("empty")


def prepare(url: str, tmp_path, toy_assets, probs: str | None = None) -> list[int]:
    run = SimpleNamespace(ckpt_path=str(tmp_path / "ckpt"), storage_options=None)
    preparation = Preparation("ids", {}, ids_of, {"id": "int64"}, lambda value: value, no_rows)
    rows = prepared_rows(preparation, Source(url, "--dataset", probs=probs, seed=3), run,
                         load_tokenizer(toy_assets["model"]))
    return list(rows)


def rows(first: int, count: int) -> list[dict]:
    return [{"id": first + i, "text": f"row {first + i}"} for i in range(count)]


@pytest.fixture
def live(monkeypatch):
    monkeypatch.setenv(WORKERS_ENV_VAR, "1")  # every batch in this process, where the records are counted
    return LiveRecords(monkeypatch)


def test_a_parquet_file_streams(tmp_path, toy_assets, live):
    write_parquet(tmp_path / "d.parquet", rows(0, NUM_ROWS))
    assert prepare(str(tmp_path / "d.parquet"), tmp_path, toy_assets) == list(range(NUM_ROWS))
    assert live.peak <= 2 * BATCH_ROWS


def test_a_hub_dataset_streams(tmp_path, toy_assets, hf_home, live):  # noqa: F811 - the fixture
    save_dataset(hf_home, "org/prefs", {"train": rows(0, NUM_ROWS)})
    assert prepare("org/prefs", tmp_path, toy_assets) == list(range(NUM_ROWS))
    assert live.peak <= 2 * BATCH_ROWS


@pytest.mark.parametrize("probs", [None, "0.7,0.3"])
def test_a_mixture_streams_in_interleave_datasets_order(tmp_path, toy_assets, live, probs):
    import datasets

    first, second = rows(0, NUM_ROWS), rows(10**6, BATCH_ROWS + 17)
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(row) + "\n" for row in first))
    write_parquet(tmp_path / "b.parquet", second)
    got = prepare(f"{tmp_path / 'a.jsonl'},{tmp_path / 'b.parquet'}", tmp_path, toy_assets, probs)
    if probs is None:
        expected = [row["id"] for row in first + second]
    else:
        mixed = datasets.interleave_datasets([datasets.Dataset.from_list(first), datasets.Dataset.from_list(second)],
                                             probabilities=[0.7, 0.3], seed=3, stopping_strategy="all_exhausted")
        expected = mixed["id"]
    assert got == expected and len(got) >= len(first) + len(second)
    assert live.peak <= 4 * BATCH_ROWS  # a batch being mixed, a read-ahead block of each source, the last batch


@pytest.mark.parametrize("name", ["d.jsonl", "d.parquet"])
def test_max_samples_that_cuts_the_data_says_so_once(tmp_path, toy_assets, caplog, name):
    path = tmp_path / name
    if name.endswith(".jsonl"):
        path.write_text("".join(json.dumps(row) + "\n" + "\n" * (i % 2) for i, row in enumerate(rows(0, 30))))
    else:
        write_parquet(path, rows(0, 30))
    run = SimpleNamespace(ckpt_path=str(tmp_path / "ckpt"), storage_options=None)
    preparation = Preparation("ids", {}, ids_of, {"id": "int64"}, lambda value: value, no_rows)
    tokenizer = load_tokenizer(toy_assets["model"])
    with caplog.at_level("INFO", logger="rlhf_core"):
        for _ in range(2):  # prepared, then found prepared: one line
            assert len(prepared_rows(preparation, Source(str(path), "--dataset", max_samples=20), run, tokenizer)) == 20
    said = [record.getMessage() for record in caplog.records if "--max_samples" in record.getMessage()]
    assert said == [f"--max_samples 20: --dataset {path} is cut to its first 20 rows; 10 of its 30 rows are dropped."]
