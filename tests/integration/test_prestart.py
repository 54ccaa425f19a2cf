"""The worker group a command starts ahead of its first chunk (`StageRunner.prestart`), on a real
local Ray with real DeepSpeed: adopted by the chunk, stopped when the chunk's settings differ, and its start's
error raised by the chunk that would have used it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import ray

from rlhf_core.driver.chunk import ensure_checkpoint
from rlhf_core.driver.runner import StageRunner
from rlhf_core.config import RunConfig
from rlhf_core.stages.sft import SFTConfig
from rlhf_core.driver.ray_start import ensure_ray
from rlhf_core.errors import UserError
from rlhf_core.driver.resume import begin_stage

pytestmark = pytest.mark.slow
MODEL_FAMILY_MODULE = "transformers.models.llama.modeling_llama"  # the toy model's


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    ensure_ray(None)
    yield
    ray.shutdown()


def make_run(toy, ckpt: Path, **overrides) -> RunConfig:
    sft = SFTConfig(pretrain=toy["model"], dataset=toy["sft"], input_key="prompt", output_key="response", max_len=64,
                    train_batch_size=8, micro_train_batch_size=4, max_epochs=1, learning_rate=1e-3, save_steps=2)
    return RunConfig(sft=sft, ckpt_path=str(ckpt), **overrides)


def imported_on_each_rank(group, module: str) -> list[bool]:
    return ray.get([worker.__ray_call__.remote(lambda _worker: module in sys.modules) for worker in group.workers])


def test_the_first_chunk_trains_on_the_prestarted_group(toy_assets, tmp_path):
    run = make_run(toy_assets, tmp_path / "ckpt")
    with StageRunner(run) as runner:
        group = runner.prestart("sft").wait()
        assert imported_on_each_rank(group, MODEL_FAMILY_MODULE) == [True]  # warm_up ran before any setup
        result = ensure_checkpoint(runner, "sft", 2, begin_stage(run, "sft"))
        assert result.step == 2 and result.num_steps_trained == 2
        assert runner.warm_group is group and runner.prestarted is None


def test_a_prestarted_group_with_other_settings_is_stopped_and_a_new_one_trains(toy_assets, tmp_path):
    run = make_run(toy_assets, tmp_path / "ckpt")
    with StageRunner(run) as runner:
        stale = runner.prestart("sft", make_run(toy_assets, tmp_path / "ckpt", num_cpus_per_worker=0.5)).wait()
        stale_workers = list(stale.workers)
        ensure_checkpoint(runner, "sft", 2, begin_stage(run, "sft"))
        assert runner.warm_group is not stale and runner.warm_group.step == 2
        with pytest.raises(ray.exceptions.RayActorError):  # stopped by the chunk, not by the runner's close
            ray.get(stale_workers[0].location.remote(), timeout=60)


def test_the_prestart_error_is_the_chunks_error(toy_assets, tmp_path):
    run = make_run(toy_assets, tmp_path / "ckpt", num_cpus_per_worker=64, placement_timeout_s=1)
    with StageRunner(run) as runner:
        runner.prestart("sft")
        with pytest.raises(UserError, match="--num_workers 1: Ray could not place 1 ranks"):
            ensure_checkpoint(runner, "sft", 2, begin_stage(run, "sft"))
        assert runner.prestarted is None and runner.warm_group is None
