"""GRPO with a reward function in OpenRLHF's form: `--remote_rm_url reward_func.py` written as an OpenRLHF
user writes it (queries, prompts, labels -> {"rewards", "scores", "extra_logs"}), with labels from
`--label_key`, KL in the loss (`--use_kl_loss`, k3), dynamic filtering and evaluation on held-out
prompts. The policy it trains beats the SFT policy it starts from on the toy's gold score.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlhf_core.driver.stage_driver import train_stage
from rlhf_core.driver.plan import plan_stage, resolve_paths
from rlhf_core.config import RunConfig
from rlhf_core.stages.ppo import PPOConfig
from rlhf_core.models.evaluate import mean_gold_score
from rlhf_core.toy import prompt_digits

pytestmark = pytest.mark.slow
# GRPO's gain over the session's SFT policy on 64 held-out prompts, seed 42: 0.091 measured (0.052 ->
# 0.143). Half of it is demanded, as test_pipeline_stages does.
MIN_GOLD_GAIN = 0.045

REWARD_FUNC = '''
import torch

from rlhf_core.toy import gold_score


def reward_func(queries, prompts, labels, **kwargs):
    responses = [query[len(prompt):].replace("</s>", "").strip() for query, prompt in zip(queries, prompts)]
    rewards = torch.tensor([gold_score(prompt, response) for prompt, response in zip(prompts, responses)])
    exact = [float(response == label) for response, label in zip(responses, labels)]
    return {"rewards": rewards, "scores": rewards, "extra_logs": {"exact_match": exact}}
'''


@pytest.fixture(scope="module")
def sft_policy(reference_sft_weights, toy_assets, tmp_path_factory) -> str:
    """The session's SFT policy (trained once, for the kill tests too) as a model folder. It is a weak
    policy (one epoch, gold score ~0.05), which leaves GRPO a clear gain to make in 32 steps; from the
    demo's stronger SFT (~0.60) 32 GRPO steps gained only 0.01-0.03 in every setting tried."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("sft-policy")
    save_file(reference_sft_weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text((Path(toy_assets["model"]) / "config.json").read_text())
    AutoTokenizer.from_pretrained(toy_assets["model"]).save_pretrained(folder)
    return str(folder)


def labelled_prompts(source: str, target: Path) -> str:
    """The toy prompts with their answer under "answer", as a dataset with labels looks."""
    rows = [json.loads(line) for line in Path(source).read_text().splitlines()]
    target.write_text("".join(json.dumps({**row, "answer": " ".join(map(str, sorted(prompt_digits(row["prompt"])))),
                                          }) + "\n" for row in rows))
    return str(target)


def test_grpo_with_an_openrlhf_reward_func_beats_the_sft_policy(sft_policy, toy_assets, tmp_path):
    sft = sft_policy
    (tmp_path / "reward_func.py").write_text(REWARD_FUNC)
    ppo = PPOConfig(
        pretrain=sft, remote_rm_url=str(tmp_path / "reward_func.py"), label_key="answer",
        prompt_data=labelled_prompts(toy_assets["prompts"], tmp_path / "prompts.jsonl"), input_key="prompt",
        eval_dataset=labelled_prompts(toy_assets["eval_prompts"], tmp_path / "eval_prompts.jsonl"),
        eval_n_samples_per_prompt=1, eval_steps=16,  # PPO evaluates only when --eval_steps says so (OpenRLHF's)
        advantage_estimator="group_norm", use_kl_loss=True, kl_estimator="k3", init_kl_coef=0.01,
        dynamic_filtering=True, dynamic_filtering_reward_range=(0.0, 1.0),
        n_samples_per_prompt=8, rollout_batch_size=8, micro_rollout_batch_size=32, train_batch_size=32,
        micro_train_batch_size=8, max_new_tokens=8, temperature=0.7, learning_rate=1e-3, save_steps=16,
        save_path=str(tmp_path / "out"))
    run = resolve_paths(RunConfig(stages=["ppo"], ckpt_path=str(tmp_path / "ckpt"), max_ckpt_num=0, seed=42, ppo=ppo))
    train_stage(run, "ppo")

    last = plan_stage(run, "ppo").total_steps
    metadata = Path(run.stage_url("ppo")) / f"step_{last}" / "training_metadata.json"
    metrics = json.loads(metadata.read_text())["metrics"]
    assert {"exact_match", "dynamic_filtering_pass_rate", "eval_reward"} <= set(metrics), metrics
    sft_score = mean_gold_score(sft, toy_assets["eval_prompts"])
    grpo_score = mean_gold_score(run.ppo.save_path, toy_assets["eval_prompts"])
    print(f"gold score on held-out prompts: SFT {sft_score:.3f}, GRPO {grpo_score:.3f}; last step {metrics}")
    assert grpo_score - sft_score >= MIN_GOLD_GAIN, (sft_score, grpo_score)
