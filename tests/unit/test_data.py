"""Data: every fixable problem stops with the file and line; tokenization masks the prompt."""

from __future__ import annotations

import json
import logging
import os

import pytest

from rlhf_core.data.records import rank_micro_batches
from rlhf_core.data.stream import RecordStream, read_records
from rlhf_core.data.determinism import step_sample_indices
from rlhf_core.errors import UserError
from rlhf_core.data.samples import IGNORE_INDEX, PairKeys, Renderer, collate_sft, tokenize_pairs, tokenize_prompts
from rlhf_core.data.samples import tokenize_sft as _tokenize_sft
from rlhf_core.toy import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def tokenize_sft(url, records, tokenizer, input_key, output_key, max_len, chat, input_template=None):
    return _tokenize_sft(Renderer(tokenizer, url, chat, input_template), records, input_key, output_key, max_len)


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
    with pytest.raises(UserError, match="no sample fits --max_len 8"):
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
    assert sample.input_ids[0] == tokenizer.bos_token_id  # the toy's tokenizer adds BOS to plain text, as Llama's
    assert sample.loss_mask == [0] * num_prompt + [1] * 3  # "1", "2", EOS
    labels = collate_sft([sample], tokenizer.pad_token_id)["labels"][0].tolist()
    assert labels[:num_prompt] == [IGNORE_INDEX] * num_prompt
    assert labels[-1] == tokenizer.eos_token_id


def test_chat_template_wraps_the_prompt(tmp_path, tokenizer):
    url = write(tmp_path / "d.jsonl", json.dumps({"prompt": "sort : 2 1 =", "response": "1 2"}) + "\n")
    [plain] = tokenize_sft(url, read_records(url), tokenizer, "prompt", "response", 64, False)
    [chat] = tokenize_sft(url, read_records(url), tokenizer, "prompt", "response", 64, True)
    assert tokenizer.decode(chat.input_ids).startswith("user : sort")  # the template writes no BOS: none added
    assert tokenizer.decode(chat.input_ids).endswith("assistant : 1 2 </s>")
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
    from rlhf_core.data import fingerprints as data

    path = tmp_path / "d.jsonl"
    path.write_text('{"a": "1"}\n')
    opened = []
    real_open = data.open_data
    monkeypatch.setattr(data, "open_data", lambda *args, **kwargs: opened.append(args[0]) or real_open(*args, **kwargs))
    first = data.fingerprint(str(path))
    assert data.fingerprint(str(path)) == first and len(opened) == 1  # unchanged: not read again
    path.write_text('{"a": "2"}\n')  # same size, new contents
    os.utime(path, ns=(path.stat().st_mtime_ns + 10**9,) * 2)  # a coarse clock could give the same mtime
    assert data.fingerprint(str(path)) != first and len(opened) == 2


def test_bytes_that_are_not_utf8_name_file_line_and_offset(tmp_path):
    path = tmp_path / "d.jsonl"
    good = b'{"prompt": "a", "response": "b"}\n'
    path.write_bytes(good + b'{"prompt": "caf\xe9", "response": "b"}\n')
    offset = len(good) + len(b'{"prompt": "caf')
    with pytest.raises(UserError, match=rf"d\.jsonl line 2: bytes that are not UTF-8 at byte offset {offset} "):
        read_records(str(path))
    path.write_bytes(b"\xef\xbb\xbf" + good)  # a UTF-8 BOM is fine
    assert read_records(str(path))[0].fields["prompt"] == "a"


def test_json_array_problems_name_the_item_and_syntax_errors_the_line(tmp_path, tokenizer):
    url = write(tmp_path / "d.json", json.dumps([{"prompt": "sort : 1 =", "response": "1"}, {"prompt": "x"}]))
    with pytest.raises(UserError, match=r"d\.json item 2: no key 'response'"):
        tokenize_sft(url, read_records(url), tokenizer, "prompt", "response", 64, False)
    with pytest.raises(UserError, match=r"d\.json item 2: expected a JSON object, got int"):
        read_records(write(tmp_path / "d.json", '[{"prompt": "a"}, 3]'))
    with pytest.raises(UserError, match=r"d\.json line 3: invalid JSON"):
        read_records(write(tmp_path / "d.json", '[\n{"prompt": "a"},\n{"prompt": }\n]'))
    # JSON lines in a .json file, as datasets' json loader reads them
    lines = read_records(write(tmp_path / "l.json", '{"prompt": "a"}\n{"prompt": "b"}\n'))
    assert [record.fields["prompt"] for record in lines] == ["a", "b"] and lines[1].where("x") == "x line 2"


def test_csv_rows(tmp_path):
    records = read_records(write(tmp_path / "d.csv", "prompt,response\nsort : 2 1 =,1 2\n"))
    assert records[0].fields == {"prompt": "sort : 2 1 =", "response": "1 2"} and records[0].unit == "row"


