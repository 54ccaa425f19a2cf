"""The identity of a stage's data, recorded in every checkpoint's metadata for the drift check: the sha256 of a file
(found by its version, size and mtime or ETag, when its preparation recorded it, else hashed once per process and
version), datasets' own fingerprint of a hub dataset, and a hash of the parts of a folder or mixture."""

from __future__ import annotations

import functools
import hashlib
import json
import os
from typing import Callable

import fsspec

from rlhf_core.data.records import as_user_error, hub_dataset, open_data, split_data_dir
from rlhf_core.stages.base import StageSettings
from rlhf_core.storage.locate import is_hub_id, is_local_url, local_path, store_unreachable

# A file's sha256 by its version (url, size, mtime or ETag), recorded when its data was prepared
# (rlhf_core.data.prepared.recorded_hashes); None when none was.
HashLookup = Callable[[tuple], "str | None"]


def dataset_fingerprint(cfg: StageSettings, storage_options: dict | None = None,
                        known_hash: HashLookup | None = None) -> str:
    """Fingerprint of a stage's data (its `data_source`: the data and its split), or "" if it has none;
    `known_hash` saves reading a file whose hash was recorded at its version."""
    source = cfg.data_source()
    if source is None or not source.url:
        return ""
    return fingerprint(source.url, storage_options, split=source.split, flag=source.flag, known_hash=known_hash)


def file_version(url: str, storage_options: dict | None, flag: str) -> tuple | None:
    """(url, size, modification stamp or ETag) of a file, or None when the store tells neither."""
    try:
        filesystem, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
        info = filesystem.info(path)
    except Exception as error:  # noqa: BLE001 - a store's own error types: unknown version, unless unreachable
        unreachable = store_unreachable(error, flag, url, storage_options)
        if unreachable is not None:
            raise unreachable from None
        return None
    stamp = info.get("mtime") or info.get("ETag") or info.get("LastModified")
    return (url, info.get("size"), str(stamp)) if stamp is not None else None


def fingerprint(url: str, storage_options: dict | None = None, *, split: str = "train",
                flag: str = "--dataset", known_hash: HashLookup | None = None) -> str:
    """Identity of the data at `url`, recorded in each checkpoint's metadata: the sha256 of a file (of
    every file of a folder), datasets' own fingerprint of a hub dataset's split, and a hash of the parts'
    fingerprints for a comma-separated mixture. Files are hashed once per process and version (size and
    mtime or ETag; `_hash_file_version`): every commit asks, and a dataset can be large."""
    sources = [part.strip() for part in url.split(",") if part.strip()]
    if len(sources) > 1:
        parts = "\n".join(fingerprint(source, storage_options, split=split, flag=flag, known_hash=known_hash)
                          for source in sources)
        return hashlib.sha256(parts.encode()).hexdigest()
    name, data_dir = split_data_dir(url, flag)
    if data_dir is not None and os.path.isdir(name):
        return fingerprint(os.path.join(name, data_dir), storage_options, split=split, flag=flag,
                           known_hash=known_hash)
    protocol, _ = fsspec.core.split_protocol(name)
    path = local_path(name)
    if path is not None and not os.path.exists(path) and is_hub_id(name):
        return _hub_fingerprint(name, split, flag, data_dir)
    try:
        filesystem, fs_path = fsspec.core.url_to_fs(url, **(storage_options or {}))
        if filesystem.isdir(fs_path):
            names = sorted(filesystem.find(fs_path))
            protocol_prefix = "" if is_local_url(name) else f"{protocol}://"
            parts = "\n".join(f"{name[len(fs_path):]}:"
                               f"{_file_fingerprint(protocol_prefix + name, storage_options, flag, known_hash)}"
                               for name in names)
            return hashlib.sha256(parts.encode()).hexdigest()
    except Exception as error:  # noqa: BLE001 - a store's own error types; re-raised unless understood
        raise as_user_error(error, url, flag, storage_options) from None
    return _file_fingerprint(url, storage_options, flag, known_hash)


@functools.lru_cache(maxsize=64)
def _hub_fingerprint(name: str, split: str, flag: str, data_dir: str | None) -> str:
    return "hub:" + hub_dataset(name, split, flag, data_dir)._fingerprint


def _file_fingerprint(url: str, storage_options: dict | None, flag: str, known_hash: HashLookup | None) -> str:
    version = file_version(url, storage_options, flag)
    if version is None:  # the store tells no version: hash it every time
        return _hash_file(url, storage_options, flag)
    known = known_hash(version) if known_hash is not None else None
    if known is not None:
        return known
    return _hash_file_version(url, _HashableOptions(storage_options or {}), flag, version)


class _HashableOptions(dict):
    """Storage options as a memo's key (hashed by their JSON text), handed on to fsspec as they are."""

    def __hash__(self) -> int:  # type: ignore[override]  # dict is unhashable; these are never mutated
        return hash(json.dumps(self, sort_keys=True, default=repr))


@functools.lru_cache(maxsize=256)
def _hash_file_version(url: str, storage_options: _HashableOptions, flag: str, version: tuple) -> str:
    """A memo of `_hash_file` for one version of the file (size and mtime or ETag): each version of a large
    dataset is read once per process."""
    return _hash_file(url, storage_options, flag)


def _hash_file(url: str, storage_options: dict | None, flag: str) -> str:
    digest = hashlib.sha256()
    with open_data(url, storage_options, flag=flag) as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
