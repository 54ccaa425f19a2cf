"""A model's tokenizer loaded only when used (`LazyTokenizer`), for the driver's count of a stage's data. A
preparation's key holds the tokenizer's identity (`prepared.tokenizer_identity`), which takes loading it
(transformers and its tokenizer, ~4 CPU-s with torch); once loaded, that identity, the chat template and a
`tokenizer_snapshot` (its backend and special tokens, enough to encode as it does) are recorded under the
tokenizer files' cheap version (their names, sizes and mtimes, the override of the chat template, transformers' and
tokenizers' versions): in the run's store, and in this machine's cache (RLHF_TOKENIZER_CACHE, default
~/.cache/rlhf/tokenizers). A later run, or another run of the same model folder, finds its preparation, or prepares
new data, from the record and the snapshot without importing transformers; what the snapshot cannot do loads the
tokenizer. Beside the record, the files `save_pretrained` writes of the tokenizer as `load_tokenizer` gives it: the
export copies those (`saved_tokenizer_files`) instead of loading it. Both are written only once the count they
served has succeeded (`keep_records`): a refused run writes nothing.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import tempfile
from importlib import metadata
from typing import Any, Callable, Sized

from rlhf_core.data.prepared import PreparedStore, tokenizer_identity
from rlhf_core.data.tokenizer_snapshot import ATTRIBUTES, TokenizerSnapshot, snapshot_from, take_snapshot
from rlhf_core.storage.durable import replace_durably
from rlhf_core.storage.locate import TOKENIZER_FILES, is_lora_dir, load_tokenizer, local_model_dir, lora_base_dir

RECORDS_DIR = "tokenizers"  # {cheap version}.json: {"identity": ..., "chat_template": ..., "snapshot": ...}
CACHE_ENV_VAR = "RLHF_TOKENIZER_CACHE"  # this machine's records (default ~/.cache/rlhf/tokenizers)
_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".onnx")
_UNSET = object()


def tokenizer_dir(url: str, storage_options: dict | None, flag: str) -> str:
    """The folder `load_tokenizer` reads: the model's, or an adapter's base when the adapter has no tokenizer."""
    directory = local_model_dir(url, storage_options, flag=flag)
    has_tokenizer = any(os.path.exists(os.path.join(directory, name)) for name in TOKENIZER_FILES)
    if not has_tokenizer and is_lora_dir(directory):
        return lora_base_dir(directory, storage_options, flag=flag)
    return directory


def files_version(directory: str, chat_template: Any) -> str:
    """What the tokenizer loaded from `directory` depends on, cheaply: every file but the weights (name, size,
    mtime), the chat template that replaces the folder's, and the libraries that load it."""
    files = sorted((entry.name, entry.stat().st_size, entry.stat().st_mtime_ns) for entry in os.scandir(directory)
                   if entry.is_file() and not entry.name.endswith(_WEIGHTS))
    libraries = [_version("transformers"), _version("tokenizers")]
    state = json.dumps([directory, files, libraries, None if chat_template is _UNSET else chat_template])
    return hashlib.sha256(state.encode()).hexdigest()[:32]


def machine_cache() -> str:
    return os.environ.get(CACHE_ENV_VAR) or os.path.join(os.path.expanduser("~"), ".cache", "rlhf", RECORDS_DIR)


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


