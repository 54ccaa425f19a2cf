"""`rlhf train sft --pretrain ORG/MODEL --dataset ORG/DATA` as an OpenRLHF user writes it, resolved from a local
Hugging Face cache in hub layout (offline): the names survive path resolution, reach the Ray workers, and the
checkpoint records the hub revision as the model's identity."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_core.storage.checkpoint import CheckpointStore
from rlhf_core.data.stream import RecordStream, read_records
from tests.conftest import HUB_REVISION as REVISION, hub_snapshot_dir
from tests.integration.conftest import on_local_ray

RLHF = str(Path(sys.executable).parent / "rlhf")


@pytest.mark.slow
def test_sft_from_a_hub_model_and_a_hub_dataset(tmp_path, toy_assets, rlhf_env):
    import pyarrow as pa
    import pyarrow.parquet as pq

    home = tmp_path / "hf"
    shutil.copytree(toy_assets["model"], hub_snapshot_dir(home, "model", "toy-org/toy-base"), dirs_exist_ok=True)
    rows = [record.fields for record in read_records(RecordStream(toy_assets["sft"], None, max_samples=48))]
    data_dir = hub_snapshot_dir(home, "dataset", "toy-org/toy-sft") / "data"
    data_dir.mkdir()
    pq.write_table(pa.Table.from_pylist(rows), data_dir / "train-00000-of-00001.parquet")

    # the ranks resolve the hub ids in HF_HOME too
    env = {**on_local_ray(rlhf_env), "HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    command = [RLHF, "train", "sft", "--pretrain", "toy-org/toy-base", "--dataset", "toy-org/toy-sft",
               "--input_key", "prompt", "--output_key", "response", "--max_len", "64", "--train_batch_size", "8",
               "--micro_train_batch_size", "8", "--max_epochs", "1", "--save_steps", "3",  # 6 steps, commits at 3, 6
               "--ckpt_path", str(tmp_path / "ckpt"), "--save_path", str(tmp_path / "out"), "--run_name", "hub"]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "out" / "model.safetensors").exists()
    store = CheckpointStore(str(tmp_path / "ckpt" / "hub" / "sft"))
    committed = [info for info in store.list(verify=True) if info.is_committed]
    assert [info.step for info in committed] == [3, 6]
    metadata = store.read_metadata(6)
    assert metadata["config"]["pretrain"] == "toy-org/toy-base" and metadata["config"]["dataset"] == "toy-org/toy-sft"
    assert metadata["input_models"]["pretrain"] == f"hub:toy-org/toy-base@{REVISION}"
    assert metadata["dataset_fingerprint"]

    other = [*command[:4], "toy-org/not-cached", *command[5:-1], "hub-missing"]
    missing = subprocess.run(other, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert missing.returncode == 2 and "Traceback" not in missing.stderr, missing.stderr[-2000:]
    assert "--pretrain: toy-org/not-cached" in missing.stderr and "HF_HUB_OFFLINE=1" in missing.stderr
    assert json.loads((tmp_path / "ckpt" / "hub" / "sft" / "step_6" / "MANIFEST.json").read_text())["step"] == 6
