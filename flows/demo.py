"""`rlhf demo`: toy assets, then the pipeline on them, then where everything is and how good it got."""

from __future__ import annotations

import os
import time

from rlhf_core.config import RunConfig, SFTConfig
from rlhf_core.toy import init_toy


def demo_config(workdir: str, num_workers: int) -> RunConfig:
    toy = os.path.join(workdir, "toy")
    return RunConfig(
        run_name="demo",
        ckpt_path=os.path.join(workdir, "ckpt"),
        load_checkpoint=True,  # running the demo again resumes (and skips) instead of refusing
        num_workers=num_workers,
        sft=SFTConfig(
            pretrain=os.path.join(toy, "model"), dataset=os.path.join(toy, "sft.jsonl"),
            input_key="prompt", output_key="response", max_len=64,
            train_batch_size=16, micro_train_batch_size=8, max_epochs=6, learning_rate=3e-3,
            lr_warmup_ratio=0.05, save_steps=16, save_path=os.path.join(workdir, "out", "sft"),
        ),
    )


def run_demo(workdir: str, num_workers: int = 1) -> None:
    from flows.cli import run_pipeline
    from rlhf_core.evaluate import mean_gold_score

    started = time.perf_counter()
    toy = init_toy(os.path.join(workdir, "toy"))
    run = demo_config(workdir, num_workers)
    summary = run_pipeline(run)
    print("\n== demo summary ==")
    for stage, result in summary.items():
        print(f"{stage}: {len(result['chunks'])} chunks, final step {result['final_step']}")
        for row in result["chunks"]:
            print(f"  step {row['step']:>4}  {row['status']:<20} loss {row.get('loss', float('nan')):.4f}")
        print(f"  checkpoints: {os.path.dirname(result['checkpoint'])}")
        print(f"  final HF model: {result['save_path']}")
    print(f"gold score (held-out prompts), toy model before SFT: {mean_gold_score(toy['model'], toy['prompts']):.3f}")
    print(f"gold score (held-out prompts), after SFT:            "
          f"{mean_gold_score(summary['sft']['save_path'], toy['prompts']):.3f}")
    print(f"demo wall time: {time.perf_counter() - started:.1f} s")
