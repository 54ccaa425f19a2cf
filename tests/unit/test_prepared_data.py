"""Prepared data (issue 33): SFT's samples are read, checked and tokenized once into the run's store, found again by
a key of everything they depend on, rebuilt when any input changes or the preparation is damaged, never left
half-written by a kill; the samples are today's (`tokenize_sft`), and the drift check reads the hash recorded."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_core.config import RunConfig
from rlhf_core.data import fingerprints, records
from rlhf_core.data.prepared import DATA_NAME, MARKER_NAME, PREPARED_DIR
from rlhf_core.data.fingerprints import dataset_fingerprint
from rlhf_core.data.stream import read_records
from rlhf_core.data.samples import Renderer, tokenize_sft
from rlhf_core.data.sft import count_sft_samples, load_sft_samples
from rlhf_core.errors import UserError
from rlhf_core.stages.sft import SFTConfig
from rlhf_core.storage.locate import load_tokenizer

ROWS = [{"prompt": f"sort : {a} {b} 3 =", "response": f"{min(a, b)} {max(a, b)} 3", "q": "sort : 1 =", "a": "1"}
        for a in range(10) for b in range(4)]


def write_rows(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def sft_run(tmp_path: Path, model: str, dataset: str, **settings) -> RunConfig:
    # no input template: the expected samples are rendered without one (OpenRLHF's SFT default has one)
    fields = {"input_key": "prompt", "output_key": "response", "max_len": 64, "input_template": None, **settings}
    return RunConfig(ckpt_path=str(tmp_path / "ckpt"), sft=SFTConfig(pretrain=model, dataset=dataset, **fields))


def preparations(tmp_path: Path) -> set[str]:
    root = tmp_path / "ckpt" / PREPARED_DIR
    return {name for name in os.listdir(root) if len(name) == 32} if root.exists() else set()  # not .tmp-*, hashes


def as_tuples(samples) -> list[tuple[list[int], list[int]]]:
    return [(sample.input_ids, sample.loss_mask) for sample in samples]


@pytest.fixture
def data(tmp_path) -> str:
    return write_rows(tmp_path / "sft.jsonl", ROWS)


@pytest.mark.parametrize("chat", [False, True])
def test_prepared_samples_are_todays_samples(toy_assets, tmp_path, data, chat):
    tokenizer = load_tokenizer(toy_assets["model"])
    run = sft_run(tmp_path, toy_assets["model"], data, apply_chat_template=chat)
    prepared = load_sft_samples(run, tokenizer)
    expected = tokenize_sft(Renderer(tokenizer, data, chat), read_records(data), "prompt", "response", 64)
    assert as_tuples(prepared) == as_tuples(expected)
    assert as_tuples(prepared[3:7]) == as_tuples(expected[3:7]) and prepared[-1] == expected[-1]
    assert count_sft_samples(run) == len(expected) and len(preparations(tmp_path)) == 1  # the count reuses it


def test_a_second_load_reads_the_preparation_not_the_file(toy_assets, tmp_path, data, monkeypatch):
    run = sft_run(tmp_path, toy_assets["model"], data)
    first = as_tuples(load_sft_samples(run, load_tokenizer(toy_assets["model"])))
    monkeypatch.setattr(records, "open_data", lambda *args, **kwargs: pytest.fail("the raw file was read again"))
    assert as_tuples(load_sft_samples(run, load_tokenizer(toy_assets["model"]))) == first


@pytest.mark.parametrize("change", ["tokenizer", "chat_template", "key", "max_len", "input_template"])
def test_a_changed_input_builds_a_new_preparation(toy_assets, tmp_path, data, change):
    base = {"apply_chat_template": change == "chat_template"}
    load_sft_samples(sft_run(tmp_path, toy_assets["model"], data, **base), load_tokenizer(toy_assets["model"]))
    tokenizer = load_tokenizer(toy_assets["model"])
    changed = dict(base)
    if change == "tokenizer":
        tokenizer.add_tokens(["newword"])
    elif change == "chat_template":
        changed["tokenizer_chat_template"] = "{% for m in messages %}user = {{ m['content'] }}{% endfor %}"
    elif change == "key":
        changed.update(input_key="q", output_key="a")
    elif change == "max_len":
        changed["max_len"] = 32
    else:
        changed["input_template"] = "user : {} assistant :"
    samples = load_sft_samples(sft_run(tmp_path, toy_assets["model"], data, **changed), tokenizer)
    assert len(preparations(tmp_path)) == 2
    if change == "key":
        assert all(sample.input_ids[-2] == tokenizer.convert_tokens_to_ids("1") for sample in samples)


def test_a_changed_file_builds_a_new_preparation_and_fingerprint(toy_assets, tmp_path, data):
    run = sft_run(tmp_path, toy_assets["model"], data)
    assert len(load_sft_samples(run, load_tokenizer(toy_assets["model"]))) == len(ROWS)
    before = dataset_fingerprint(run.sft)
    write_rows(Path(data), ROWS[:8])
    os.utime(data, (1, 1))  # a different version even within the file system's mtime resolution
    assert len(load_sft_samples(run, load_tokenizer(toy_assets["model"]))) == 8
    assert len(preparations(tmp_path)) == 2 and dataset_fingerprint(run.sft) != before


def test_the_drift_fingerprint_is_the_hash_recorded_at_preparation(toy_assets, tmp_path, data, monkeypatch):
    """A new process (a restart's drift check, a commit's metadata) finds the hash by the file's version in the
    store's hashes/ (`recorded_hashes`), and never reads the raw file again."""
    from rlhf_core.data.prepared import recorded_hashes

    run = sft_run(tmp_path, toy_assets["model"], data)
    load_sft_samples(run, load_tokenizer(toy_assets["model"]))
    fingerprints._hash_file_version.cache_clear()  # a new process: only the store knows the hash
    monkeypatch.setattr(fingerprints, "_hash_file", lambda *args: pytest.fail("the raw file was hashed again"))
    known = recorded_hashes(run.ckpt_path, run.storage_options)
    expected = hashlib.sha256(Path(data).read_bytes()).hexdigest()
    assert dataset_fingerprint(run.sft, run.storage_options, known) == expected


