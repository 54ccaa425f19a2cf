"""Fault injection for tests: pause or die at a named point, chosen by an environment variable.

    RLHF_FAULT_INJECT="after_commit@10=sleep:60,train_step@7=kill"

makes the process sleep 60 s right after committing step 10, and SIGKILL itself when about to train
step 7. Unset (the normal case), `fault_point` does nothing. Ray workers inherit the variable.
"""

from __future__ import annotations

import os
import signal
import time

ENV_VAR = "RLHF_FAULT_INJECT"


def fault_point(name: str, step: int) -> None:
    spec = os.environ.get(ENV_VAR)
    if not spec:
        return
    for rule in spec.split(","):
        where, _, action = rule.strip().partition("=")
        if where != f"{name}@{step}":
            continue
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif action.startswith("sleep:"):
            time.sleep(float(action.split(":", 1)[1]))
