"""Fixtures shared by the unit tests of the checkpoint store."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from fsspec.core import url_to_fs


@pytest.fixture(params=["memory", "local"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path):
    """A store root on each backend the unit tests use: fsspec's memory:// and a local folder."""
    if request.param == "local":
        yield str(tmp_path / "store" / "run" / "sft")
        return
    bucket = f"ckpt-{uuid.uuid4().hex}"
    yield f"memory://{bucket}/run/sft"
    fs, bucket_path = url_to_fs(f"memory://{bucket}")
    if fs.exists(bucket_path):
        fs.rm(bucket_path, recursive=True)
