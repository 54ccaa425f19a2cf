"""A CLI run resolves its paths and validates its start once: `preflight` does both and returns the checked run
with its plans, and the flow `rlhf` on a runner given them does neither again; a run the runner was not given (a
deployment run) gets both."""

from __future__ import annotations

from rlhf_core.config import RunConfig
from rlhf_core.driver import preflight
from rlhf_core.driver.runner import StageRunner
from rlhf_core.stages.sft import SFTConfig


def test_preflight_returns_the_resolved_run_and_only_that_run_counts_as_checked(toy_assets, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = RunConfig(ckpt_path="ckpt", sft=SFTConfig(pretrain=toy_assets["model"], dataset=toy_assets["sft"],
                                                   input_key="prompt", output_key="response", max_len=64,
                                                   train_batch_size=8, micro_train_batch_size=8, save_path="out"))
    checked = preflight.preflight(run)
    resolved = checked.run
    assert resolved.ckpt_path == str(tmp_path / "ckpt") and resolved.sft.save_path == str(tmp_path / "out")
    runner = StageRunner(resolved, checked)
    assert runner.is_checked(resolved)
    assert runner.is_checked(RunConfig.model_validate_json(resolved.model_dump_json()))  # as the flow receives it
    assert not runner.is_checked(run)  # unresolved: the flow resolves and validates it itself
    assert not runner.is_checked(resolved.model_copy(update={"load_checkpoint": True}))
    assert not StageRunner(resolved).is_checked(resolved)  # a deployment run's flow checks for itself
    assert runner.plan("sft") is checked.plans["sft"]  # counted once, by preflight
