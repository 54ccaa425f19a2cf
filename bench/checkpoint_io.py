"""Checkpoint save and load cost, next to copying the same bytes with `cp`, measured side by side.

For the toy model and a ~100M-parameter Llama (toy tokenizer, wider and deeper), one DeepSpeed rank
(ZeRO-2, AdamW) on a local Ray trains one step, then:

    save     group.save (DeepSpeed state + HF copy into a local staging folder)
    commit   store.commit (sha256 of every file, copy into the store, MANIFEST, latest)
    fetch    store.download (copy out of the store + sha256 check of every file)
    scan     the pickle scan (torch.load(weights_only=True) of every DeepSpeed file)
    load     group.load (DeepSpeed load_checkpoint in the worker)
    cp       `cp -r` of the committed step folder (the floor for moving those bytes)

    .venv/bin/python bench/checkpoint_io.py [--skip_large]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
import time


def timed(action) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def make_large_model(directory: str) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhf_core.toy import build_tokenizer

    tokenizer = build_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=1024, intermediate_size=4096, num_hidden_layers=6,
                         num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=128,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def measure(name: str, model_dir: str, toy: dict[str, str], workdir: str) -> None:
    from rlhf_core.chunk import plan_stage, resolve_paths
    from rlhf_core.checkpoint import CheckpointStore
    from rlhf_core.config import RunConfig, SFTConfig
    from rlhf_core.engine import WorkerGroup
    from rlhf_core.safe_load import check_no_pickled_code

    run = resolve_paths(RunConfig(ckpt_path=os.path.join(workdir, "ckpt", name), sft=SFTConfig(
        pretrain=model_dir, dataset=toy["sft"], input_key="prompt", output_key="response", max_len=64,
        train_batch_size=8, micro_train_batch_size=8)))
    plan = plan_stage(run, "sft")
    group = WorkerGroup(1)
    group.setup(run, "sft", plan.total_steps)
    group.train_until(1)
    store = CheckpointStore(run.stage_url("sft"))
    staging, fetched, copied = (os.path.join(workdir, f"{name}-{part}") for part in ("staging", "fetched", "cp"))
    seconds = {
        "save": timed(lambda: group.save(staging)),
        "commit": timed(lambda: store.commit(1, staging, {"step": 1})),
        "fetch": timed(lambda: store.download(1, fetched)),
        "scan": timed(lambda: check_no_pickled_code(fetched)),
        "load": timed(lambda: group.load(fetched)),
        "cp": timed(lambda: subprocess.run(["cp", "-r", os.path.join(store.root, "step_1"), copied], check=True)),
    }
    group.shutdown()
    size_mb = sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(copied) for f in files) / 1e6
    save_total = seconds["save"] + seconds["commit"]
    load_total = seconds["fetch"] + seconds["scan"] + seconds["load"]
    print(f"\n{name}: checkpoint {size_mb:.1f} MB")
    for phase, value in seconds.items():
        print(f"  {phase:<7} {value:8.3f} s")
    print(f"  save+commit / cp = {save_total / seconds['cp']:.1f}   fetch+scan+load / cp = {load_total / seconds['cp']:.1f}")
    print(f"  verification on resume (sha256 in fetch + scan) vs the whole load: "
          f"{(seconds['fetch'] - seconds['cp'] + seconds['scan']) / load_total:.0%} (fetch minus cp as the hash cost)")
    for path in (staging, fetched, copied):
        shutil.rmtree(path, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--skip_large", action="store_true", help="Only the toy model.")
    args = parser.parse_args()
    from rlhf_core.toy import init_toy

    with tempfile.TemporaryDirectory(prefix="rlhf-bench-io-") as workdir:
        toy = init_toy(os.path.join(workdir, "toy"))
        measure("toy", toy["model"], toy, workdir)
        if not args.skip_large:
            measure("llama-100m", make_large_model(os.path.join(workdir, "large")), toy, workdir)


if __name__ == "__main__":
    main()
