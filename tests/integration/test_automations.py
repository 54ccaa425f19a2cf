"""The automations of deployments/ on a real server: created by the one command, and the alerts notify.

deployments/create_automations.py (after two `prefect automation create -f` calls that leave duplicates) leaves
exactly one automation per name, and with `--notify-block` each `rlhf.alert.*` event reaches a webhook on loopback
through a notification block, with the run, stage and step in its subject. No Ray, a few seconds.

The automations that restart a run are exercised by the chaos soak: tests/integration/test_soak.py (a SIGKILLed
flow-run process, restarted with no call from the test) and `make soak` (a power cut: the worker and the flow run
die together, and the heartbeat automation notices).
"""

from __future__ import annotations

import asyncio
import http.server
import json
import subprocess
import sys
import threading
import time
from typing import ClassVar

import yaml

from tests.integration.conftest import PROJECT_DIR

AUTOMATIONS_FILE = PROJECT_DIR / "deployments" / "automations.yaml"
CREATE_AUTOMATIONS = PROJECT_DIR / "deployments" / "create_automations.py"


def create_automations(prefect_server) -> dict[str, str]:
    """Run the one command; returns {name: id} as the server lists them."""
    from prefect.client.orchestration import SyncPrefectClient

    result = subprocess.run([sys.executable, str(CREATE_AUTOMATIONS), "--api-url", prefect_server.api_url],
                            env=prefect_server.env, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    with SyncPrefectClient(prefect_server.api_url) as client:
        return {automation.name: str(automation.id) for automation in client.read_automations()}


def wait_until(what: str, condition, timeout: float, interval: float = 1.0, context=lambda: ""):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f} s\n{context()}"
        time.sleep(interval)
    return value


ALERT_EVENTS = ("rlhf.alert.reward-stagnant", "rlhf.alert.checkpoint-size", "rlhf.alert.non-finite")


class _Webhook(http.server.BaseHTTPRequestHandler):
    received: ClassVar[list[dict]] = []

    def do_POST(self):
        _Webhook.received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


def emit_alert(api_url: str, name: str, step: int) -> None:
    """What flows/pipeline.py emits for an alert: resource rlhf.run.{run}.{stage}, the alert as payload."""
    from prefect.events import Event
    from prefect.events.clients import PrefectEventsClient

    alert = {"name": name, "run_name": "alerts-demo", "stage": "sft", "step": step, "message": f"{name} fired",
             "details": {}, "time": time.time()}

    async def send():
        async with PrefectEventsClient(api_url) as events:
            await events.emit(Event(event=name, resource={"prefect.resource.id": "rlhf.run.alerts-demo.sft"},
                                    payload=alert))

    asyncio.run(send())


def test_alert_events_fire_their_automations(prefect_server):
    from prefect.blocks.notifications import CustomWebhookNotificationBlock
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.settings import PREFECT_API_URL, temporary_settings

    for _ in range(2):  # Prefect's own command adds copies; ours must reduce them to one per name
        prefect_server.cli("automation", "create", "--from-file", str(AUTOMATIONS_FILE))
    names = [a["name"] for a in yaml.safe_load(AUTOMATIONS_FILE.read_text())["automations"]]
    automations = create_automations(prefect_server)
    assert sorted(automations) == sorted(names)
    assert create_automations(prefect_server) == automations  # a second call updates them in place

    _Webhook.received = []
    webhook = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Webhook)
    threading.Thread(target=webhook.serve_forever, daemon=True).start()
    try:
        with temporary_settings({PREFECT_API_URL: prefect_server.api_url}):
            CustomWebhookNotificationBlock(
                name="rlhf-alerts", url=f"http://127.0.0.1:{webhook.server_address[1]}/hook",
                json_data={"subject": "{{subject}}", "body": "{{body}}"}).save("rlhf-test-alerts", overwrite=True)
        result = subprocess.run([sys.executable, str(CREATE_AUTOMATIONS), "--api-url", prefect_server.api_url,
                                 "--notify-block", "custom-webhook/rlhf-test-alerts"],
                                env=prefect_server.env, capture_output=True, text=True, timeout=120, check=False)
        assert result.returncode == 0, result.stdout + result.stderr
        with SyncPrefectClient(prefect_server.api_url) as client:
            assert sorted(a.name for a in client.read_automations()) == sorted(names)
        for step, name in enumerate(ALERT_EVENTS, start=1):
            emit_alert(prefect_server.api_url, name, step)
        wait_until("a notification per alert", lambda: len(_Webhook.received) >= len(ALERT_EVENTS), 120,
                   context=lambda: f"received {_Webhook.received}\n{prefect_server.process.log_tail()}")
    finally:
        webhook.shutdown()
    by_alert = {message["subject"].split(":")[0].removeprefix("RLHF alert "): message for message in _Webhook.received}
    assert sorted(by_alert) == sorted(ALERT_EVENTS), _Webhook.received
    for step, name in enumerate(ALERT_EVENTS, start=1):
        assert by_alert[name]["subject"] == f"RLHF alert {name}: run alerts-demo, stage sft, step {step}"
        assert f"{name} fired" in by_alert[name]["body"], by_alert[name]
