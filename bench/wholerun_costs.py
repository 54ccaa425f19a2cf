"""The suite's whole-run measure (section `wholerun`, `whole_run`): the `rlhf` Prefect flow, SFT on the 23.6M model,
once with a checkpoint every 50 steps and once as a single chunk, same seed and data; the extra wall time per
checkpoint, against the training time of a 50-step chunk; and the floor under it, the single chunk with a durable
copy of the same bytes at each boundary (`durable_floor`). What one checkpoint costs is `ckpt_costs.py`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import time

import ours
from table import Row, extra_per_checkpoint


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
    from rlhf_core.rank.threads import WRITER_SCHEDULING_ENV

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


def _shape(costs: dict) -> tuple[dict, int, int]:
    """The breakdown of the extra time, the largest checkpoint's bytes, and the steps the runs trained."""
    parts, size = costs["breakdown"], max(costs["pairs"][0]["chunked"]["sizes"], default=0)
    num_steps = costs["pairs"][0]["chunked"]["chunks"][-1]["step"]  # whole epochs: may exceed --wholerun_steps
    return parts, size, num_steps


def print_costs(costs: dict, save_steps: int) -> None:
    """The `wholerun` section's measures, line by line, under the suite's table."""
    parts, size, num_steps = _shape(costs)
    for pair in costs["pairs"]:
        single, chunked = pair["single"], pair["chunked"]
        if "equal_writer" in pair:
            print(f"  wholerun: the writer sharing the cores as an equal: {pair['equal_writer']['chunked']['wall']:.1f} "
                  f"s, extra per checkpoint {pair['equal_writer']['extra_per_checkpoint']:.2f} s", flush=True)
        print(f"  wholerun: {num_steps} steps; one chunk {single['wall']:.1f} s, a checkpoint every "
              f"{save_steps} steps ({len(chunked['chunks'])} checkpoints of {size / 1e6:.0f} MB) "
              f"{chunked['wall']:.1f} s (from the first training call to the flow's end); extra per checkpoint "
              f"{pair['extra_per_checkpoint']:.2f} s, a {save_steps}-step chunk trains "
              f"{pair['chunk_train']:.2f} s; CPU (ranks + driver) {single['cpu']:.1f} s against "
              f"{chunked['cpu']:.1f} s, {pair['extra_cpu_per_checkpoint']:.2f} CPU-s per extra checkpoint", flush=True)
    extras = sorted(pair["extra_per_checkpoint"] for pair in costs["pairs"])
    print(f"  wholerun: extra per checkpoint over {len(extras)} pairs, sorted: "
          f"{', '.join(f'{extra:+.2f}' for extra in extras)} s (median {costs['extra_per_checkpoint']:+.2f} s)",
          flush=True)
    if costs["boundary"] is not None:
        chunked_costs = ", ".join(f"{pair['boundary']:.2f}" for pair in costs["pairs"])
        single_costs = ", ".join(f"{pair['boundary_single']:+.2f}" for pair in costs["pairs"])
        print(f"  wholerun, inside each run: per chunk boundary, the ranks idle before training ahead plus the "
              f"{BOUNDARY_STEPS} steps after it beyond the median step: {chunked_costs} s (chunked runs), "
              f"{single_costs} s at the same steps of the single-chunk runs (the measure's bias)", flush=True)
    if costs["floor_boundary"] is not None:
        floors = [pair["floor"] for pair in costs["pairs"]]
        boundaries = ", ".join(f"{floor['boundary']:.2f}" for floor in floors)
        print(f"  wholerun, the floor: single-chunk runs whose rank copies the same bytes "
              f"({floors[0]['bytes'] / 1e6:.0f} MB: the weights twice, Adam's moments) at each boundary "
              f"(median {_median_after_first(floors, 'copy_s'):.3f} s) and writes them durably "
              f"(O_DIRECT, fsync) from a SCHED_IDLE thread "
              f"({_median_after_first(floors, 'write_s'):.2f} s), measured as above: "
              f"{boundaries} s per boundary", flush=True)
    print(f"    per extra checkpoint: stall (snapshot) {parts['stall']:.2f} s, ranks' step loop slower beside the "
          f"writer {parts['slower_steps']:.2f} s, the rest (Prefect task, planning, waiting for the commit) "
          f"{parts['rest']:.2f} s; each commit ran {parts['commit_beside_training']:.2f} s beside training",
          flush=True)
    print(f"    inside the chunked run, per checkpoint: steps beside the writer ran {parts['in_run_writer_slowdown']:.2f} s "
          f"beyond the median step; the writer's threads: serialise and write {parts['in_run_writer_write']:.2f} s, "
          f"hashing beyond the write {parts['in_run_writer_hash']:.2f} s, fsync {parts['in_run_writer_fsync']:.2f} s",
          flush=True)


def rows(costs: dict, save_steps: int) -> list[Row]:
    """The `wholerun` section's rows of the suite's table."""
    parts, size, num_steps = _shape(costs)
    return [Row(f"whole run: extra wall per checkpoint / {save_steps}-step chunk's training (23.6M, "
                f"{size / 1e6:.0f} MB durable checkpoints, {num_steps} steps)", costs["chunk_train"],
                costs["extra_per_checkpoint"], "s", "<=", 0.02, as_percent=True),
            # Wall time moves with whatever else shares the machine; CPU seconds less so.
            Row("  the same in CPU-seconds of the ranks and the driver", costs["chunk_train_cpu"],
                costs["extra_cpu_per_checkpoint"], "s", "<=", 0.02, as_percent=True),
            *([Row("  the same with the writer sharing the cores as an equal (RLHF_WRITER_SCHEDULING=normal)",
                   costs["chunk_train"], costs["equal_writer_extra_per_checkpoint"], "s", "<=", None, as_percent=True)]
              if costs["equal_writer_extra_per_checkpoint"] is not None else []),
            # One run, no subtraction of two: a boundary's cost to the ranks (idle, then slower) against their median.
            *([Row(f"  inside the chunked run: ranks idle at a boundary + its {BOUNDARY_STEPS} steps beyond "
                   "the median step / chunk's training", costs["chunk_train"], costs["boundary"], "s", "<=", None,
                   as_percent=True)] if costs["boundary"] is not None else []),
            # The same measure against what a durable copy of the same bytes beside training costs.
            *([Row("  inside the run: a durable copy of the same bytes at each boundary (the floor) / chunk's "
                   "training", costs["chunk_train"], costs["floor_boundary"], "s", "<=", None, as_percent=True),
               Row("  inside the chunked run: ranks idle + steps beyond the median, against the floor's",
                   costs["floor_boundary"], costs["boundary"], "s", "<=", None)]
              if costs["floor_boundary"] is not None and costs["boundary"] is not None else []),
            # One run, no subtraction of two: the stall and the steps' slowdown beside the writer, per checkpoint.
            Row("  inside the chunked run: stall + step loop's slowdown beside the writer / chunk's training",
                costs["chunk_train"], parts["in_run_stall"] + parts["in_run_writer_slowdown"], "s", "<=", None,
                as_percent=True)]


def _median_after_first(floors: list[dict], key: str) -> float:
    """The median of `key`'s seconds over every floor run, each run's first (cold buffers) left out."""
    return statistics.median(seconds for floor in floors for seconds in (floor[key][1:] or floor[key]))
