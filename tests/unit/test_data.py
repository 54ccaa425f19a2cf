"""Data: every fixable problem stops with the file and line; tokenization masks the prompt."""

from __future__ import annotations

import json
import os

import pytest

from rlhf_core.data import IGNORE_INDEX, collate_sft, rank_micro_batches, read_records, tokenize_sft
from rlhf_core.determinism import step_sample_indices
from rlhf_core.errors import UserError
from rlhf_core.toy import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def write(path, text):
    path.write_text(text)
    return str(path)


def test_bad_json_names_file_and_line(tmp_path):
    url = write(tmp_path / "d.jsonl", '{"prompt": "a", "response": "b"}\n{"prompt": oops}\n')
    with pytest.raises(UserError, match=r"d.jsonl line 2: invalid JSON"):
        read_records(url)


def test_missing_key_names_line_and_flag(tmp_path, tokenizer):
    url = write(tmp_path / "d.jsonl", '{"prompt": "sort : 1 =", "response": "1"}\n\n{"prompt": "sort : 2 ="}\n')
    with pytest.raises(UserError, match=r"line 3: no key 'response' \(choose the key with --output_key\)"):
        tokenize_sft(url, read_records(url), tokenizer, "prompt", "response", 64, False)


def test_empty_and_missing_files(tmp_path):
    with pytest.raises(UserError, match="the dataset is empty"):
        read_records(write(tmp_path / "e.jsonl", "\n\n"))
    with pytest.raises(UserError, match="dataset file not found"):
        read_records(str(tmp_path / "nope.jsonl"))


def test_everything_truncated_away(tmp_path, tokenizer):
    url = write(tmp_path / "d.jsonl", json.dumps({"prompt": "sort : 1 2 3 4 5 6 7 8 =", "response": "1"}) + "\n")
    with pytest.raises(UserError, match="truncated away at --max_len 8"):
        tokenize_sft(url, read_records(url), tokenizer, "prompt", "response", 8, False)


def test_json_array_and_parquet_and_memory_url(tmp_path, tokenizer):
    import fsspec
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": "sort : 2 1 =", "response": "1 2"}]
    assert read_records(write(tmp_path / "d.json", json.dumps(rows)))[0].fields == rows[0]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    assert read_records(str(tmp_path / "d.parquet"))[0].fields == rows[0]
    with fsspec.open("memory://data/d.jsonl", "w") as handle:
        handle.write(json.dumps(rows[0]) + "\n")
    assert read_records("memory://data/d.jsonl")[0].fields == rows[0]


def test_prompt_tokens_are_masked(tmp_path, tokenizer):
    url = write(tmp_path / "d.jsonl", json.dumps({"prompt": "sort : 2 1 =", "response": "1 2"}) + "\n")
    [sample] = tokenize_sft(url, read_records(url), tokenizer, "prompt", "response", 64, False)
    num_prompt = 1 + len(tokenizer("sort : 2 1 =", add_special_tokens=False).input_ids)  # BOS + prompt
    assert sample.loss_mask == [0] * num_prompt + [1] * 3  # "1", "2", EOS
    labels = collate_sft([sample], tokenizer.pad_token_id)["labels"][0].tolist()
    assert labels[:num_prompt] == [IGNORE_INDEX] * num_prompt
    assert labels[-1] == tokenizer.eos_token_id


def test_chat_template_wraps_the_prompt(tmp_path, tokenizer):
    url = write(tmp_path / "d.jsonl", json.dumps({"prompt": "sort : 2 1 =", "response": "1 2"}) + "\n")
    [plain] = tokenize_sft(url, read_records(url), tokenizer, "prompt", "response", 64, False)
    [chat] = tokenize_sft(url, read_records(url), tokenizer, "prompt", "response", 64, True)
    assert tokenizer.decode(chat.input_ids).startswith("<s> user : sort")
    assert len(chat.input_ids) > len(plain.input_ids)


def test_data_order_is_the_same_at_any_world_size():
    indices = step_sample_indices(step=3, batch_size=8, num_samples=50, seed=42)
    assert len(set(indices)) == 8
    one_rank = rank_micro_batches(indices, rank=0, world_size=1, micro_batch_size=4)
    two_ranks = [rank_micro_batches(indices, rank, 2, 4) for rank in range(2)]
    assert sorted(sum(one_rank, [])) == sorted(sum(sum(two_ranks, []), []))
    assert step_sample_indices(3, 8, 50, 42) == indices != step_sample_indices(3, 8, 50, 43)
    # Steps of one epoch never repeat a sample.
    epoch = sum((step_sample_indices(s, 8, 50, 42) for s in range(6)), [])
    assert len(set(epoch)) == 48


def test_dataset_fingerprint_is_hashed_once_per_file_version(tmp_path, monkeypatch):
    from rlhf_core import data

    path = tmp_path / "d.jsonl"
    path.write_text('{"a": "1"}\n')
    opened = []
    real_open = data._open
    monkeypatch.setattr(data, "_open", lambda *args, **kwargs: opened.append(args[0]) or real_open(*args, **kwargs))
    first = data.fingerprint(str(path))
    assert data.fingerprint(str(path)) == first and len(opened) == 1  # unchanged: not read again
    path.write_text('{"a": "2"}\n')  # same size, new contents
    os.utime(path, ns=(path.stat().st_mtime_ns + 10**9,) * 2)  # a coarse clock could give the same mtime
    assert data.fingerprint(str(path)) != first and len(opened) == 2