class LazyTokenizer:
    """Stands for `load_tokenizer(url)` and loads it at the first use that needs it. Its identity (the key's),
    chat template and snapshot come from the record in `store` or this machine's cache when there is one; what the
    snapshot answers (`tokenizer_snapshot.ATTRIBUTES`, plain calls) is answered from it until the tokenizer is
    loaded. `chat_template` set before loading replaces the folder's, as on the tokenizer. Pickled (for a
    preparation's worker), it is a proxy of the same record without a store, or the loaded tokenizer."""

    _SLOTS = ("_where", "_store", "_loaded", "_chat_template", "_record", "_unwritten", "_snapshot", "_found")

    def __init__(self, url: str, storage_options: dict | None, store: PreparedStore | None, *,
                 flag: str = "--pretrain"):
        state = {"_where": (url, storage_options, flag), "_store": store, "_loaded": None,
                 "_chat_template": _UNSET, "_record": _UNSET, "_unwritten": [], "_snapshot": _UNSET, "_found": ()}
        for name, value in state.items():
            object.__setattr__(self, name, value)

    def load(self):
        """The tokenizer itself, loaded once."""
        if self._loaded is None:
            url, storage_options, flag = self._where
            tokenizer = load_tokenizer(url, storage_options, flag=flag)
            as_in_folder = copy.copy(tokenizer)  # its own chat_template: the one of the folder, whatever is set below
            self._unwritten.append(lambda: save_tokenizer_files(as_in_folder, url, storage_options, self._store, flag))
            if self._chat_template is not _UNSET:
                tokenizer.chat_template = self._chat_template
            object.__setattr__(self, "_loaded", tokenizer)
            if self._find_record() is not None and "snapshot" not in self._record:  # an older record: add it
                self._keep_with_snapshot(self._record)
        return self._loaded

    def identity(self) -> str:
        """`tokenizer_identity` of the tokenizer: recorded, or taken from it once loaded (and recorded)."""
        record = self._find_record()
        if record is not None and self._loaded is None:
            return record["identity"]
        identity = tokenizer_identity(self.load())
        record = {"identity": identity, "chat_template": self._loaded.chat_template}
        object.__setattr__(self, "_record", record)
        object.__setattr__(self, "_found", ())
        self._keep_with_snapshot(record)
        return identity

    def _keep_with_snapshot(self, record: dict) -> None:
        """Save `record` with the loaded tokenizer's snapshot at `keep_records`: taken only for a count that
        succeeded, never in a rank (which keeps no records)."""
        tokenizer = self._loaded
        self._unwritten.append(lambda: self._save_record({**record, "snapshot": take_snapshot(tokenizer)}))

    def keep_records(self) -> None:
        """Write what loading the tokenizer found (its record, its files) into the store and this machine's cache:
        called once the count that loaded it succeeded, so that a run refused for its data leaves nothing behind.
        A record found in only one of the two is written into the other."""
        if self._record not in (_UNSET, None) and len(self._found) == 1:
            self._unwritten.append(lambda: self._save_record(self._record))
        while self._unwritten:
            self._unwritten.pop(0)()

    def _version(self) -> str:
        url, storage_options, flag = self._where
        return files_version(tokenizer_dir(url, storage_options, flag), self._chat_template)

    def _record_places(self) -> list[tuple[Any, str, bool]]:
        """(filesystem, path, whether local) of this tokenizer's record: the run's store, this machine's cache."""
        version, places = self._version(), []
        if self._store is not None:
            store = self._store
            places.append((store.fs, f"{store.root}/{RECORDS_DIR}/{version}.json", store.local))
        return [*places, (None, os.path.join(machine_cache(), f"{version}.json"), True)]

    def _find_record(self) -> dict | None:
        if self._record is _UNSET:
            found, record = [], None
            for filesystem, path, _ in self._record_places():
                try:
                    with (filesystem.open(path, "rb") if filesystem else open(path, "rb")) as handle:
                        candidate = json.loads(handle.read())
                except (OSError, ValueError):
                    continue
                if isinstance(candidate, dict) and isinstance(candidate.get("identity"), str):
                    record = record or candidate
                    found.append(path)
            object.__setattr__(self, "_record", record)
            object.__setattr__(self, "_found", tuple(found))
        return self._record

    def _save_record(self, record: dict) -> None:
        data = json.dumps(record).encode()
        for filesystem, path, local in self._record_places():
            try:
                if not local:
                    filesystem.pipe_file(path, data)
                    continue
                replace_durably(path, data)
            except OSError:  # this machine's cache is a convenience: an unwritable one is left as it is
                if filesystem is None:
                    continue
                raise
        object.__setattr__(self, "_record", record)
        object.__setattr__(self, "_found", ())

    def _light(self) -> TokenizerSnapshot | None:
        """The recorded snapshot, while the tokenizer is not loaded."""
        if self._loaded is not None:
            return None
        if self._snapshot is _UNSET:
            record = self._find_record()
            object.__setattr__(self, "_snapshot", snapshot_from(record.get("snapshot")) if record else None)
        return self._snapshot

    @property
    def chat_template(self):
        if self._loaded is not None:
            return self._loaded.chat_template
        if self._chat_template is not _UNSET:
            return self._chat_template
        record = self._find_record()
        return record.get("chat_template") if record is not None else self.load().chat_template

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "chat_template" and self._loaded is None:
            object.__setattr__(self, "_chat_template", value)
            for unset in ("_record", "_snapshot"):  # another template: another record
                object.__setattr__(self, unset, _UNSET)
        else:
            setattr(self.load(), name, value)

    def __getattr__(self, name: str) -> Any:  # what is not the proxy's own: the snapshot's, else the tokenizer's
        if name.startswith("__") or name in self._SLOTS:
            raise AttributeError(name)
        light = self._light() if name in ATTRIBUTES else None
        return getattr(light if light is not None else self.load(), name)

    def __call__(self, *args, **kwargs):
        light = self._light()
        if light is not None and light.accepts(kwargs):
            return light(*args, **kwargs)
        return self.load()(*args, **kwargs)

    def __len__(self) -> int:
        return len(self.load())

    def __reduce__(self):
        if self._light() is None:
            return _itself, (self.load(),)
        return _worker_proxy, (self._where, self._chat_template, self._record)


