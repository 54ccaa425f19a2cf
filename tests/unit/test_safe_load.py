"""The guarded checkpoint loader: plain data only, and DeepSpeed's second read of a file served from the first."""

import os
import types

import pytest
import torch

from rlhf_core.errors import UnsafeCheckpoint
from rlhf_core.storage.safe_load import guard_checkpoint_loads, reading_checkpoint


class CountingOpen:
    """Counts how often torch.load opens each path (torch.load opens a path through `open`)."""

    def __init__(self, monkeypatch):
        self.opened: list[str] = []
        real_open = open

        def counting_open(path, *args, **kwargs):
            if isinstance(path, (str, os.PathLike)) and str(path).endswith(".pt"):
                self.opened.append(os.path.basename(str(path)))
            return real_open(path, *args, **kwargs)

        monkeypatch.setattr("builtins.open", counting_open)


def guarded_engine():
    engine = types.SimpleNamespace(checkpoint_engine=types.SimpleNamespace(load=None))
    guard_checkpoint_loads(engine)
    return engine.checkpoint_engine


def test_the_same_file_read_twice_while_loading_is_read_once(tmp_path, monkeypatch):
    torch.save({"module": {"w": torch.arange(4.0)}, "mp_world_size": 1}, tmp_path / "model_states.pt")
    torch.save({"optimizer": torch.ones(2)}, tmp_path / "optim_states.pt")
    loader, counter = guarded_engine(), CountingOpen(monkeypatch)
    with reading_checkpoint(str(tmp_path)):
        # DeepSpeed's order: check_ckpt_list, then the load itself (each with a lambda mapping to CPU).
        first = loader.load(str(tmp_path / "model_states.pt"), map_location=lambda storage, loc: storage)
        second = loader.load(str(tmp_path / "model_states.pt"), map_location=lambda storage, loc: storage)
        other = loader.load(str(tmp_path / "optim_states.pt"), map_location=torch.device("cpu"))
        # A different mapping of the same file is read anew.
        loader.load(str(tmp_path / "optim_states.pt"), map_location=None)
    assert second is first and torch.equal(first["module"]["w"], torch.arange(4.0))
    assert torch.equal(other["optimizer"], torch.ones(2))
    assert counter.opened == ["model_states.pt", "optim_states.pt", "optim_states.pt"]
    # Outside a load, nothing is kept: each call reads the file.
    loader.load(str(tmp_path / "model_states.pt"))
    loader.load(str(tmp_path / "model_states.pt"))
    assert counter.opened[3:] == ["model_states.pt", "model_states.pt"]


def test_a_pickle_that_runs_code_is_refused_with_the_file_named(tmp_path):
    torch.save({"module": {}, "hook": os.getcwd}, tmp_path / "model_states.pt")
    with reading_checkpoint(str(tmp_path)), pytest.raises(UnsafeCheckpoint, match="model_states.pt holds pickled"):
        guarded_engine().load(str(tmp_path / "model_states.pt"))
