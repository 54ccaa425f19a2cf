"""Fixtures shared by unit and integration tests: toy assets and an environment for `rlhf` subprocesses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

RLHF = str(Path(sys.executable).with_name("rlhf"))


@pytest.fixture(scope="session")
def toy_assets(tmp_path_factory) -> dict[str, str]:
    from rlhf_core.toy import init_toy

    return init_toy(str(tmp_path_factory.mktemp("toy")))


@pytest.fixture(scope="session")
def rlhf_env(tmp_path_factory) -> dict[str, str]:
    """Environment for `rlhf` subprocesses: Prefect's ephemeral server with a private home."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PREFECT_API", "RLHF_FAULT"))}
    env.update(
        PREFECT_HOME=str(tmp_path_factory.mktemp("prefect-home")),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PYTHONUNBUFFERED="1",
    )
    return env


def run_rlhf(args: list[str], env: dict[str, str], timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([RLHF, *args], env=env, capture_output=True, text=True, timeout=timeout)
