"""The seed's resume pattern, `if [ -d ckpt ]; then load_args=--load_checkpoint; fi`, is a user-side script:
its first run starts fresh, its second resumes. A plain `--load_checkpoint` on a folder with no checkpoint is
a fresh start too, said in one line (as OpenRLHF 0.11 falls back), never an error."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.conftest import RLHF, run_rlhf

pytestmark = pytest.mark.slow

SEED_SCRIPT = """
set -euo pipefail
CKPT="$1"; shift
load_args=""
if [ -d "$CKPT" ]; then load_args="--load_checkpoint"; fi
"$RLHF" train sft --ckpt_path "$CKPT" $load_args "$@"
"""


def sft_flags(toy: dict[str, str], out: Path) -> list[str]:
    """Two chunks of the toy SFT (8 steps, a commit every 4)."""
    return ["--pretrain", toy["model"], "--dataset", toy["sft"], "--input_key", "prompt", "--output_key", "response",
            "--max_len", "64", "--max_samples", "64", "--train_batch_size", "8", "--micro_train_batch_size", "8",
            "--max_epochs", "1", "--learning_rate", "1e-3", "--save_steps", "4", "--save_path", str(out)]


def test_load_checkpoint_on_a_new_folder_starts_fresh_and_the_seeds_pattern_then_resumes(toy_assets, rlhf_env,
                                                                                          tmp_path):
    """A plain --load_checkpoint on a folder that does not exist yet trains from --pretrain, saying so in one
    line; the seed's script then finds the folder, passes --load_checkpoint, and the finished stage is not
    entered again (its last step committed and exported)."""
    ckpt, flags = tmp_path / "ckpt", sft_flags(toy_assets, tmp_path / "out")
    first = run_rlhf(["train", "sft", "--ckpt_path", str(ckpt), "--load_checkpoint", *flags], rlhf_env)
    assert first.returncode == 0, first.stderr[-3000:]
    log = first.stdout + first.stderr
    lines = [line for line in log.splitlines() if "--load_checkpoint found no checkpoint" in line]
    assert len(lines) == 1 and f"starting from {toy_assets['model']}" in lines[0], log[-3000:]
    assert "step 8/8: trained 4 steps" in log, log[-3000:]

    script = tmp_path / "train.sh"
    script.write_text(SEED_SCRIPT)
    again = subprocess.run(["bash", str(script), str(ckpt), *flags], env={**rlhf_env, "RLHF": RLHF},
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    log = again.stdout + again.stderr
    assert "sft: finished by an earlier run (step 8, exported to" in log and "trained" not in log, log[-3000:]
    assert "--load_checkpoint found no checkpoint" not in log
