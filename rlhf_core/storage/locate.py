"""Finding what a run names, for the driver and the ranks alike: local paths and fsspec URLs, Hugging Face hub ids
(a cached snapshot is used without asking the hub, where OpenRLHF asks on every start), model folders and their
tokenizers, model fingerprints, the checks that refuse a folder transformers would fail on, and one sentence for a
store that does not answer. docs/design-notes.md ("Finding models, data and stores") has the rules.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import fsspec

from rlhf_core.errors import UserError

def local_path(url: str) -> str | None:
    """The filesystem path `url` names when it is local, else None."""
    protocol, path = fsspec.core.split_protocol(url)
    return path if protocol in (None, "file", "local") else None


def is_local_url(url: str) -> bool:
    return local_path(url) is not None

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


def connection_error(error: BaseException) -> BaseException | None:
    """`error`, or the error it was raised from, when that is a failure to connect to a store (by its class's
    name: botocore's, aiohttp's, httpx's, urllib3's and the OS's); None otherwise."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if type(current).__name__ in _CONNECTION_ERRORS:
            return current
        current = current.__cause__ or current.__context__
    return None


def store_unreachable(error: BaseException, flag: str, url: str, storage_options: dict | None = None
                      ) -> UserError | None:
    """A UserError naming `flag`, `url` and the endpoint when `error` (or its cause) is a failure to
    connect to the store; None for any other error."""
    current = connection_error(error)
    if current is None:
        return None
    return UserError(f"{flag}: cannot reach the store of {url} at {_endpoint(current, storage_options)} "
                     f"({type(current).__name__}); check the endpoint (--storage_options endpoint_url or "
                     "AWS_ENDPOINT_URL) and the network.")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model", "sentencepiece.bpe.model")
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth")


def local_model_dir(url: str, storage_options: dict | None = None, *, flag: str = "--pretrain") -> str:
    """A local folder holding the model at `url` (a folder, a hub id, or a remote URL fetched once into a
    cache); errors name `flag`, the option the user gave `url` with."""
    path = local_path(url)
    if path is not None:
        if Path(path).is_dir():
            return str(Path(path).resolve())
        if Path(path).exists():
            raise UserError(f"{flag}: {url} is a file, not a model folder.")
        if is_hub_id(url):  # (a file:// URL never is one)
            return hub_model_dir(url, flag)
        raise UserError(f"{flag}: {url} is not a model folder (no such folder).")
    with reaching_store(flag, url, storage_options):
        return _fetch_remote(url, storage_options, flag)


def _fetch_remote(url: str, storage_options: dict | None, flag: str) -> str:
    """Copy the remote folder once into a local cache; the copy lands under a temporary name and is
    renamed, so an interrupted download is never taken for a model."""
    key = url + json.dumps(storage_options or {}, sort_keys=True, default=str)
    cache = Path(tempfile.gettempdir()) / "rlhf-model-cache" / hashlib.sha256(key.encode()).hexdigest()[:16]
    if cache.is_dir():
        return str(cache)
    filesystem, remote_path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    if not filesystem.exists(remote_path):
        raise UserError(f"{flag}: {url} does not exist.")
    cache.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=cache.name + ".partial-", dir=cache.parent))
    try:
        filesystem.get(remote_path.rstrip("/") + "/", str(partial), recursive=True)
        os.replace(partial, cache)
    except OSError:
        if not cache.is_dir():  # another process finished first; any other failure is re-raised
            raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return str(cache)


SOURCE_NAME = "rlhf_source.json"  # written by export: the checkpoint a stage's output came from


def model_fingerprint(url: str, storage_options: dict | None = None, *, flag: str = "--pretrain") -> str:
    """Identity of the model at `url`, cheap enough to take at every commit: the manifest digest of the
    checkpoint it was exported from (our own stage outputs), a hub id's revision, else its file names
    and sizes; "" when there is nothing there."""
    path = local_path(url)
    if path is not None and not os.path.exists(path) and is_hub_id(url):
        snapshot = hub_snapshot(url, download=False)
        return f"hub:{url}@{os.path.basename(snapshot)}" if snapshot else ""
    try:
        filesystem, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
        try:
            source = json.loads(filesystem.cat_file(f"{path.rstrip('/')}/{SOURCE_NAME}"))
            return f"checkpoint:{source['manifest_digest']}"
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            pass
        listing = sorted((entry["name"].rsplit("/", 1)[-1], entry.get("size"))
                         for entry in filesystem.ls(path, detail=True) if entry.get("type") == "file")
    except (FileNotFoundError, NotADirectoryError):  # nothing (or a file) there: the folder check names it
        return ""
    except Exception as error:  # noqa: BLE001 - a store's own error types; re-raised unless understood
        unreachable = store_unreachable(error, flag, url, storage_options)
        if unreachable is not None:
            raise unreachable from None
        raise
    return "files:" + hashlib.sha256(repr(listing).encode()).hexdigest()


def input_model_fingerprints(cfg, storage_options: dict | None = None) -> dict[str, str]:
    """`model_fingerprint` of each model a stage starts from: its fields with the role "model"."""
    from rlhf_core.stages.base import fields_with_role

    return {name: model_fingerprint(getattr(cfg, name), storage_options, flag=f"--{name}")
            for name in fields_with_role(type(cfg), "model") if getattr(cfg, name, None)}


