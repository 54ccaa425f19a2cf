"""A model's tokenizer loaded only when used (`LazyTokenizer`), for the driver's count of a stage's data. A
preparation's key holds the tokenizer's identity (`prepared.tokenizer_identity`), which takes loading it
(transformers and its tokenizer, ~1.4 CPU-s); once loaded, that identity and the chat template are recorded in the
run's store under the tokenizer files' cheap version (their names, sizes and mtimes, the override of the chat
template, transformers' and tokenizers' versions), so a later run whose data is prepared finds its preparation
without loading the tokenizer at all. Beside it, in a local store, the files `save_pretrained` writes of the
tokenizer as `load_tokenizer` gives it: the export copies those (`saved_tokenizer_files`) instead of loading it.
Both are written only once the count they served has succeeded (`keep_records`): a refused run writes nothing.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import secrets
import shutil
import tempfile
from importlib import metadata
from typing import Any, Callable, Sized

from rlhf_core.data.prepared import PreparedStore, tokenizer_identity
from rlhf_core.storage.locate import TOKENIZER_FILES, is_lora_dir, load_tokenizer, local_model_dir, lora_base_dir

RECORDS_DIR = "tokenizers"  # {cheap version}.json: {"identity": ..., "chat_template": ...}
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


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


class LazyTokenizer:
    """Stands for `load_tokenizer(url)` and loads it at the first use that needs it. Its identity (the key's) and
    chat template come from the record in `store` when there is one; `chat_template` set before loading replaces
    the folder's, as on the tokenizer. Pickled, it is the loaded tokenizer (a preparation's worker gets that)."""

    def __init__(self, url: str, storage_options: dict | None, store: PreparedStore, *, flag: str = "--pretrain"):
        state = {"_where": (url, storage_options, flag), "_store": store, "_loaded": None,
                 "_chat_template": _UNSET, "_record": _UNSET, "_unwritten": []}
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
        return self._loaded

    def identity(self) -> str:
        """`tokenizer_identity` of the tokenizer: recorded, or taken from it once loaded (and recorded)."""
        record = self._find_record()
        if record is not None and self._loaded is None:
            return record["identity"]
        identity = tokenizer_identity(self.load())
        record = {"identity": identity, "chat_template": self._loaded.chat_template}
        object.__setattr__(self, "_record", record)
        self._unwritten.append(lambda: self._save_record(record))
        return identity

    def keep_records(self) -> None:
        """Write what loading the tokenizer found (its record, its files) into the store: called once the count
        that loaded it succeeded, so that a run refused for its data leaves nothing behind."""
        while self._unwritten:
            self._unwritten.pop(0)()

    def _version(self) -> str:
        url, storage_options, flag = self._where
        return files_version(tokenizer_dir(url, storage_options, flag), self._chat_template)

    def _find_record(self) -> dict | None:
        if self._record is _UNSET:
            store = self._store
            try:
                with store.fs.open(f"{store.root}/{RECORDS_DIR}/{self._version()}.json", "rb") as handle:
                    record = json.loads(handle.read())
            except (OSError, ValueError):
                record = None
            valid = isinstance(record, dict) and isinstance(record.get("identity"), str)
            object.__setattr__(self, "_record", record if valid else None)
        return self._record

    def _save_record(self, record: dict) -> None:
        store, data = self._store, json.dumps(record).encode()
        path = f"{store.root}/{RECORDS_DIR}/{self._version()}.json"
        if not store.local:
            store.fs.pipe_file(path, data)
        else:  # whole or absent: another run reads it at any moment
            os.makedirs(os.path.dirname(path), exist_ok=True)
            staging = f"{path}.tmp-{secrets.token_hex(4)}"
            with open(staging, "wb") as handle:
                handle.write(data)
            os.replace(staging, path)
        object.__setattr__(self, "_record", record)

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
            object.__setattr__(self, "_record", _UNSET)  # another template: another record
        else:
            setattr(self.load(), name, value)

    def __getattr__(self, name: str) -> Any:  # what is not the proxy's own: the tokenizer's
        if name.startswith("__") or name in ("_where", "_store", "_loaded", "_chat_template", "_record", "_unwritten"):
            raise AttributeError(name)
        return getattr(self.load(), name)

    def __call__(self, *args, **kwargs):
        return self.load()(*args, **kwargs)

    def __len__(self) -> int:
        return len(self.load())

    def __reduce__(self):
        return _itself, (self.load(),)


def _itself(tokenizer):
    return tokenizer


def identity_of(tokenizer) -> str:
    """The tokenizer identity of a preparation's key, of a tokenizer or a `LazyTokenizer`."""
    return tokenizer.identity() if isinstance(tokenizer, LazyTokenizer) else tokenizer_identity(tokenizer)


def lazy_tokenizer(url: str, run, flag: str = "--pretrain") -> LazyTokenizer:
    """The tokenizer of the model at `url` for a count of `run`'s data, recorded in the run's store."""
    return LazyTokenizer(url, run.storage_options, PreparedStore(run.ckpt_path, run.storage_options), flag=flag)


def _files_dir(store: PreparedStore, url: str, storage_options: dict | None, flag: str) -> str:
    return f"{store.root}/{RECORDS_DIR}/{files_version(tokenizer_dir(url, storage_options, flag), _UNSET)}.files"


def save_tokenizer_files(tokenizer, url: str, storage_options: dict | None, store: PreparedStore,
                         flag: str = "--pretrain") -> None:
    """Keep `tokenizer.save_pretrained`'s files in a local store, unless there already (a remote store keeps
    none: the export loads the tokenizer there). `tokenizer` must be `load_tokenizer(url)`'s, unchanged."""
    if not store.local:
        return
    target = _files_dir(store, url, storage_options, flag)
    if os.path.isdir(target):
        return
    os.makedirs(os.path.dirname(target), exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".tmp-tokenizer-", dir=os.path.dirname(target))
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
    if not store.local:
        return None
    target = _files_dir(store, url, storage_options, flag)
    return target if os.path.isdir(target) else None


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
