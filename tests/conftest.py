"""Fixtures shared by unit and integration tests: toy assets and an environment for `rlhf` subprocesses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

RLHF = str(Path(sys.executable).with_name("rlhf"))
# Under pytest-xdist each worker is a process of its own, named gw0, gw1, ... ("main" without xdist).
WORKER = os.environ.get("PYTEST_XDIST_WORKER", "main")


def _private_ray_temp_dir() -> None:
    """A bare `ray.init()` joins the cluster named in Ray's temp folder (`ray_current_cluster`, written by `ray start`)
    before it starts one of its own. Each pytest process gets a temp folder of its own (RAY_TMPDIR), so a test's local
    Ray never joins another xdist worker's test cluster, nor a cluster the developer started on this machine. Short:
    Ray's unix socket paths live under it and must stay under 108 bytes."""
    if "RAY_TMPDIR" not in os.environ:
        import atexit
        import shutil
        import tempfile

        os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix=f"rt-{WORKER}-", dir="/tmp")
        atexit.register(shutil.rmtree, os.environ["RAY_TMPDIR"], ignore_errors=True)


_private_ray_temp_dir()


def _share_the_cores() -> None:
    """Each xdist worker's processes (the test's own, its `rlhf` commands and their ranks, which take the driver's
    OMP_NUM_THREADS) get an equal share of the cores. By default every torch process takes them all, and two workers
    training at once spun in OpenMP's barriers against each other: on 2 cores, 5x slower than one thread each."""
    num_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if num_workers > 1:
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // num_workers)))


_share_the_cores()


def _tokenizer_cache_of_this_run() -> None:
    """One machine cache of tokenizer records (RLHF_TOKENIZER_CACHE) for the whole run, made by the first pytest
    process (xdist's controller; its workers inherit it) and removed with it: every `rlhf` command of the suite
    prepares the toy's data from the toy tokenizer's snapshot, as a user's later runs of one model do, without a
    developer's own ~/.cache in it."""
    if "RLHF_TOKENIZER_CACHE" not in os.environ:
        import atexit
        import shutil
        import tempfile

        os.environ["RLHF_TOKENIZER_CACHE"] = tempfile.mkdtemp(prefix="rlhf-tokenizers-")
        atexit.register(shutil.rmtree, os.environ["RLHF_TOKENIZER_CACHE"], ignore_errors=True)


_tokenizer_cache_of_this_run()
# What `ray.init` in this process adds to os.environ (RAY_AUTH_MODE=token among them), as the session began.
RAY_SET_VARIABLES = ("RAY_", "PYTHONBREAKPOINT")
_SESSION_RAY_ENVIRONMENT = {name: value for name, value in os.environ.items() if name.startswith(RAY_SET_VARIABLES)}


@pytest.fixture(autouse=True)
def ray_leaves_no_environment_behind():
    """`ray.init` in this process (a test that connects in-process) sets RAY_AUTH_MODE=token, RAY_USAGE_STATS_ENABLED
    and PYTHONBREAKPOINT in os.environ. A later test's `ray start --head` and `rlhf` subprocesses inherit what it
    copies from os.environ, and with RAY_AUTH_MODE=token there every rank of the model-families module died before
    it started (ActorDiedError, "all references to the actor were removed"): CI's 6 failures. Each test ends with
    those variables as the session began."""
    yield
    for name in [name for name in os.environ if name.startswith(RAY_SET_VARIABLES)]:
        if name not in _SESSION_RAY_ENVIRONMENT:
            del os.environ[name]
    os.environ.update(_SESSION_RAY_ENVIRONMENT)


@pytest.fixture(autouse=True)
def fresh_s3_clients():
    """fsspec caches S3 filesystems by their arguments, not by AWS_ENDPOINT_URL: a test that points the
    environment at another endpoint (a dead one, in the bad-input suite) must not leave its client to the next."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    yield
    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture(scope="session")
def toy_assets(tmp_path_factory) -> dict[str, str]:
    from rlhf_core.toy import init_toy

    return init_toy(str(tmp_path_factory.mktemp("toy")))


@pytest.fixture(scope="session")
def ephemeral_rlhf_env(tmp_path_factory) -> dict[str, str]:
    """Environment for `rlhf` subprocesses on Prefect's ephemeral server (no PREFECT_API_URL), with a private home.
    Integration tests take `rlhf_env` (tests/integration/conftest.py): the same, pointed at one server per worker."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PREFECT_API", "RLHF_FAULT"))}
    env.update(
        PREFECT_HOME=str(tmp_path_factory.mktemp("prefect-home")),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PYTHONUNBUFFERED="1",
    )
    return env


