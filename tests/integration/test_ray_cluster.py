"""A real 3-node Ray cluster on one machine: ranks on two hosts, a Ray client driver, an unplaceable
group, and the loss of a node mid-chunk.

One cluster serves the whole module (`tests.integration.ray_cluster`): a CPU-less head and two worker
nodes of 1 CPU each, every node with its own Ray temp dir and TMPDIR, so ranks on the two nodes
stage checkpoints in different folders, as on two hosts. Checkpoints go to the moto S3 endpoint,
which every node reaches with its own credentials (the AWS variables in its environment). `rlhf`
runs as a user runs it: a subprocess with `--ray_address`. The two node-loss tests kill worker node 1,
so they come last (pytest keeps file order); the last brings it back before and after it runs.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import fsspec
import pytest
from safetensors.torch import load_file

from rlhf_core.storage.checkpoint import CheckpointStore
from tests.conftest import RLHF, make_bucket, run_rlhf, s3_environment
from tests.integration.ray_cluster import RayCluster

pytestmark = pytest.mark.slow

RUN_TIMEOUT = 600


@pytest.fixture(scope="module")
def cluster_env(rlhf_env, s3_endpoint) -> dict[str, str]:
    """The environment of the cluster's nodes and of every `rlhf` run: this worker's Prefect server and S3."""
    env = {key: value for key, value in rlhf_env.items() if key != "RAY_ADDRESS"}
    return {**env, **s3_environment(s3_endpoint), "RAY_AUTH_MODE": "disabled"}


@pytest.fixture(scope="module")
def cluster(cluster_env, tmp_path_factory):
    ray_cluster = RayCluster.start(cluster_env, tmp_path_factory.mktemp("ray-cluster-logs"))
    yield ray_cluster
    ray_cluster.stop()


@pytest.fixture(scope="module")
def bucket(s3_endpoint) -> str:
    name = f"ray-cluster-{uuid.uuid4().hex[:8]}"
    make_bucket(s3_endpoint, name)
    return name


@pytest.fixture
def s3_here(cluster_env, monkeypatch):
    """This process reads the same store as the runs (CheckpointStore, fsspec)."""
    for name, value in cluster_env.items():
        if name.startswith("AWS_"):
            monkeypatch.setenv(name, value)


def sft_args(toy: dict[str, str], ckpt: str, out: Path, *, max_samples: int = 48, max_ckpt_num: int = 3) -> list[str]:
    """A tiny SFT: max_samples / 8 steps, a chunk every 2 steps."""
    return [
        "train", "sft", "--pretrain", toy["model"], "--dataset", toy["sft"],
        "--input_key", "prompt", "--output_key", "response", "--max_len", "128", "--max_samples", str(max_samples),
        "--train_batch_size", "8", "--micro_train_batch_size", "4", "--max_epochs", "1",
        "--learning_rate", "1e-3", "--save_steps", "2", "--ckpt_path", ckpt, "--max_ckpt_num", str(max_ckpt_num),
        "--save_path", str(out), "--seed", "42", "--load_checkpoint", "--num_workers", "2",
    ]


def on_cluster(address: str) -> list[str]:
    """One rank on each worker node."""
    return ["--num_cpus_per_worker", "1", "--placement_strategy", "STRICT_SPREAD", "--ray_address", address]


def output(result: subprocess.CompletedProcess) -> str:
    return result.stdout + result.stderr


def committed_steps(stage_url: str) -> list[int]:
    """Steps of the committed checkpoints, every file's sha256 checked; fails on any other state."""
    infos = CheckpointStore(stage_url).list(verify=True)
    assert all(info.is_committed for info in infos), [(info.name, info.status, info.reason) for info in infos]
    return [info.step for info in infos]


def assert_same_weights(expected: dict, model_dir: Path) -> None:
    actual = load_file(str(model_dir / "model.safetensors"))
    assert actual.keys() == expected.keys()
    for name, tensor in expected.items():
        assert actual[name].equal(tensor), f"{name}: max abs diff {(actual[name] - tensor).abs().max().item()}"


def placed_nodes(log: str, num_placed: int, num_wanted: int) -> list[str]:
    """The node ids named by the 'placed N of M ranks' lines of a run's output, in order."""
    lines = re.findall(rf"placed {num_placed} of {num_wanted} ranks \(\w+\) on nodes: (.*)", log)
    return [node_id for line in lines for node_id in re.findall(r"node ([0-9a-f]+)", line)]


def read_bytes(url: str) -> bytes:
    with fsspec.open(url, "rb") as handle:
        return handle.read()