def is_lora_dir(directory: str) -> bool:
    return os.path.exists(os.path.join(directory, "adapter_config.json"))


def _read_json(path: str, flag: str) -> dict:
    try:
        with open(path, encoding="utf-8") as handle:
            value = json.load(handle)
    except json.JSONDecodeError as error:
        raise UserError(f"{flag}: {path} is not valid JSON (line {error.lineno}: {error.msg}).") from None
    except UnicodeDecodeError as error:
        raise UserError(f"{flag}: {path} is not UTF-8 text (byte offset {error.start}).") from None
    if not isinstance(value, dict):
        raise UserError(f"{flag}: {path} must hold a JSON object, not {type(value).__name__}.")
    return value


def lora_base_dir(directory: str, storage_options: dict | None = None, *, flag: str = "--pretrain") -> str:
    """The local folder of the base model an adapter folder names (base_model_name_or_path)."""
    config_path = os.path.join(directory, "adapter_config.json")
    base = _read_json(config_path, flag).get("base_model_name_or_path")
    if not base:
        raise UserError(f"{flag}: {config_path} names no base_model_name_or_path.")
    return local_model_dir(base, storage_options, flag=f"{flag} (base_model_name_or_path in {config_path})")


def check_model_dir(directory: str, url: str, flag: str) -> None:
    """Refuse a folder transformers would fail on, naming the file: config.json missing, not JSON, or of
    an unknown model_type; no weights; truncated or corrupt safetensors (a header check, no loading). Neither
    torch nor transformers is imported unless the model type is not found in transformers' generated table."""
    config_path = os.path.join(directory, "config.json")
    if is_lora_dir(directory):  # its own file first: a broken adapter_config.json explains what follows
        _read_json(os.path.join(directory, "adapter_config.json"), flag)
    elif not os.path.exists(config_path):
        raise UserError(f"{flag}: {url} has no config.json (nor adapter_config.json); it is not a Hugging Face "
                        "model folder.")
    elif not known_model_type(model_type := _read_json(config_path, flag).get("model_type")):
        from transformers import __version__ as transformers_version

        raise UserError(f"{flag}: {config_path} has model_type {model_type!r}, an architecture transformers "
                        f"{transformers_version} does not know; fix the file or install a transformers that "
                        "knows it (models with custom code are not supported).")
    weights = sorted(path for pattern in WEIGHT_PATTERNS for path in glob.glob(os.path.join(directory, pattern)))
    if not weights:
        raise UserError(f"{flag}: {url} has no weights (model.safetensors or pytorch_model.bin).")
    for index_path in glob.glob(os.path.join(directory, "*.index.json")):
        for shard in sorted(set(_read_json(index_path, flag).get("weight_map", {}).values())):
            if not os.path.exists(os.path.join(directory, shard)):
                raise UserError(f"{flag}: {index_path} lists the weight file {shard}, which is missing.")
    for path in weights:
        if path.endswith(".safetensors"):
            _check_safetensors(path, flag)


def known_model_type(model_type) -> bool:
    """Whether transformers knows `model_type` (its CONFIG_MAPPING_NAMES): found as a key in the source of the
    table transformers generates, read as text (importing its auto classes imports torch, ~1 CPU-s), else asked
    of transformers itself, so only a refusal pays for the import."""
    import importlib.util

    spec = importlib.util.find_spec("transformers")  # finds the package without importing it
    table = os.path.join(os.path.dirname(spec.origin or ""), "models", "auto", "auto_mappings.py") if spec else ""
    if isinstance(model_type, str) and os.path.exists(table):
        with open(table, encoding="utf-8") as handle:
            if f'("{model_type}", "' in handle.read():
                return True
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return model_type in CONFIG_MAPPING_NAMES


def _check_safetensors(path: str, flag: str) -> None:
    from safetensors import safe_open

    try:  # numpy: the same header and size checks as torch's, without importing torch
        with safe_open(path, framework="numpy"):
            pass
    except Exception as error:  # noqa: BLE001 - SafetensorError and OSError alike mean a bad file
        raise UserError(f"{flag}: {path} is truncated or corrupt ({error}); copy the weights again.") from None


def load_tokenizer(url: str, storage_options: dict | None = None, *, flag: str = "--pretrain"):
    """The tokenizer of the model at `url` (an adapter folder without one uses its base's)."""
    from transformers import AutoTokenizer

    directory = local_model_dir(url, storage_options, flag=flag)
    if not _has_tokenizer(directory) and is_lora_dir(directory):
        directory = lora_base_dir(directory, storage_options, flag=flag)
    if not _has_tokenizer(directory):
        raise UserError(f"{flag}: {url} has no tokenizer ({', '.join(TOKENIZER_FILES[:3])} ...); copy the "
                        "tokenizer files of the model there.")
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory)
    except Exception as error:  # noqa: BLE001 - transformers raises many types for a bad tokenizer
        raise UserError(f"{flag}: cannot load the tokenizer in {url} ({type(error).__name__}: {error}).") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _has_tokenizer(directory: str) -> bool:
    return any(os.path.exists(os.path.join(directory, name)) for name in TOKENIZER_FILES)
