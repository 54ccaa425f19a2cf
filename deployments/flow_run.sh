#!/usr/bin/env sh
# What the process worker runs for each flow run of these deployments (prefect.yaml's `command` job variable), in
# place of `python -m prefect.engine`: flows/supervise.py, which runs the engine and starts it again on this host if
# it dies (the OOM killer, a segfault). The interpreter: RLHF_PYTHON if set, else this checkout's .venv, else python3.
set -eu
here="$(cd "$(dirname "$0")/.." && pwd -P)"
python="${RLHF_PYTHON:-$here/.venv/bin/python}"
if [ -z "${RLHF_PYTHON:-}" ] && [ ! -x "$python" ]; then
  python="$(command -v python3)"
fi
exec "$python" -m flows.supervise
