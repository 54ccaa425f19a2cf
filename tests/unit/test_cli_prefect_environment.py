"""What the `rlhf` command sets of Prefect's environment before prefect is imported (flows.cli.prefect_environment):
no telemetry banner on a terminal unless the user asked for Prefect's analytics. In a subprocess on a pseudo-terminal
with a Prefect home of its own: Prefect prints its banner when it is imported, once per home, on a terminal only."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys

import pytest

BANNER = "Prefect collects anonymous usage data"
# Prefect's own check (prefect._internal.analytics.ci_detection): any of these set, it never prints the banner.
CI_VARIABLES = ("CI", "GITHUB_ACTIONS", "GITLAB_CI", "JENKINS_URL", "TRAVIS", "CIRCLECI", "BUILDKITE", "TF_BUILD",
                "CODEBUILD_BUILD_ID", "BITBUCKET_COMMIT", "TEAMCITY_VERSION", "DRONE", "SEMAPHORE", "APPVEYOR",
                "BUDDY", "CI_NAME")


def _import_prefect_as_the_cli_does(prefect_home, **user_environment: str) -> str:
    """The output, on a pseudo-terminal, of the CLI's `prefect_environment()` then `import prefect`, in a process
    whose environment is ours less the telemetry settings, plus `user_environment` (as a user's shell sets it)."""
    env = {name: value for name, value in os.environ.items()
           if name not in ("DO_NOT_TRACK", "PREFECT_SERVER_ANALYTICS_ENABLED", *CI_VARIABLES)}
    env.update(PREFECT_HOME=str(prefect_home), **user_environment)
    code = "from flows.cli import prefect_environment; prefect_environment(); import prefect"
    master, terminal = pty.openpty()
    process = subprocess.Popen([sys.executable, "-c", code], stdin=terminal, stdout=terminal, stderr=terminal,
                               env=env)
    os.close(terminal)
    output = bytearray()
    while True:
        ready, _, _ = select.select([master], [], [], 60)
        try:
            chunk = os.read(master, 65536) if ready else b""
        except OSError:  # the process closed its end
            chunk = b""
        if not chunk:
            break
        output.extend(chunk)
    os.close(master)
    assert process.wait(timeout=60) == 0, output.decode(errors="replace")
    return output.decode(errors="replace")


def test_a_plain_command_prints_no_telemetry_banner(tmp_path):
    assert BANNER not in _import_prefect_as_the_cli_does(tmp_path / "prefect")


@pytest.mark.parametrize("asked", [{"PREFECT_SERVER_ANALYTICS_ENABLED": "true"}, {"DO_NOT_TRACK": "0"}])
def test_a_user_who_turns_analytics_on_gets_prefects_banner(tmp_path, asked):
    assert BANNER in _import_prefect_as_the_cli_does(tmp_path / "prefect", **asked)
