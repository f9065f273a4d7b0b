"""benchmarks/forked.py: ranks forked from one zygote get what torchrun gives them, fail
together, and a job that overruns ends with every rank ([Note: forked ranks])."""

from __future__ import annotations

import json
import os
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.common import _env  # noqa: E402
from benchmarks.forked import GRACE_S, Zygote  # noqa: E402

RANK_MODULE = textwrap.dedent(
    """
    import json, os, sys, time
    import torch
    import torch.distributed as dist

    mode, out = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    if mode == "hang" and rank == 1:
        time.sleep(120)
    dist.init_process_group("gloo")
    if mode == "fail" and rank == 1:
        raise RuntimeError("rank one gives up")
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)  # rank 0 of the "fail" job waits here until it is ended
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
            "MASTER_PORT", "TORCHELASTIC_RUN_ID", "ZS_TEST_MARK")
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump({"env": {k: os.environ.get(k) for k in keys}, "argv": sys.argv[1:],
                   "sum": t.item(), "name": __name__}, f)
    print(f"rank {rank} done", flush=True)
    dist.destroy_process_group()
    """
)


@pytest.fixture(scope="module")
def zygote(tmp_path_factory):
    mods = tmp_path_factory.mktemp("forked-mods")
    (mods / "zs_forked_probe.py").write_text(RANK_MODULE)
    env = _env(1, {"PYTHONPATH": os.pathsep.join([str(mods), str(REPO)])})
    z = Zygote(preload=("torch", "torch.distributed"))  # what the probe imports
    yield z, env
    z.stop()


def test_forked_ranks_get_torchruns_environment_and_form_a_group(zygote, tmp_path):
    z, env = zygote
    rc, out = z.run("zs_forked_probe", ["ok", str(tmp_path)], nproc=3,
                    env=dict(env, ZS_TEST_MARK="m"), timeout=120)
    assert rc == 0, out
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    for r, got in enumerate(ranks):
        assert got["sum"] == 6.0 and got["name"] == "__main__" and got["argv"] == [
            "ok", str(tmp_path)]
        e = got["env"]
        assert (e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"]) == (
            str(r), str(r), "3", "3")
        assert e["MASTER_ADDR"] == "127.0.0.1" and e["ZS_TEST_MARK"] == "m"
    assert len({g["env"]["MASTER_PORT"] for g in ranks}) == 1
    assert len({g["env"]["TORCHELASTIC_RUN_ID"] for g in ranks}) == 1
    assert sorted(line for line in out.splitlines() if "done" in line) == [
        "rank 0 done", "rank 1 done", "rank 2 done"]


def test_a_failing_rank_fails_the_job_and_ends_the_others(zygote, tmp_path):
    z, env = zygote
    t0 = time.monotonic()
    rc, out = z.run("zs_forked_probe", ["fail", str(tmp_path)], nproc=2, env=env, timeout=120)
    assert rc not in (0, None), out
    assert "RuntimeError: rank one gives up" in out, out
    assert time.monotonic() - t0 < GRACE_S + 30  # rank 0, stuck in its all-reduce, was ended
    assert not list(tmp_path.glob("rank*.json"))
    rc, out = z.run("zs_forked_probe", ["ok", str(tmp_path)], nproc=2, env=env, timeout=120)
    assert rc == 0, out  # the zygote serves the next job


def test_a_job_over_its_time_ends_every_rank_and_the_next_job_runs(zygote, tmp_path):
    z, env = zygote
    t0 = time.monotonic()
    rc, _ = z.run("zs_forked_probe", ["hang", str(tmp_path)], nproc=2, env=env, timeout=10)
    assert rc is None and time.monotonic() - t0 < 20
    assert z.proc is None  # the zygote and its ranks were ended
    rc, out = z.run("zs_forked_probe", ["ok", str(tmp_path)], nproc=2, env=env, timeout=120)
    assert rc == 0, out


def test_a_zygote_that_cannot_preload_fails_the_job_saying_why(tmp_path):
    z = Zygote(preload=("zs_no_such_module",))
    rc, out = z.run("zs_forked_probe", ["ok", str(tmp_path)], nproc=2, env=_env(1),
                    timeout=60)
    assert rc == 1 and z.proc is None
    assert "ModuleNotFoundError" in out and "zs_no_such_module" in out, out