@pytest.fixture(scope="session")
def s3_endpoint():
    """A real S3 endpoint on loopback (moto's server in a thread), shared by the session."""
    moto_server = pytest.importorskip("moto.server")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


def s3_environment(endpoint: str) -> dict[str, str]:
    """The standard AWS variables a user would set: credentials and endpoint come from here."""
    return {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing-secret",
            "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint}


def make_bucket(endpoint: str, name: str) -> None:
    import boto3

    boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing",
                 aws_secret_access_key="testing-secret", region_name="us-east-1").create_bucket(Bucket=name)


HUB_REVISION = "0123456789abcdef0123456789abcdef01234567"


def hub_snapshot_dir(home: Path, repo_type: str, repo_id: str) -> Path:
    """`{type}s--org--name/snapshots/<rev>/` with `refs/main` naming <rev>: huggingface_hub's cache layout."""
    repo = home / "hub" / f"{repo_type}s--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(HUB_REVISION)
    snapshot = repo / "snapshots" / HUB_REVISION
    snapshot.mkdir(parents=True)
    return snapshot


def run_rlhf(args: list[str], env: dict[str, str], timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([RLHF, *args], env=env, capture_output=True, text=True, timeout=timeout)


# Integration modules, the heaviest first (module totals of a serial run, tests/README.md). Under pytest-xdist
# (`make test`: `-n 2 --dist loadfile`) a free worker takes the next module in this order, so the long ones start
# first and the short ones and the unit tests fill the gaps at the end. A module missing here runs after these.
HEAVIEST_MODULES_FIRST = (
    "test_openrlhf_scripts", "test_model_families", "test_deployment", "test_fault_matrix", "test_agent",
    "test_soak", "test_ray_cluster", "test_pipeline_stages", "test_stop_signals", "test_zero3",
    "test_bad_input", "test_dpo", "test_resume_paths", "test_full_disk", "test_prm", "test_docs_examples",
    "test_chunk_retry", "test_hang", "test_store_outage",
    "test_console", "test_ppo_multirank",
)


def _schedule_for_workers(items: list) -> None:
    """Under `--dist loadfile` each module is one unit of work: its module-scoped fixtures (a Prefect server, a Ray
    head, an HF cache, a reference run) are built once, on the worker that runs it, and its tests keep their order.
    (Not `--dist loadgroup`: pytest-xdist 3.8 marks a group by rewriting `item._nodeid`, which pytest 9 no longer
    reads, so every test was its own group.) Modules are ordered heaviest first, then the other integration modules,
    then the unit tests; `--no-loadscope-reorder` keeps that order (by default xdist puts the modules with the most
    tests first, which left the one-test heavy modules, the agent and the fault matrix, for the end)."""
    rank = {name: index for index, name in enumerate(HEAVIEST_MODULES_FIRST)}

    def order(item) -> tuple[int, int]:
        module = item.path.stem
        if "integration" not in item.path.parts:
            return (2, 0)
        return (0, rank[module]) if module in rank else (1, 0)

    items.sort(key=order)  # stable: within a module, the collection order


_FIRST_FAILURES_OF_RERUNS: list[tuple[str, str]] = []
_FIRST_FAILURE_CHARS = 3000


def pytest_runtest_logreport(report):
    """A `slow` test that failed and is run once more: keep the end of its first failure, which `-rR` does not
    show (a flaky test in CI must say why it failed)."""
    if report.outcome == "rerun" and report.longrepr is not None:
        _FIRST_FAILURES_OF_RERUNS.append((report.nodeid, str(report.longrepr)[-_FIRST_FAILURE_CHARS:]))


def pytest_terminal_summary(terminalreporter):
    for nodeid, failure in _FIRST_FAILURES_OF_RERUNS:
        terminalreporter.write_sep("-", f"the first failure of {nodeid}, run once more")
        terminalreporter.write_line(failure)


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` skip cleanly on machines without CUDA. Tests marked `slow` (real Ray clusters, Prefect
    servers, moto, DeepSpeed processes on a shared 2-core machine) run once more after a failure: a start-up
    race in one of those services (e.g. Ray's "Starting Ray client server failed") must not fail the suite,
    while a failure that repeats still does. `make test` lists each rerun in its summary (-rR), so a flaky
    test stays visible."""
    import torch

    rerun_once = pytest.mark.flaky(reruns=1, reruns_delay=5)
    skip = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs CUDA (marked gpu)")
    for item in items:
        if skip is not None and "gpu" in item.keywords:
            item.add_marker(skip)
        elif "slow" in item.keywords:
            item.add_marker(rerun_once)
    _schedule_for_workers(items)