@pytest.fixture(scope="module")
def one_host_reference(toy_assets, cluster_env, tmp_path_factory) -> dict:
    """The final weights of the 2-rank SFT on one host (a local Ray, fractional CPUs, local checkpoints)."""
    out = tmp_path_factory.mktemp("one-host-2-ranks")
    reference = run_rlhf(sft_args(toy_assets, str(out / "ckpt"), out / "model"), cluster_env, timeout=RUN_TIMEOUT)
    assert reference.returncode == 0, output(reference)[-4000:]
    assert placed_nodes(output(reference), 2, 2), output(reference)[-3000:]
    return load_file(str(out / "model" / "model.safetensors"))


PROBE = """
import json, os, sys, time, ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

for attempt in range(3):  # a fresh cluster's first ray:// connect can fail to start its client server
    try:
        ray.init(address=sys.argv[1], logging_level="ERROR")
        break
    except ConnectionError:
        if attempt == 2:
            raise
        time.sleep(2)
group = placement_group([{"CPU": 1}] * 2, strategy="STRICT_SPREAD")
ray.get(group.ready(), timeout=60)

@ray.remote(num_cpus=1)
class Probe:
    def where(self):
        return ray.get_runtime_context().get_node_id(), os.environ.get("TMPDIR")

probes = [Probe.options(scheduling_strategy=PlacementGroupSchedulingStrategy(group, index)).remote()
          for index in range(2)]
print(json.dumps(ray.get([probe.where.remote() for probe in probes])))
"""


@pytest.mark.parametrize("address_kind", ["gcs", "client"])
def test_strict_spread_puts_one_actor_on_each_worker_node(cluster, address_kind):
    address = cluster.gcs_address if address_kind == "gcs" else cluster.client_address
    before = cluster.actor_log_snapshot("Probe")
    probe = subprocess.run([sys.executable, "-c", PROBE, address], check=False, env=cluster.env, capture_output=True,
                           text=True, timeout=180)
    assert probe.returncode == 0, probe.stderr[-3000:] + cluster.log_tails()
    placed = json.loads(probe.stdout.strip().splitlines()[-1])
    assert len({node_id for node_id, _ in placed}) == 2, placed
    # Each actor sees its own node's TMPDIR: staging folders on two nodes are two folders.
    assert sorted(tmpdir for _, tmpdir in placed) == sorted(str(worker.tmpdir) for worker in cluster.workers)
    assert cluster.actor_nodes("Probe", before) == {worker.name: 1 for worker in cluster.workers}


def test_two_ranks_on_two_nodes_match_one_host(cluster, toy_assets, cluster_env, bucket, tmp_path, s3_here,
                                               one_host_reference):
    ckpt = f"s3://{bucket}/two-nodes-{uuid.uuid4().hex[:6]}/ckpt"
    before = cluster.actor_log_snapshot("TrainWorker")
    # No spares beside the ranks: a group older than SPARES_AFTER_S (a loaded machine) would start them on these nodes.
    result = run_rlhf(sft_args(toy_assets, ckpt, tmp_path / "model") + on_cluster(cluster.gcs_address)
                      + ["--num_spare_workers", "0"], cluster_env, timeout=RUN_TIMEOUT)
    log = output(result)
    assert result.returncode == 0, log[-4000:] + cluster.log_tails()
    # Ranks ran on the two worker nodes: the driver's placement line, and the nodes' own actor logs.
    assert len(set(placed_nodes(log, 2, 2))) == 2, log[-3000:]
    assert cluster.actor_nodes("TrainWorker", before) == {worker.name: 1 for worker in cluster.workers}
    assert committed_steps(f"{ckpt}/rlhf/sft") == [2, 4, 6]
    assert CheckpointStore(f"{ckpt}/rlhf/sft").read_metadata(6)["world_size"] == 2
    assert_same_weights(one_host_reference, tmp_path / "model")


def test_ray_client_driver_off_the_cluster(cluster, toy_assets, cluster_env, bucket, tmp_path, s3_here,
                                           one_host_reference):
    ckpt = f"s3://{bucket}/client-{uuid.uuid4().hex[:6]}/ckpt"
    result = run_rlhf(sft_args(toy_assets, ckpt, tmp_path / "model") + on_cluster(cluster.client_address),
                      cluster_env, timeout=RUN_TIMEOUT)
    log = output(result)
    assert result.returncode == 0, log[-4000:] + cluster.log_tails()
    assert committed_steps(f"{ckpt}/rlhf/sft") == [2, 4, 6]
    assert_same_weights(one_host_reference, tmp_path / "model")


