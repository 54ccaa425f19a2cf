"""A real SFT checkpoint (weights, DeepSpeed optimizer state, manifest, metadata) written by the code of commit
1b50b26, the main issue 45 started from, for tests/integration/test_old_checkpoint_resume.py.

The old code trains the toy SFT for 8 steps (`--max_samples 64`, `--save_steps 4`, one rank) and commits
step_4 and step_8. The fixture `tests/data/checkpoints/old_1b50b26/` keeps what a resume from step 4 needs:
the toy model and data that run started from (`toy/`, made by 1b50b26's `init_toy`), step_4's committed folder
as written, `latest` as it read right after that commit (`step_4`), and the weights the old run ended with at
step 8 (`reference/step_8.safetensors`, its exported `model.safetensors`). About 2.1 MB.

The one change to what 1b50b26 wrote: `training_metadata.json` records the run's absolute paths, and a resume
with other paths is config drift, so the fixture holds the folder of the old run as `<run>` (ORIGIN.json says
which folder it was) and `install_fixture` writes the test's folder in, with that file's size and checksum in
step_4's MANIFEST.json to match. It first checks that the original folder gives back the checksum the old code
wrote, so the placeholder loses nothing.

Regenerate (only if the fixture is lost; the point is that 1b50b26 wrote it), from the repository root:

    git worktree add /tmp/old1b50 1b50b26
    .venv/bin/python -m tests.integration.old_checkpoint_fixture /tmp/old1b50 $(mktemp -d)
    git worktree remove --force /tmp/old1b50

It runs 1b50b26's `init_toy` and `rlhf train sft` with this venv and `PYTHONPATH=<checkout>` (the old package
is imported before the installed one, in the driver and in the Ray ranks, which inherit the environment)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

OLD_COMMIT = "1b50b26"
FIXTURE = Path(__file__).resolve().parents[1] / "data" / "checkpoints" / "old_1b50b26"
RUN_PLACEHOLDER = "<run>"
SAVE_STEPS, TOTAL_STEPS = 4, 8
STEP_DIR = Path("ckpt") / "rlhf" / "sft" / f"step_{SAVE_STEPS}"
METADATA = "training_metadata.json"
REFERENCE = Path("reference") / f"step_{TOTAL_STEPS}.safetensors"
RLHF = str(Path(sys.executable).with_name("rlhf"))


def sft_args(run_root: Path) -> list[str]:
    """The toy SFT command (tests/integration/conftest.py's `train_sft_args`, cut to 64 rows: 8 steps), with
    the toy, checkpoints and output under `run_root`."""
    return [
        "train", "sft", "--pretrain", str(run_root / "toy" / "model"), "--dataset", str(run_root / "toy" / "sft.jsonl"),
        "--input_key", "prompt", "--output_key", "response", "--input_template", "{}", "--max_len", "128",
        "--train_batch_size", "8", "--micro_train_batch_size", "4", "--max_epochs", "1", "--max_samples", "64",
        "--learning_rate", "1e-3", "--save_steps", str(SAVE_STEPS), "--ckpt_path", str(run_root / "ckpt"),
        "--max_ckpt_num", "3", "--save_path", str(run_root / "out"), "--seed", "42", "--load_checkpoint",
    ]


def run_old_code(checkout: Path, run_root: Path) -> None:
    """The toy and the 8-step SFT run, both by the code in `checkout`, into `run_root`."""
    env = {**os.environ, "PYTHONPATH": str(checkout), "PREFECT_HOME": tempfile.mkdtemp(prefix="prefect-old-"),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "RAY_TMPDIR": tempfile.mkdtemp(prefix="rt-old-", dir="/tmp")}
    env = {key: value for key, value in env.items() if not key.startswith(("PREFECT_API", "RLHF_FAULT"))}
    imported = subprocess.run([sys.executable, "-c", "import rlhf_core; print(rlhf_core.__file__)"], env=env,
                              cwd=checkout, capture_output=True, text=True, check=True).stdout.strip()
    assert Path(imported).is_relative_to(checkout), f"imported {imported}, not the checkout's package"
    subprocess.run([sys.executable, "-c", f"from rlhf_core.toy import init_toy; init_toy({str(run_root / 'toy')!r})"],
                   env=env, cwd=checkout, check=True)
    trained = subprocess.run([RLHF, *sft_args(run_root)], env=env, cwd=checkout, capture_output=True, text=True)
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]


def write_fixture(checkout: Path, work: Path) -> None:
    """Run the old code in `work` and copy what a resume from step 4 needs into FIXTURE."""
    run_root = work / "run"
    run_old_code(checkout, run_root)
    shutil.rmtree(FIXTURE, ignore_errors=True)
    (FIXTURE / "toy").mkdir(parents=True)
    shutil.copytree(run_root / "toy" / "model", FIXTURE / "toy" / "model")
    shutil.copy2(run_root / "toy" / "sft.jsonl", FIXTURE / "toy" / "sft.jsonl")
    shutil.copytree(run_root / STEP_DIR, FIXTURE / STEP_DIR)
    metadata = (run_root / STEP_DIR / METADATA).read_text()
    (FIXTURE / STEP_DIR / METADATA).write_text(metadata.replace(str(run_root), RUN_PLACEHOLDER))
    (FIXTURE / STEP_DIR.parent / "latest").write_text(STEP_DIR.name)  # as the step-4 commit left it
    (FIXTURE / REFERENCE).parent.mkdir()
    shutil.copy2(run_root / "out" / "model.safetensors", FIXTURE / REFERENCE)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=checkout, capture_output=True, text=True,
                            check=True).stdout.strip()
    origin = {"commit": commit, "run_root": str(run_root), "command": ["rlhf", *sft_args(Path(RUN_PLACEHOLDER))]}
    (FIXTURE / "ORIGIN.json").write_text(json.dumps(origin, indent=2) + "\n")


def install_fixture(run_root: Path) -> None:
    """Lay the fixture out in `run_root` as the old run's folder (toy/, ckpt/), with `run_root` for `<run>`."""
    import xxhash

    shutil.copytree(FIXTURE / "toy", run_root / "toy")
    shutil.copytree(FIXTURE / STEP_DIR.parent, run_root / STEP_DIR.parent)
    template = (FIXTURE / STEP_DIR / METADATA).read_text()
    manifest_path = run_root / STEP_DIR / "MANIFEST.json"
    manifest = json.loads(manifest_path.read_text())
    entry = next(entry for entry in manifest["files"] if entry["path"] == METADATA)
    original = template.replace(RUN_PLACEHOLDER, json.loads((FIXTURE / "ORIGIN.json").read_text())["run_root"])
    assert xxhash.xxh3_128(original.encode()).hexdigest() == entry["xxh3_128"], "the placeholder lost bytes"
    localized = template.replace(RUN_PLACEHOLDER, str(run_root)).encode()
    (run_root / STEP_DIR / METADATA).write_bytes(localized)
    entry.update(size=len(localized), xxh3_128=xxhash.xxh3_128(localized).hexdigest())
    manifest_path.write_text(json.dumps(manifest, indent=2))


if __name__ == "__main__":
    write_fixture(Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve())
    print(f"wrote {FIXTURE}")
