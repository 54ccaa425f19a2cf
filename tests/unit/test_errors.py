"""The failure taxonomy (rlhf_core/errors.py): each class says whether a retry helps and what the CLI exits with;
Prefect's retry policy and the CLI read those attributes; every class survives pickling (Ray carries a rank's
exception to the driver; tests/integration/test_errors_over_ray.py does it through a real Ray)."""

from __future__ import annotations

import errno
import pickle

import pytest
from ray import cloudpickle

from rlhf_core.ops.alerts import NonFiniteTraining
from rlhf_core.errors import (CorruptCheckpoint, LeaseLost, PlacementFailed, RLHFError, StoreFull,
                              TransientStoreError, UnsafeCheckpoint, UserError, WorkerLost, exit_code_of, is_retryable,
                              store_full)

# (an instance, retryable, exit code), one per class of the taxonomy.
TAXONOMY = [
    (UserError("--dataset x.jsonl: no such file; give a path that exists."), False, 2),
    (CorruptCheckpoint("step_5 is corrupt; resume from an earlier step.", 5, "checksum mismatch in a.pt"), False, 2),
    (UnsafeCheckpoint("a.pt would run code when unpickled; it is refused."), False, 2),
    (store_full("/ckpt", OSError(errno.ENOSPC, "No space left on device")), False, 2),
    (LeaseLost("another process holds the run now; this one stops."), False, 1),
    (NonFiniteTraining("sft", 12, ["loss"], ["lm_head.weight"]), False, 1),
    (WorkerLost("rank 1 on node 10.0.0.2 died; the chunk is retried."), True, 1),
    (PlacementFailed("2 ranks of 1 CPU stayed unplaced for 60 s."), True, 1),
    (TransientStoreError("s3://b/ckpt: 503 Slow Down after 5 attempts."), True, 1),
]


@pytest.mark.parametrize("error, retryable, exit_code", TAXONOMY, ids=lambda value: type(value).__name__)
def test_each_failure_says_whether_a_retry_helps_and_its_exit_code(error, retryable, exit_code):
    assert isinstance(error, RLHFError)
    assert is_retryable(error) is retryable and error.retryable is retryable
    assert exit_code_of(error) == exit_code


@pytest.mark.parametrize("dumps, loads", [(pickle.dumps, pickle.loads), (cloudpickle.dumps, cloudpickle.loads)],
                         ids=["pickle", "cloudpickle"])
@pytest.mark.parametrize("error, retryable, exit_code", TAXONOMY, ids=lambda value: type(value).__name__)
def test_each_failure_survives_pickling(error, retryable, exit_code, dumps, loads):
    copy = loads(dumps(error))
    assert type(copy) is type(error) and str(copy) == str(error) and copy.retryable is retryable
    assert vars(copy) == vars(error)  # CorruptCheckpoint's step and reason, NonFiniteTraining's stage, step, names


def test_exceptions_outside_the_taxonomy_are_retried_unless_no_retry_can_fix_them():
    assert is_retryable(ConnectionResetError("reset by peer")) and is_retryable(RuntimeError("gloo timeout"))
    assert not is_retryable(OSError(errno.ENOSPC, "No space left on device"))
    wrapped = RuntimeError("the write failed")
    wrapped.__cause__ = OSError(errno.EROFS, "Read-only file system")
    assert not is_retryable(wrapped)
    assert exit_code_of(ValueError("a bug")) == 1


class _FailedState:
    def __init__(self, error: BaseException):
        self.error = error

    def result(self):
        raise self.error


@pytest.mark.parametrize("error, retryable, exit_code", TAXONOMY, ids=lambda value: type(value).__name__)
def test_prefects_retry_policy_reads_the_attribute(error, retryable, exit_code):
    from tasks.chunks import _retry_if_retryable

    assert _retry_if_retryable(None, None, _FailedState(error)) is retryable


def test_the_cli_prints_one_line_with_the_failures_exit_code(monkeypatch, capsys):
    import flows.cli as cli

    def lose_the_lease(args):
        raise LeaseLost("another process holds ./ckpt/rlhf now (pid 7 on host a); this one stops.")

    monkeypatch.setattr(cli, "cmd_status", lambda run_url: lose_the_lease(None))
    assert cli.main(["status", "./ckpt/rlhf"]) == 1
    err = capsys.readouterr().err
    assert err == "rlhf: error: another process holds ./ckpt/rlhf now (pid 7 on host a); this one stops.\n"


def test_a_full_store_is_a_user_error_that_is_never_retried():
    error = store_full("/ckpt", OSError(errno.EDQUOT, "Disk quota exceeded"), free_bytes=10, needed_bytes=10**9)
    assert isinstance(error, StoreFull) and isinstance(error, UserError) and not is_retryable(error)
    assert "--max_ckpt_num" in str(error)


def test_a_write_that_fails_in_a_way_that_passes_is_a_transient_store_error(tmp_path, monkeypatch):
    """EIO from a flaky NFS server (or a 5xx after s3fs's own retries) mid-write: retried, nothing committed."""
    from rlhf_core.storage import direct_io, durable
    from rlhf_core.storage.checkpoint import CheckpointStore

    def flaky_write(self, block):
        raise OSError(errno.EIO, "Input/output error")

    source = tmp_path / "ckpt"
    source.mkdir()
    (source / "model_states.pt").write_bytes(b"x" * 4096)
    store = CheckpointStore(str(tmp_path / "store" / "rlhf" / "sft"))
    monkeypatch.setattr(durable.WritebackAhead, "write", flaky_write)
    monkeypatch.setattr(direct_io.DirectWriter, "write", flaky_write)
    with pytest.raises(TransientStoreError, match=r"--ckpt_path .*/store/rlhf/sft: a write failed \(OSError") as caught:
        store.commit(2, str(source), {"global_step": 2})
    assert is_retryable(caught.value) and isinstance(caught.value.__cause__, OSError)
    assert not [info for info in store.list() if info.is_committed]
