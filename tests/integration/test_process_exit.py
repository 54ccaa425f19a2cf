"""A finished `rlhf` command leaves through `rlhf_core.driver.process_exit.exit_now`, skipping the interpreter's
teardown: what the exit must still do is checked on a real process with a real local Ray cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from rlhf_core.processes import process_exists

CHILD = textwrap.dedent("""
    import atexit, json, sys, threading, time
    from rlhf_core.driver.process_exit import exit_now

    folder, with_ray = sys.argv[1], sys.argv[2] == "ray"
    pids = {}
    if with_ray:  # a training command; `rlhf ckpt ls` and the like start none
        import ray

        ray.init(include_dashboard=False, num_cpus=1)
        node = ray._private.worker._global_node
        pids = {name: [info.process.pid for info in infos] for name, infos in node.all_processes.items()}
    # Prefect drains its log queue to the API in threading's exit callbacks, before the atexit handler that stops
    # its server: the order the interpreter keeps.
    threading._register_atexit(lambda: open(f"{folder}/drained", "w").write("before the server stopped"))
    atexit.register(lambda: open(f"{folder}/atexit", "w").write(open(f"{folder}/drained").read()))

    def finish_late():
        time.sleep(3)
        open(f"{folder}/thread", "w").write("joined")

    threading.Thread(target=finish_late).start()
    print(json.dumps(pids))
    sys.stdout.write("last words, no newline")  # stdout is a pipe: block-buffered until flushed
    exit_now(3)
""")


@pytest.mark.parametrize("with_ray", ["ray", "no ray"])
def test_exit_now_keeps_the_code_atexit_threads_and_output_and_leaves_no_ray_process(tmp_path, with_ray):
    env = {name: value for name, value in os.environ.items() if name != "PYTHONUNBUFFERED"}  # as a user's shell
    done = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path), with_ray], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 3, done.stderr[-3000:]
    first_line, _, rest = done.stdout.partition("\n")
    assert rest == "last words, no newline"
    assert (tmp_path / "atexit").read_text() == "before the server stopped"
    assert (tmp_path / "thread").read_text() == "joined"
    pids = json.loads(first_line)
    assert {"raylet", "gcs_server", "monitor"} <= set(pids) or with_ray == "no ray", pids
    left = {name: pid for name, group in pids.items() for pid in group if process_exists(pid)}
    assert not left, f"Ray processes outlived the command: {left}"