@pytest.mark.parametrize("damage", ["truncate", "flip", "marker", "no_data"])
def test_a_damaged_preparation_is_rebuilt_never_trusted(toy_assets, tmp_path, data, damage):
    run = sft_run(tmp_path, toy_assets["model"], data)
    expected = as_tuples(load_sft_samples(run, load_tokenizer(toy_assets["model"])))
    [key] = preparations(tmp_path)
    folder = tmp_path / "ckpt" / PREPARED_DIR / key
    arrow = folder / DATA_NAME
    if damage == "truncate":
        arrow.write_bytes(arrow.read_bytes()[:len(arrow.read_bytes()) // 2])
    elif damage == "flip":
        blob = bytearray(arrow.read_bytes())
        blob[len(blob) // 2] ^= 0xFF
        arrow.write_bytes(bytes(blob))
    elif damage == "marker":
        (folder / MARKER_NAME).write_text("{not json")
    else:
        arrow.unlink()
    assert as_tuples(load_sft_samples(run, load_tokenizer(toy_assets["model"]))) == expected
    assert json.loads((folder / MARKER_NAME).read_text())["rows"] == len(expected)


KILLED_PREPARATION = """
import sys
from rlhf_core.config import RunConfig
from rlhf_core.data.sft import load_sft_samples
from rlhf_core.stages.sft import SFTConfig
from rlhf_core.storage.locate import load_tokenizer
model, data, ckpt = sys.argv[1:]
run = RunConfig(ckpt_path=ckpt, sft=SFTConfig(pretrain=model, dataset=data, input_key="prompt", output_key="response",
                                             max_len=64))
load_sft_samples(run, load_tokenizer(model))
"""


def test_a_kill_mid_preparation_leaves_nothing_in_use(toy_assets, tmp_path):
    data = write_rows(tmp_path / "sft.jsonl", ROWS * 250)  # 10,000 rows: two batches
    env = {**os.environ, "RLHF_FAULT_INJECT": "prepare@2=kill"}
    killed = subprocess.run([sys.executable, "-c", KILLED_PREPARATION, toy_assets["model"], data,
                             str(tmp_path / "ckpt")], env=env, capture_output=True, timeout=120)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert preparations(tmp_path) == set()  # only a staging folder, which no reader looks at
    left = [name for name in os.listdir(tmp_path / "ckpt" / PREPARED_DIR) if name.startswith(".tmp-")]
    assert len(left) == 1
    run = sft_run(tmp_path, toy_assets["model"], data)
    assert len(load_sft_samples(run, load_tokenizer(toy_assets["model"]))) == len(ROWS) * 250
    assert len(preparations(tmp_path)) == 1
    assert sorted(os.listdir(tmp_path / "ckpt" / PREPARED_DIR)) == sorted(preparations(tmp_path) | {"hashes"})


@pytest.mark.parametrize("content, message", [
    ('{"prompt": "a", "response": "b"}\n\n{"prompt": "a", "response": \n', "line 3: invalid JSON"),
    ('{"prompt": "a", "response": "b"}\n[1, 2]\n', "line 2: expected a JSON object, got list"),
    ('{"prompt": "a", "response": "b"}\n{"prompt": "a"}\n', "line 2: no key 'response'"),
    ('{"prompt": "a", "response": "b"}\n{"prompt": "\xff"}\n', "line 2: bytes that are not UTF-8 at byte offset 45"),
])
def test_a_bad_row_names_its_line_as_before(toy_assets, tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content.encode("utf-8").replace(b"\xc3\xbf", b"\xff"))
    run = sft_run(tmp_path, toy_assets["model"], str(path))
    with pytest.raises(UserError) as prepared_error:
        load_sft_samples(run, load_tokenizer(toy_assets["model"]))
    assert message in str(prepared_error.value)
    if "response" not in message:  # the reader's own errors: word for word today's
        with pytest.raises(UserError) as todays_error:
            read_records(str(path))
        assert str(prepared_error.value) == str(todays_error.value)
    assert preparations(tmp_path) == set()


def test_a_remote_store_is_read_through_a_checked_local_copy(toy_assets, tmp_path, data, monkeypatch):
    """An object store (here fsspec's memory://): the preparation is uploaded, marker last, and each process reads
    a local copy in RLHF_PREPARED_CACHE, checked like a local one."""
    import fsspec

    monkeypatch.setenv("RLHF_PREPARED_CACHE", str(tmp_path / "cache"))
    url = f"memory://prepared-test-{os.getpid()}-{tmp_path.name}"
    run = RunConfig(ckpt_path=url, sft=SFTConfig(pretrain=toy_assets["model"], dataset=data, input_key="prompt",
                                                 output_key="response", max_len=64))
    expected = as_tuples(load_sft_samples(run, load_tokenizer(toy_assets["model"])))
    filesystem = fsspec.filesystem("memory")
    [key] = [name for name in (path.rsplit("/", 1)[-1] for path in filesystem.ls(f"{url}/{PREPARED_DIR}",
                                                                                detail=False)) if len(name) == 32]
    assert filesystem.exists(f"{url}/{PREPARED_DIR}/{key}/{MARKER_NAME}")
    marker = filesystem.cat_file(f"{url}/{PREPARED_DIR}/{key}/{MARKER_NAME}")
    for copy in (tmp_path / "cache").rglob(DATA_NAME):  # a damaged local copy: fetched again from the store
        copy.write_bytes(copy.read_bytes()[:100])
    assert as_tuples(load_sft_samples(run, load_tokenizer(toy_assets["model"]))) == expected
    assert filesystem.cat_file(f"{url}/{PREPARED_DIR}/{key}/{MARKER_NAME}") == marker  # not prepared again


CONVERSATIONS = [{"messages": [{"role": "user", "content": f"sort : {a} 1 ="}, {"role": "assistant", "content": "1"},
                               {"role": "user", "content": "again"}, {"role": "assistant", "content": f"{a}"}]}
                 for a in range(6)]
REFUSING_TEMPLATE = ("{% for m in messages %}{% if m['content'] == 'again' %}{{ raise_exception('one turn only') }}"
                     "{% endif %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}")


@pytest.mark.parametrize("multiturn", [False, True])
def test_conversations_and_a_template_refusal_as_today(toy_assets, tmp_path, multiturn):
    data = write_rows(tmp_path / "chat.jsonl", CONVERSATIONS)
    settings = {"apply_chat_template": True, "input_key": "messages", "output_key": None, "multiturn": multiturn}
    tokenizer = load_tokenizer(toy_assets["model"])
    prepared = load_sft_samples(sft_run(tmp_path, toy_assets["model"], data, **settings), tokenizer)
    expected = tokenize_sft(Renderer(tokenizer, data, True), read_records(data), "messages", None, 64, multiturn)
    assert as_tuples(prepared) == as_tuples(expected)
    refused = sft_run(tmp_path, toy_assets["model"], data, tokenizer_chat_template=REFUSING_TEMPLATE, **settings)
    with pytest.raises(UserError) as prepared_error:
        load_sft_samples(refused, load_tokenizer(toy_assets["model"]))
    tokenizer.chat_template = REFUSING_TEMPLATE
    with pytest.raises(UserError) as todays_error:
        tokenize_sft(Renderer(tokenizer, data, True), read_records(data), "messages", None, 64, multiturn)
    assert str(prepared_error.value) == str(todays_error.value) and "line 1" in str(todays_error.value)


@pytest.mark.parametrize("spec", ["chatml", "llama3-base"])
@pytest.mark.parametrize("max_len", [10, 64])
def test_byte_level_tokenizers_and_truncation_as_today(toy_assets, tmp_path, data, spec, max_len):
    """A byte-level BPE tokenizer saved as --pretrain (Llama 3's adds BOS, ChatML's does not), prompts and
    responses cut at --max_len: the batch tokenization gives today's samples, --pretrain_mode too."""
    from rlhf_core.data.samples import tokenize_pretraining
    from tests.hub_cache import LLAMA3_BASE, QWEN2_CHATML, build_tokenizer

    tokenizer = build_tokenizer({"chatml": QWEN2_CHATML, "llama3-base": LLAMA3_BASE}[spec])
    tokenizer.save_pretrained(tmp_path / "model")
    model = str(tmp_path / "model")
    chat = tokenizer.chat_template is not None
    for pretrain_mode in (False, True):
        run = sft_run(tmp_path, model, data, max_len=max_len, apply_chat_template=chat and not pretrain_mode,
                      pretrain_mode=pretrain_mode)
        prepared = outcome(lambda: load_sft_samples(run, load_tokenizer(model)))
        expected = outcome(lambda: tokenize_pretraining(data, read_records(data), load_tokenizer(model), "prompt",
                                                        max_len) if pretrain_mode else
                           tokenize_sft(Renderer(load_tokenizer(model), data, chat), read_records(data), "prompt",
                                        "response", max_len))
        assert prepared == expected


def outcome(load) -> list | str:
    """The samples as tuples, or the one sentence that refused them (a --max_len no chat prompt fits)."""
    try:
        return as_tuples(load())
    except UserError as error:
        return str(error)
