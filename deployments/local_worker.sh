#!/usr/bin/env bash
# Create the process work pool (if missing), deploy every deployment of prefect.yaml (rlhf/full, sft,
# rm, ppo, ppo-nightly; the nightly schedule stays inactive until you resume it), create or update the
# automations (deployments/create_automations.py: a killed worker's run is marked Crashed, then restarted), and run a
# worker in the foreground. Needs a running Prefect server: PREFECT_API_URL set, or `prefect server start`.
#
#   deployments/local_worker.sh              # pool rlhf-local
#   RLHF_WORK_POOL=gpu-box deployments/local_worker.sh
#   RLHF_SKIP_DEPLOY=1 deployments/local_worker.sh   # only start a worker
set -euo pipefail

PROJECT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
POOL="${RLHF_WORK_POOL:-rlhf-local}"
if [[ -x "$PROJECT_DIR/.venv/bin/prefect" ]]; then
  PREFECT="$PROJECT_DIR/.venv/bin/prefect"   # the worker runs flows with this venv's python
  PYTHON="$PROJECT_DIR/.venv/bin/python"
else
  PREFECT="$(command -v prefect)"
  PYTHON="$(command -v python3)"
fi
export PREFECT_SERVER_ANALYTICS_ENABLED="${PREFECT_SERVER_ANALYTICS_ENABLED:-false}"
# Flow-run processes inherit this even when `prefect deploy --job-variable env=...` replaces the env mapping.
export PREFECT_FLOWS_HEARTBEAT_FREQUENCY="${PREFECT_FLOWS_HEARTBEAT_FREQUENCY:-30}"

cd "$PROJECT_DIR"
export PWD="$PROJECT_DIR"   # prefect.yaml records {{ $PWD }} as the folder the worker runs the flow from

if "$PREFECT" work-pool inspect "$POOL" >/dev/null 2>&1; then
  echo "work pool '$POOL' exists"
else
  "$PREFECT" work-pool create "$POOL" --type process
fi

if [[ -z "${RLHF_SKIP_DEPLOY:-}" ]]; then
  "$PREFECT" --no-prompt deploy --all --pool "$POOL"
fi

# Without these a killed worker's run stays Running for ever (deployments/README.md); safe to repeat.
echo "automations: a run whose worker dies is marked Crashed after 90 s without a heartbeat, and a crashed run is restarted by itself; alerts show in the UI"
"$PYTHON" deployments/create_automations.py

# A run of this pool that ran here and whose process is gone (a power cut, a reboot) is marked Crashed now, and
# restarted, instead of after the heartbeat automation's 90 s (flows/orphans.py). A supervisor (systemd) that
# restarts the worker runs these last two lines.
"$PYTHON" -m flows.orphans --pool "$POOL"
exec "$PREFECT" worker start --pool "$POOL"
