"""The one test of whether a URL names something on this machine's filesystem (a plain path, `file://`,
`local://`) or in a remote store (`s3://`, `gs://`, `memory://`, ...). Everything that treats the two apart asks
here, so `file:///x` is local everywhere."""

from __future__ import annotations

import fsspec


def local_path(url: str) -> str | None:
    """The filesystem path `url` names when it is local, else None."""
    protocol, path = fsspec.core.split_protocol(url)
    return path if protocol in (None, "file", "local") else None


def is_local_url(url: str) -> bool:
    return local_path(url) is not None
