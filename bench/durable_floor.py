"""The floor under a checkpoint's cost to a whole run: a durable copy of the same bytes beside training.

Installed into a rank of a single-chunk run (`install`, through `__ray_call__`), it does at every `save_steps`
boundary what any asynchronous checkpoint must at least do, and nothing more: copy the rank's state (the weights
twice, as DeepSpeed's file and the HF copy hold them, and the optimizer's moments) into page-aligned buffers while
training waits, then write those bytes into one file with O_DIRECT and fsync it and its folder, from a SCHED_IDLE
thread while training goes on (as our writer runs). No serialisation, no hashing, no manifest, no commit, no
Prefect task, no Ray round trip. `wholerun_costs.boundary_cost` over this run's steps is that floor; the chunked run's
measure against it says what the rest costs.

The rank cannot import the bench folder, so the driver sends this module by value (`cloudpickle`).
"""

from __future__ import annotations

import mmap
import os
import threading
import time

from rlhf_core.storage.durable import fsync_dir

PIECE_BYTES = 8 << 20
PAGE = 4096


def _state_tensors(engine) -> list:
    """The tensors a checkpoint of this DeepSpeed engine holds, in a fixed order (their bytes, not their format)."""
    import torch

    weights = [parameter.data for parameter in engine.module.parameters()]
    optimizer = getattr(engine.optimizer, "optimizer", engine.optimizer)
    moments = [value for state in optimizer.state.values() for value in state.values()
               if torch.is_tensor(value) and value.numel() > 1]
    return weights + weights + moments  # the HF copy repeats the weights


def _write_durably(buffers: list[mmap.mmap], path: str, seconds: list[float]) -> None:
    os.sched_setscheduler(threading.get_native_id(), os.SCHED_IDLE, os.sched_param(0))
    started = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        for buffer in buffers:
            view = memoryview(buffer)
            for start in range(0, len(view), PIECE_BYTES):
                os.write(fd, view[start:start + PIECE_BYTES])
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(os.path.dirname(path))
    seconds.append(time.perf_counter() - started)


class DurableCopies:
    """Wraps a trainer's `train_step`: before the first step after each boundary, copy and start the write."""

    def __init__(self, trainer, boundaries: set[int], folder: str):
        self.trainer, self.boundaries, self.folder = trainer, boundaries, folder
        self.train_step, self.buffers, self.writer = trainer.train_step, None, None
        self.copy_seconds: list[float] = []
        self.write_seconds: list[float] = []

    def __call__(self):
        if self.trainer.step in self.boundaries:
            self._copy_and_write()
        return self.train_step()

    def _copy_and_write(self) -> None:
        import torch

        started = time.perf_counter()
        tensors = [tensor for engine in self.trainer.engines.values() for tensor in _state_tensors(engine)]
        if self.buffers is None:  # reused, as our snapshot reuses its buffers: no page faults after the first
            self.buffers = [mmap.mmap(-1, -(-tensor.numel() * tensor.element_size() // PAGE) * PAGE)
                            for tensor in tensors]
        for tensor, buffer in zip(tensors, self.buffers):
            torch.frombuffer(buffer, dtype=tensor.dtype, count=tensor.numel()).copy_(tensor.reshape(-1))
        self.copy_seconds.append(time.perf_counter() - started)
        self.wait()  # one write at a time, as ours
        for name in os.listdir(self.folder):
            os.remove(os.path.join(self.folder, name))
        path = os.path.join(self.folder, f"step_{self.trainer.step}.bin")
        self.writer = threading.Thread(target=_write_durably, args=(self.buffers, path, self.write_seconds),
                                       daemon=True)
        self.writer.start()

    def wait(self) -> None:
        if self.writer is not None:
            self.writer.join()

    def report(self) -> dict:
        self.wait()
        return {"bytes": sum(len(buffer) for buffer in self.buffers or []), "copy_s": self.copy_seconds,
                "write_s": self.write_seconds}


def install(worker, boundaries: set[int], folder: str) -> None:
    """On a rank (`worker`: its TrainWorker): durable copies at `boundaries` into `folder`."""
    os.makedirs(folder, exist_ok=True)
    worker.trainer.train_step = worker.durable_copies = DurableCopies(worker.trainer, boundaries, folder)


def report(worker) -> dict:
    """Bytes per copy and each copy's and write's seconds (after the last write ends)."""
    return worker.durable_copies.report()
