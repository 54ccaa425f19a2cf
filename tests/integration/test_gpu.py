"""GPU paths: bf16 training on CUDA through the same chunk machinery. Skipped without CUDA."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlhf_core.driver.plan import resolve_paths
from rlhf_core.config import RunConfig
from rlhf_core.stages.sft import SFTConfig
from tests.integration.chunks import train_chunks

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def test_bf16_sft_chunk_trains_and_commits_on_cuda(toy_assets, tmp_path):
    import torch

    run = resolve_paths(RunConfig(ckpt_path=str(tmp_path), sft=SFTConfig(
        pretrain=toy_assets["model"], dataset=toy_assets["sft"], input_key="prompt", output_key="response",
        max_len=64, train_batch_size=8, micro_train_batch_size=4, learning_rate=1e-3, save_steps=4, bf16=True)))
    [result] = train_chunks(run, "sft", 4)
    assert result.num_steps_trained == 4 and torch.isfinite(torch.tensor(result.metrics["loss"]))
    metadata = json.loads((Path(run.stage_url("sft")) / "step_4" / "training_metadata.json").read_text())
    assert metadata["config"]["bf16"] is True


def ppo_settings(toy_assets, **overrides) -> dict:
    return {"pretrain": toy_assets["model"], "reward_fn": "rlhf_core.toy:gold_reward",
            "prompt_data": toy_assets["prompts"], "input_key": "prompt", "max_samples": 16,
            "n_samples_per_prompt": 2, "rollout_batch_size": 4, "micro_rollout_batch_size": 8,
            "train_batch_size": 8, "micro_train_batch_size": 4, "max_new_tokens": 12, "save_steps": 2,
            "advantage_estimator": "reinforce", "vllm_num_engines": 1, **overrides}


def test_vllm_engine_samples_from_the_actors_current_weights(toy_assets, monkeypatch):
    """Greedy vLLM output (after the weight sync) equals transformers' greedy output of the same actor."""
    pytest.importorskip("vllm")
    import torch

    from rlhf_core.stages.ppo import PPOConfig
    from rlhf_core.models.load import load_causal_lm
    from rlhf_core.storage.locate import load_tokenizer
    from rlhf_core.rank.vllm_engine import VLLMGenerator

    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "29533"}.items():
        monkeypatch.setenv(name, value)
    cfg = PPOConfig(**ppo_settings(toy_assets, temperature=1e-6))
    tokenizer = load_tokenizer(cfg.pretrain)
    actor = load_causal_lm(cfg.pretrain).cuda().eval()
    engine = VLLMGenerator(cfg, seed=0, rank=0)  # dummy weights until the first generate
    prompts = [tokenizer(json.loads(line)["prompt"])["input_ids"]
               for line in Path(toy_assets["eval_prompts"]).read_text().splitlines()[:16]]
    sampled = engine.generate(actor, prompts, step=0, eos_token_id=tokenizer.eos_token_id)
    matches = 0
    for prompt, response in zip(prompts, sampled):
        ids = torch.tensor([prompt], device="cuda")
        greedy = actor.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                max_new_tokens=cfg.max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                                pad_token_id=tokenizer.pad_token_id)[0, len(prompt):].tolist()
        if tokenizer.eos_token_id in greedy:
            greedy = greedy[: greedy.index(tokenizer.eos_token_id) + 1]
        matches += greedy == response
    assert matches >= 14, f"only {matches}/16 vLLM responses match the actor's greedy ones"


def test_ppo_chunk_with_vllm_generation_trains_and_commits(toy_assets, tmp_path):
    pytest.importorskip("vllm")
    import torch

    from rlhf_core.stages.ppo import PPOConfig
    from rlhf_core.driver.resume import begin_stage

    run = resolve_paths(RunConfig(stages=["ppo"], ckpt_path=str(tmp_path), load_checkpoint=True,
                                  ppo=PPOConfig(**ppo_settings(toy_assets, bf16=True, vllm_enable_sleep=True))))
    [result] = train_chunks(run, "ppo", 2, lineage=begin_stage(run, "ppo"))
    assert result.num_steps_trained == 2
    assert torch.isfinite(torch.tensor(result.metrics["policy_loss"])) and result.metrics["response_length"] > 0
    assert (Path(run.stage_url("ppo")) / "step_2" / "MANIFEST.json").exists()