def _worker_proxy(where: tuple, chat_template: Any, record: dict) -> LazyTokenizer:
    url, storage_options, flag = where
    proxy = LazyTokenizer(url, storage_options, None, flag=flag)
    for name, value in (("_chat_template", chat_template), ("_record", record)):
        object.__setattr__(proxy, name, value)
    return proxy


def _itself(tokenizer):
    return tokenizer


def identity_of(tokenizer) -> str:
    """The tokenizer identity of a preparation's key, of a tokenizer or a `LazyTokenizer`."""
    return tokenizer.identity() if isinstance(tokenizer, LazyTokenizer) else tokenizer_identity(tokenizer)


def lazy_tokenizer(url: str, run, flag: str = "--pretrain") -> LazyTokenizer:
    """The tokenizer of the model at `url` for a count of `run`'s data, recorded in the run's store."""
    return LazyTokenizer(url, run.storage_options, PreparedStore(run.ckpt_path, run.storage_options), flag=flag)


def _files_dirs(store: PreparedStore | None, url: str, storage_options: dict | None, flag: str) -> list[str]:
    """Where `save_tokenizer_files` keeps its copy: a local run store, and this machine's cache."""
    name = f"{files_version(tokenizer_dir(url, storage_options, flag), _UNSET)}.files"
    in_store = [f"{store.root}/{RECORDS_DIR}/{name}"] if store is not None and store.local else []
    return [*in_store, os.path.join(machine_cache(), name)]


def save_tokenizer_files(tokenizer, url: str, storage_options: dict | None, store: PreparedStore | None,
                         flag: str = "--pretrain") -> None:
    """Keep `tokenizer.save_pretrained`'s files in a local store and this machine's cache, unless there already
    (a remote store keeps none). `tokenizer` must be `load_tokenizer(url)`'s, unchanged."""
    for target in _files_dirs(store, url, storage_options, flag):
        if os.path.isdir(target):
            continue
        try:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            staging = tempfile.mkdtemp(prefix=".tmp-tokenizer-", dir=os.path.dirname(target))
        except OSError:  # an unwritable cache
            continue
        try:
            tokenizer.save_pretrained(staging)
            os.rename(staging, target)  # whole or absent; another process's copy, first, is the same files
        except OSError:
            pass
        finally:
            shutil.rmtree(staging, ignore_errors=True)


def saved_tokenizer_files(url: str, storage_options: dict | None, store: PreparedStore,
                          flag: str = "--pretrain") -> str | None:
    """The local folder of `save_tokenizer_files`' copy for the tokenizer at `url` as it is now, or None."""
    return next((target for target in _files_dirs(store, url, storage_options, flag) if os.path.isdir(target)), None)


def count_with_eval(run, cfg, load: Callable[[Any, Any, bool], Sized]) -> int:
    """Usable training items of a stage whose `load(run, tokenizer, evaluation)` reads and tokenizes its data;
    its eval dataset, when it has one, is read too, so that its keys are checked before training. The tokenizer
    is loaded only if the data is not prepared yet (`LazyTokenizer`)."""
    tokenizer = lazy_tokenizer(cfg.start_model, run)
    if cfg.eval_dataset:
        load(run, tokenizer, True)
    count = len(load(run, tokenizer, False))
    tokenizer.keep_records()
    return count
