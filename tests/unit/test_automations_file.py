"""deployments/automations.yaml, checked offline: every entry is a valid Prefect automation, each alert
that rlhf_core emits has one, and the crash automation's window leaves room for missed heartbeats."""

from __future__ import annotations

import importlib.util
import uuid
from pathlib import Path

import pytest

from rlhf_core.ops.alerts import ALERT_NAMES
from rlhf_core.errors import UserError

SCRIPT = Path(__file__).resolve().parents[2] / "deployments" / "create_automations.py"
MINIMUM_HEARTBEAT_S = 30  # Prefect's floor for PREFECT_FLOWS_HEARTBEAT_FREQUENCY


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("create_automations", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_alert_has_a_reactive_automation_on_rlhf_run_resources(script):
    automations = script.load_automations(script.AUTOMATIONS_FILE)
    expected = set(ALERT_NAMES)
    alerts = {next(iter(a.trigger.expect)): a for a in automations if a.name.startswith(script.ALERT_PREFIX)}
    assert set(alerts) == expected
    for automation in alerts.values():
        assert automation.trigger.posture.value == "Reactive"
        assert automation.trigger.match.root == {"prefect.resource.id": "rlhf.run.*"}
        assert [action.type for action in automation.actions] == ["do-nothing"]
        assert automation.description


def test_notify_block_replaces_only_the_alert_actions(script):
    block_id = uuid.uuid4()
    automations = {a.name: a for a in script.load_automations(script.AUTOMATIONS_FILE, block_id)}
    for name, automation in automations.items():
        types = [action.type for action in automation.actions]
        if name.startswith(script.ALERT_PREFIX):
            assert types == ["send-notification"] and automation.actions[0].block_document_id == block_id
            assert "{{ event.payload.message }}" in automation.actions[0].body
        else:
            assert types == ["change-flow-run-state"]


def test_crash_automation_waits_for_three_heartbeats_of_rlhf_flows(script):
    crash = next(a for a in script.load_automations(script.AUTOMATIONS_FILE) if a.name.startswith("rlhf-crash"))
    trigger = crash.trigger
    assert trigger.posture.value == "Proactive" and trigger.after == {"prefect.flow-run.heartbeat"}
    assert {"prefect.flow-run.heartbeat", "prefect.flow-run.Completed", "prefect.flow-run.Failed",
            "prefect.flow-run.Cancelled", "prefect.flow-run.Crashed"} <= trigger.expect
    assert trigger.for_each == {"prefect.resource.id"}
    assert trigger.within.total_seconds() >= 3 * MINIMUM_HEARTBEAT_S
    assert crash.actions[0].state.value == "CRASHED"
    # a run that rescheduled itself sends no heartbeat until a worker picks it up: that is no crash
    assert {"prefect.flow-run.AwaitingRetry", "prefect.flow-run.Preempted"} <= trigger.expect


def test_crashed_deployment_runs_of_rlhf_are_rescheduled_as_retry_would_and_out_of_restarts_is_left_alone(script):
    restart = next(a for a in script.load_automations(script.AUTOMATIONS_FILE) if a.name.startswith("rlhf-restart"))
    trigger, action = restart.trigger, restart.actions[0]
    assert trigger.posture.value == "Proactive" and trigger.after == {"prefect.flow-run.Crashed"}
    assert {"prefect.flow-run.Running", "prefect.flow-run.AwaitingRetry"} <= trigger.expect  # restarted already
    assert "prefect.flow-run.Crashed" not in trigger.expect  # the second report of the same death
    assert trigger.for_each == {"prefect.resource.id"} and trigger.within.total_seconds() == 15
    assert [spec.root for spec in trigger.match_related] == [
        {"prefect.resource.role": "flow", "prefect.resource.name": "rlhf"},  # not the stage subflows
        {"prefect.resource.role": "deployment"}]  # a run by hand has no worker to pick it up again
    assert (action.type, action.state.value, action.name, action.force) == ("change-flow-run-state", "SCHEDULED",
                                                                           "AwaitingRetry", True)
    from flows.restarts import RESTART_MARK

    assert action.message.startswith(RESTART_MARK)  # what the run counts against --max_restarts


def test_bad_file_is_one_sentence_naming_the_entry(script, tmp_path):
    bad = tmp_path / "automations.yaml"
    bad.write_text("automations:\n  - name: broken\n    trigger: {type: event}\n")
    with pytest.raises(UserError, match=r"automations\[0\] \('broken'\) is not a valid automation \(actions"):
        script.load_automations(bad)
    bad.write_text("automations:\n" + "  - {name: twice, trigger: {type: event}, actions: [{type: do-nothing}]}\n" * 2)
    with pytest.raises(UserError, match="names must be unique"):
        script.load_automations(bad)
