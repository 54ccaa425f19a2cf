"""Prepared data: a dataset read, checked and tokenized once, stored as an Arrow file in the run's store under
`{ckpt_path}/.prepared/{key}/`, the key a hash of everything the tokens depend on (the data's cheap version, the
tokenizer and its chat template, the stage's data flags, the format version). Published atomically (a folder
renamed into place, `PREPARED.json` with the file's size and checksum last), verified at every open, rebuilt when
damaged; ranks and restarts memory-map it (`rlhf_core.data.columns`). docs/design-notes.md ("Prepared data") has the design.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import shutil
import socket
import time
from typing import Any, Callable

import fsspec

from rlhf_core.data.fingerprints import HashLookup, file_version, fingerprint
from rlhf_core.data.records import split_data_dir
from rlhf_core.processes import process_exists
from rlhf_core.storage.locate import is_hub_id, is_local_url, local_path
from rlhf_core.storage.manifest import DEFAULT_CHECKSUM, digest_of_local_file

FORMAT_VERSION = 1  # of the samples' layout and of what the key holds: a change builds every preparation anew
PREPARED_DIR = ".prepared"
MARKER_NAME = "PREPARED.json"
STAGING = ".tmp-"  # a preparation's folder while it is written: .tmp-{key}-{tag}-{pid}@{host}
DATA_NAME = "samples.arrow"
HASHES_DIR = "hashes"  # {version hash}.json: a data file's sha256 by its version, for the drift check
CACHE_ENV_VAR = "RLHF_PREPARED_CACHE"  # the local cache in front of a remote store (default ~/.cache/rlhf/prepared)

logger = logging.getLogger(__name__)



def tokenizer_identity(tokenizer) -> str:
    """A hash of what the tokenizer turns text into: its vocabulary, rules and special tokens, and its chat
    template (which a stage's --tokenizer_chat_template may have replaced)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:  # less the truncation and padding a call leaves set on it
        state = {k: v for k, v in json.loads(backend.to_str()).items() if k not in ("truncation", "padding")}
        rules = json.dumps(state, sort_keys=True)
    else:
        rules = json.dumps(sorted(tokenizer.get_vocab().items()))
    extra = json.dumps({"class": type(tokenizer).__name__, "special": tokenizer.special_tokens_map,
                        "chat_template": getattr(tokenizer, "chat_template", None)}, sort_keys=True, default=str)
    return hashlib.sha256((rules + "\n" + extra).encode()).hexdigest()


def source_versions(url: str, storage_options: dict | None, split: str, flag: str) -> list:
    """The cheap identity of each source of `url`: (url, size, mtime or ETag) of a file, of every file of a
    folder; a hub name's own version is datasets' fingerprint of the split. A file is hashed only on a store that
    tells neither mtime nor ETag."""
    versions: list = []
    for source in (part.strip() for part in url.split(",") if part.strip()):
        name, data_dir = split_data_dir(source, flag)
        if data_dir is not None and os.path.isdir(name):
            source = os.path.join(name, data_dir)
        path = local_path(name)
        if (data_dir is not None and not os.path.isdir(name)) or (path is not None and not os.path.exists(path)
                                                                  and is_hub_id(name)):
            versions.append(["hub", source, split, fingerprint(source, storage_options, split=split, flag=flag)])
            continue
        try:
            filesystem, fs_path = fsspec.core.url_to_fs(source, **(storage_options or {}))
            if filesystem.isdir(fs_path):
                found = filesystem.find(fs_path, detail=True)
                versions.append(["dir", source, sorted([name, info.get("size"), str(info.get("mtime") or
                                                                                   info.get("ETag"))]
                                                       for name, info in found.items())])
                continue
        except Exception:  # noqa: BLE001 - read_records names the problem when it reads the source
            pass
        version = file_version(source, storage_options, flag)
        if version is None:  # a store that tells no version: the content is the only identity
            versions.append(["hashed", source, fingerprint(source, storage_options, split=split, flag=flag)])
        else:
            versions.append(["file", *version])
    return versions


def preparation_key(kind: str, versions: list, tokenizer_id: str, settings: dict[str, Any]) -> tuple[str, dict]:
    """(key, what it hashes): the folder name of a preparation and the inputs it depends on; `tokenizer_id` is
    `tokenizer_identity`'s (or a `tokenizer_ref.LazyTokenizer`'s, which may not load it)."""
    inputs = {"format": FORMAT_VERSION, "kind": kind, "sources": versions,
              "tokenizer": tokenizer_id, "settings": settings}
    return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()[:32], inputs


def cache_root() -> str:
    return os.environ.get(CACHE_ENV_VAR) or os.path.join(os.path.expanduser("~"), ".cache", "rlhf", "prepared")


class PreparedStore:
    """The `.prepared` folder of a run's store (`ckpt_path`): find a valid preparation, or publish a new one.
    A local store is read in place; a remote one through a verified copy in the local cache."""

    def __init__(self, ckpt_path: str, storage_options: dict | None = None):
        self.url = f"{ckpt_path.rstrip('/')}/{PREPARED_DIR}"
        self.storage_options = storage_options or {}
        self.local = is_local_url(self.url)
        self.fs, self.root = fsspec.core.url_to_fs(self.url, **self.storage_options)

    def local_dir(self, key: str) -> str:
        """Where the preparation's files are read from on this machine."""
        if self.local:
            return os.path.join(local_path(self.url) or self.root, key)
        return os.path.join(cache_root(), hashlib.sha256(self.url.encode()).hexdigest()[:16], key)

    def open(self, key: str) -> tuple[str, dict] | None:
        """(local path of the data file, its marker) of a valid preparation, or None. One that fails its check (a
        marker unreadable, a size or checksum that differs) is removed, never trusted: a remote store's local copy
        is fetched once more, and removed from the store when that fails too."""
        folder = self.local_dir(key)
        for _ in range(1 if self.local else 2):
            if not self.local and not os.path.exists(folder) and not self._download(key, folder):
                return None
            found = _checked(folder)
            if found is not None:
                return found
            if os.path.exists(folder):
                logger.warning("prepared data %s is incomplete or damaged; it is prepared again", folder)
                shutil.rmtree(folder, ignore_errors=True)
        if not self.local:
            self.fs.rm(f"{self.root}/{key}", recursive=True)
        return None

    def publish(self, key: str, write: Callable[[str], dict]) -> None:
        """Build a preparation in a temporary folder (`write(data_path)` returns the marker's fields), then move it
        into place whole; when another process published the same key first, its copy is kept."""
        parent = os.path.dirname(self.local_dir(key))
        os.makedirs(parent, exist_ok=True)
        remove_stale_staging(parent)
        staging = os.path.join(parent, f"{STAGING}{key}-{_owner()}")
        os.makedirs(staging)
        try:
            data = os.path.join(staging, DATA_NAME)
            fields = write(data)
            size, digest = digest_of_local_file(data, DEFAULT_CHECKSUM)
            marker = {**fields, "size": size, "checksum": DEFAULT_CHECKSUM, "digest": digest,
                      "created": time.time()}
            _write_durable(os.path.join(staging, MARKER_NAME), json.dumps(marker, indent=1).encode())
            _fsync_path(data)
            self._install(key, staging)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def _install(self, key: str, staging: str) -> None:
        target = self.local_dir(key)
        if os.path.exists(target) and _read_marker(target) is None:
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.rename(staging, target)
        except OSError:  # published by another process meanwhile: theirs is the same data
            return
        _fsync_path(os.path.dirname(target))
        if not self.local:
            self._upload(key, target)

    def save_hash(self, version: list, digest: str) -> None:
        """Record a file's sha256 by its version (url, size, mtime or ETag) in `hashes/`, for the drift check of a
        later process that has not opened the preparation yet (`recorded_hashes`)."""
        path, data = f"{self.root}/{HASHES_DIR}/{_hash_name(version)}", json.dumps({"sha256": digest}).encode()
        if self.local:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            staging = f"{path}.tmp-{secrets.token_hex(4)}"
            _write_durable(staging, data)
            os.replace(staging, path)
        else:
            self.fs.pipe_file(path, data)

    def load_hash(self, version: list) -> str | None:
        try:
            with self.fs.open(f"{self.root}/{HASHES_DIR}/{_hash_name(version)}", "rb") as handle:
                digest = json.loads(handle.read()).get("sha256")
        except (OSError, ValueError, AttributeError):
            return None
        return digest if isinstance(digest, str) and len(digest) == 64 else None

    def _upload(self, key: str, folder: str) -> None:
        remote = f"{self.root}/{key}"
        self.fs.put_file(os.path.join(folder, DATA_NAME), f"{remote}/{DATA_NAME}")
        self.fs.put_file(os.path.join(folder, MARKER_NAME), f"{remote}/{MARKER_NAME}")  # last: the commit

    def _download(self, key: str, folder: str) -> bool:
        remote = f"{self.root}/{key}"
        if not self.fs.exists(f"{remote}/{MARKER_NAME}"):
            return False
        remove_stale_staging(os.path.dirname(folder))
        staging = os.path.join(os.path.dirname(folder), f"{STAGING}{key}-{_owner()}")
        os.makedirs(staging)
        try:
            for name in (MARKER_NAME, DATA_NAME):
                self.fs.get_file(f"{remote}/{name}", os.path.join(staging, name))
            os.makedirs(os.path.dirname(folder), exist_ok=True)
            os.rename(staging, folder)
        except OSError:
            pass
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return os.path.exists(folder)


def _owner() -> str:
    """The part of a staging folder's name that says whose it is: a random tag, this process's pid and host."""
    return f"{secrets.token_hex(4)}-{os.getpid()}@{socket.gethostname()}"


def remove_stale_staging(parent: str) -> list[str]:
    """Remove the staging folders in `parent` of processes of this host that are gone (a preparation or a
    download killed midway); another host's, on a shared filesystem, are left to that host."""
    removed = []
    for name in os.listdir(parent) if os.path.isdir(parent) else []:
        head, _, host = name.rpartition("@")
        pid = head.rpartition("-")[2]
        if name.startswith(STAGING) and host == socket.gethostname() and pid.isdigit() \
                and not process_exists(int(pid)):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
            removed.append(name)
    return removed


def _hash_name(version: list) -> str:
    return hashlib.sha256(json.dumps(list(version), default=str).encode()).hexdigest()[:32] + ".json"


def recorded_hashes(ckpt_path: str, storage_options: dict | None) -> HashLookup:
    """The sha256 recorded at preparation of a file at a version (`PreparedStore.save_hash`), for the drift
    fingerprint (`fingerprints.dataset_fingerprint`): a restart and every commit find it by the file's version and do
    not read the file again."""
    store: list[PreparedStore] = []  # made on the first lookup: a run without data files never opens the store

    def lookup(version: tuple) -> str | None:
        if not store:
            store.append(PreparedStore(ckpt_path, storage_options))
        return store[0].load_hash(list(version))
    return lookup


def _checked(folder: str) -> tuple[str, dict] | None:
    """(data file, marker) of a folder whose data matches its marker's size and checksum, else None."""
    marker = _read_marker(folder)
    if marker is None:
        return None
    data = os.path.join(folder, DATA_NAME)
    if not os.path.exists(data):
        return None
    size, digest = digest_of_local_file(data, marker["checksum"], marker["size"])
    return (data, marker) if size == marker["size"] and digest == marker["digest"] else None


def _read_marker(folder: str) -> dict | None:
    try:
        with open(os.path.join(folder, MARKER_NAME), "rb") as handle:
            marker = json.loads(handle.read())
    except (OSError, ValueError):
        return None
    required = {"size": int, "digest": str, "checksum": str, "rows": int}
    if not isinstance(marker, dict) or not all(isinstance(marker.get(k), t) for k, t in required.items()):
        return None
    return marker


def _write_durable(path: str, data: bytes) -> None:
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
