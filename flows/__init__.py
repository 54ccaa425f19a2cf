"""Prefect flows and the `rlhf` command: the outermost layer."""

import os

# A flow-run heartbeat every 30 s (Prefect's minimum; default 180): deployments/automations.yaml marks an
# rlhf* run Crashed after 90 s without one, so a killed worker's run can be retried, and a live run
# reporting to such a server must beat faster than that.
os.environ.setdefault("PREFECT_FLOWS_HEARTBEAT_FREQUENCY", "30")
