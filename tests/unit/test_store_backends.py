"""The store behind one interface (rlhf_core/storage/backends.py): both backends implement all of it, the store's
commit logic never asks which one it has, and one function tells a local URL from a remote one."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

from rlhf_core.storage.backends import LocalBackend, ObjectStoreBackend, StoreBackend, backend_for
from rlhf_core.storage.locate import is_local_url, local_path

ROOT = Path(__file__).resolve().parents[2]


def _interface(cls) -> set[str]:
    return {name for name, _ in inspect.getmembers(cls, inspect.isfunction) if not name.startswith("_")}


@pytest.mark.parametrize("backend", [LocalBackend, ObjectStoreBackend])
def test_each_backend_implements_the_whole_interface(backend):
    assert _interface(StoreBackend) <= _interface(backend), _interface(StoreBackend) - _interface(backend)
    for name in _interface(StoreBackend):
        assert inspect.signature(getattr(backend, name)).parameters.keys() == \
            inspect.signature(getattr(StoreBackend, name)).parameters.keys(), name


def test_the_filesystem_picks_the_backend():
    assert isinstance(backend_for(LocalFileSystem()), LocalBackend)
    assert isinstance(backend_for(MemoryFileSystem()), ObjectStoreBackend)


def test_the_stores_logic_never_asks_which_backend_it_has():
    source = (ROOT / "rlhf_core" / "storage" / "checkpoint.py").read_text()
    asks = re.findall(r"_is_local|LocalFileSystem|isinstance\(self\.fs|os\.rename|os\.fsync|durable\.", source)
    assert asks == [], f"rlhf_core/storage/checkpoint.py branches on the medium: {asks}"


@pytest.mark.parametrize("url, path", [
    ("/data/ckpt", "/data/ckpt"), ("ckpt/run", "ckpt/run"), ("file:///data/ckpt", "/data/ckpt"),
    ("local:///data/ckpt", "/data/ckpt"), ("s3://bucket/ckpt", None), ("memory://b/ckpt", None),
    ("gs://bucket/x", None), ("OpenRLHF/Llama-3-8b-sft-mixture", "OpenRLHF/Llama-3-8b-sft-mixture"),
])
def test_one_function_tells_a_local_url(url, path):
    assert local_path(url) == path and is_local_url(url) is (path is not None)


def test_nothing_else_tells_a_local_url_by_hand():
    hand_written = re.compile(r"in \(None, \"file\"\)|startswith\(\"file://\"\)|split_protocol\([^)]*\)\[0\] is None")
    found = [f"{path.relative_to(ROOT)}:{number}" for package in ("rlhf_core", "flows", "tasks")
             for path in (ROOT / package).rglob("*.py") if path.name != "locate.py"
             for number, line in enumerate(path.read_text().splitlines(), 1) if hand_written.search(line)]
    assert found == []


def test_an_object_store_file_is_handed_a_large_block_in_pieces(monkeypatch):
    """fsspec's buffered files copy what they are given and upload a part once they hold a block: a whole
    tensor passed at once would sit in that buffer in full first."""
    from fsspec.implementations.memory import MemoryFile

    from rlhf_core.storage.manifest import TRANSFER_BLOCK_BYTES

    sizes: list[int] = []
    real_write = MemoryFile.write
    monkeypatch.setattr(MemoryFile, "write", lambda self, data: sizes.append(memoryview(data).nbytes)
                        or real_write(self, data))
    fs = MemoryFileSystem()
    data = bytes(range(256)) * ((2 * TRANSFER_BLOCK_BYTES + 4097) // 256)
    with ObjectStoreBackend(fs).open_new("/bucket/run/step_1/optim_states.pt") as handle:
        assert handle.write(data) == len(data)
    assert max(sizes) == TRANSFER_BLOCK_BYTES and sum(sizes) == len(data)
    assert fs.cat_file("/bucket/run/step_1/optim_states.pt") == data
