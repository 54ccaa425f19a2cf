"""The soak's faults, one function per kind: each does to the running soak (`tests.soak.site.SoakSite`) what the
failure does in production, and nothing else: no call to Prefect, no retry. It raises `NotNow` when the run offers
no target at that moment (no rank training, no flow-run process yet); the soak tries again a moment later.

Kinds and what stands in for them here:
- rank_kill: SIGKILL to a rank (a segfault, a killed container).
- rank_hang: SIGSTOP to a rank (a stuck collective, a dead NFS mount): the hang watch must catch it.
- oom: a 16 MiB memory limit on a rank's cgroup, then the rank's next step allocates (an `armed` fault action,
  rlhf_core/faults.py: a rank in its steady state reuses its memory and never meets a limit by itself): the
  kernel's OOM killer kills it.
- flow_run_kill: SIGKILL to the flow-run engine process (the driver), as the OOM killer would; its supervisor
  (flows/supervise.py) and its worker live.
- worker_kill: SIGKILL to the Prefect worker alone; its supervisor (systemd) starts it again a second later. Its
  flow run did not outlive it in the trials (it was found Crashed and restarted), as under systemd's default
  KillMode, which stops a dead service's whole cgroup.
- preemption: SIGTERM to the flow-run engine and its supervisor, as a service's stop sends it to every process,
  with no cancel asked of Prefect (a spot preemption, a drain).
- node_loss: SIGKILL to a whole Ray worker node; it rejoins NODE_DOWN_S later (the run waits for it).
- store_outage: the S3 endpoint stops for OUTAGE_S, then comes back with its buckets.
- power_cut: the machine loses power: the worker, the flow run and the Ray nodes die at once, what was not
  fsync'd is gone from the checkpoint disk (tests/powercut_fs.py), then nodes and worker start again.
"""

from __future__ import annotations

import os
import random
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from tests.soak.observe import live_rank_pids

if TYPE_CHECKING:
    from tests.soak.site import SoakSite

NODE_DOWN_S = 15.0
OUTAGE_S = 120.0
OOM_LIMIT_BYTES = 16 << 20  # charged from the move on: the armed allocation's first block passes it


class NotNow(Exception):
    """The fault has no target right now (nothing training, no flow-run process)."""


def _a_rank(site: SoakSite, rng: random.Random) -> int:
    pids = live_rank_pids(site.trace.read())
    if not pids:
        raise NotNow("no rank is training")
    return rng.choice(pids)


def rank_kill(site: SoakSite, rng: random.Random) -> str:
    pid = _a_rank(site, rng)
    os.kill(pid, signal.SIGKILL)
    return f"rank pid {pid}"


def rank_hang(site: SoakSite, rng: random.Random) -> str:
    pid = _a_rank(site, rng)
    os.kill(pid, signal.SIGSTOP)
    return f"rank pid {pid}"


def oom(site: SoakSite, rng: random.Random) -> str:
    pid = _a_rank(site, rng)
    group = _memory_cgroup(pid) / f"rlhf-soak-oom-{pid}"
    group.mkdir()
    limit_file = "memory.max" if (group / "memory.max").exists() else "memory.limit_in_bytes"
    (group / limit_file).write_text(str(OOM_LIMIT_BYTES))
    (group / "cgroup.procs").write_text(str(pid))
    site.cleanups.append(lambda: _remove_when_empty(group))
    (site.fault_state / f"armed-{pid}").write_text("oom")
    return f"rank pid {pid}, {limit_file} {OOM_LIMIT_BYTES >> 20} MiB"


def _memory_cgroup(pid: int) -> Path:
    """The memory cgroup folder of `pid`: cgroup v1's memory controller, else the unified (v2) hierarchy."""
    lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return Path("/sys/fs/cgroup/memory") / path.lstrip("/")
    unified = next(line.split(":", 2)[2] for line in lines if line.startswith("0::"))
    return Path("/sys/fs/cgroup") / unified.lstrip("/")


def _remove_when_empty(group: Path) -> None:
    try:
        if not (group / "cgroup.procs").read_text().strip():
            group.rmdir()
    except OSError:
        pass


def flow_run_kill(site: SoakSite, rng: random.Random) -> str:
    process = site.flow_run_process(engine=True)
    process.send_signal(signal.SIGKILL)
    return f"flow-run engine pid {process.pid}"


def preemption(site: SoakSite, rng: random.Random) -> str:
    processes = list(dict.fromkeys([site.flow_run_process(), site.flow_run_process(engine=True)]))  # one without
    for process in processes:                                                                    # a supervisor
        process.send_signal(signal.SIGTERM)
    return f"flow-run pids {', '.join(str(process.pid) for process in processes)}"


def worker_kill(site: SoakSite, rng: random.Random) -> str:
    return f"worker pid {site.worker.kill()}"


def node_loss(site: SoakSite, rng: random.Random) -> str:
    index = rng.randrange(len(site.cluster.workers))
    site.cluster.kill_worker(index)
    site.later(NODE_DOWN_S * site.time_scale, lambda: site.cluster.restart_worker(index))
    return f"{site.cluster.workers[index].name}, back after {NODE_DOWN_S * site.time_scale:.0f} s"


def store_outage(site: SoakSite, rng: random.Random) -> str:
    if site.store is None:
        raise NotNow("the run's store is not S3")
    site.store.stop()
    site.later(OUTAGE_S * site.time_scale, site.store.start)
    return f"S3 down for {OUTAGE_S * site.time_scale:.0f} s"


def power_cut(site: SoakSite, rng: random.Random) -> str:
    if site.mount is None:
        raise NotNow("the run's store is not the power-cut filesystem")
    return site.power_cut()


KINDS: dict[str, Callable[[SoakSite, random.Random], str]] = {
    "rank_kill": rank_kill, "rank_hang": rank_hang, "oom": oom, "flow_run_kill": flow_run_kill,
    "worker_kill": worker_kill, "preemption": preemption, "node_loss": node_loss, "store_outage": store_outage,
    "power_cut": power_cut,
}
# Which leg can hold each kind: the S3 leg has the outage, the disk leg (on the power-cut filesystem) the rest.
S3_KINDS = ("store_outage",)
RESTARTS_THE_DRIVER = ("flow_run_kill", "preemption", "power_cut")  # the run's next attempt starts from its commit

