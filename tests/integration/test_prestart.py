"""The worker group a command starts ahead of its first chunk (`rlhf_core.driver.chunk.prestart_workers`), on a real
local Ray with real DeepSpeed: adopted by the chunk, stopped when the chunk's settings differ, and its start's
error raised by the chunk that would have used it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import ray

from rlhf_core.driver.chunk import _Prestart, _WarmGroup, ensure_checkpoint, prestart_workers, release_workers
from rlhf_core.config import RunConfig
from rlhf_core.stages.sft import SFTConfig
from rlhf_core.driver.engine import ensure_ray
from rlhf_core.errors import UserError
from rlhf_core.driver.resume import begin_stage

pytestmark = pytest.mark.slow
MODEL_FAMILY_MODULE = "transformers.models.llama.modeling_llama"  # the toy model's


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    ensure_ray(None)
    yield
    release_workers()
    ray.shutdown()


@pytest.fixture(autouse=True)
def no_group_left():
    release_workers()
    yield
    release_workers()


def make_run(toy, ckpt: Path, **overrides) -> RunConfig:
    sft = SFTConfig(pretrain=toy["model"], dataset=toy["sft"], input_key="prompt", output_key="response", max_len=64,
                    train_batch_size=8, micro_train_batch_size=4, learning_rate=1e-3, save_steps=2)
    return RunConfig(sft=sft, ckpt_path=str(ckpt), **overrides)


def started_group():
    """The prestarted group, once its start has finished (without taking it)."""
    _Prestart.thread.join()
    return _Prestart.outcome


def imported_on_each_rank(group, module: str) -> list[bool]:
    return ray.get([worker.__ray_call__.remote(lambda _worker: module in sys.modules) for worker in group.workers])


def test_the_first_chunk_trains_on_the_prestarted_group(toy_assets, tmp_path):
    run = make_run(toy_assets, tmp_path / "ckpt")
    prestart_workers(run, "sft")
    group = started_group()
    assert imported_on_each_rank(group, MODEL_FAMILY_MODULE) == [True]  # warm_up ran before any setup
    result = ensure_checkpoint(run, "sft", 2, begin_stage(run, "sft"))
    assert result.step == 2 and result.num_steps_trained == 2
    assert _WarmGroup.group is group and _Prestart.thread is None


def test_a_prestarted_group_with_other_settings_is_stopped_and_a_new_one_trains(toy_assets, tmp_path):
    prestart_workers(make_run(toy_assets, tmp_path / "ckpt", num_cpus_per_worker=0.5), "sft")
    stale = started_group()
    stale_workers = list(stale.workers)
    run = make_run(toy_assets, tmp_path / "ckpt")
    ensure_checkpoint(run, "sft", 2, begin_stage(run, "sft"))
    assert _WarmGroup.group is not stale and _WarmGroup.group.step == 2
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(stale_workers[0].location.remote(), timeout=60)


def test_the_prestart_error_is_the_chunks_error(toy_assets, tmp_path):
    run = make_run(toy_assets, tmp_path / "ckpt", num_cpus_per_worker=64, placement_timeout_s=1)
    prestart_workers(run, "sft")
    with pytest.raises(UserError, match="--num_workers 1: Ray could not place 1 ranks"):
        ensure_checkpoint(run, "sft", 2, begin_stage(run, "sft"))
    assert _Prestart.thread is None and _WarmGroup.group is None
