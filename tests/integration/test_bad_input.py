"""Bad input (issue 7): every malformed input a new user may give is refused before training starts.

Each case of `bad_input_cases.CASES` (data files, models, flags, paths, object stores, reward functions, YAML run
configs, each subcommand) runs the real `rlhf` command against a copy of a committed run and must end with
exit code 2, no traceback, exactly one `rlhf: error:` line (argparse's own `rlhf train sft: error:` for flags it
refuses) naming the culprit, and every file of the workspace (the committed run, the inputs) unchanged, nothing
new written. Most cases call `flows.cli.main` in-process with the flow replaced by a failure: a case that gets
past the checks before training fails instead of training. A few run as subprocesses: where the environment
matters (HF_HUB_OFFLINE), to show no traceback reaches a real terminal, and, for read-only folders, without
root's power to write anywhere (setpriv drops CAP_DAC_OVERRIDE when the tests run as root).

Reward functions that fail only at step time, inside a Ray worker, need a real PPO run: NaN, the wrong number
of scores, an exception. Each must come back as the same one-sentence error, exit 2, without a Prefect retry
(the function's calls are counted), and with the checkpoint committed before it intact.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

import flows.pipeline  # noqa: F401 - prefect's console handler takes sys.stderr at import: collection's, not a case's
from flows.cli import main
from tests.conftest import RLHF, run_rlhf
from tests.integration.bad_input_cases import CASES, RUN_NAME, Bad, Workspace, ppo_args, sft_args

ERROR_LINE = re.compile(r"^rlhf(?: [\w-]+)*: error: .*$", re.MULTILINE)
DROP_ROOT_WRITES = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--"]


def tree_state(root: Path) -> dict[str, tuple]:
    """Every folder and file below `root`: ("dir",) or (size, sha256). A complete preparation of the data
    (`.prepared/{key}/` with its marker, and the hashes beside it) is left out: a refusal that needs the count
    (fewer prompts than a step) comes after the data was prepared, and the corrected run reuses it. Anything else
    under `.prepared` (a staging folder) still counts."""
    state = {}
    for path in sorted(root.rglob("*")):
        if _published_preparation(path):
            continue
        relative = str(path.relative_to(root))
        state[relative] = ("dir",) if path.is_dir() else (path.stat().st_size,
                                                          hashlib.sha256(path.read_bytes()).hexdigest())
    return state


def _published_preparation(path: Path) -> bool:
    parts = path.parts
    if ".prepared" not in parts:
        return False
    below = parts[parts.index(".prepared") + 1:]
    if not below:
        return True
    folder = path.parents[len(below) - 2] if len(below) > 1 else path  # .prepared/{key or hashes}
    return below[0] == "hashes" or (folder / "PREPARED.json").exists()


@pytest.fixture(scope="module")
def committed_run(toy_assets, rlhf_env, tmp_path_factory) -> dict[str, Path]:
    """A short real SFT run (2 steps, 2 committed checkpoints) and its exported model, once per module."""
    root = tmp_path_factory.mktemp("committed-run")
    flags = sft_args(toy_assets, str(root / "ckpt"), str(root / "sft_model"))
    result = run_rlhf(["train", "sft", *[item for pair in flags.items() for item in pair]], rlhf_env)
    assert result.returncode == 0, result.stderr[-3000:]
    return {"ckpt": root / "ckpt", "sft_model": root / "sft_model"}


@pytest.fixture
def workspace(tmp_path, committed_run, toy_assets) -> Workspace:
    shutil.copytree(committed_run["ckpt"], tmp_path / "ckpt")
    return Workspace(tmp_path, toy_assets, tmp_path / "ckpt", str(committed_run["sft_model"]))


def run_in_process(bad: Bad, capsys, monkeypatch) -> tuple[int, str, str]:
    import flows.pipeline

    def flow_started(*args, **kwargs):
        raise AssertionError("the checks before training let this input through: the flow started")

    monkeypatch.setattr(flows.pipeline, "rlhf", flow_started)
    for name, value in bad.env.items():
        monkeypatch.setenv(name, value)
    capsys.readouterr()
    try:
        code = main(bad.argv)
    except SystemExit as exit_:  # argparse
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


def run_subprocess(bad: Bad, env: dict[str, str]) -> tuple[int, str, str]:
    prefix = DROP_ROOT_WRITES if bad.unprivileged and os.geteuid() == 0 else []
    result = subprocess.run([*prefix, RLHF, *bad.argv], env={**env, **bad.env}, capture_output=True, text=True,
                            timeout=600)
    return result.returncode, result.stdout, result.stderr


def assert_refused(code: int, out: str, err: str, names: list[str]) -> str:
    """Exit 2, no traceback, one error line naming every one of `names`; returns that line."""
    assert "Traceback" not in out + err, err[-3000:]
    lines = ERROR_LINE.findall(err)
    assert len(lines) == 1, f"expected one error line, got {lines}\n--- stderr\n{err[-3000:]}"
    line = lines[0]
    assert code == 2, f"exit {code}: {line}"
    missing = [name for name in names if name not in line]
    assert not missing, f"{missing} not named in: {line}"
    if "usage: rlhf" not in err:  # ours, not argparse's: one sentence
        assert line.endswith((".", "?")), line
    return line


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_is_refused_up_front(name, workspace, capsys, monkeypatch, rlhf_env):
    bad = CASES[name](workspace)
    before = tree_state(workspace.tmp)
    if bad.subprocess:
        code, out, err = run_subprocess(bad, rlhf_env)
    else:
        code, out, err = run_in_process(bad, capsys, monkeypatch)
    assert_refused(code, out, err, bad.names)
    assert tree_state(workspace.tmp) == before, "the failed command changed or left files in the workspace"


STEP_TIME_FAILURES = {
    "nan": ("return [float('nan')] * len(queries)", "rewards[0] = nan"),
    "wrong_length": ("return [0.0] * (len(queries) - 1)", "returned 7 rewards for 8 samples"),
    "raises": ("raise RuntimeError('grader crashed')", "raised RuntimeError: grader crashed"),
}

REWARD_FAILING_AT_STEP_2 = '''
CALLS = {calls!r}


def reward_func(queries, prompts, labels, **kwargs):
    if len(queries) == 1:  # the check before training scores one sample: fine
        return [0.0]
    with open(CALLS, "a") as log:
        log.write("call\\n")
    with open(CALLS) as log:
        if len(log.readlines()) == 1:  # the first PPO step trains and commits
            return [0.0] * len(queries)
    {failure}
'''


@pytest.mark.slow
@pytest.mark.parametrize("failure", sorted(STEP_TIME_FAILURES))
def test_reward_failing_inside_a_worker_is_one_error_not_retried(failure, workspace, rlhf_env):
    body, expected = STEP_TIME_FAILURES[failure]
    calls = workspace.tmp / "calls.log"
    reward_file = workspace.write("reward_func.py", REWARD_FAILING_AT_STEP_2.format(calls=str(calls), failure=body))
    flags = {**ppo_args(workspace.toy, str(workspace.ckpt), workspace.path("out/ppo")), "--reward_fn": None,
             "--remote_rm_url": reward_file}
    sft_before = tree_state(workspace.ckpt / RUN_NAME / "sft")
    code, out, err = run_subprocess(Bad(["train", "ppo", *[str(item) for pair in flags.items() if pair[1] is not None
                                                           for item in pair]], []), rlhf_env)
    line = assert_refused(code, out, err, ["reward_func.py", expected])
    assert calls.read_text().count("call") == 2, f"step 2's failure was retried: {line}"
    assert "Retry 1/" not in out + err
    assert tree_state(workspace.ckpt / RUN_NAME / "sft") == sft_before
    listing = subprocess.run([RLHF, "ckpt", "verify", str(workspace.ckpt / RUN_NAME / "ppo"), "--json"],
                             env=rlhf_env, capture_output=True, text=True, timeout=300)
    assert listing.returncode == 0, listing.stderr
    assert [(row["name"], row["status"]) for row in json.loads(listing.stdout)] == [("step_1", "committed")]
