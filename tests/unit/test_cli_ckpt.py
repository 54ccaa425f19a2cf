"""`rlhf ckpt ls` and `rlhf ckpt verify` on a local store."""

from __future__ import annotations

import json

from flows.cli import main
from rlhf_core.checkpoint import CheckpointStore


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

    from rlhf_core.models import load_causal_lm

    store = CheckpointStore(str(tmp_path / "ckpt" / "run" / "ppo"))
    for step, scale in ((2, 0.0), (4, 0.5)):
        adapted = load_causal_lm(toy_assets["model"], lora_rank=4)
        with torch.no_grad():
            for name, param in adapted.named_parameters():
                if "lora_B" in name:
                    param.fill_(scale)  # step 4's adapter changes the model, step 2's does not
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
