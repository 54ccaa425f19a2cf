"""Names that are not paths: Hugging Face hub ids (models and datasets) and unreachable object stores.

A model or dataset argument that is not an existing local path, has no fsspec protocol and reads like
`org/name` or `name` is a hub id. Hub models resolve through `huggingface_hub.snapshot_download`: a
snapshot already in the local cache is used without asking the hub for a newer revision (a resumed run
must see the weights it started with; `hf download` refreshes it), else it is downloaded unless
HF_HUB_OFFLINE=1. Departure from OpenRLHF, which lets transformers ask the hub on every start.

`store_unreachable` turns the connection errors of botocore, aiohttp and requests (an S3 endpoint that
does not answer) into one sentence naming the flag, the URL and the endpoint.
"""

from __future__ import annotations

import contextlib

import os
import re

from rlhf_core.errors import UserError

DATA_FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".arrow", ".txt")

# huggingface_hub's own rule for repo ids (letters, digits, '-', '_', '.'; at most one '/'), written out
# so that this check needs no import: it runs for every path.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}(/[A-Za-z0-9][\w.-]{0,95})?")

_CONNECTION_ERRORS = ("EndpointConnectionError", "ConnectTimeoutError", "ConnectionClosedError", "ReadTimeoutError",
                      "ClientConnectorError", "ServerDisconnectedError", "ConnectError", "ConnectTimeout",
                      "NewConnectionError", "MaxRetryError", "ConnectionRefusedError", "gaierror")


def is_hub_id(name: str) -> bool:
    """True for `org/name` or `name` that is not a local path, has no protocol and is not a data file name."""
    if "://" in name or "::" in name or os.path.exists(name) or name.lower().endswith(DATA_FILE_SUFFIXES):
        return False
    return bool(_HUB_ID.fullmatch(name)) and ".." not in name and not name.endswith(".")


def hf_cache_setting() -> str:
    """Where the local Hugging Face cache is, as huggingface_hub reads it, for messages: `HF_HOME=...`."""
    from huggingface_hub import constants

    if os.environ.get("HF_HUB_CACHE"):
        return f"HF_HUB_CACHE={constants.HF_HUB_CACHE}"
    return f"HF_HOME={constants.HF_HOME}"


def hub_offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def not_cached(flag: str, name: str, kind: str) -> UserError:
    reach = "HF_HUB_OFFLINE=1 is set" if hub_offline() else "the hub is unreachable from here"
    return UserError(f"{flag}: {name} is not a local path, and the {kind} {name!r} is not in the local Hugging Face "
                     f"cache ({hf_cache_setting()}) while {reach}; download it there first (hf download {name}"
                     f"{' --repo-type dataset' if kind == 'dataset' else ''}) or give a local path.")


def hub_snapshot(repo_id: str, repo_type: str = "model", download: bool = True) -> str | None:
    """The local snapshot folder of `repo_id`: the cached one, else a download (unless offline or not
    `download`); None when neither works."""
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id, repo_type=repo_type, local_files_only=True)
    except (FileNotFoundError, OSError, ValueError):  # LocalEntryNotFoundError, HFValidationError
        pass
    if not download or hub_offline():
        return None
    try:
        return snapshot_download(repo_id, repo_type=repo_type)
    except Exception:  # noqa: BLE001 - any failure to reach or read the hub means "not available here"
        return None


def hub_model_dir(repo_id: str, flag: str) -> str:
    directory = hub_snapshot(repo_id)
    if directory is None:
        raise not_cached(flag, repo_id, "model")
    return directory


def _endpoint(error: BaseException, storage_options: dict | None) -> str:
    options = storage_options or {}
    endpoint = options.get("endpoint_url") or (options.get("client_kwargs") or {}).get("endpoint_url")
    found = re.search(r"https?://[^\s\"'/?]+", str(error))  # scheme and host of the request, not its path
    named = found.group(0).rstrip(".") if found else None
    return endpoint or named or os.environ.get("AWS_ENDPOINT_URL") or "the default endpoint"


@contextlib.contextmanager
def reaching_store(flag: str, url: str, storage_options: dict | None = None):
    """Inside it, a failure to connect to the store at `url` becomes one UserError naming `flag`, `url` and
    the endpoint (`store_unreachable`); anything else passes unchanged."""
    try:
        yield
    except UserError:
        raise
    except Exception as error:  # noqa: BLE001 - a store's own error types; re-raised unless understood
        unreachable = store_unreachable(error, flag, url, storage_options)
        if unreachable is not None:
            raise unreachable from None
        raise


def store_unreachable(error: BaseException, flag: str, url: str, storage_options: dict | None = None
                      ) -> UserError | None:
    """A UserError naming `flag`, `url` and the endpoint when `error` (or its cause) is a failure to
    connect to the store; None for any other error."""
    seen, current = set(), error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if type(current).__name__ in _CONNECTION_ERRORS:
            return UserError(f"{flag}: cannot reach the store of {url} at {_endpoint(current, storage_options)} "
                             f"({type(current).__name__}); check the endpoint (--storage_options endpoint_url or "
                             "AWS_ENDPOINT_URL) and the network.")
        current = current.__cause__ or current.__context__
    return None
