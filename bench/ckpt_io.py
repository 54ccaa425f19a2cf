"""Per-rank checkpoint save and load time against a raw copy of the same bytes, for 1 and 2 ranks.

Each rank saves into a staging folder on its own node and uploads its own files into the store
(hashing while it writes), and on load fetches and verifies only the files it reads; the driver only
writes the manifest. This times those per-rank paths inside the ranks themselves, phase by phase, next to
a plain fsspec copy of exactly the bytes that rank moved. It saves as a plain folder save does (the trainer's
`save` into a folder on disk, then `upload_tree` of it), not as `TrainWorker.snapshot` + `write_snapshot` do
(DeepSpeed's state kept in memory and streamed into the store); the suite's `ckpt` section times that path.
Loads go through `fetch` into a folder (as `TrainWorker.load_from_store` does for a remote store):

    ds_save  DeepSpeed + HF save into the rank's node-local staging folder
    upload   `upload_tree` of that folder into the uncommitted step (sha256 while writing)
    put      raw copy of the same staged files into the store (no hashing)
    fetch    `fetch` of the files this rank reads (sha256-verified as they arrive)
    ds_load  DeepSpeed's load of the fetched files
    get      raw copy of the same files out of the store
    commit   the driver's part: metadata, MANIFEST.json, latest

Ratios: save/put = (ds_save + upload) / put and load/get = (fetch + ds_load) / get set the whole
operation against moving its bytes; upload/put and fetch/get isolate the cost of hashing. Each
phase is run --repeat times (median), starting with no dirty pages and including the flush of its
own writes, so no phase pays for another's. The model is the toy one, or with --model 100m a
~100M-parameter Llama (bench/models.py); the store is a local folder, or with
--store s3 a moto S3 endpoint on loopback. One local Ray; 2 ranks share this machine's cores and
disk, so their phases overlap as on one host.

    .venv/bin/python bench/ckpt_io.py [--model toy|100m] [--store local|s3] [--ranks 1,2] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

PHASES = ("ds_save", "upload", "put", "fetch", "ds_load", "get")


def timed_durable(action, repeat: int) -> float:
    """Median seconds of `action` over `repeat` runs, each from a flushed page cache's dirty pages and
    including the flush of its own writes: the cost of bytes that are on disk, not just in memory."""
    seconds = []
    for _ in range(repeat):
        os.sync()
        started = time.perf_counter()
        action()
        os.sync()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def rank_save(worker, store_url: str, storage_options: dict, pending, raw_url: str, repeat: int) -> dict:
    """Runs inside a rank (`__ray_call__`): DeepSpeed + HF save into node-local staging, then `upload_tree` into the pending step; next to a raw put of the
    same staged files. Returns the rank's manifest entries and seconds."""
    import fsspec

    from rlhf_core.storage.checkpoint import CheckpointStore

    store = CheckpointStore(store_url, storage_options)
    raw_fs, raw_root = fsspec.core.url_to_fs(f"{raw_url}/rank{worker.rank}", **storage_options)
    staging = tempfile.mkdtemp(prefix=f"bench-save-rank{worker.rank}-")
    entries = []
    try:
        ds_save = timed_durable(lambda: worker.trainer.save(staging), repeat)  # collective: all ranks run it
        put = timed_durable(lambda: raw_fs.put(staging.rstrip("/") + "/", raw_root, recursive=True), repeat)
        upload = timed_durable(lambda: entries.__setitem__(slice(None), store.upload_tree(pending, staging)), repeat)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return {"rank": worker.rank, "entries": entries, "ds_save": ds_save, "upload": upload, "put": put,
            "save_mb": sum(entry.size for entry in entries) / 1e6}


def rank_load(worker, store_url: str, storage_options: dict, step: int, repeat: int) -> dict:
    """Runs inside a rank, step by step as `TrainWorker.load_from_store` (same rank, same world size):
    the verified fetch of the files this rank reads, then DeepSpeed's load; next to a raw get of the
    same files."""
    import fsspec

    from rlhf_core.storage.checkpoint import CheckpointStore
    from rlhf_core.storage.manifest import Manifest, step_dir_name
    from rlhf_core.rank.loading import files_for_rank

    store = CheckpointStore(store_url, storage_options)
    fs, root = fsspec.core.url_to_fs(store_url, **storage_options)
    step_path = f"{root.rstrip('/')}/{step_dir_name(step)}"
    manifest = Manifest.from_bytes(fs.cat_file(f"{step_path}/MANIFEST.json"))
    select = lambda paths: files_for_rank(paths, worker.rank, False)  # noqa: E731 - what load_from_store picks
    chosen = select([entry.path for entry in manifest.files])
    fetched_dir, raw_dir = (tempfile.mkdtemp(prefix=f"bench-{kind}-rank{worker.rank}-") for kind in ("fetch", "raw"))
    local_paths = [os.path.join(raw_dir, *path.split("/")) for path in chosen]
    try:
        for path in local_paths:
            os.makedirs(os.path.dirname(path), exist_ok=True)
        get = timed_durable(lambda: fs.get([f"{step_path}/{path}" for path in chosen], local_paths), repeat)
        fetch = timed_durable(lambda: store.fetch(step, fetched_dir, select), repeat)
        ds_load = timed_durable(lambda: worker.trainer.load(fetched_dir, False, False), repeat)
    finally:
        shutil.rmtree(fetched_dir, ignore_errors=True)
        shutil.rmtree(raw_dir, ignore_errors=True)
    return {"rank": worker.rank, "fetch": fetch, "ds_load": ds_load, "get": get,
            "load_mb": sum(entry.size for entry in manifest.files if entry.path in set(chosen)) / 1e6}


