"""`rlhf ckpt ls` and `rlhf ckpt verify` on a local store."""

from __future__ import annotations

import json
import os

from flows.cli import main
from rlhf_core.storage.checkpoint import CheckpointStore


def make_store(tmp_path, steps):
    store = CheckpointStore(str(tmp_path / "run" / "sft"))
    for step in steps:
        local = tmp_path / f"local_{step}"
        local.mkdir()
        (local / "weights.bin").write_bytes(bytes([step]) * 1000)
        store.commit(step, str(local), {"step": step})
    return tmp_path / "run" / "sft"


def test_verify_passes_when_newest_is_valid_and_fails_when_not(tmp_path, capsys):
    stage_dir = make_store(tmp_path, [5, 10])
    assert main(["ckpt", "verify", str(stage_dir), "--json"]) == 0
    assert [row["status"] for row in json.loads(capsys.readouterr().out)] == ["committed", "committed"]
    weights = stage_dir / "step_10" / "weights.bin"
    weights.write_bytes(b"\x00" + weights.read_bytes()[1:])  # same size: only sha256 can tell
    assert main(["ckpt", "ls", str(stage_dir)]) == 0  # ls checks sizes only
    assert "corrupt" not in capsys.readouterr().out
    assert main(["ckpt", "verify", str(stage_dir)]) == 1
    captured = capsys.readouterr()
    assert "corrupt" in captured.out and "checksum mismatch in weights.bin" in captured.out
    assert "newest checkpoint is not valid: step_10 is corrupt" in captured.err


def test_verify_of_an_empty_store_fails(tmp_path, capsys):
    (tmp_path / "nothing").mkdir()
    assert main(["ckpt", "verify", str(tmp_path / "nothing")]) == 1
    assert "no checkpoint found" in capsys.readouterr().err


def test_lora_combiner_takes_a_checkpoints_latest_as_lora_path(tmp_path, toy_assets, capsys):
    """The seed's `lora_combiner --lora_path {ckpt_path}/latest`: the newest committed checkpoint's adapter."""
    import torch

    from rlhf_core.models.load import LoadOptions, load_causal_lm

    store = CheckpointStore(str(tmp_path / "ckpt" / "run" / "ppo"))
    # A trained adapter's size: step 4's changes the model, step 2's (zero) does not. An oversized one (every
    # lora_B 0.5) saturated the toy's attention, and the merge check's own fp32 error then hung on the lora_A draw:
    # 3 of 18 seeds went over the 1e-4 it allows. Seeded, so the draw no longer depends on the tests run before.
    torch.manual_seed(2)
    for step, scale in ((2, 0.0), (4, 0.02)):
        adapted = load_causal_lm(toy_assets["model"], LoadOptions(lora_rank=4))
        with torch.no_grad():
            for name, param in adapted.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, scale)
        local = tmp_path / f"local_{step}"
        adapted.save_pretrained(str(local / "actor_model" / "hf"))
        store.commit(step, str(local), {"step": step})
    out = tmp_path / "merged"
    assert main(["lora-combiner", "--model_path", toy_assets["model"], "--lora_path",
                 str(tmp_path / "ckpt" / "run" / "ppo" / "latest"), "--output_path", str(out), "--bf16"]) == 0
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(toy_assets["model"])
    result = AutoModelForCausalLM.from_pretrained(str(out))
    assert result.dtype == torch.bfloat16
    changed = any(not torch.equal(a.to(torch.bfloat16), b) for a, b in zip(base.parameters(), result.parameters()))
    assert changed, "the merged model is the base: step_2's zero adapter was used, not latest (step_4)"
    assert main(["lora-combiner", "--model_path", toy_assets["model"], "--lora_path",
                 str(tmp_path / "ckpt" / "run" / "ppo" / "step_9"), "--output_path", str(out)]) == 2
    assert "holds no valid checkpoint step_9" in capsys.readouterr().err


# ---------------------------------------------------------------- alerts in `ckpt ls`, and `rlhf status`


def _alerts(run_dir, *alerts):
    from rlhf_core.ops.alerts import Alert, AlertLog

    AlertLog(str(run_dir)).append(*(Alert(name=name, run_name="run", stage=stage, step=step, message=message)
                                    for name, stage, step, message in alerts))


