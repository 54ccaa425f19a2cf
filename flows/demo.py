"""`rlhf demo`: toy assets, then the whole pipeline on them (SFT -> RM -> PPO with LoRA -> merge ->
export), then where everything is and how much the policy improved on held-out prompts.

The PPO stage rewards with the toy's verifiable gold score (`--reward_fn`), and its critic starts
from the reward model this run trains; on 2 CPU cores the whole demo takes a few minutes.
"""

from __future__ import annotations

import os
import time

from rlhf_core.driver.stop import StopSignals
from rlhf_core.config import RunConfig
from rlhf_core.stages.export import ExportConfig
from rlhf_core.stages.merge import MergeConfig
from rlhf_core.stages.ppo import PPOConfig
from rlhf_core.stages.rm import RMConfig
from rlhf_core.stages.sft import SFTConfig
from rlhf_core.toy import init_toy


def demo_config(workdir: str, num_workers: int, stages: list[str] | None = None) -> RunConfig:
    toy, out = os.path.join(workdir, "toy"), os.path.join(workdir, "out")
    return RunConfig(
        run_name="demo",
        stages=stages or ["sft", "rm", "ppo", "merge", "export"],
        ckpt_path=os.path.join(workdir, "ckpt"),
        load_checkpoint=True,  # running the demo again resumes (and skips) instead of refusing
        num_workers=num_workers,
        sft=SFTConfig(
            pretrain=os.path.join(toy, "model"), dataset=os.path.join(toy, "sft.jsonl"),
            input_key="prompt", output_key="response", input_template=None, max_len=64,  # the prompts as written
            train_batch_size=16, micro_train_batch_size=8, max_epochs=6, learning_rate=3e-3,
            lr_warmup_ratio=0.05, save_steps=16, save_path=os.path.join(out, "sft"),
        ),
        rm=RMConfig(
            dataset=os.path.join(toy, "prefs.jsonl"), prompt_key="prompt", max_len=64, train_batch_size=16,
            micro_train_batch_size=8, max_epochs=3, learning_rate=1e-3, save_steps=16, save_path=os.path.join(out, "rm"),
            eval_holdout=0.1, eval_steps=16,  # accuracy on held-out pairs at each chunk: the demo shows it
        ),
        ppo=PPOConfig(
            prompt_data=os.path.join(toy, "prompts.jsonl"), input_key="prompt", reward_fn="rlhf_core.toy:gold_reward",
            advantage_estimator="gae", n_samples_per_prompt=8, rollout_batch_size=8, micro_rollout_batch_size=32,
            train_batch_size=32, micro_train_batch_size=8, max_new_tokens=8, temperature=0.7, init_kl_coef=0.01,
            value_clip=0.2, lambd=0.95,  # the demo's tuning (OpenRLHF's defaults: 0.5 and 1)
            learning_rate=3e-3, critic_learning_rate=1e-3, lora_rank=8, lora_alpha=16, num_episodes=2,
            save_steps=16, save_path=os.path.join(out, "ppo_lora"),
        ),
        merge=MergeConfig(output_path=os.path.join(out, "merged")),
        export=ExportConfig(save_path=os.path.join(out, "final")),
    )


def run_demo(workdir: str, num_workers: int = 1, signals: StopSignals | None = None) -> None:
    from flows.pipeline import run_pipeline
    from rlhf_core.models.evaluate import mean_gold_score

    started = time.perf_counter()
    toy = init_toy(os.path.join(workdir, "toy"))
    summary = run_pipeline(demo_config(workdir, num_workers), signals=signals)
    print("\n== demo summary ==")
    for stage, result in summary.items():
        print(f"{stage}: {result['save_path']} ({result['seconds']:.1f} s)")
        for row in result.get("chunks", []):
            shown = {k: row[k] for k in ("loss", "eval_accuracy", "reward", "kl") if k in row}
            print(f"  step {row['step']:>4}  {row['status']:<20} " + "  ".join(f"{k} {v:.3f}" for k, v in shown.items()))
    scores = {name: mean_gold_score(path, toy["eval_prompts"]) for name, path in (
        ("toy model before SFT", toy["model"]), ("SFT policy", summary["sft"]["save_path"]),
        ("PPO policy (final export)", summary["export"]["save_path"]))}
    for name, score in scores.items():
        print(f"gold score on held-out prompts, {name:<26} {score:.3f}")
    print(f"demo wall time: {time.perf_counter() - started:.1f} s")