def test_input_template_wraps_the_prompt_unless_a_chat_template_applies(tmp_path, tokenizer, caplog):
    template = "sort : {} ="
    url = write(tmp_path / "d.jsonl", json.dumps({"prompt": "2 1", "response": "1 2", "bad": "1"}) + "\n")
    records = read_records(url)
    plain, chat = Renderer(tokenizer, url, False, template), Renderer(tokenizer, url, True, template)
    [chat_prompt] = tokenize_prompts(chat, records, "prompt", 64)
    assert tokenizer.decode(chat_prompt.ids) == "user : 2 1 assistant :"  # the chat template wins over the template
    [sample] = tokenize_sft(url, records, tokenizer, "prompt", "response", 64, False, input_template=template)
    assert tokenizer.decode(sample.input_ids).startswith("<s> sort : 2 1 =")
    [item] = tokenize_prompts(plain, records, "prompt", 64)
    assert item.value == "2 1" and tokenizer.decode(item.ids) == "<s> sort : 2 1 =" and item.bos_added
    [pair] = tokenize_pairs(plain, records, PairKeys("prompt", "response", "bad"), 64)
    assert tokenizer.decode(pair.chosen_ids).startswith("<s> sort : 2 1 =")
    with caplog.at_level(logging.WARNING):  # OpenRLHF sets a template without '{}' to None, with a warning
        [as_written] = tokenize_prompts(Renderer(tokenizer, url, False, "User: "), records, "prompt", 64)
    assert tokenizer.decode(as_written.ids) == "<s> 2 1"
    assert "--input_template 'User: ' has no '{}' where the prompt goes, so it is not used" in caplog.text
    with pytest.raises(UserError, match=r"^--input_template 'Q \{\} \{name\}' is not a str\.format template"):
        tokenize_prompts(Renderer(tokenizer, url, False, "Q {} {name}"), records, "prompt", 64)


def test_unreachable_s3_dataset_names_flag_url_and_endpoint(monkeypatch):
    pytest.importorskip("s3fs")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing-secret")
    options = {"endpoint_url": "http://127.0.0.1:9", "config_kwargs": {"retries": {"max_attempts": 1}}}
    with pytest.raises(UserError, match=r"^--prompt_data: cannot reach the store of s3://bucket/d\.jsonl at "
                                        r"http://127\.0\.0\.1:9 \(EndpointConnectionError\)"):
        read_records(RecordStream("s3://bucket/d.jsonl", options, flag="--prompt_data"))


def test_fingerprints_of_folders_and_mixtures(tmp_path):
    from rlhf_core.data.fingerprints import fingerprint

    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "a.jsonl").write_text('{"a": "1"}\n')
    before = fingerprint(str(folder))
    (folder / "b.jsonl").write_text('{"a": "2"}\n')
    assert fingerprint(str(folder)) != before
    first, second = write(tmp_path / "1.jsonl", '{"a": "1"}\n'), write(tmp_path / "2.jsonl", '{"a": "2"}\n')
    assert fingerprint(f"{first},{second}") != fingerprint(f"{second},{first}") != fingerprint(first)


def test_pretrain_mode_and_a_replacement_chat_template(toy_assets, tmp_path):
    """OpenRLHF's --pretrain_mode (every token of input_key a target) and --tokenizer_chat_template."""
    from rlhf_core.config import RunConfig
    from rlhf_core.stages.sft import SFTConfig
    from rlhf_core.storage.locate import load_tokenizer
    from rlhf_core.data.sft import load_sft_samples

    def samples(**settings):
        run = RunConfig(sft=SFTConfig(pretrain=toy_assets["model"], dataset=toy_assets["sft"], input_key="prompt",
                                      output_key="response", max_len=64, max_samples=4, **settings))
        return load_sft_samples(run, load_tokenizer(toy_assets["model"]))

    pretraining = samples(pretrain_mode=True)
    assert all(sum(sample.loss_mask) == len(sample.input_ids) for sample in pretraining)
    tokenizer = load_tokenizer(toy_assets["model"])
    first_prompt = read_records(toy_assets["sft"])[0].fields["prompt"]
    assert pretraining[0].input_ids[1:] == tokenizer(first_prompt, add_special_tokens=False).input_ids
    plain, templated = samples(apply_chat_template=True), samples(
        apply_chat_template=True, tokenizer_chat_template="{% for m in messages %}user = {{ m['content'] }}{% endfor %}")
    assert templated[0].input_ids != plain[0].input_ids
    assert tokenizer.convert_tokens_to_ids("=") in templated[0].input_ids[:3]  # the replacement's "user ="
