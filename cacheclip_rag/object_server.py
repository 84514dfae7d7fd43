"""Servers on loopback for tests and benchmarks: `free_port`, and a real S3 server, moto's standalone server
(`moto[server]`), a separate process speaking the S3 HTTP API, started and stopped like `redis-server` in the
Redis tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from collections.abc import Iterator


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a server a test or benchmark starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    """`python -m moto.server` on 127.0.0.1; `stop()` and `start()` again keep the port (its objects are lost
    on stop: moto keeps them in memory)."""

    def __init__(self, port: int | None = None):
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{self.endpoint}/", timeout=1).close()
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("moto's S3 server did not start (pip install 'moto[server]')") from None
                time.sleep(0.1)

    def bucket(self, name: str) -> str:
        """Create bucket `name` (CreateBucket: PUT /name); its s3:// URL."""
        urllib.request.urlopen(urllib.request.Request(f"{self.endpoint}/{name}", method="PUT"), timeout=10).close()
        return f"s3://{name}"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    @contextmanager
    def environment(self) -> Iterator[None]:
        """The AWS variables pointing S3 clients at this server (restored after)."""
        values = {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
                  "AWS_REGION": "us-east-1"}
        saved = {k: os.environ.get(k) for k in values}
        os.environ.update(values)
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
