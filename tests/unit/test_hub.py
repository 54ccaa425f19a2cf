"""Models and datasets by hub name, from a Hugging Face cache in hub layout in a temporary HF_HOME (offline)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_core.data.fingerprints import fingerprint
from rlhf_core.data.stream import RecordStream, read_records
from tests.conftest import HUB_REVISION as REVISION, hub_snapshot_dir
from rlhf_core.errors import UserError
from rlhf_core.models.load import load_causal_lm
from rlhf_core.storage.locate import load_tokenizer, local_model_dir, model_fingerprint



@pytest.fixture
def hf_home(tmp_path, monkeypatch) -> Path:
    """An empty, offline Hugging Face cache. The variables are set for child processes; huggingface_hub
    and datasets read them into constants when first imported (already done in this process), so those
    constants are patched too."""
    import datasets
    import huggingface_hub.constants as hub_constants

    home = tmp_path / "hf"
    for name, value in {"HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HF_DATASETS_CACHE", raising=False)
    monkeypatch.setattr(hub_constants, "HF_HOME", str(home))
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_CACHE_HOME", str(home))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", home / "datasets")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    return home


def write_parquet(path: Path, rows: list[dict]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)


def test_model_by_hub_id_loads_from_the_cache(hf_home, toy_assets):
    snapshot = hub_snapshot_dir(hf_home, "model", "OpenRLHF/toy-sft")
    shutil.copytree(toy_assets["model"], snapshot, dirs_exist_ok=True)
    assert local_model_dir("OpenRLHF/toy-sft") == str(snapshot)
    model, tokenizer = load_causal_lm("OpenRLHF/toy-sft"), load_tokenizer("OpenRLHF/toy-sft")
    assert model.config.vocab_size == len(tokenizer)
    assert model_fingerprint("OpenRLHF/toy-sft") == f"hub:OpenRLHF/toy-sft@{REVISION}"


def test_missing_hub_model_names_flag_id_and_cache(hf_home):
    with pytest.raises(UserError) as error:
        local_model_dir("OpenRLHF/Llama-3-8b-sft-mixture", flag="--reward_pretrain")
    message = str(error.value)
    assert message.startswith("--reward_pretrain: OpenRLHF/Llama-3-8b-sft-mixture")
    assert f"HF_HOME={hf_home}" in message and "HF_HUB_OFFLINE=1" in message and "\n" not in message
    assert model_fingerprint("OpenRLHF/Llama-3-8b-sft-mixture") == ""


def test_hub_model_in_a_fresh_process_reads_the_environment(hf_home, toy_assets):
    """No patched constants: HF_HOME and HF_HUB_OFFLINE as a user sets them, before anything is imported."""
    snapshot = hub_snapshot_dir(hf_home, "model", "org/toy")
    shutil.copytree(toy_assets["model"], snapshot, dirs_exist_ok=True)
    code = "from rlhf_core.models.load import local_model_dir; print(local_model_dir('org/toy'))"
    result = subprocess.run([sys.executable, "-c", code], env=dict(os.environ), capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(snapshot)


def test_dataset_from_a_hub_snapshot_with_splits(hf_home):
    """A dataset repository downloaded into the hub cache (`hf download --repo-type dataset`)."""
    snapshot = hub_snapshot_dir(hf_home, "dataset", "Open-Orca/tiny")
    write_parquet(snapshot / "data" / "train-00000-of-00001.parquet",
                  [{"question": f"q{i}", "response": f"r{i}"} for i in range(5)])
    write_parquet(snapshot / "data" / "test-00000-of-00001.parquet", [{"question": "t", "response": "u"}])
    records = read_records("Open-Orca/tiny")
    assert [record.fields["question"] for record in records] == [f"q{i}" for i in range(5)]
    assert records[0].where("Open-Orca/tiny") == "Open-Orca/tiny row 1"
    test_split = read_records(RecordStream("Open-Orca/tiny", None, split="test"))
    assert [record.fields["question"] for record in test_split] == ["t"]
    with pytest.raises(UserError, match=r"--prompt_data: .*'validation'.* --prompt_split"):
        read_records(RecordStream("Open-Orca/tiny", None, split="validation", flag="--prompt_data"))
    assert fingerprint("Open-Orca/tiny") != fingerprint("Open-Orca/tiny", split="test")


def test_dataset_from_the_datasets_cache(hf_home, tmp_path):
    """What `load_dataset("org/name")` leaves in HF_DATASETS_CACHE when it once ran online, which it reads
    offline: `org___name/<config>/<version>/<hash>/` holding `name-<split>.arrow` and dataset_info.json."""
    import datasets

    write_parquet(tmp_path / "src" / "train.parquet", [{"prompt": f"p{i}"} for i in range(4)])
    datasets.load_dataset("parquet", data_files={"train": str(tmp_path / "src" / "train.parquet")},
                          cache_dir=str(tmp_path / "build"))
    [built] = [path for path in (tmp_path / "build").glob("parquet/*/*/*") if path.is_dir()]
    cached = hf_home / "datasets" / "org___tiny" / "default" / "0.0.0" / built.name
    shutil.copytree(built, cached)
    (cached / "parquet-train.arrow").rename(cached / "tiny-train.arrow")
    assert [record.fields["prompt"] for record in read_records("org/tiny")] == [f"p{i}" for i in range(4)]


def test_missing_hub_dataset_is_one_sentence(hf_home):
    with pytest.raises(UserError) as error:
        read_records("Open-Orca/OpenOrca")
    message = str(error.value)
    assert message.startswith("--dataset: Open-Orca/OpenOrca") and "dataset 'Open-Orca/OpenOrca'" in message
    assert f"HF_HOME={hf_home}" in message and "\n" not in message


def test_saved_dataset_folder_and_dict_split(tmp_path):
    import datasets

    rows = {"prompt": ["a", "b", "c"], "response": ["1", "2", "3"]}
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "plain"))
    assert [record.fields["prompt"] for record in read_records(str(tmp_path / "plain"))] == ["a", "b", "c"]
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows),
                          "test": datasets.Dataset.from_dict({"prompt": ["z"], "response": ["9"]})}
                         ).save_to_disk(str(tmp_path / "dict"))
    test_split = read_records(RecordStream(str(tmp_path / "dict"), None, split="test"))
    assert [record.fields["prompt"] for record in test_split] == ["z"]
    with pytest.raises(UserError, match=r"no split 'dev' \(it has train, test\); choose one with --dataset_split"):
        read_records(RecordStream(str(tmp_path / "dict"), None, split="dev"))


def test_hub_id_detection():
    from rlhf_core.storage.locate import is_hub_id

    assert is_hub_id("Open-Orca/OpenOrca") and is_hub_id("gpt2") and is_hub_id("org/name.v2")
    for path in ("./model", "/abs/model", "s3://bucket/model", "data.jsonl", "a/b/c", "../up", "org/"):
        assert not is_hub_id(path), path


def test_mixture_follows_probabilities_and_seed(tmp_path):
    big, small = tmp_path / "big.jsonl", tmp_path / "small.jsonl"
    big.write_text("".join(json.dumps({"prompt": f"big{i}"}) + "\n" for i in range(40)))
    small.write_text("".join(json.dumps({"prompt": f"small{i}"}) + "\n" for i in range(10)))
    url = f"{big},{small}"
    concatenated = read_records(url)
    assert len(concatenated) == 50 and concatenated[40].source == str(small)
    mixed = read_records(RecordStream(url, None, probs="0.5,0.5", seed=1))
    names = [record.fields["prompt"] for record in mixed]
    # all_exhausted: every record of both appears, and the small one is drawn about as often as the big one.
    assert {f"big{i}" for i in range(40)} <= set(names) and {f"small{i}" for i in range(10)} <= set(names)
    assert sum(name.startswith("small") for name in names) > 20
    def mixture(seed: int) -> list[str]:
        return [record.fields["prompt"] for record in read_records(RecordStream(url, None, probs="0.5,0.5", seed=seed))]

    assert names == mixture(1) and names != mixture(2)
    assert len(read_records(RecordStream(url, None, probs="7,3", seed=1, max_samples=5))) == 5
    with pytest.raises(UserError, match=r"--dataset_probs '0.7' has 1 weights for 2 comma-separated datasets"):
        read_records(RecordStream(url, None, probs="0.7"))
    with pytest.raises(UserError, match=r"small.jsonl line 3: no key 'response'"):
        from rlhf_core.data.samples import require_text

        require_text(url, read_records(url)[42], "response", "--output_key")
