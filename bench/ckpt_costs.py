"""The suite's checkpoint measures: what a checkpoint costs against the physical limit of its bytes, and what
checkpointing costs a whole run.

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
- `whole_run` (section `wholerun`): the `rlhf` Prefect flow, SFT on the 23.6M model, once with a
  checkpoint every 50 steps and once as a single chunk, same seed and data; the extra wall time per
  checkpoint, against the training time of a 50-step chunk; and the floor under it, the single chunk with a
  durable copy of the same bytes at each boundary (`durable_floor`).
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
from table import extra_per_checkpoint

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
    from rlhf_core.rank.worker import files_for_rank

    with StageRunner(run) as runner:
        results, by_variant = run_chunks(runner, run)
        group = runner.warm_group
        in_memory = ray.get(group.workers[0].__ray_call__.remote(ours.copy_rank_tensors, repeat)) if group else None
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
            "tensor_bytes": in_memory["bytes"] if in_memory else None,
            "cp_page": cp_page, "cp_durable": cp_durable, "hashes": hashes, "resume": resume,
            "step_bytes": step_bytes, "read_bytes": read_bytes, "checkpoint_bytes": results[-1].size_bytes,
            "page_cache_dropped": reference_io.drop_page_cache(),
            "chunk_seconds": [result.seconds for result in results]}


def _process_cpu(_worker=None) -> float:
    """CPU seconds (user + system, every thread) this process has used: a rank's (`__ray_call__`) or ours."""
    return time.process_time()


@contextlib.contextmanager
def group_hooks(first_training, before_shutdown):
    """Wrap `WorkerGroup.train_until` and `.shutdown`: `first_training(group)` runs before a group's first training
    call, `before_shutdown(group)` before that group's ranks are killed (the flow's end)."""
    from rlhf_core.driver.engine import WorkerGroup

    trained: set[int] = set()
    train_until, shutdown = WorkerGroup.train_until, WorkerGroup.shutdown

    def hooked_train_until(self, target_step):
        if id(self) not in trained:
            trained.add(id(self))
            first_training(self)
        return train_until(self, target_step)

    def hooked_shutdown(self):
        if id(self) in trained and self.workers:
            trained.discard(id(self))
            before_shutdown(self)
        return shutdown(self)

    WorkerGroup.train_until, WorkerGroup.shutdown = hooked_train_until, hooked_shutdown
    try:
        yield
    finally:
        WorkerGroup.train_until, WorkerGroup.shutdown = train_until, shutdown


@contextlib.contextmanager
def recorded_cpu():
    """The CPU seconds every rank and this process used between a group's first training call and its shutdown
    (the flow's end). It moves less than wall time when other work shares the machine, though heavy contention
    for the same cores inflates it too."""
    import ray

    marks: dict[int, float] = {}
    spent: list[float] = []

    def cpu(group) -> float:
        return sum(ray.get([worker.__ray_call__.remote(_process_cpu) for worker in group.workers])) + _process_cpu()

    def mark(group) -> None:
        marks[id(group)] = cpu(group)

    def count(group) -> None:
        spent.append(cpu(group) - marks.pop(id(group)))

    with group_hooks(mark, count):
        yield spent


@contextlib.contextmanager
def recorded_steps():
    """Wrap `WorkerGroup._collect` and `.train_ahead`: rank 0's time of every step, in order, and for each
    `train_ahead` the seconds the ranks sat idle before it (from the end of the training collected last, i.e.
    the chunk's end: the checks, the metadata and the snapshot)."""
    from rlhf_core.driver.engine import WorkerGroup

    recorded: dict[str, list[float]] = {"steps": [], "idle": []}
    collected_at: list[float] = []
    collect, train_ahead = WorkerGroup._collect, WorkerGroup.train_ahead

    def recorded_collect(self, trainings):
        num_before = len(self._step_times)
        try:
            return collect(self, trainings)
        finally:
            recorded["steps"] += [seconds for seconds, _ in self._step_times[num_before:]]
            collected_at[:] = [time.perf_counter()]

    def recorded_train_ahead(self, target_step):
        if collected_at:
            recorded["idle"].append(time.perf_counter() - collected_at[0])
        return train_ahead(self, target_step)

    WorkerGroup._collect, WorkerGroup.train_ahead = recorded_collect, recorded_train_ahead
    try:
        yield recorded
    finally:
        WorkerGroup._collect, WorkerGroup.train_ahead = collect, train_ahead


