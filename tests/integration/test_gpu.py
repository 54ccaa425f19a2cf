"""GPU paths: bf16 training on CUDA through the same chunk machinery. Skipped without CUDA."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlhf_core.chunk import ensure_checkpoint, release_workers, resolve_paths
from rlhf_core.config import RunConfig, SFTConfig

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def test_bf16_sft_chunk_trains_and_commits_on_cuda(toy_assets, tmp_path):
    import torch

    run = resolve_paths(RunConfig(ckpt_path=str(tmp_path), sft=SFTConfig(
        pretrain=toy_assets["model"], dataset=toy_assets["sft"], input_key="prompt", output_key="response",
        max_len=64, train_batch_size=8, micro_train_batch_size=4, learning_rate=1e-3, save_steps=4, bf16=True)))
    result = ensure_checkpoint(run, "sft", 4)
    release_workers()
    assert result.num_steps_trained == 4 and torch.isfinite(torch.tensor(result.metrics["loss"]))
    metadata = json.loads((Path(run.stage_url("sft")) / "step_4" / "training_metadata.json").read_text())
    assert metadata["config"]["bf16"] is True
