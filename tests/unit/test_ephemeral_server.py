"""Prefect's ephemeral server started beside Ray (flows.startup): a start that times out leaves no server behind.
Prefect 3.9 keeps the process of a start that did not answer within its timeout running, and the flow's client
then starts a second one; the first outlived `rlhf` and held its stdout open, so a caller waiting for EOF hung."""

from __future__ import annotations

import subprocess
import sys

import prefect.server.api.server as prefect_server

from flows.startup import EphemeralServer


class _SlowServer:
    """A SubprocessASGIServer whose process starts but never answers in time."""

    started: list[subprocess.Popen] = []

    def start(self) -> None:
        self.server_process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        self.started.append(self.server_process)
        raise RuntimeError("Timed out while attempting to connect to ephemeral Prefect API server.")


def test_a_server_start_that_times_out_leaves_no_process_behind(monkeypatch):
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.setattr(prefect_server, "SubprocessASGIServer", _SlowServer)
    server = EphemeralServer()
    server.start()
    server.join()
    (process,) = _SlowServer.started
    assert process.wait(timeout=10) is not None  # killed, not left running
