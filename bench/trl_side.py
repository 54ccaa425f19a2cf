"""TRL's side of the suite: one SFT, reward-model or GRPO run with TRL's trainers, timed per step.

Runs with the TRL venv's python (bench/.cache/trl-venv, built by `make bench`), never the project's,
so TRL and its dependencies stay out of the project's environment. It reads the same toy data and
the same model folder as our side and prints one line `BENCH_RESULT {json}` with the wall-clock
time (time.time()) at the end of every optimizer step, which the suite turns into seconds per step
(windows after warm-up) and into start-up (the suite's launch time to the end of step 1).

    bench/.cache/trl-venv/bin/python bench/trl_side.py sft --model DIR --data sft.jsonl --steps 32 [--fp32]

Settings follow our side's: batch `--batch` in one micro-batch, max length 64, no checkpoints, no
evaluation, no reporting; precision is TRL's default (bf16 autocast on a CPU that has it) unless
--fp32 (`bf16=False`). The GRPO reward is the toy's gold score (`rlhf_core.toy.gold_score`, imported
from this checkout: it needs only `tokenizers`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time


def read_jsonl(path: str) -> list[dict]:
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def common_args(args: argparse.Namespace, output_dir: str) -> dict:
    precision = {"bf16": False} if args.fp32 else {}
    return {"output_dir": output_dir, "max_steps": args.steps, "gradient_accumulation_steps": 1,
            "learning_rate": args.learning_rate, "use_cpu": True, "report_to": "none", "save_strategy": "no",
            "logging_steps": args.steps, "disable_tqdm": True, "dataloader_num_workers": 0, "seed": 42, **precision}


def build_trainer(args: argparse.Namespace, output_dir: str, callbacks: list):
    from datasets import Dataset
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    records = read_jsonl(args.data)
    if args.task == "sft":
        from trl import SFTConfig, SFTTrainer

        data = Dataset.from_list([{"prompt": r["prompt"], "completion": " " + r["response"]} for r in records])
        config = SFTConfig(per_device_train_batch_size=args.batch, max_length=64, **common_args(args, output_dir))
        return SFTTrainer(model=args.model, args=config, train_dataset=data, processing_class=tokenizer,
                          callbacks=callbacks)
    if args.task == "rm":
        from trl import RewardConfig, RewardTrainer

        data = Dataset.from_list([{"prompt": r["prompt"], "chosen": " " + r["chosen"], "rejected": " " + r["rejected"]}
                                  for r in records])
        config = RewardConfig(per_device_train_batch_size=args.batch, max_length=64, **common_args(args, output_dir))
        return RewardTrainer(model=args.model, args=config, train_dataset=data, processing_class=tokenizer,
                             callbacks=callbacks)
    from trl import GRPOConfig, GRPOTrainer

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from rlhf_core.toy import gold_score

    def gold_reward(prompts, completions, **_):
        return [gold_score(prompt, completion) for prompt, completion in zip(prompts, completions)]

    data = Dataset.from_list([{"prompt": r["prompt"]} for r in records])
    config = GRPOConfig(per_device_train_batch_size=args.batch * args.num_generations,
                        num_generations=args.num_generations, max_completion_length=args.max_new_tokens,
                        temperature=1.0, **common_args(args, output_dir))
    return GRPOTrainer(model=args.model, reward_funcs=[gold_reward], args=config, train_dataset=data,
                       processing_class=tokenizer, callbacks=callbacks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("task", choices=("sft", "rm", "grpo"))
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--batch", type=int, default=8, help="Samples (pairs; prompts for GRPO) per step.")
    parser.add_argument("--learning_rate", type=float, default=1e-4)
    parser.add_argument("--fp32", action="store_true", help="bf16=False (default: TRL's default precision).")
    parser.add_argument("--num_generations", type=int, default=8)
    parser.add_argument("--max_new_tokens", type=int, default=8)
    args = parser.parse_args()
    from transformers import TrainerCallback

    step_ends: list[float] = []

    class StepClock(TrainerCallback):
        def on_step_end(self, *_, **__):
            step_ends.append(time.time())

    with tempfile.TemporaryDirectory(prefix="bench-trl-") as output_dir:
        trainer = build_trainer(args, output_dir, [StepClock()])
        trainer.train()
    import torch
    import trl

    print("BENCH_RESULT " + json.dumps({"step_ends": step_ends, "trl": trl.__version__, "torch": torch.__version__,
                                        "bf16": bool(trainer.args.bf16), "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
