"""A large preparation's batches go to worker processes (issue 33, "Fast preparation"): the samples, their order,
a bad row's sentence and the warnings are those of one process, and a kill leaves no worker behind."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
import uuid

import pytest

from rlhf_core.data import workers
from rlhf_core.data.sft import load_sft_samples
from rlhf_core.errors import UserError
from rlhf_core.storage.locate import load_tokenizer
from tests.unit.test_prepared_data import ROWS, as_tuples, preparations, sft_run, write_rows

NUM_ROWS = len(ROWS) * 750  # 30,000 rows: four batches


@pytest.fixture
def in_workers(monkeypatch):
    """Every batch in two worker processes, none in this one."""
    monkeypatch.setattr(workers, "IN_PROCESS_BATCHES", 0)
    monkeypatch.setenv(workers.WORKERS_ENV_VAR, "2")


def prepare(tmp_path, model: str, data: str, name: str, **settings):
    return load_sft_samples(sft_run(tmp_path / name, model, data, **settings), load_tokenizer(model))


def test_workers_prepare_the_samples_one_process_prepares_in_order(toy_assets, tmp_path, monkeypatch):
    rows = [{**row, "prompt": f"{row['prompt']} {i % 10}"} for i, row in enumerate(ROWS * 750)]
    data = write_rows(tmp_path / "sft.jsonl", rows)
    alone = as_tuples(prepare(tmp_path, toy_assets["model"], data, "alone"))
    monkeypatch.setattr(workers, "IN_PROCESS_BATCHES", 0)
    monkeypatch.setenv(workers.WORKERS_ENV_VAR, "2")
    assert as_tuples(prepare(tmp_path, toy_assets["model"], data, "workers")) == alone
    assert len(alone) == NUM_ROWS


def test_a_bad_row_in_a_worker_is_the_same_sentence(toy_assets, tmp_path, monkeypatch):
    rows = ROWS * 750
    rows[20_000] = {"prompt": "sort : 1 ="}
    data = write_rows(tmp_path / "sft.jsonl", rows)
    with pytest.raises(UserError) as alone:
        prepare(tmp_path, toy_assets["model"], data, "alone")
    monkeypatch.setattr(workers, "IN_PROCESS_BATCHES", 0)
    monkeypatch.setenv(workers.WORKERS_ENV_VAR, "2")
    with pytest.raises(UserError) as in_workers:
        prepare(tmp_path, toy_assets["model"], data, "run")
    assert str(in_workers.value) == str(alone.value) and "line 20001: no key 'response'" in str(alone.value)
    assert preparations(tmp_path / "run") == set()


def test_a_workers_warning_reaches_the_log_once(toy_assets, tmp_path, in_workers, caplog):
    data = write_rows(tmp_path / "sft.jsonl", ROWS * 750)
    with caplog.at_level(logging.WARNING, logger="rlhf_core"):
        prepare(tmp_path, toy_assets["model"], data, "run", input_template="Q: {}\\n")
    said = [record.getMessage() for record in caplog.records if "two characters \\n" in record.getMessage()]
    assert len(said) >= 1 and len(set(said)) == 1


KILLED_IN_WORKERS = """
import sys
from rlhf_core.config import RunConfig
from rlhf_core.data import workers
from rlhf_core.data.sft import load_sft_samples
from rlhf_core.stages.sft import SFTConfig
from rlhf_core.storage.locate import load_tokenizer
workers.IN_PROCESS_BATCHES = 0
model, data, ckpt = sys.argv[1:]
run = RunConfig(ckpt_path=ckpt, sft=SFTConfig(pretrain=model, dataset=data, input_key="prompt", output_key="response",
                                             max_len=64))
load_sft_samples(run, load_tokenizer(model))
"""


def test_a_kill_mid_preparation_leaves_no_worker_behind(toy_assets, tmp_path):
    data = write_rows(tmp_path / "sft.jsonl", ROWS * 750)
    marker = uuid.uuid4().hex
    env = {**os.environ, "RLHF_FAULT_INJECT": "prepare@3=kill", workers.WORKERS_ENV_VAR: "2", "RLHF_TEST_MARK": marker}
    with open(tmp_path / "stderr", "wb") as stderr:  # a file, not a pipe: a worker left behind would hold a pipe
        killed = subprocess.run([sys.executable, "-c", KILLED_IN_WORKERS, toy_assets["model"], data,
                                 str(tmp_path / "ckpt")], env=env, stdout=subprocess.DEVNULL, stderr=stderr,
                                timeout=120)
    assert killed.returncode == -9, (tmp_path / "stderr").read_text()[-2000:]
    deadline = time.monotonic() + 30
    while marked_processes(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert marked_processes(marker) == []  # the fork server and its workers end with the process they served
    assert preparations(tmp_path) == set()


DIES_IN_A_WORKER = KILLED_IN_WORKERS.replace("load_sft_samples(run, load_tokenizer(model))", """
from rlhf_core.errors import PreparationWorkerDied
try:
    load_sft_samples(run, load_tokenizer(model))
except PreparationWorkerDied as error:
    print(error)
    sys.exit(3)
""")


def test_a_worker_that_dies_is_one_sentence_and_nothing_is_published(toy_assets, tmp_path):
    """In a process of its own: the fork server keeps the environment it started with (the fault's variables)."""
    data = write_rows(tmp_path / "sft.jsonl", ROWS * 750)
    env = {**os.environ, "RLHF_FAULT_INJECT": "prepare_worker@2=kill", workers.WORKERS_ENV_VAR: "2"}
    died = subprocess.run([sys.executable, "-c", DIES_IN_A_WORKER, toy_assets["model"], data, str(tmp_path / "ckpt")],
                          env=env, capture_output=True, text=True, timeout=120)
    assert died.returncode == 3, died.stderr[-2000:]
    assert died.stdout.strip().startswith(f"a worker process preparing {data} died")
    assert preparations(tmp_path) == set()


def marked_processes(marker: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as environ:
                if f"RLHF_TEST_MARK={marker}".encode() in environ.read().split(b"\0"):
                    found.append(int(pid))
        except OSError:
            continue
    return found