def make_run(tmp_path):
    """A run folder with an SFT stage (steps 5, 10 with metrics) and a PPO stage (step 4), and three alerts."""
    run_dir = tmp_path / "run"
    for stage, steps in (("sft", (5, 10)), ("ppo", (4,))):
        store = CheckpointStore(str(run_dir / stage))
        for step in steps:
            local = tmp_path / f"local_{stage}_{step}"
            local.mkdir()
            (local / "weights.bin").write_bytes(bytes([step]) * 1000)
            metrics = {"loss": 3.0 - step / 10} if stage == "sft" else {"reward": 0.25, "mean_reward": 0.5}
            store.commit(step, str(local), {"step": step, "total_steps": 20 if stage == "sft" else 8,
                                            "metrics": metrics, "save_path": f"/out/{stage}"})
    _alerts(run_dir, ("rlhf.alert.checkpoint-size", "sft", 10, "step_10 is 90% smaller than predicted."),
            ("rlhf.alert.non-finite", "sft", 15, "loss is NaN at step 15; not committed."),
            ("rlhf.alert.reward-stagnant", "ppo", 4, "mean_reward has not improved in 3 checkpoints."))
    return run_dir


def test_ckpt_ls_shows_each_checkpoints_alerts_below_it(tmp_path, capsys):
    run_dir = make_run(tmp_path)
    assert main(["ckpt", "ls", str(run_dir / "sft")]) == 0
    lines = capsys.readouterr().out.splitlines()
    step_10 = next(index for index, line in enumerate(lines) if line.startswith("10 "))
    assert lines[step_10 + 1] == "  ! rlhf.alert.checkpoint-size: step_10 is 90% smaller than predicted."
    step_5 = next(index for index, line in enumerate(lines) if line.startswith("5 "))
    assert lines[step_5 + 1].startswith("10 "), "step 5 has no alert"
    assert "reward-stagnant" not in "\n".join(lines), "another stage's alert"
    assert lines[-2:] == ["alerts at steps without a checkpoint here:",
                          "  step 15: rlhf.alert.non-finite: loss is NaN at step 15; not committed."]
    assert main(["ckpt", "ls", str(run_dir / "sft"), "--json"]) == 0
    rows = {row["step"]: row for row in json.loads(capsys.readouterr().out)}
    assert rows[5]["alerts"] == []
    assert [alert["name"] for alert in rows[10]["alerts"]] == ["rlhf.alert.checkpoint-size"]


def test_ckpt_ls_without_alerts_is_the_plain_table(tmp_path, capsys):
    stage_dir = make_store(tmp_path, [5])
    assert main(["ckpt", "ls", str(stage_dir)]) == 0
    assert "!" not in capsys.readouterr().out


def test_status_lists_stages_steps_metrics_outputs_alerts_and_lease(tmp_path, capsys):
    from rlhf_core.storage.lease import RunLease

    run_dir = make_run(tmp_path)
    assert main(["status", str(run_dir)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == f"run run ({run_dir})"
    assert lines[1] == "sft    step 10/20, 2 committed, loss 2, output /out/sft"
    assert lines[2] == "ppo    step 4/8, 1 committed, mean_reward 0.5, output /out/ppo"
    assert "lease: free" in lines
    assert "alerts: 3" in lines
    assert "  ppo step 4: rlhf.alert.reward-stagnant: mean_reward has not improved in 3 checkpoints." in lines
    assert len(lines) <= 10
    with RunLease(str(run_dir)):
        assert main(["status", str(run_dir)]) == 0
        assert f"lease: held by pid {os.getpid()} on " in capsys.readouterr().out


def test_status_of_a_folder_that_is_no_run_is_one_sentence(tmp_path, capsys):
    run_dir = make_run(tmp_path)
    assert main(["status", str(run_dir / "sft")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not a run folder" in err and f"give its parent, {run_dir}" in err
    assert main(["status", str(tmp_path / "missing")]) == 2
    assert "is not a folder" in capsys.readouterr().err


def test_status_of_a_run_with_only_an_alert_log(tmp_path, capsys):
    _alerts(tmp_path / "run", ("rlhf.alert.non-finite", "sft", 3, "loss is NaN at step 3; not committed."))
    assert main(["status", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "no stage folders yet" in out and "sft step 3: rlhf.alert.non-finite" in out
