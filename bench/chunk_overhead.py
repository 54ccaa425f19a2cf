"""Where the time of a chunk goes: training versus everything around it, measured side by side.

Runs the `rlhf` flow in-process on the toy SFT config (Prefect's ephemeral server, a local Ray, real
DeepSpeed) and prints, for the first (cold) chunk and the later (warm) chunks, the seconds spent in
training steps and outside them (planning, worker start + model load, save + commit), and the
flow's whole wall time next to the summed training time.

    .venv/bin/python bench/chunk_overhead.py [--num_workers 1]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num_workers", type=int, default=1)
    args = parser.parse_args()
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from flows.demo import demo_config
    from flows.pipeline import rlhf
    from rlhf_core.toy import init_toy

    with tempfile.TemporaryDirectory(prefix="rlhf-bench-") as workdir:
        init_toy(os.path.join(workdir, "toy"))
        run = demo_config(workdir, args.num_workers)
        started = time.perf_counter()
        summary = rlhf(config=run)
        wall = time.perf_counter() - started
    rows = summary["sft"]["chunks"]
    phases = ("plan_s", "workers_and_load_s", "train_s", "save_and_commit_s")
    print(f"{'chunk':>6} " + " ".join(f"{p:>20}" for p in phases) + f" {'outside/train':>14}")
    for row in rows:
        outside = sum(row[p] for p in phases if p != "train_s")
        print(f"{row['step']:>6} " + " ".join(f"{row[p]:>20.3f}" for p in phases) + f" {outside / row['train_s']:>14.2f}")
    train_total = sum(row["train_s"] for row in rows)
    print(f"flow wall time {wall:.1f} s, of which training steps {train_total:.2f} s "
          f"(ratio wall/train {wall / train_total:.1f})")


if __name__ == "__main__":
    main()