def measure(num_ranks: int, model_dir: str, toy: dict[str, str], ckpt_root: str, storage_options: dict,
            repeat: int) -> list[dict]:
    """One group of `num_ranks`: train a step, then time a save, the driver's commit and a load on every rank."""
    import ray

    from rlhf_core.storage.checkpoint import CheckpointStore
    from rlhf_core.driver.plan import plan_stage, resolve_paths
    from rlhf_core.config import RunConfig
    from rlhf_core.stages.sft import SFTConfig
    from rlhf_core.driver.engine import WorkerGroup

    run = resolve_paths(RunConfig(
        ckpt_path=f"{ckpt_root}/ranks{num_ranks}", num_workers=num_ranks, storage_options=storage_options,
        sft=SFTConfig(pretrain=model_dir, dataset=toy["sft"], input_key="prompt", output_key="response",
                      max_len=64, train_batch_size=8, micro_train_batch_size=8 // num_ranks, max_epochs=1,
                      input_template=None)))
    store_url, plan = run.stage_url("sft"), plan_stage(run, "sft")
    store = CheckpointStore(store_url, storage_options)
    group = WorkerGroup(run)
    try:
        group.setup(run, "sft", plan.targets)
        group.train_until(1)
        pending = store.prepare_step(1)
        saves = ray.get([worker.__ray_call__.remote(rank_save, store_url, storage_options, pending,
                                                    f"{ckpt_root}/raw-ranks{num_ranks}", repeat)
                         for worker in group.workers])
        started = time.perf_counter()
        store.finish_commit(pending, [entry for share in saves for entry in share.pop("entries")], {"step": 1})
        commit_seconds = time.perf_counter() - started
        loads = ray.get([worker.__ray_call__.remote(rank_load, store_url, storage_options, 1, repeat)
                         for worker in group.workers])
    finally:
        group.shutdown()
    return [{**save, **load, "commit": commit_seconds} for save, load in zip(saves, loads)]


def print_table(rows_by_ranks: dict[int, list[dict]]) -> None:
    print(f"{'ranks':>5} {'rank':>4} {'save MB':>8} {'load MB':>8} " + " ".join(f"{phase:>8}" for phase in PHASES)
          + f" {'commit':>7} | {'save/put':>8} {'upload/put':>10} {'load/get':>8} {'fetch/get':>9}")
    for num_ranks, rows in rows_by_ranks.items():
        for row in rows:
            save, load = row["ds_save"] + row["upload"], row["fetch"] + row["ds_load"]
            print(f"{num_ranks:>5} {row['rank']:>4} {row['save_mb']:>8.1f} {row['load_mb']:>8.1f} "
                  + " ".join(f"{row[phase]:>8.3f}" for phase in PHASES) + f" {row['commit']:>7.3f} | "
                  + f"{save / row['put']:>8.2f} {row['upload'] / row['put']:>10.2f} "
                  + f"{load / row['get']:>8.2f} {row['fetch'] / row['get']:>9.2f}")
    print("seconds per rank (median, each phase flushed to disk); save = ds_save + upload (sha256 while writing), "
          "load = fetch (sha256-verified) + ds_load; put / get: a raw fsspec copy of the same files; "
          "commit: the driver's metadata + MANIFEST.json + latest")


def start_moto() -> object:
    """A moto S3 endpoint on loopback with a bucket `bench`; this process and the local Ray it starts
    reach it through the standard AWS variables (secrets never go in storage_options)."""
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    endpoint = "http://{}:{}".format(*server.get_host_and_port())
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench-secret", AWS_DEFAULT_REGION="us-east-1",
                      AWS_ENDPOINT_URL=endpoint)
    boto3.client("s3").create_bucket(Bucket="bench")
    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("toy", "100m"), default="toy")
    parser.add_argument("--store", choices=("local", "s3"), default="local")
    parser.add_argument("--ranks", default="1,2", help="Comma-separated world sizes to measure.")
    parser.add_argument("--repeat", type=int, default=3, help="Runs of each phase; the median is shown.")
    args = parser.parse_args()
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    from models import build_model_dir  # bench/models.py: the suite's models
    from rlhf_core.toy import init_toy

    with tempfile.TemporaryDirectory(prefix="rlhf-bench-ckpt-io-") as workdir:
        toy = init_toy(os.path.join(workdir, "toy"))
        model_dir = toy["model"] if args.model == "toy" else build_model_dir(os.path.join(workdir, "large"), "100m")[0]
        server, storage_options, ckpt_root = None, {}, os.path.join(workdir, "store")
        if args.store == "s3":
            server = start_moto()
            ckpt_root = "s3://bench/store"
        try:
            rows = {num_ranks: measure(num_ranks, model_dir, toy, ckpt_root, storage_options, args.repeat)
                    for num_ranks in (int(part) for part in args.ranks.split(","))}
        finally:
            if server is not None:
                server.stop()
    print(f"\nmodel {args.model}, store {args.store}")
    print_table(rows)


if __name__ == "__main__":
    main()
