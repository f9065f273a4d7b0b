"""A storage server that refuses connections or stops answering ends in one StorageError
naming the URL, after bounded retries: never a hang, never a raw client traceback."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

from zerostate.errors import StorageError
from zerostate.layout.partition import even_layout
from zerostate.store import StepWriter, TensorSpec, open_checkpoint


def _refusing_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _SilentServer:
    """Accepts TCP connections on 127.0.0.1 and never answers a byte."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.held: list[socket.socket] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        self.sock.settimeout(0.2)
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
                self.held.append(conn)
            except OSError:
                continue

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        for c in self.held:
            c.close()
        self.sock.close()


def _opts(port: int, **config) -> dict:
    opts = {"key": "k", "secret": "s",
            "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}"}}
    if config:
        opts["config_kwargs"] = config
    return opts


def test_refused_connection_is_a_storage_error_quickly():
    t0 = time.monotonic()
    with pytest.raises(StorageError, match=r"s3://bucket/run"):
        open_checkpoint("s3://bucket/run", storage_options=_opts(_refusing_port())).steps()
    assert time.monotonic() - t0 < 60


@pytest.mark.slow
def test_server_that_stops_answering_times_out_with_storage_error():
    server = _SilentServer()
    try:
        opts = _opts(server.port, read_timeout=1, connect_timeout=1)
        t0 = time.monotonic()
        with pytest.raises(StorageError, match=r"after 3 attempts"):
            open_checkpoint("s3://bucket/run", storage_options=opts).steps()
        assert time.monotonic() - t0 < 90
        spec = TensorSpec("model/w", (4,), torch.float32, even_layout(4, 1))
        writer = StepWriter("s3://bucket/run", 1, rank=0, world_size=1, specs=[spec],
                            storage_options=opts, timeout_s=30)
        with pytest.raises(StorageError):
            writer.write({"model/w": torch.zeros(4)})
    finally:
        server.close()


def test_cli_reports_unreachable_server_in_one_line():
    port = _refusing_port()
    proc = subprocess.run(
        [sys.executable, "-m", "zerostate_cli.main", "inspect", "s3://bucket/run",
         "--storage-option", f"client_kwargs.endpoint_url=http://127.0.0.1:{port}",
         "--storage-option", "key=k", "--storage-option", "secret=s"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 1
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("zerostate: error:"), proc.stderr
    assert "Traceback" not in proc.stderr
