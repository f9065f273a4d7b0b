"""tests/forked_launch.py gives each rank what torchrun gives it, reports a failing or hung
rank as a failed launch, and ends the other ranks ([Note: forked launches])."""

from __future__ import annotations

import textwrap
import time

import forked_launch

SCRIPT = textwrap.dedent(
    """
    import os, sys
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = dist.get_rank() + 1
    import torch
    x = torch.tensor([float(t)])
    dist.all_reduce(x)
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID")
    print(__name__, sys.argv[1:], [os.environ[n] for n in names[:4]], x.item(),
          os.environ.get("ZS_PROBE"), flush=True)
    dist.destroy_process_group()
    mode = sys.argv[1]
    if mode == "fail" and os.environ["RANK"] == "1":
        raise SystemExit(3)
    if mode == "raise" and os.environ["RANK"] == "0":
        raise ValueError("rank 0 broke")
    if mode == "hang" and os.environ["RANK"] == "1":
        import time
        time.sleep(600)
    """
)


def _script(tmp_path):
    path = tmp_path / "job.py"
    path.write_text(SCRIPT)
    return path


def test_ranks_get_torchruns_environment_and_argv(tmp_path):
    done = forked_launch.launch(_script(tmp_path), 3, ["ok", "--x"], env={"ZS_PROBE": "7"},
                                timeout=120, workdir=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = sorted(done.stdout.splitlines())
    assert lines == [f"__main__ ['ok', '--x'] ['{r}', '{r}', '3', '3'] 6.0 7" for r in range(3)]


def test_a_failing_rank_fails_the_launch_and_is_named(tmp_path):
    done = forked_launch.launch(_script(tmp_path), 2, ["fail"], env={}, timeout=120,
                                workdir=tmp_path)  # fmt: skip
    assert done.returncode == 1
    assert "--- rank 1 (exit 3) ---" in done.stderr
    raised = forked_launch.launch(_script(tmp_path), 2, ["raise"], env={}, timeout=120,
                                  workdir=tmp_path)  # fmt: skip
    assert raised.returncode == 1 and "ValueError: rank 0 broke" in raised.stderr


def test_a_hung_rank_is_ended_at_the_time_bound(tmp_path):
    start = time.monotonic()
    done = forked_launch.launch(_script(tmp_path), 2, ["hang"], env={}, timeout=8,
                                workdir=tmp_path)  # fmt: skip
    assert done.returncode == 1 and "did not finish within 8" in done.stderr
    assert time.monotonic() - start < 30
