"""The CLI's contract with a new user: one line per failure, one exit-code rule (2: the
command line is wrong, 1: a well-formed command failed), a fast ``--help``, options per
end of ``reshard``."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from cli_helpers import run_cli

from zerostate.store import open_checkpoint, save_tensors

TENSORS = {"model/w": torch.arange(120, dtype=torch.float32).reshape(8, 15)}


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    root = tmp_path / "ckpt"
    save_tensors(str(root), 2, TENSORS, world_size=1, min_shard_numel=64)
    return root


def assert_one_line(err: str, *needles: str) -> None:
    assert err.startswith("zerostate: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, err


MALFORMED = [
    ("endpoint-url=http://127.0.0.1:1", "did you mean endpoint_url?"),
    ("client_kwargs=3", "must be a JSON object"),
    ("s3_additional_kwargs={", "not valid JSON"),
    ('config_kwargs={"retries": ', "not valid JSON"),
    ("no-equals-sign", "not KEY=VALUE"),
    ("=value", "not KEY=VALUE"),
    ("client_kwargs..region_name=x", "not KEY=VALUE"),
    ("anon=yes", "must be true or false"),
    ("max_concurrency=many", "must be a whole number"),
    ("bogus_option=1", "takes no option 'bogus_option'"),
]


@pytest.mark.parametrize(("pair", "needle"), MALFORMED, ids=[m[0] for m in MALFORMED])
@pytest.mark.parametrize("command", ["inspect", "verify", "consolidate", "reshard"])
def test_malformed_storage_option_is_a_usage_error(command, pair, needle, tmp_path, capsys):
    # Checked before any connection: no server is needed and none is tried.
    argv = [command, "s3://zs-bucket/run", "--storage-option", pair]
    if command == "consolidate":
        argv.insert(2, str(tmp_path / "o.safetensors"))
    if command == "reshard":
        argv[2:2] = [str(tmp_path / "dst"), "--world-size", "2"]
    code, _, err = run_cli(argv, capsys)
    assert code == 2, err
    assert_one_line(err, needle, "--storage-option")
    assert list(tmp_path.iterdir()) == []


def test_malformed_option_from_the_installed_command_has_no_traceback(tmp_path: Path) -> None:
    exe = Path(sys.executable).with_name("zerostate")
    proc = subprocess.run(
        [str(exe), "inspect", "s3://b/run", "--storage-option", "client_kwargs=3"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "ZEROSTATE_DEBUG": ""},
    )
    assert proc.returncode == 2
    assert_one_line(proc.stderr, "client_kwargs")


@pytest.mark.parametrize(
    ("argv", "code", "needle"),
    [
        (["inspect"], 2, "CKPT"),
        (["frobnicate"], 2, "invalid choice"),
        (["inspect", "{ckpt}", "--step", "-1"], 2, "--step"),
        (["reshard", "{ckpt}", "{t}/o", "--world-size", "0"], 2, "--world-size"),
        (["consolidate", "{ckpt}", "{t}/o.safetensors", "--dtype", "fp8"], 2, "--dtype"),
        (["consolidate", "{ckpt}", "{t}/o", "--max-shard-size", "10"], 2, "10GB"),
        (["consolidate", "{ckpt}", "{t}/o", "--max-shard-size", "4096"], 2, "no unit"),
        (["inspect", "{ckpt}", "--storage-option", "anon=true"], 2, "local path"),
        (["reshard", "{ckpt}", "{t}/o", "--world-size", "2", "--src-storage-option", "a=1"],
         2, "--src-storage-option"),
        (["inspect", "{t}/missing"], 1, "does not exist"),
        (["inspect", "{ckpt}", "--step", "3"], 1, "step 3 is not committed"),
        (["reshard", "{ckpt}", "{ckpt}/../ckpt", "--world-size", "2", "--force"], 1, "same"),
        (["consolidate", "{ckpt}", "{ckpt}/m.safetensors"], 1, "inside the checkpoint"),
    ],
)  # fmt: skip
def test_exit_code_rule(argv, code, needle, ckpt: Path, tmp_path: Path, capsys) -> None:
    argv = [a.format(ckpt=ckpt, t=tmp_path) for a in argv]
    got, _, err = run_cli(argv, capsys)
    assert got == code, err
    assert_one_line(err, needle)


def test_existing_output_is_a_failure_not_usage(ckpt: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "m.safetensors"
    assert run_cli(["consolidate", str(ckpt), str(out), "-q"], capsys)[0] == 0
    code, _, err = run_cli(["consolidate", str(ckpt), str(out), "-q"], capsys)
    assert code == 1
    assert_one_line(err, "already exists", "--force")


@pytest.mark.parametrize(("size", "files"), [("1048576", 1), ("1MiB", 1), ("100B", 1)])
def test_shard_size_rule(ckpt: Path, tmp_path: Path, capsys, size: str, files: int) -> None:
    # A unit makes any size explicit; a bare number must be at least 1MiB.
    argv = ["consolidate", str(ckpt), str(tmp_path / "hf"), "--max-shard-size", size, "-q"]
    code, _, err = run_cli(argv, capsys)
    assert code == 0, err
    names = sorted(os.listdir(tmp_path / "hf"))
    assert names[-1] == "model.safetensors.index.json" and len(names) == files + 1, names


def test_help_imports_neither_torch_nor_fsspec() -> None:
    # What keeps `zerostate --help` fast: building every subcommand's parser and printing
    # the help must not import the heavy libraries.
    code = (
        "import sys, time, contextlib, io\n"
        "t = time.perf_counter()\n"
        "from zerostate_cli.main import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    for argv in (['--help'], ['reshard', '--help'], ['consolidate', '--help']):\n"
        "        try: main(argv)\n"
        "        except SystemExit: pass\n"
        "print(time.perf_counter() - t)\n"
        "print(sorted(m for m in ('torch', 'fsspec', 's3fs', 'numpy') if m in sys.modules))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    seconds, heavy = proc.stdout.splitlines()
    print(f"zerostate --help (three parsers, in-process): {float(seconds):.3f} s")
    assert heavy == "[]", heavy


def test_help_wall_time() -> None:
    exe = Path(sys.executable).with_name("zerostate")
    best = float("inf")
    for _ in range(3):  # best of three: other processes share this machine
        t0 = time.perf_counter()
        subprocess.run([str(exe), "--help"], capture_output=True, timeout=60, check=True)
        best = min(best, time.perf_counter() - t0)
    print(f"zerostate --help wall time, best of 3: {best:.3f} s")
    assert best < 0.5


def test_reshard_options_per_end(ckpt: Path, tmp_path: Path, capsys) -> None:
    # --storage-option applies to URL ends only; side options stack on it for their end.
    dst = "memory://zs-cli-usage/run"
    code, _, err = run_cli(
        [
            "reshard", str(ckpt), dst, "--world-size", "2", "-q",
            "--storage-option", "skip_instance_cache=true",
            "--dst-storage-option", "use_listings_cache=false",
        ],
        capsys,
    )  # fmt: skip
    assert code == 0, err
    st = open_checkpoint(dst).step()
    assert st.world_size == 2 and torch.equal(st.read("model/w"), TENSORS["model/w"])
    back = tmp_path / "back"
    code, _, err = run_cli(["reshard", dst, str(back), "--world-size", "1", "-q"], capsys)
    assert code == 0, err
    code, _, err = run_cli(["verify", str(back), "-q"], capsys)
    assert code == 0, err


@pytest.mark.s3
def test_reshard_between_s3_and_local(s3_server, ckpt: Path, tmp_path: Path, capsys) -> None:
    bucket, _ = s3_server.new_bucket()
    s3 = [
        f"key={s3_server.key}",
        f"secret={s3_server.secret}",
        f"client_kwargs.endpoint_url={s3_server.endpoint_url}",
        "client_kwargs.region_name=us-east-1",
    ]
    up = [a for pair in s3 for a in ("--dst-storage-option", pair)]
    url = f"s3://{bucket}/run"
    code, _, err = run_cli(["reshard", str(ckpt), url, "--world-size", "3", "-q", *up], capsys)
    assert code == 0, err
    down = [a for pair in s3 for a in ("--storage-option", pair)]  # shared: the URL end only
    back = tmp_path / "back"
    code, _, err = run_cli(["reshard", url, str(back), "--world-size", "1", "-q", *down], capsys)
    assert code == 0, err
    st = open_checkpoint(str(back)).step()
    st.verify()
    assert torch.equal(st.read("model/w"), TENSORS["model/w"])