def test_unplaceable_group_fails_with_a_sentence_naming_the_missing_cpus(cluster, toy_assets, cluster_env, bucket,
                                                                          tmp_path):
    args = sft_args(toy_assets, f"s3://{bucket}/unplaceable-{uuid.uuid4().hex[:6]}/ckpt", tmp_path / "model")
    args[args.index("--num_workers") + 1] = "1"
    args += ["--num_cpus_per_worker", "64", "--placement_timeout_s", "5", "--ray_address", cluster.gcs_address]
    result = run_rlhf(args, cluster_env, timeout=180)  # generous: a hang fails as TimeoutExpired
    log = output(result)
    assert result.returncode != 0, log[-3000:]
    sentences = [line for line in log.splitlines() if "64 CPU" in line and "--placement_timeout_s" in line]
    assert sentences, log[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert not (tmp_path / "model").exists()


def wait_for_path(path: Path, run: subprocess.Popen, log_path: Path, timeout: float = RUN_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert run.poll() is None, \
            f"the run ended (rc {run.returncode}) before {path.name}:\n{log_path.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"{path.name} did not appear within {timeout} s"
        time.sleep(0.2)


def seconds_until_line(pattern: str, log_path: Path, run: subprocess.Popen, since: float) -> float | None:
    """Poll the run's streamed output for `pattern`; seconds from `since` (monotonic) until it shows,
    None if the run ends first."""
    while not re.search(pattern, log_path.read_text(errors="replace")):
        if run.poll() is not None:
            return None
        time.sleep(0.2)
    return time.monotonic() - since


def test_node_lost_with_room_left_trains_on_from_the_snapshots_its_peer_kept(cluster, toy_assets, cluster_env, bucket,
                                                                             tmp_path, s3_here, one_host_reference):
    """Two ranks of half a CPU, one on each worker node (SPREAD), a snapshot between commits at every step. The
    rank on node 1 pauses entering step 4 and node 1 is SIGKILLed there, its own snapshots with it. Both ranks fit
    on node 0, so the group stays at 2 ranks and trains on from step 3: the lost rank's snapshot is the copy node
    0 kept. The final weights equal the 2-rank run with no fault."""
    ckpt, faults = f"s3://{bucket}/peer-snapshots-{uuid.uuid4().hex[:6]}/ckpt", tmp_path / "faults"
    faults.mkdir()
    cluster.restart_worker(1, {"RLHF_FAULT_INJECT": "train_step@4=sleep:120", "RLHF_FAULT_STATE": str(faults)})
    args = sft_args(toy_assets, ckpt, tmp_path / "model") + [
        "--num_cpus_per_worker", "0.5", "--placement_strategy", "SPREAD", "--ray_address", cluster.gcs_address,
        "--snapshot_steps", "1", "--num_spare_workers", "0", "--hang_timeout_s", "3600"]
    log_path = tmp_path / "run.log"
    with open(log_path, "wb") as log_file:
        run = subprocess.Popen([RLHF, *args], env=cluster_env, stdout=log_file, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for_path(faults / "train_step@4", run, log_path)
        deadline = time.monotonic() + RUN_TIMEOUT  # a hang guard, not a speed check
        # Step 2 committed, and each rank's snapshot of step 3 whole on both nodes: its own, and its peer's copy.
        while not (2 in committed_steps(f"{ckpt}/rlhf/sft") and all(
                len(snapshot_nodes(run.pid, rank, step=3)) == 2 for rank in (0, 1))):
            assert run.poll() is None and time.monotonic() < deadline, log_path.read_text()[-4000:]
            time.sleep(0.2)
        cluster.kill_worker(1)
        returncode = run.wait(timeout=RUN_TIMEOUT)
    finally:
        kill_if_running(run)
    # Node 1 stays down: the module's last test brings it back, with its own fault hook.
    log = log_path.read_text(errors="replace")
    assert returncode == 0, log[-5000:]
    first, second = re.findall(r"placed 2 of 2 ranks \(SPREAD\) on nodes: (.*)", log)[:2]
    assert len(re.findall(r"node [0-9a-f]+", first)) == 2 and len(re.findall(r"node [0-9a-f]+", second)) == 1, log
    restarts = [line for line in log.splitlines() if "Replaced the ranks in" in line]
    assert len(restarts) == 1 and "was lost mid-chunk" in restarts[0], restarts or log[-4000:]
    assert "training again from step 3 (a snapshot between commits" in restarts[0], restarts[0]
    assert committed_steps(f"{ckpt}/rlhf/sft") == [2, 4, 6]
    assert_same_weights(one_host_reference, tmp_path / "model")


def kill_if_running(run: subprocess.Popen) -> None:
    """A run a failed assertion left behind: SIGKILL to its session."""
    if run.poll() is None:
        subprocess.run(["kill", "-9", f"-{run.pid}"], check=False)
        run.wait()


def snapshot_nodes(driver_pid: int, rank: int, step: int) -> set[str]:
    """The node folders in this machine's tmpfs (every test node shares it) holding `rank`'s snapshot of `step`
    taken under the driver `driver_pid`."""
    pattern = f"rlhf-interim-{socket.gethostname()}-{driver_pid}-*/*/slot_*/rank{rank}.json"
    return {marker.parent.parent.name for marker in Path("/dev/shm").glob(pattern)
            if json.loads(marker.read_text() or "{}").get("step") == step}


def test_node_lost_mid_chunk_finishes_on_the_surviving_node(cluster, toy_assets, cluster_env, bucket, tmp_path,
                                                            s3_here):
    """Last in the module: it kills a worker node (and restarts it at the end).

    The rank on worker node 1 pauses inside step 3 (the fault hook is in that node's environment only,
    so it is always that rank), and node 1 is SIGKILLed there: its peer on node 0 is waiting in a
    collective, the common case, where gloo on the survivor reports a closed connection before Ray
    reports the node dead. The failed chunk must still name the lost node."""
    stage_url, faults = f"s3://{bucket}/node-loss-{uuid.uuid4().hex[:6]}/ckpt/rlhf/sft", tmp_path / "faults"
    faults.mkdir()
    cluster.restart_worker(1, {"RLHF_FAULT_INJECT": "train_step@3=sleep:120", "RLHF_FAULT_STATE": str(faults)})
    try:
        check_node_loss(cluster, toy_assets, cluster_env, tmp_path, stage_url, faults)
    finally:
        cluster.restart_worker(1)  # as the module's other tests found it: no fault hook


def check_node_loss(cluster, toy_assets, cluster_env, tmp_path, stage_url, faults) -> None:
    args = sft_args(toy_assets, stage_url.removesuffix("/rlhf/sft"), tmp_path / "model", max_samples=64,
                    max_ckpt_num=0)
    args += on_cluster(cluster.gcs_address) + ["--allow_fewer_workers", "--placement_timeout_s", "10"]
    args += ["--hang_timeout_s", "3600"]  # its rank pauses on purpose until the node is killed
    log_path = tmp_path / "run.log"
    with open(log_path, "wb") as log_file:
        run = subprocess.Popen([RLHF, *args], env=cluster_env, stdout=log_file, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for_path(faults / "train_step@3", run, log_path)  # node 1's rank paused in step 3
        # Step 2 commits in the background while step 3 trains: wait for its manifest.
        deadline = time.monotonic() + RUN_TIMEOUT  # a hang guard, not a speed check
        while not any(info.step == 2 and info.is_committed for info in CheckpointStore(stage_url).list()):
            assert run.poll() is None and time.monotonic() < deadline, "step 2 never committed"
            time.sleep(0.2)
        before = committed_steps(stage_url)
        manifests = {step: read_bytes(f"{stage_url}/step_{step}/MANIFEST.json") for step in before}
        killed_at = cluster.kill_worker(1)
        to_placed = seconds_until_line(r"placed 1 of 2 ranks", log_path, run, killed_at)
        to_commit = seconds_until_line(r"step 4/8: trained", log_path, run, killed_at)
        returncode = run.wait(timeout=RUN_TIMEOUT)
    finally:
        kill_if_running(run)
    log = log_path.read_text(errors="replace")
    print(f"\nnode kill -> the chunk's new rank placed on the surviving node: {to_placed} s; "
          f"-> the chunk committed: {to_commit} s")
    assert returncode == 0, log[-5000:] + cluster.log_tails()
    assert before == [2], before
    assert to_placed is not None, log[-4000:]
    # The chunk replaced its ranks in place; the rest ran on the survivor, 1 of 2 ranks.
    assert re.search(r"step 4/8: trained \d+ steps on 1 of 2 ranks", log), log[-4000:]
    after = committed_steps(stage_url)
    assert set(before) <= set(after) and after[-1] == 8, (before, after)
    for step, manifest in manifests.items():  # committed before the kill: never rewritten
        assert read_bytes(f"{stage_url}/step_{step}/MANIFEST.json") == manifest
    final = CheckpointStore(stage_url).read_metadata(8)
    assert final["world_size"] == 1, final
    assert final["world_size_changes"] == [{"step": 2, "from": 2, "to": 1}], final
    assert (tmp_path / "model" / "model.safetensors").exists()
    # The failed chunk named the node that was lost.
    lost = set(placed_nodes(log, 2, 2)) - set(placed_nodes(log, 1, 2))
    assert len(lost) == 1, log[-4000:]
    failures = [line for line in log.splitlines() if "was lost mid-chunk" in line]
    assert len(failures) == 1 and lost.pop() in failures[0] and "Replaced the ranks in" in failures[0], \
        failures or log[-4000:]
