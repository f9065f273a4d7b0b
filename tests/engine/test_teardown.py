"""A dropped engine is freed, and ``dist.destroy_process_group()`` really ends its group.

A process group that outlives ``destroy_process_group()`` keeps gloo's worker threads
running into interpreter shutdown, where one still releasing a finished collective aborts
the process (see [Note: pinned default group] in zerostate.dist.collectives and
[Note: no group kept to exit] in zerostate.dist.lifetime).
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


#: A script's start: an engine's imports, and the threads before any process group.
HEAD = """
import gc, os, sys, time, weakref
import torch, torch.distributed as dist
sys.path[:0] = [{tests!r}, {engine_tests!r}]
from common import batch, make_engine, make_model

def threads():
    return len(os.listdir("/proc/self/task"))

torch.set_num_threads(1)
before = threads()
"""
#: Waits until the threads the group started have gone, or 10 s.
THREADS_GONE = """
deadline = time.monotonic() + 10  # a finished thread may take a moment to leave, under load
while threads() > before and time.monotonic() < deadline:
    time.sleep(0.05)
"""

SCRIPT = (
    HEAD
    + """
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
"""
    + THREADS_GONE
    + """
tasks = os.listdir("/proc/self/task")
names = sorted(open(f"/proc/self/task/{{t}}/comm").read().strip() for t in tasks)
alive = sum(g() is not None for g in groups)
print("groups alive:", alive, "threads left:", threads() - before, names)
"""
)


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


TWO_RANKS = (
    HEAD
    + """
from zerostate.dist import collectives

rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=rank, world_size=2)
engine = make_engine(make_model(), stage={stage})
x, y = batch(0, rank)
engine.backward(engine(x, y))
engine.step()
# A collective large enough for the shared-memory transport, as a bigger model's buckets are.
big = torch.full((1 << 17,), float(rank + 1))
collectives.all_reduce(big, group=None, stats=None)
assert big[0].item() == 3.0
print("transports:", len(collectives._TRANSPORTS))
group = weakref.ref(dist.group.WORLD)
del engine
gc.collect()
dist.barrier()
dist.destroy_process_group()
"""
    + THREADS_GONE
    + """
print("group alive:", group() is not None, "threads left:", threads() - before)
"""
)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc")
@pytest.mark.parametrize("stage", [1, 3])
def test_a_shared_memory_transport_does_not_keep_its_group(stage) -> None:
    """[Note: no group kept to exit]: the transport's table and its collectives held the
    group, so at 2 ranks ``destroy_process_group()`` left it and its gloo threads alive to
    interpreter exit."""
    import subprocess
    import sys
    import textwrap

    from ports import free_port

    tests = Path(__file__).resolve().parents[1]
    script = textwrap.dedent(TWO_RANKS).format(
        tests=str(tests), engine_tests=str(tests / "engine"), port=free_port(), stage=stage
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(rank)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for rank in range(2)
    ]
    outputs = [p.communicate(timeout=180) for p in procs]
    for proc, (out, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, err[-2000:]
        assert "transports: 1" in out, out + err[-2000:]
        assert "group alive: False threads left: 0" in out, out + err[-2000:]


#: Destroys the default group and says when the group itself is freed: at once, before
#: the interpreter finalises, or (no line) not at all.
DESTROY_WATCHED = """
def freed(_):
    print("group freed while finalizing:", sys.is_finalizing(), flush=True)


ref = weakref.ref(dist.group.WORLD, freed)
dist.destroy_process_group()
print("alive after destroy:", ref() is not None, flush=True)
"""


PINNED = (
    """
import atexit, gc, sys, types, weakref


def defaults():  # registered before zerostate is imported: runs after its exit hook
    print("defaults:", lib.Backend.barrier.__defaults__, lib.gather.__kwdefaults__, flush=True)


atexit.register(defaults)
import torch, torch.distributed as dist
sys.path[:0] = [{tests!r}, {engine_tests!r}]
from common import batch, make_engine, make_model

torch.set_num_threads(1)
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
if {client!r} == "engine":
    engine = make_engine(make_model(), stage=2)
    x, y = batch(0, 0)
    engine.backward(engine(x, y))
    engine.step()
    del engine
else:  # the public save and load
    import zerostate

    state = {{"w": torch.arange(6.0).reshape(2, 3)}}
    zerostate.save(state, {root!r})
    got = {{"w": torch.zeros(2, 3)}}
    assert zerostate.load(got, {root!r}) == 0 and torch.equal(got["w"], state["w"])
gc.collect()
# A library imported once the group exists binds it as a default, as DeepSpeed's
# TorchBackend.barrier(group=GroupMember.WORLD) does; one keyword-only default too.
lib = types.ModuleType("pinning_library")
exec(
    "import torch.distributed as dist\\n"
    "class Backend:\\n"
    "    def barrier(self, group=dist.GroupMember.WORLD, async_op=False):\\n"
    "        return group\\n"
    "def gather(*, group=dist.group.WORLD, dst=0):\\n"
    "    return group, dst\\n",
    lib.__dict__,
)
sys.modules[lib.__name__] = lib

"""
    + DESTROY_WATCHED
)


@pytest.mark.slow
@pytest.mark.parametrize("client", ["engine", "save-load"])
def test_a_group_another_module_pinned_is_freed_before_finalisation(client, tmp_path) -> None:
    """[Note: no group kept to exit]: a default argument of another library kept the
    destroyed group (and its gloo workers) alive into interpreter finalisation, where a
    worker releasing a collective aborts the process; the exit hook frees it first. The
    library's functions then take the default group, as the default meant."""
    from helpers_dist import run_script

    proc = run_script(PINNED, client=client, root=str(tmp_path / "ckpt"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    # Still alive after destroy_process_group: the pin is real, not the test's own.
    assert "alive after destroy: True" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert "group freed while finalizing: False" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert "defaults: (None, False) {'group': None, 'dst': 0}" in proc.stdout, proc.stdout


def test_the_exit_hook_leaves_live_groups_and_other_defaults() -> None:
    from zerostate.dist import lifetime

    def keep(group=None, other=3, *, sentinel="x"):
        return group, other, sentinel

    # No group destroyed in this process (or none used): nothing to do, nothing touched.
    assert lifetime._release_destroyed_group_pins() == 0
    assert keep.__defaults__ == (None, 3) and keep.__kwdefaults__ == {"sentinel": "x"}


SAVE_LOAD = (
    """
import sys, weakref
import torch, torch.distributed as dist
import zerostate

dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
state = {{"w": torch.arange(6.0).reshape(2, 3)}}
zerostate.save(state, {root!r})
got = {{"w": torch.zeros(2, 3)}}
assert zerostate.load(got, {root!r}) == 0 and torch.equal(got["w"], state["w"])

"""
    + DESTROY_WATCHED
)


@pytest.mark.slow
def test_save_and_load_keep_no_destroyed_group_to_finalisation(tmp_path) -> None:
    """``zerostate.load`` kept each group's memory tiers, and with them the group, for the
    life of the process ([Note: no group kept to exit])."""
    from helpers_dist import run_script

    proc = run_script(SAVE_LOAD, root=str(tmp_path / "ckpt"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "group freed while finalizing: False" in proc.stdout, proc.stdout + proc.stderr[-2000:]
