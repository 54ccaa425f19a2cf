"""The suite's checkpoint measures (section `ckpt`): what a checkpoint costs against the physical limit of its bytes.
What checkpointing costs a whole run (section `wholerun`) is `wholerun_costs.py`.

- `checkpoint_costs` (section `ckpt`): chunks of one step on the ~100M model through `ensure_checkpoint`,
  read from its own timers (`ChunkResult.seconds`). After the first (cold) chunk the chunks cycle through
  `schedule()`, side by side in one run: each manifest checksum, and the default one with `os.fsync` a
  no-op in the driver and in the rank (what the durable calls cost), and the default written through the page
  cache instead of around it (O_DIRECT off), each committed with nothing training
  beside it (`train_ahead=False`, as the copies run); and the default as users get it, committed while the
  next chunk's step trains beside it. Then the references
  (`reference_io`): a durable copy of the committed step (`cp -r` + fsync of every file and folder), and
  `cat` of the files the rank reads from a cold and from a warm page cache, next to a fresh group's
  `WorkerGroup.load` of one checkpoint per checksum, cold and warm; and each checksum alone over the
  same files.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import tempfile
import time

import ours
import reference_io
from table import Row

NO_FSYNC = "no fsync"
PAGE_CACHE = "page cache"  # the default checksum, written through the page cache (O_DIRECT off) with writeback ahead
BESIDE = " beside training"  # suffix of the variant committed while the next chunk trains (the users' path)
_REAL_FSYNC = os.fsync  # this module is imported before any variant patches it, in the driver and each rank


def variants() -> tuple[str, ...]:
    """The variants of a cycle: the default fsync'ing nothing, every other checksum installed here (blake3 is
    optional: `pip install -e .[blake3]`), the default last."""
    from rlhf_core.storage.manifest import CHECKSUMS, DEFAULT_CHECKSUM, new_hasher
    from rlhf_core.errors import UserError

    def installed(name: str) -> bool:
        try:
            new_hasher(name)
        except UserError:
            return False
        return True

    others = [name for name in CHECKSUMS if name != DEFAULT_CHECKSUM and installed(name)]
    return (NO_FSYNC, PAGE_CACHE, *others, DEFAULT_CHECKSUM)


def schedule() -> list[tuple[str, bool]]:
    """One cycle of warm chunks: (variant, whether the next chunk trains beside its commit)."""
    return [(variant, False) for variant in variants()] + [(variants()[-1], True)]


def _set_fsync(_worker, enabled: bool) -> None:
    """In a rank (`__ray_call__`) or the driver: `os.fsync` real, or a no-op (every durable call in
    rlhf_core goes through it: the rank's file fsyncs, `durable.fsync_dir`, `replace_durably`)."""
    os.fsync = _REAL_FSYNC if enabled else (lambda fd: None)


def _set_direct_io(_worker, enabled: bool) -> None:
    """In a rank or the driver: checkpoint files written around the page cache (O_DIRECT, as shipped) or through
    it (`RLHF_WRITER_DIRECT_IO=0`: 256 KiB writes, each 32 MiB handed to the disk ahead of the fsync)."""
    from rlhf_core.storage.direct_io import DIRECT_IO_ENV

    if enabled:
        os.environ.pop(DIRECT_IO_ENV, None)
    else:
        os.environ[DIRECT_IO_ENV] = "0"


@contextlib.contextmanager
def checkpoint_variant(variant: str | None, group):
    """The driver's checksum default (which `prepare_step` hands the ranks) set for one chunk, and for
    NO_FSYNC `os.fsync` a no-op in this process and in every rank of `group`."""
    import ray

    from rlhf_core.storage import manifest  # where the store reads its default checksum

    previous = manifest.DEFAULT_CHECKSUM
    if variant not in (None, NO_FSYNC, PAGE_CACHE):
        manifest.DEFAULT_CHECKSUM = variant
    switch = {NO_FSYNC: _set_fsync, PAGE_CACHE: _set_direct_io}.get(variant) if group is not None else None
    if switch is not None:
        switch(None, False)
        ray.get([worker.__ray_call__.remote(switch, False) for worker in group.workers])
    try:
        yield
    finally:
        manifest.DEFAULT_CHECKSUM = previous
        if switch is not None:
            switch(None, True)
            ray.get([worker.__ray_call__.remote(switch, True) for worker in group.workers])


def run_chunks(runner, run) -> tuple[list, dict[str, list]]:
    """Every chunk of `run` on `runner` (a StageRunner), the first cold and the rest cycling through `schedule()`;
    all results, and the warm ones by variant (BESIDE appended for those committed beside training)."""
    from rlhf_core.driver import chunk
    from rlhf_core.driver.resume import begin_stage

    plan, lineage, cycle = runner.plan("sft"), begin_stage(run, "sft"), schedule()
    results, by_variant = [], {}
    for index, target in enumerate(plan.targets):
        variant, ahead = (None, True) if index == 0 else cycle[(index - 1) % len(cycle)]
        # Back-to-back 1.6 GB checkpoints outrun the disk's write-back: each one, like each copy, starts
        # from flushed pages, so none pays for another's (the no-fsync variant's pages included).
        os.sync()
        with checkpoint_variant(variant, runner.warm_group):
            result = chunk.ensure_checkpoint(runner, "sft", target, lineage, train_ahead=ahead)
        results.append(result)
        if variant is not None:
            by_variant.setdefault(variant + (BESIDE if ahead else ""), []).append(result)
    return results, by_variant


def resume_costs(run, steps: dict[str, int], read_paths: list[str], step_dirs: dict[str, str], repeat: int) -> dict:
    """Per checksum: a fresh group's `WorkerGroup.load` of its checkpoint from a cold page cache and a warm
    one, next to `cat` of the same files, cold and warm (medians of `repeat`)."""
    from rlhf_core.driver.plan import plan_stage
    from rlhf_core.driver.engine import WorkerGroup

    plan, costs = plan_stage(run, "sft"), {}
    group = WorkerGroup(run)
    try:
        group.setup(run, "sft", plan.targets)

        def load(step: int, cold: bool) -> float:
            if cold:
                reference_io.drop_page_cache()
            started = time.perf_counter()
            group.load(run.stage_url("sft"), run.storage_options, step)
            return time.perf_counter() - started

        for algorithm, step in steps.items():
            root = step_dirs[algorithm]
            costs[algorithm] = {
                "cold": statistics.median(load(step, True) for _ in range(repeat)),
                "warm": statistics.median(load(step, False) for _ in range(repeat)),
                "read_cold": statistics.median(reference_io.cold_read(root, read_paths) for _ in range(repeat)),
                "read_warm": statistics.median(reference_io.warm_read(root, read_paths) for _ in range(repeat))}
    finally:
        group.shutdown()
    return costs


def checkpoint_costs(run, repeat: int) -> dict:
    """Section `ckpt`; see the module docstring. `run` keeps at least len(schedule()) checkpoints."""
    import ray

    from rlhf_core.driver.runner import StageRunner
    from rlhf_core.rank.loading import files_for_rank

    with StageRunner(run) as runner:
        results, by_variant = run_chunks(runner, run)
        group = runner.warm_group
        in_memory = ray.get(group.workers[0].__ray_call__.remote(ours.copy_rank_tensors, repeat)) if group else None
        interim = ray.get(group.workers[0].__ray_call__.remote(ours.interim_stalls, repeat)) if group else None
    step_dirs = {variant: ours.local_path(chunk_results[-1].uri) for variant, chunk_results in by_variant.items()}
    for step_dir in step_dirs.values():
        ours.wait_committed(step_dir)
    default_dir = step_dirs[variants()[-1]]
    with open(os.path.join(default_dir, "MANIFEST.json")) as handle:
        paths = [entry["path"] for entry in json.load(handle)["files"]]
    read_paths = files_for_rank(paths, 0, False)
    scratch = tempfile.mkdtemp(prefix="bench-cp-", dir=os.path.dirname(default_dir))
    try:
        target = os.path.join(scratch, "copy")
        cp_page = reference_io.timed_copies(reference_io.page_copy, default_dir, target, repeat)
        cp_durable = reference_io.timed_copies(reference_io.durable_copy, default_dir, target, repeat)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    algorithms = [variant for variant in variants() if variant not in (NO_FSYNC, PAGE_CACHE)]  # each alone
    hashes = {algorithm: {"all": reference_io.hash_seconds(default_dir, paths, algorithm, repeat),
                          "read": reference_io.hash_seconds(default_dir, read_paths, algorithm, repeat)}
              for algorithm in algorithms}
    steps = {algorithm: by_variant[algorithm][-1].step for algorithm in algorithms}
    resume = resume_costs(run, steps, read_paths, step_dirs, repeat)
    per_variant = {}
    for variant, chunk_results in by_variant.items():
        stalls, commits = zip(*(ours.stall_and_commit(result.seconds) for result in chunk_results))
        after_snapshot = [commit - stall for stall, commit in zip(stalls, commits)]
        per_variant[variant] = {"stall": statistics.median(stalls), "save_to_commit": statistics.median(commits),
                                "after_snapshot": statistics.median(after_snapshot), "samples": list(commits)}
    step_bytes = sum(os.path.getsize(os.path.join(default_dir, path)) for path in paths)
    read_bytes = sum(os.path.getsize(os.path.join(default_dir, path)) for path in read_paths)
    return {"variants": per_variant, "default": variants()[-1],
            "in_memory_copy": in_memory["seconds"] if in_memory else None,
            "tensor_bytes": in_memory["bytes"] if in_memory else None, "interim": interim,
            "cp_page": cp_page, "cp_durable": cp_durable, "hashes": hashes, "resume": resume,
            "step_bytes": step_bytes, "read_bytes": read_bytes, "checkpoint_bytes": results[-1].size_bytes,
            "page_cache_dropped": reference_io.drop_page_cache(),
            "chunk_seconds": [result.seconds for result in results]}


def print_costs(costs: dict) -> None:
    """The `ckpt` section's measures, line by line, under the suite's table."""
    variants, default, resume = costs["variants"], costs["default"], costs["resume"]
    print(f"  ckpt: {costs['checkpoint_bytes'] / 1e9:.2f} GB checkpoint ({costs['read_bytes'] / 1e9:.2f} GB read by "
          f"the rank), {(costs['tensor_bytes'] or 0) / 1e9:.2f} GB of tensors; in-memory copy "
          f"{costs['in_memory_copy']:.2f} s; cp -r {costs['cp_page']:.2f} s into the page cache, durable copy "
          f"{costs['cp_durable']:.2f} s; page cache dropped: {costs['page_cache_dropped']}", flush=True)
    interim = costs.get("interim")
    if interim:
        print(f"  snapshot between commits: stall {interim['seconds']:.3f} s ({interim['first']:.3f} s the first, "
              f"its slot's pages new); K as chosen: {interim['interval']} (step {interim['step_seconds'] or 0:.3f} s, "
              "stall within 5% of training)", flush=True)
    for variant, measured in variants.items():
        print(f"    {variant:>9}: stall {measured['stall']:.2f} s, save-to-commit {measured['save_to_commit']:.2f} s "
              f"{[round(x, 2) for x in measured['samples']]}", flush=True)
    fsync_cost = variants[default]["save_to_commit"] - variants[NO_FSYNC]["save_to_commit"]
    print(f"    fsync adds {fsync_cost:.2f} s per checkpoint (durable {default} against os.fsync a no-op, both "
          "with nothing training beside them)", flush=True)
    for algorithm, hashed in costs["hashes"].items():
        rate = costs["step_bytes"] / hashed["all"] / 1e9
        print(f"    {algorithm:>9}: alone {hashed['all']:.2f} s for the step ({rate:.2f} GB/s, one core, page cache), "
              f"{hashed['read']:.2f} s for the files read; resume cold "
              f"{resume[algorithm]['cold']:.2f} s (cat {resume[algorithm]['read_cold']:.2f} s), warm "
              f"{resume[algorithm]['warm']:.2f} s (cat {resume[algorithm]['read_warm']:.2f} s)", flush=True)


def rows(costs: dict) -> list[Row]:
    """The `ckpt` section's rows of the suite's table."""
    variants, default, resume, hashes = costs["variants"], costs["default"], costs["resume"], costs["hashes"]
    durable, cold, warm = costs["cp_durable"], resume[default]["read_cold"], resume[default]["read_warm"]
    others = [algorithm for algorithm in hashes if algorithm != default]
    beside = variants[default + BESIDE]
    rows = [Row("ckpt stall / one in-memory copy of its tensors (100M)", costs["in_memory_copy"], beside["stall"], "s",
                "<=", 1.5),
            Row("snapshot between commits: stall / one in-memory copy of its tensors (100M)", costs["in_memory_copy"],
                costs["interim"]["seconds"] if costs.get("interim") else None, "s", "<=", 1.5),
            Row(f"ckpt save-to-durable-commit ({default}) / durable copy of the step (100M)", durable,
                variants[default]["save_to_commit"], "s", "<=", 1.25),
            Row("  the same with the next chunk training beside it (the default path)", durable,
                beside["save_to_commit"], "s", "<=", None),
            Row("  the commit after the snapshot (no in-memory copy) / durable copy", durable,
                variants[default]["after_snapshot"], "s", "<=", None),
            *[Row(f"  save-to-commit with {algorithm} / durable copy", durable, variants[algorithm]["save_to_commit"],
                  "s", "<=", None) for algorithm in others],
            Row("  fsync's share: save-to-commit / same with os.fsync a no-op",
                variants[NO_FSYNC]["save_to_commit"], variants[default]["save_to_commit"], "s", "<=", None),
            Row("  O_DIRECT: save-to-commit / same written through the page cache (RLHF_WRITER_DIRECT_IO=0)",
                variants[PAGE_CACHE]["save_to_commit"], variants[default]["save_to_commit"], "s", "<=",
                None),
            Row("  cp -r into the page cache / durable copy (the old reference)", durable, costs["cp_page"], "s", "<=",
                None),
            Row(f"resume, cold cache: fetch + verify + load ({default}) / cold cat of the files read (100M)", cold,
                resume[default]["cold"], "s", "<=", 1.25),
            Row("resume, warm cache / warm cat of the files read", warm, resume[default]["warm"], "s", "<=", 1.25),
            *[Row(f"  resume, cold cache, with {algorithm} / cold cat", resume[algorithm]["read_cold"],
                  resume[algorithm]["cold"], "s", "<=", None) for algorithm in others],
            # Floors, not our code: when the checksum alone misses the goal, no writer that records it can meet it.
            Row(f"  floor: {default} alone of the step / durable copy", durable, hashes[default]["all"], "s", "<=",
                1.25),
            Row(f"  floor: {default} alone of the files read / cold cat", cold, hashes[default]["read"], "s", "<=",
                1.25)]
    return rows
