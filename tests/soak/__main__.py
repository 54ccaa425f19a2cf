"""`make soak`: python -m tests.soak [--short] [--seed N] [--workdir DIR]. The last line printed is the folder of
soak_report.json."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from tests.soak.soak import FULL, SHORT, run_soak


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.soak", description=__doc__)
    parser.add_argument("--short", action="store_true", help="the suite's short version (3 faults of 3 kinds)")
    parser.add_argument("--seed", type=int, default=0, help="the fault schedule's seed")
    parser.add_argument("--workdir", type=Path, default=None, help="where everything goes (default: a new temp dir)")
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="rlhf-soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    result = run_soak(SHORT if args.short else FULL, workdir, seed=args.seed)
    good = result["human_actions"] == 0 and result["commits_lost"] == 0 and result["bit_exact"]
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
