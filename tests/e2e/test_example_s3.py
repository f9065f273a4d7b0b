"""examples/train_gpt.py against a real S3 server (SeaweedFS): --storage-option, and the
standard AWS environment variables instead."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers_dist import free_port

from zerostate.store import open_checkpoint

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"
TINY = ["--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--seq-len", "16",
        "--global-batch", "2"]  # fmt: skip


def run_example(args: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    world = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}  # fmt: skip
    return subprocess.run(
        [sys.executable, str(EXAMPLE), *TINY, *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **world, **(env or {})},
    )


@pytest.mark.s3
def test_example_saves_and_resumes_on_s3(s3_server, tmp_path: Path) -> None:
    bucket, options = s3_server.new_bucket("example")
    url = f"s3://{bucket}/run"
    flags = [
        "--storage-option", f"key={s3_server.key}",
        "--storage-option", f"secret={s3_server.secret}",
        "--storage-option", f"client_kwargs.endpoint_url={s3_server.endpoint_url}",
        "--storage-option", "client_kwargs.region_name=us-east-1",
    ]  # fmt: skip
    proc = run_example(["--ckpt", url, "--steps", "2", "--save-every", "2", *flags])
    assert proc.returncode == 0, proc.stderr[-3000:]
    ckpt = open_checkpoint(url, storage_options=options)
    assert ckpt.steps() == [2]
    ckpt.step().verify()

    # The same server through the environment alone, as the docs describe.
    env = {
        "AWS_ENDPOINT_URL": s3_server.endpoint_url,
        "AWS_ACCESS_KEY_ID": s3_server.key,
        "AWS_SECRET_ACCESS_KEY": s3_server.secret,
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    proc = run_example(["--ckpt", url, "--steps", "3", "--save-every", "3", "--resume"], env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout and "at step 2" in proc.stdout, proc.stdout
    assert open_checkpoint(url, storage_options=options).steps() == [2, 3]


@pytest.mark.parametrize(
    ("option", "needle"),
    [("endpoint-url=http://127.0.0.1:1", "did you mean endpoint_url?"),
     ("client_kwargs=3", "must be a JSON object")],
)  # fmt: skip
def test_example_refuses_a_malformed_storage_option(option: str, needle: str) -> None:
    proc = run_example(["--ckpt", "s3://b/run", "--steps", "1", "--storage-option", option])
    assert proc.returncode == 2
    assert needle in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