@contextlib.contextmanager
def durable_floor(boundaries: set[int], folder: str):
    """Every worker group's ranks make a durable copy of their state's bytes at `boundaries`, into `folder`
    (`durable_floor`); yields a dict that gets rank 0's report (bytes, copy and write seconds) at shutdown."""
    import ray
    import ray.cloudpickle

    import durable_floor as floor

    ray.cloudpickle.register_pickle_by_value(floor)  # the ranks cannot import the bench folder
    report: dict = {}

    def install(group) -> None:
        ray.get([worker.__ray_call__.remote(floor.install, boundaries, folder) for worker in group.workers])

    def collect(group) -> None:
        report.update(ray.get(group.workers[0].__ray_call__.remote(floor.report)))

    try:
        with group_hooks(install, collect):
            yield report
    finally:
        shutil.rmtree(folder, ignore_errors=True)


BOUNDARY_STEPS = 8  # steps after a boundary counted in `boundary_cost`: the writer and the commit end within them


def boundary_cost(steps: list[float], idle: list[float], save_steps: int) -> float | None:
    """Inside one run, per chunk boundary that has `BOUNDARY_STEPS` steps after it: the ranks' idle time before
    they trained ahead, plus those steps' time beyond the run's median step (the steps near no boundary). A
    single-chunk run at the same positions gives the measure's own bias (about 0)."""
    boundaries = [step for step in range(save_steps, len(steps) - BOUNDARY_STEPS + 1, save_steps)]
    if not boundaries:
        return None
    near = {boundary + offset for boundary in boundaries for offset in range(BOUNDARY_STEPS)}
    median = statistics.median(seconds for index, seconds in enumerate(steps) if index not in near)
    excess = [sum(steps[boundary + offset] - median for offset in range(BOUNDARY_STEPS)) for boundary in boundaries]
    idle_seconds = statistics.mean(idle[:len(boundaries)]) if idle else 0.0
    return statistics.mean(excess) + idle_seconds


def _flow_costs(run) -> dict:
    """One `rlhf` flow over `run`: wall from the start of its first training call (so Ray's and the group's
    start-up, which the two runs may pay unequally, stay out) to its end, the CPU seconds of the ranks and
    the driver over the same span, its chunk rows, and rank 0's step times and idle spells (`recorded_steps`)."""
    with recorded_cpu() as spent, recorded_steps() as recorded:
        flow = ours.chunk_boundaries(run)
    first_training = flow["spans"][0][0] if flow["spans"] else flow["started"]
    return {"wall": flow["started"] + flow["wall"] - first_training, "cpu": sum(spent), "chunks": flow["chunks"],
            "flow_wall": flow["wall"], **recorded}


def checkpoint_sizes(run) -> list[int]:
    from rlhf_core.storage.checkpoint import CheckpointStore

    return [info.size_bytes for info in CheckpointStore(run.stage_url("sft")).list() if info.is_committed]


def whole_run(workdir: str, toy: dict[str, str], model_dir: str, num_steps: int, save_steps: int,
              repeat: int = 1, equal_writer: bool = True, floor: bool = True) -> dict:
    """Section `wholerun`: the same SFT run (seed, data, steps) as one chunk and with a checkpoint every
    `save_steps`, `repeat` pairs in ABBA order (so a drift of the machine's load hits both alike); see the
    module docstring. Medians over the pairs. Without `equal_writer` no pair runs that third variant, so the
    same time buys half as many pairs again. With `floor`, each pair also runs the single chunk with a durable
    copy of the same bytes at every boundary (`durable_floor`): the floor under the chunked run's in-run cost."""
    pairs = []
    for index in range(repeat):
        # "equal writer": the chunked run with the rank's writer sharing the cores as an equal of the training
        # threads (RLHF_WRITER_SCHEDULING=normal), against the default, where it takes only CPU time training
        # leaves unused (SCHED_IDLE).
        order = [name for name in ("single", "chunked", "floor", "equal writer")
                 if (name != "equal writer" or equal_writer) and (name != "floor" or floor)]
        runs = {name: _whole_run_variant(workdir, toy, model_dir, num_steps, save_steps, name, index)
                for name in (order if index % 2 == 0 else order[::-1])}
        pairs.append({**_pair_costs(runs["single"], runs["chunked"], save_steps),
                      **({"equal_writer": _pair_costs(runs["single"], runs["equal writer"], save_steps)}
                         if equal_writer else {}),
                      **({"floor": {**runs["floor"]["floor"],
                                    "boundary": boundary_cost(runs["floor"]["steps"], [], save_steps)}}
                         if floor else {})})
    return {"pairs": pairs, **{key: statistics.median(pair[key] for pair in pairs)
                               for key in ("extra_per_checkpoint", "chunk_train", "extra_cpu_per_checkpoint",
                                           "chunk_train_cpu")},
            "equal_writer_extra_per_checkpoint": statistics.median(pair["equal_writer"]["extra_per_checkpoint"]
                                                                   for pair in pairs) if equal_writer else None,
            **{key: statistics.median(pair[key] for pair in pairs) if all(pair[key] is not None for pair in pairs)
               else None for key in ("boundary", "boundary_single")},
            "floor_boundary": statistics.median(pair["floor"]["boundary"] for pair in pairs) if floor else None,
            "breakdown": {key: statistics.median(pair["breakdown"][key] for pair in pairs)
                          for key in pairs[0]["breakdown"]}}


