"""PPO samples per second on the toy config (the demo's PPO stage), split into rollout+update time
and the time around it, measured in one run.

Needs the SFT and RM outputs of `make demo` (./demo/out/sft, ./demo/out/rm); trains PPO into a
temporary folder.

    .venv/bin/python bench/ppo_throughput.py [--num_workers 1]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num_workers", type=int, default=1)
    parser.add_argument("--demo_dir", default="./demo")
    args = parser.parse_args()
    from flows.demo import demo_config
    from rlhf_core.chunk import ensure_checkpoint, plan_stage, release_workers, resolve_paths
    from rlhf_core.resume import begin_stage

    demo = demo_config(args.demo_dir, args.num_workers)
    with tempfile.TemporaryDirectory(prefix="rlhf-bench-ppo-") as workdir:
        ppo = demo.ppo.model_copy(update={"pretrain": demo.sft.save_path, "critic_pretrain": demo.rm.save_path,
                                          "save_path": os.path.join(workdir, "out")})
        run = resolve_paths(demo.model_copy(update={"stages": ["ppo"], "ckpt_path": workdir, "ppo": ppo}))
        plan, lineage = plan_stage(run, "ppo"), begin_stage(run, "ppo")
        started = time.perf_counter()
        results = [ensure_checkpoint(run, "ppo", target, lineage) for target in plan.targets]
        wall = time.perf_counter() - started
        release_workers()
    samples = plan.total_steps * ppo.rollout_batch_size * ppo.n_samples_per_prompt
    train_seconds = sum(result.seconds["train"] for result in results)
    print(f"PPO ({ppo.advantage_estimator}, {plan.total_steps} steps x {ppo.rollout_batch_size} prompts x "
          f"{ppo.n_samples_per_prompt} samples, max_new_tokens {ppo.max_new_tokens}, {args.num_workers} rank(s))")
    print(f"  samples/s during PPO steps (rollout + scoring + update): {samples / train_seconds:.1f}")
    print(f"  samples/s over the stage's wall time (workers, checkpoints): {samples / wall:.1f}")
    print(f"  wall/train ratio: {wall / train_seconds:.2f}")


if __name__ == "__main__":
    main()
