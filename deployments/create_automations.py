"""Create or update the pipeline's Prefect automations (deployments/automations.yaml) on a Prefect server.

    .venv/bin/python deployments/create_automations.py [--api-url URL] [--notify-block TYPE/NAME] [--file PATH]

Idempotent: an automation is matched by name; an existing one is updated in place (its id, and so its
history in the UI, stays), a missing one is created, and duplicates of a name (e.g. from two
`prefect automation create -f` calls) are reduced to one. Automations on the server that the file does
not name are left alone.

Why a script and not `prefect automation create -f`: that command adds a new copy at every call, and
the alerts' notification needs a block document id, which only exists on the user's server.
`--notify-block slack-webhook/rlhf-alerts` (block type slug / block name, as in `prefect block ls`)
replaces the alerts' `do-nothing` action with a notification through that block, using the file's
`alert_notification` subject and body. Without it nothing needs network access beyond the server.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any
from uuid import UUID

import yaml

from rlhf_core.errors import UserError

AUTOMATIONS_FILE = Path(__file__).resolve().parent / "automations.yaml"
ALERT_PREFIX = "rlhf-alert-"


def load_automations(path: Path, notify_block_id: UUID | None = None) -> list[Any]:
    """The file's automations as validated `AutomationCore` models; the alerts notify through
    `notify_block_id` when given. Raises UserError naming the file and the problem."""
    from prefect.events.schemas.automations import AutomationCore
    from pydantic import ValidationError

    try:
        spec = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as error:
        raise UserError(f"{path}: cannot read it as YAML ({error})") from error
    if not isinstance(spec, dict) or not isinstance(spec.get("automations"), list):
        raise UserError(f"{path}: expected a mapping with an `automations:` list")
    automations = []
    for index, entry in enumerate(spec["automations"]):
        if notify_block_id is not None and str(entry.get("name", "")).startswith(ALERT_PREFIX):
            entry = {**entry, "actions": [_notification(spec, notify_block_id)]}
        try:
            automations.append(AutomationCore.model_validate(entry))
        except ValidationError as error:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'entry'}: {e['msg']}" for e in error.errors())
            raise UserError(f"{path}: automations[{index}] ({entry.get('name')!r}) is not a valid automation "
                            f"({problems})") from None
    names = [automation.name for automation in automations]
    if len(set(names)) != len(names):
        raise UserError(f"{path}: automation names must be unique (they are how updates find them): {names}")
    return automations


def _notification(spec: dict, block_id: UUID) -> dict:
    template = spec.get("alert_notification") or {}
    return {"type": "send-notification", "block_document_id": str(block_id),
            "subject": template.get("subject", "RLHF alert {{ event.event }}"),
            "body": template.get("body", "{{ event.payload.message }}")}


def resolve_block(client, slug: str) -> UUID:
    """The id of block document `TYPE/NAME` (as `prefect block ls` shows it); UserError when missing."""
    from prefect.exceptions import ObjectNotFound

    block_type, _, block_name = slug.partition("/")
    if not block_type or not block_name:
        raise UserError(f"--notify-block {slug!r}: expected BLOCK_TYPE/BLOCK_NAME, e.g. slack-webhook/rlhf-alerts")
    try:
        return client.read_block_document_by_name(block_name, block_type).id
    except ObjectNotFound:
        raise UserError(f"--notify-block {slug!r}: no such block on the server; create it first "
                         f"(UI: Blocks -> +, or `prefect block ls` to see the existing ones)") from None


def apply_automations(client, automations: list[Any]) -> list[tuple[str, str, UUID]]:
    """Create or update each automation by name; returns (name, 'created'|'updated', id) per automation."""
    done = []
    for automation in automations:
        existing = client.read_automations_by_name(automation.name)
        if existing:
            keep, *extra = existing
            client.update_automation(keep.id, automation)
            for duplicate in extra:
                client.delete_automation(duplicate.id)
            done.append((automation.name, "updated", keep.id))
        else:
            done.append((automation.name, "created", client.create_automation(automation)))
    return done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--api-url", help="Prefect API URL, e.g. http://127.0.0.1:4200/api "
                                          "(default: PREFECT_API_URL or the active profile)")
    parser.add_argument("--notify-block", metavar="TYPE/NAME",
                        help="send the alerts through this notification block instead of doing nothing")
    parser.add_argument("--file", type=Path, default=AUTOMATIONS_FILE, help="automations file (default: %(default)s)")
    args = parser.parse_args(argv)

    import httpx
    from prefect.client.orchestration import SyncPrefectClient, get_client

    try:
        with (SyncPrefectClient(args.api_url) if args.api_url else get_client(sync_client=True)) as client:
            block_id = resolve_block(client, args.notify_block) if args.notify_block else None
            automations = load_automations(args.file, block_id)
            for name, what, automation_id in apply_automations(client, automations):
                print(f"{what} automation {name} ({automation_id})")
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except httpx.HTTPError as error:
        print(f"error: the Prefect API call failed ({error}); is the server up (`prefect server start`) and "
              f"--api-url / PREFECT_API_URL pointing at it (ending in /api)?", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
