"""Transient object-store errors are retried: a checkpoint commits and downloads through a proxy in
front of a real S3 endpoint (moto) that answers some requests with 503 and resets others."""

from __future__ import annotations

import http.client
import itertools
import socket
import struct
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse


from rlhf_core.storage.checkpoint import CheckpointStore
from tests.conftest import make_bucket, s3_environment

HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "proxy-connection"}


def flaky_proxy(upstream: str):
    """A proxy that fails requests 3, 8, 13, ... with 503 and resets requests 5, 10, 15, ..."""
    target = urlparse(upstream)
    counter = itertools.count(1)
    injected: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # keep test output readable
            pass

        def handle_one_request(self):
            try:
                super().handle_one_request()
            except (ConnectionError, OSError):
                self.close_connection = True

        def relay(self):
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            number = next(counter)
            if number % 5 == 3:
                injected.append("503")
                payload = b"<Error><Code>ServiceUnavailable</Code><Message>injected</Message></Error>"
                self.send_response(503)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)
                return
            if number % 5 == 0:
                injected.append("reset")
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.close_connection = True
                self.connection.close()
                return
            upstream_conn = http.client.HTTPConnection(target.hostname, target.port, timeout=30)
            headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_HEADERS}
            upstream_conn.request(self.command, self.path, body=body, headers=headers)
            response = upstream_conn.getresponse()
            payload = response.read()
            self.send_response(response.status)
            for key, value in response.getheaders():
                if key.lower() not in HOP_HEADERS | {"content-length"}:
                    self.send_header(key, value)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(payload)
            upstream_conn.close()

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = relay

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_port}", injected


def test_commit_and_download_survive_503s_and_connection_resets(s3_endpoint, tmp_path, monkeypatch):
    bucket = f"rlhf-{uuid.uuid4().hex[:12]}"
    make_bucket(s3_endpoint, bucket)
    server, proxy_url, injected = flaky_proxy(s3_endpoint)
    for name, value in s3_environment(s3_endpoint).items():
        monkeypatch.setenv(name, value)  # credentials from the standard variables
    # The endpoint goes in storage_options: fsspec caches filesystems by their options, and an
    # option-less S3 filesystem made earlier in the session would skip the proxy.
    try:
        local = tmp_path / "ckpt"
        (local / "actor_model").mkdir(parents=True)
        for index in range(6):
            (local / "actor_model" / f"shard_{index}.bin").write_bytes(bytes([index]) * 200_000)
        store = CheckpointStore(f"s3://{bucket}/run/sft", {"client_kwargs": {"endpoint_url": proxy_url}})
        info = store.commit(5, str(local), {"step": 5})
        assert info.is_committed
        store.download(5, str(tmp_path / "back"))
        assert (tmp_path / "back" / "actor_model" / "shard_3.bin").read_bytes() == bytes([3]) * 200_000
        assert store.newest_valid().step == 5
    finally:
        server.shutdown()
    assert "503" in injected and "reset" in injected, injected
