"""How a rank's threads share the CPU: the torch threads of each rank on a node, and the checkpoint writer's
scheduling beside training (`yield_cpu_to_training`); and a free port for the process group's rendezvous.
"""

from __future__ import annotations

import os
import socket

# The writer's scheduling: "idle" (default) lets it run only on CPU time the training threads leave unused (Linux
# SCHED_IDLE); "normal" shares the cores with them as an equal. `make bench --only wholerun` compares the two.

WRITER_SCHEDULING_ENV = "RLHF_WRITER_SCHEDULING"


def yield_cpu_to_training() -> bool:
    """Put the calling thread (the actor's "io" thread, and so every thread it starts: they inherit it) under
    SCHED_IDLE, below the training threads' priority whatever their nice value (Ray runs workers at nice 15,
    where nice 19 would still take about a third of a shared core). The commit then waits for CPU the step
    loop leaves unused, rather than slowing the step loop; on a host with cores to spare it changes nothing.
    Returns whether it did (not on other systems, or with RLHF_WRITER_SCHEDULING=normal)."""
    if os.environ.get(WRITER_SCHEDULING_ENV, "idle") != "idle" or not hasattr(os, "SCHED_IDLE"):
        return False
    import threading

    os.sched_setscheduler(threading.get_native_id(), os.SCHED_IDLE, os.sched_param(0))
    return True


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def torch_threads(num_threads_asked: int | None, ranks_on_node: int) -> int:
    """A rank's torch threads: the driver's OMP_NUM_THREADS when set (as under torchrun), else an equal share of
    the CPUs this process may run on (its affinity, not the host's count). Two processes that each take every
    core spin in OpenMP's barriers against each other: 5x slower than one thread each, measured on 2 cores."""
    if num_threads_asked:
        return num_threads_asked
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, usable // ranks_on_node)
