"""Where a stage's ranks go on the Ray cluster: a placement group of one bundle per rank (`--placement_strategy`,
PACK by default) reserved before any actor starts, fewer ranks with `--allow_fewer_workers`, else one sentence
naming what the cluster lacks (a retryable failure when the resources exist but stay in use)."""

from __future__ import annotations

import os
import secrets
from typing import Callable

import ray
from ray.util.placement_group import placement_group, remove_placement_group

from rlhf_core.config import RunConfig
from rlhf_core.errors import PlacementFailed, UserError

SMALLER_GROUP_TIMEOUT_S = 10.0


def placement_bundle(run: RunConfig) -> dict[str, float]:
    """The resources one rank reserves: --num_cpus_per_worker (default 1, or an equal share of a small
    cluster's CPUs) and a GPU when the cluster has one per rank."""
    cluster = ray.cluster_resources()
    cpus = run.num_cpus_per_worker or min(1.0, max(0.01, cluster.get("CPU", 1) / run.num_workers))
    bundle = {"CPU": cpus}
    if cluster.get("GPU", 0) >= run.num_workers:
        bundle["GPU"] = 1
    return bundle


def reserve_placement(run: RunConfig):
    """A ready placement group for the ranks, and its size (fewer than num_workers only with
    --allow_fewer_workers); a sentence naming the missing resources when none can be placed."""
    bundle = placement_bundle(run)
    group = _placed(run.num_workers, bundle, run.placement_strategy, run.placement_timeout_s)
    if group is not None:
        return group, run.num_workers
    if run.allow_fewer_workers:
        for num_ranks in _smaller_world_sizes(run):
            group = _placed(num_ranks, bundle, run.placement_strategy, SMALLER_GROUP_TIMEOUT_S)
            if group is not None:
                return group, num_ranks
    message = _placement_shortfall(run, bundle)
    if _cluster_can_hold(run.num_workers, bundle, run.placement_strategy):
        raise PlacementFailed(message + " The resources exist but stayed in use; the chunk is retried.")
    raise UserError(message)


def _placed(num_ranks: int, bundle: dict, strategy: str, timeout_s: float):
    group = placement_group([dict(bundle) for _ in range(num_ranks)], strategy=strategy)
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if ready:
        return group
    remove_placement_group(group)
    return None


def _smaller_world_sizes(run: RunConfig) -> list[int]:
    """World sizes below num_workers that the batch settings allow, largest first."""
    from pydantic import ValidationError

    sizes = []
    for num_ranks in range(run.num_workers - 1, 0, -1):
        try:
            RunConfig.model_validate({**run.model_dump(), "num_workers": num_ranks})
        except ValidationError:
            continue
        sizes.append(num_ranks)
    return sizes


def _alive_nodes() -> list[dict]:
    return [node for node in ray.nodes() if node.get("Alive")]


def _cluster_can_hold(num_ranks: int, bundle: dict, strategy: str) -> bool:
    """Whether the alive nodes' total resources fit the group at all (busy or not)."""
    fits_per_node = [min(int(node["Resources"].get(name, 0) // amount) for name, amount in bundle.items() if amount)
                     for node in _alive_nodes()]
    if strategy == "STRICT_SPREAD":
        return sum(1 for fits in fits_per_node if fits >= 1) >= num_ranks
    return sum(fits_per_node) >= num_ranks


def _placement_shortfall(run: RunConfig, bundle: dict) -> str:
    nodes = _alive_nodes()
    total, free = ray.cluster_resources(), ray.available_resources()
    wanted = ", ".join(f"{amount:g} {name}" for name, amount in bundle.items())
    have = "; ".join(f"{name}: {free.get(name, 0):g} free of {total.get(name, 0):g}" for name in bundle)
    spread = f" on {run.num_workers} different nodes" if run.placement_strategy == "STRICT_SPREAD" else ""
    return (f"--num_workers {run.num_workers}: Ray could not place {run.num_workers} ranks of {{{wanted}}}{spread} "
            f"({run.placement_strategy}) within --placement_timeout_s {run.placement_timeout_s:g}; the cluster has "
            f"{len(nodes)} alive node(s) ({have}). Add nodes or resources, lower --num_workers or "
            f"--num_cpus_per_worker, or pass --allow_fewer_workers.")


def bundle_nodes(placement, num_bundles: int) -> list[str]:
    """The node id each bundle of `placement` (ready) was placed on, by bundle index."""
    table = ray.util.placement_group_table(placement).get("bundles_to_node_id", {})
    return [table.get(index, "") for index in range(num_bundles)]


def group_settings(run: RunConfig) -> dict:
    """The settings a WorkerGroup is built from: two runs that agree on them can use the same group."""
    return run.model_dump(include={"ray_address", "num_workers", "num_cpus_per_worker", "placement_strategy",
                                   "placement_timeout_s", "allow_fewer_workers", "ckpt_path", "storage_options"})


def check_store_visible(run: RunConfig, locations: list, sees: Callable[[str], list[bool]]) -> None:
    """A local --ckpt_path must be the same folder on every node: ranks write into it directly. `sees(path)`: each
    rank's answer (at `locations`, `rlhf_core.rank.worker.RankLocation`) to whether it sees the file `path`."""
    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    fs, root = fsspec.core.url_to_fs(run.ckpt_path, **run.storage_options)
    if not isinstance(fs, LocalFileSystem):
        return
    os.makedirs(root, exist_ok=True)
    marker = os.path.join(root, f".rlhf-visible-{secrets.token_hex(6)}")
    open(marker, "w").close()
    try:
        seen = sees(marker)
    finally:
        os.remove(marker)
    blind = sorted({location.describe() for location, saw in zip(locations, seen) if not saw})
    if blind:
        raise UserError(f"--ckpt_path {run.ckpt_path} is a local folder that node {', '.join(blind)} cannot see; "
                        "use a folder shared by every node at the same path, or an object store (s3://...).")
