"""A CLI run resolves its paths and validates its start once: `preflight` does both and records the run, and the
flow `rlhf` given that run does neither again; a run this process did not check (a deployment run) gets both."""

from __future__ import annotations

from rlhf_core.config import RunConfig
from rlhf_core.driver import preflight
from rlhf_core.stages.sft import SFTConfig


def test_preflight_returns_the_resolved_run_and_only_that_run_counts_as_checked(toy_assets, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = RunConfig(ckpt_path="ckpt", sft=SFTConfig(pretrain=toy_assets["model"], dataset=toy_assets["sft"],
                                                   input_key="prompt", output_key="response", max_len=64,
                                                   train_batch_size=8, micro_train_batch_size=8, save_path="out"))
    resolved = preflight.preflight(run)
    assert resolved.ckpt_path == str(tmp_path / "ckpt") and resolved.sft.save_path == str(tmp_path / "out")
    assert preflight.checked(resolved)
    assert preflight.checked(RunConfig.model_validate_json(resolved.model_dump_json()))  # as the flow receives it
    assert not preflight.checked(run)  # unresolved: the flow resolves and validates it itself
    assert not preflight.checked(resolved.model_copy(update={"load_checkpoint": True}))
