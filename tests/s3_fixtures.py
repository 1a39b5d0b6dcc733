"""S3 test fixtures: a real moto S3 server on loopback and a fault-injecting HTTP proxy in front of it.

Import the fixtures into a conftest (``from tests.s3_fixtures import *``):

- ``moto_server``  (session): a ``ThreadedMotoServer`` on 127.0.0.1:<free port>; yields its endpoint URL.
- ``s3_env``       (function): fake AWS credentials in the environment, a fresh moto state
  (``/moto-api/reset``) and the endpoint; returns an :class:`S3Env`.
- ``fault_proxy``  (function): a proxy that forwards to moto and fails a seeded-random share of
  requests (half 500/503 responses, half dropped connections). The failure rate is 0.2 unless the
  test sets it: ``@pytest.mark.parametrize("fault_proxy", [0.3], indirect=True)``.
"""

from __future__ import annotations

import http.client
import random
import socket
import threading
import urllib.request
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterator

import pytest

FAKE_KEY = "testing-key-id"
FAKE_SECRET = "testing-secret-key"

__all__ = ["moto_server", "s3_env", "fault_proxy", "S3Env", "FaultProxy", "make_s3fs", "moto_auth"]


def make_s3fs(endpoint_url: str, **kwargs: Any):
    """A fresh (not instance-cached) ``s3fs.S3FileSystem`` talking to ``endpoint_url``."""
    import s3fs

    return s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint_url},
                             skip_instance_cache=True, use_listings_cache=False, **kwargs)


@dataclass
class S3Env:
    endpoint_url: str
    storage_options: dict = field(default_factory=dict)

    def fs(self, **kwargs: Any):
        return make_s3fs(self.endpoint_url, **kwargs)


@pytest.fixture(scope="session")
def moto_server() -> Iterator[str]:
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no per-request lines
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@pytest.fixture
def s3_env(moto_server: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Env]:
    import s3fs

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", FAKE_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", FAKE_SECRET)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    # Region env vars are left alone on purpose: s3fs with a region fails to create buckets on moto.
    urllib.request.urlopen(urllib.request.Request(f"{moto_server}/moto-api/reset", method="POST")).read()
    s3fs.S3FileSystem.clear_instance_cache()
    yield S3Env(moto_server, {"endpoint_url": moto_server})
    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture
def moto_auth() -> Iterator[None]:
    """Make the (in-process) moto server check credentials for the duration of a test."""
    from moto import settings
    from moto.core.authorization import ActionAuthenticatorMixin

    old = settings.INITIAL_NO_AUTH_ACTION_COUNT
    settings.INITIAL_NO_AUTH_ACTION_COUNT = 0
    ActionAuthenticatorMixin.request_count = 0
    try:
        yield
    finally:
        settings.INITIAL_NO_AUTH_ACTION_COUNT = old


class FaultProxy:
    """Threaded HTTP proxy: forwards requests to ``upstream`` and fails a share of them.

    Decisions come from ``random.Random(seed)`` (under a lock), so the failure rate is exact in
    expectation; the order in which concurrent requests draw is up to the scheduler.
    """

    def __init__(self, upstream: str, rate: float = 0.2, seed: int = 1234) -> None:
        up = upstream.split("://", 1)[1]
        self.up_host, up_port = up.split(":")
        self.up_port = int(up_port)
        self.rate = rate
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.counts = {"requests": 0, "error_5xx": 0, "dropped": 0}
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def _read_body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    out = b""
                    while True:
                        size = int(self.rfile.readline().strip().split(b";")[0], 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            return out
                        out += self.rfile.read(size)
                        self.rfile.readline()
                n = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(n) if n else b""

            def _handle(self) -> None:
                body = self._read_body()
                fault = proxy._draw()
                if fault == "drop":
                    self.close_connection = True
                    try:
                        self.connection.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                    return
                if fault in (500, 503):
                    code = "InternalError" if fault == 500 else "ServiceUnavailable"
                    payload = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
                               f"<Message>injected fault</Message></Error>").encode()
                    self.send_response(fault)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(payload)
                    return
                conn = http.client.HTTPConnection(proxy.up_host, proxy.up_port, timeout=30)
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() not in ("transfer-encoding", "connection", "content-length")}
                headers["Content-Length"] = str(len(body))
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                conn.close()
                self.send_response(resp.status, resp.reason)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length",
                                         "server", "date"):
                        self.send_header(k, v)
                clen = resp.getheader("Content-Length")
                if self.command == "HEAD" and clen is not None:
                    self.send_header("Content-Length", clen)
                else:
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def _draw(self) -> str | int | None:
        with self.lock:
            self.counts["requests"] += 1
            if self.rng.random() >= self.rate:
                return None
            if self.rng.random() < 0.5:
                self.counts["error_5xx"] += 1
                return self.rng.choice((500, 503))
            self.counts["dropped"] += 1
            return "drop"

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "FaultProxy":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


@pytest.fixture
def fault_proxy(request: pytest.FixtureRequest, s3_env: S3Env) -> Iterator[FaultProxy]:
    rate = float(getattr(request, "param", 0.2))
    proxy = FaultProxy(s3_env.endpoint_url, rate=rate).start()
    try:
        yield proxy
    finally:
        proxy.stop()