def _whole_run_variant(workdir: str, toy: dict[str, str], model_dir: str, num_steps: int, save_steps: int,
                       name: str, index: int) -> dict:
    """One run of a `whole_run` pair: "single" (one chunk), "chunked" (a checkpoint every `save_steps`), "equal
    writer" (chunked, the writer not yielding its CPU) or "floor" (one chunk, a durable copy at each boundary)."""
    from rlhf_core.rank.worker import WRITER_SCHEDULING_ENV

    every = -1 if name in ("single", "floor") else save_steps  # -1: one chunk, whatever the rounded step count
    label = name.replace(" ", "-")
    cfg = ours.stage_config("sft", toy, model_dir, os.path.join(workdir, f"wholerun-{label}-{index}-out"),
                            num_steps, every)
    run = ours.stage_run(workdir, f"wholerun-{label}-{index}", "sft", cfg, max_ckpt_num=0)
    if name == "equal writer":
        os.environ[WRITER_SCHEDULING_ENV] = "normal"  # forwarded to the ranks (ray_start.forwarded_environment)
    floor = (durable_floor(set(range(save_steps, num_steps, save_steps)), os.path.join(workdir, f"floor-{index}"))
             if name == "floor" else contextlib.nullcontext({}))
    try:
        with floor as report:
            costs = _flow_costs(run)
    finally:
        os.environ.pop(WRITER_SCHEDULING_ENV, None)
    return {**costs, "sizes": checkpoint_sizes(run), **({"floor": report} if name == "floor" else {})}


def _pair_costs(single: dict, chunked: dict, save_steps: int) -> dict:
    extra_checkpoints = len(chunked["chunks"]) - len(single["chunks"])  # one commit per chunk
    ends = [row["step"] for row in chunked["chunks"]]
    loops = [row.get("step_loop_s", row.get("train_s")) for row in chunked["chunks"]]
    # Chunks of exactly save_steps steps, the first (it warms up) left out when there are others.
    full = [loop for loop, start, end in zip(loops, [0, *ends], ends) if end - start == save_steps]
    full = full[1:] or full
    num_steps = single["chunks"][-1]["step"]
    return {"single": single, "chunked": chunked, "extra_checkpoints": extra_checkpoints,
            "extra_per_checkpoint": extra_per_checkpoint(chunked["wall"], single["wall"], len(chunked["chunks"]),
                                                         len(single["chunks"])),
            "extra_cpu_per_checkpoint": extra_per_checkpoint(chunked["cpu"], single["cpu"], len(chunked["chunks"]),
                                                             len(single["chunks"])),
            # The single run's CPU per step (its one checkpoint and the export included: a slight overestimate).
            "chunk_train_cpu": single["cpu"] * save_steps / num_steps,
            "chunk_train": statistics.median(full), "breakdown": breakdown(single, chunked, extra_checkpoints),
            "boundary": boundary_cost(chunked["steps"], chunked["idle"], save_steps),
            "boundary_single": boundary_cost(single["steps"], [], save_steps)}


def breakdown(single: dict, chunked: dict, extra_checkpoints: int) -> dict:
    """Where the extra wall time per checkpoint went, from the chunks' own timers: the training stall
    (snapshot), the ranks' step loop running slower beside the background writer (serialisation, hashing,
    write, fsync take their CPU), and the rest (Prefect's task per chunk, planning, the commit's wait)."""
    def total(run: dict, key: str) -> float:
        return sum(row.get(f"{key}_s", 0.0) for row in run["chunks"])

    per, num_commits = max(extra_checkpoints, 1), len(chunked["chunks"])
    extra = (chunked["wall"] - single["wall"]) / per
    stall = (total(chunked, "stall") - total(single, "stall")) / per
    slower_steps = (total(chunked, "step_loop") - total(single, "step_loop")) / per
    # Measured inside the chunked run alone (no second run to subtract): the steps that ran beside a write
    # against the median step that did not (`goodput.writer_slowdown`), and the writer threads' own timers
    # (rank 0's thread-seconds; its files are written in parallel, so they add up to more than the commit).
    in_run = {f"in_run_{key}": total(chunked, key) / num_commits
              for key in ("stall", "writer_slowdown", "writer_write", "writer_hash", "writer_fsync")}
    return {"stall": stall, "slower_steps": slower_steps, "rest": extra - stall - slower_steps,
            "commit_beside_training": total(chunked, "commit") / num_commits, **in_run}
