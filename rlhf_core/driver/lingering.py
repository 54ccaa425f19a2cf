"""Rank processes that outlive their command. On a running cluster (`joined_running_cluster`) a command's CPU ranks
are detached actors, named for the driver's environment (`environment_key`) and their node, holding no resources
of their own (the group's placement holds them while it trains). After the command's clean end each is reset
(`TrainWorker.retire`, `rlhf_core.rank.reuse`) and waits as a spare, at most one per CPU of its node
(`retire_ranks`), until a command with the same environment claims it (`claim_lingering`), or its idle time
(--spare_idle_s) ends it. A process whose reset is refused, or a group that failed or was stopped, ends as before.
docs/design-notes.md ("Spares that outlive their command") has the rest.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import sys
import time
import uuid
from collections import defaultdict
from typing import Any

import ray
from ray.actor import ActorHandle
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rlhf_core.config import RunConfig
from rlhf_core.driver.placement import placement_bundle
from rlhf_core.driver.ray_start import forwarded_environment, joined_running_cluster, threads_asked
from rlhf_core.faults import HOOK_PREFIX, fault_hooks

logger = logging.getLogger(__name__)
SPARE_NAMESPACE = "rlhf-spares"  # the Ray namespace of the ranks that outlive their command
NAME_PREFIX = "rlhf-rank"
RETIRE_TIMEOUT_S = 15.0  # a rank's reset (the last command's threads may take 2 s to end)
CLAIM_TIMEOUT_S = 5.0
# How long a claim waits for ranks of a command that died (a killed flow run, started again here) to finish their
# step and reset: a new rank process takes about as long to start and import.
ORPHAN_WAIT_S = 8.0


def lingers(run: RunConfig) -> bool:
    """Whether this command's ranks outlive it: on a running cluster, ranks with no GPU, --spare_idle_s above 0,
    and Ray's job table readable (a detached rank ends itself by it once its command is dead; private API). (A GPU
    rank's process would hold its device while it waited.)"""
    return (joined_running_cluster() and run.spare_idle_s > 0 and not placement_bundle(run).get("GPU", 0)
            and _job_table_readable())


def _job_table_readable() -> bool:
    try:
        from ray._private.state import jobs  # noqa: F401 - what `rlhf_core.rank.reuse.job_alive` reads
    except ImportError:
        return False
    return True


def environment_key() -> str:
    """What a rank process takes from the command that starts it, as a hash: the variables forwarded to the ranks
    (credentials among them, so a spare never serves a job with other credentials), PYTHONPATH, the working
    directory, the driver's import path and interpreter, the threads asked for. Only the hash is in a spare's name.
    The test fault hooks (RLHF_FAULT_*) are not in it: a claimed spare takes the claiming command's instead."""
    forwarded = {name: value for name, value in forwarded_environment().items() if not name.startswith(HOOK_PREFIX)}
    environment = {"forwarded": forwarded, "pythonpath": os.environ.get("PYTHONPATH", ""),
                   "cwd": os.getcwd(), "sys_path": sys.path, "python": sys.executable, "threads": threads_asked()}
    return hashlib.sha256(json.dumps(environment, sort_keys=True).encode()).hexdigest()[:16]


def lingering_options(node_id: str) -> dict[str, Any]:
    """Ray's options for a rank that outlives its command, on `node_id` (its bundle's node)."""
    return {"num_cpus": 0, "num_gpus": 0, "lifetime": "detached", "namespace": SPARE_NAMESPACE,
            "name": f"{NAME_PREFIX}-{environment_key()}-{node_id}-{uuid.uuid4().hex[:8]}",
            "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False)}


def _spares_by_node(key: str | None = None) -> dict[str, list[str]]:
    """The names of the ranks that may outlive their command, by node (those of environment `key` only)."""
    prefix = f"{NAME_PREFIX}-{key}-" if key else f"{NAME_PREFIX}-"
    by_node: dict[str, list[str]] = defaultdict(list)
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name = entry["name"]
        if entry.get("namespace") == SPARE_NAMESPACE and name.startswith(prefix):
            by_node[name.rsplit("-", 2)[1]].append(name)
    return by_node


def claim_lingering(wanted: dict[int, str], idle_s: float) -> dict[int, ActorHandle]:
    """Spares of this environment left by earlier commands, claimed for the ranks in `wanted` (rank -> its bundle's
    node): for each, one on that node, if any is free; once this command ends they wait `idle_s` as spares."""
    taken: dict[int, ActorHandle] = {}
    if not wanted:
        return taken
    job = ray.get_runtime_context().get_job_id()
    by_node = _spares_by_node(environment_key())
    deadline = time.monotonic() + ORPHAN_WAIT_S
    for rank, node_id in sorted(wanted.items()):
        while by_node.get(node_id) and rank not in taken:
            name = by_node[node_id].pop()
            with contextlib.suppress(Exception):  # gone meanwhile (ended idle), or busy
                spare = ray.get_actor(name, namespace=SPARE_NAMESPACE)
                if _claimed(spare, job, idle_s, deadline):
                    taken[rank] = spare
    return taken


def _claimed(spare: ActorHandle, job: str, idle_s: float, deadline: float) -> bool:
    """Claim `spare`; one whose command died and that is resetting is asked again until `deadline`."""
    while True:
        if _answer(spare.claim.remote(job, idle_s, fault_hooks()), CLAIM_TIMEOUT_S):
            return True
        if time.monotonic() > deadline or not _answer(spare.becoming_spare.remote(), CLAIM_TIMEOUT_S):
            return False
        time.sleep(0.2)


def retire_ranks(workers: list[ActorHandle]) -> None:
    """Reset each rank for the next command (a spare), ending those that cannot be; then keep at most one spare
    per CPU of each node, ending the ones idle longest."""
    resets: list[Any] = [worker.retire.remote() for worker in workers]
    for worker, reset in zip(workers, resets):
        try:
            refused = str(_answer(reset, RETIRE_TIMEOUT_S))
        except Exception as error:  # noqa: BLE001 - whatever went wrong, the process ends
            refused = f"its reset failed ({str(error).strip().splitlines()[-1]})"
        if refused:
            logger.info("a rank process ends with its command: %s", refused)
            with contextlib.suppress(Exception):
                ray.kill(worker)
    _keep_one_per_cpu()


def _keep_one_per_cpu() -> None:
    cpus = {node["NodeID"]: int(node.get("Resources", {}).get("CPU", 0)) for node in ray.nodes() if node["Alive"]}
    for node_id, names in _spares_by_node().items():
        if len(names) <= cpus.get(node_id, 0):
            continue
        idle: list[tuple[float, ActorHandle]] = []
        for name in names:
            with contextlib.suppress(Exception):
                spare = ray.get_actor(name, namespace=SPARE_NAMESPACE)
                seconds = _answer(spare.spare_since.remote(), CLAIM_TIMEOUT_S)
                if seconds is not None:
                    idle.append((seconds, spare))
        idle.sort(key=lambda entry: entry[0], reverse=True)
        for _, spare in idle[:max(0, len(names) - cpus.get(node_id, 0))]:
            with contextlib.suppress(Exception):
                ray.kill(spare)


def _answer(reference: Any, timeout_s: float) -> Any:
    """One actor call's result (ray.get's typed overloads know nothing of a handle's methods)."""
    return ray.get(reference, timeout=timeout_s)
