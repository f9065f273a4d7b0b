"""A dropped engine is freed, and ``dist.destroy_process_group()`` really ends its group.

A process group that outlives ``destroy_process_group()`` keeps gloo's worker threads
running into interpreter shutdown, where one still releasing a finished collective aborts
the process (see [Note: pinned default group] in zerostate.dist.collectives).
"""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
from common import batch, make_engine, make_model
from simgroup import run_sim


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_dropped_engine_is_freed_with_its_model(monkeypatch, stage) -> None:
    def worker(rank, group):
        engine = make_engine(make_model(), stage=stage, group=group)
        x, y = batch(0, 0)
        engine.backward(engine(x, y))
        engine.step()
        refs = [weakref.ref(engine), weakref.ref(engine.module)]
        del engine
        gc.collect()
        return [r() is None for r in refs]

    assert run_sim(worker, 1, monkeypatch) == [[True, True]]


SCRIPT = """
import gc, os, sys, weakref
import torch, torch.distributed as dist
sys.path[:0] = [{tests!r}, {engine_tests!r}]
from common import batch, make_engine, make_model

def threads():
    return len(os.listdir("/proc/self/task"))

torch.set_num_threads(1)
before = threads()
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
group = dist.new_group([0]) if {explicit} else None
{user_optimizer}
engine = make_engine(make_model(), stage=2, group=group)
x, y = batch(0, 0)
engine.backward(engine(x, y))
engine.step()
groups = [weakref.ref(dist.group.WORLD)] + ([weakref.ref(group)] if group is not None else [])
del engine, group
gc.collect()  # the first optimizer's lazy torch._dynamo import leaves a frame cycle
dist.destroy_process_group()
import time
deadline = time.monotonic() + 10  # a finished thread may take a moment to leave, under load
while threads() > before and time.monotonic() < deadline:
    time.sleep(0.05)
tasks = os.listdir("/proc/self/task")
names = sorted(open(f"/proc/self/task/{{t}}/comm").read().strip() for t in tasks)
alive = sum(g() is not None for g in groups)
print("groups alive:", alive, "threads left:", threads() - before, names)
"""


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc")
@pytest.mark.parametrize(
    "explicit, user_optimizer",
    [(False, ""), (True, ""), (False, "torch.optim.SGD([torch.zeros(1, requires_grad=True)])")],
    ids=["default-group", "explicit-group", "optimizer-built-first"],
)
def test_destroy_process_group_frees_the_group_and_its_threads(explicit, user_optimizer) -> None:
    from helpers_dist import run_script

    proc = run_script(SCRIPT, explicit=explicit, user_optimizer=user_optimizer)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "groups alive: 0 threads left: 0" in proc.stdout, proc.stdout + proc.stderr[-2000:]
