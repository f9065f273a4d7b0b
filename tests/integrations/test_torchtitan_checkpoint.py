"""torchtitan 0.3.0's checkpoint-manager contract through zerostate's store
(``zerostate.integrations.torchtitan.CheckpointManager``), against torchtitan's own DCP
``CheckpointManager`` in the same runs.

The model is torchtitan's Llama3 ``debugmodel`` (benchmarks/titan.py builds it, with what runs
on CPU), FSDP2 applied by torchtitan's own ``apply_fsdp_to_decoder`` over 2 gloo ranks,
torchtitan's ``OptimizersContainer`` (AdamW) and ``LRSchedulersContainer`` (warmup), a
``train_state`` holding the step and tokens seen (what the trainer saves of itself) and a
dataloader whose state is its position. Importing ``torchtitan.trainer`` needs torchtitan's
training-loop dependencies (``torchdata``, ``datasets``), which the environment leaves out
(docs/torchtitan.md), so :func:`_job` drives the manager as ``Trainer.train`` and
``Trainer.train_step`` drive it: ``config.build(dataloader=..., model_parts=...,
optimizers=..., lr_schedulers=..., states={"train_state": ...}, sd_adapter=...,
base_folder=...)``, ``load(step=config.load_step)``, then each step forward, backward,
``maybe_wait_for_staging()``, the optimizer and scheduler steps, ``save(step,
last_step=step == training_steps)``; ``close()`` at the end. A job that stops before its
last step is a job that crashed after that step.

What is shown, with ``async_mode`` disabled and async: a job saving every 2 steps with
keep_latest_k 2 leaves the same steps as torchtitan's manager (the oldest gone); a new job,
its parameters initialised differently, resumes from the newest step with parameters
bit-identical to what torchtitan's manager restores, and its next 2 losses equal
torchtitan's resume and the uninterrupted run. Also: ``exclude_from_loading`` leaves those
states as they were, ``initial_load_path`` loads the model only, ``last_save_in_hf`` writes
a Hugging Face directory that ``initial_load_in_hf`` loads back, and bad settings are refused
in one line.

Gated like tests/integrations/test_torchtitan.py: a missing ``torchtitan`` package skips
this file unless ``ZEROSTATE_REQUIRE_TORCHTITAN`` is set."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers_dist import run_distributed
from titan_gate import require_torchtitan

require_torchtitan()


REPO = Path(__file__).resolve().parents[2]
WORLD = 2
#: The first job trains to CRASH_AFTER of TRAINING_STEPS (saves at 2, 4, 6); the resumed job
#: finishes (steps 7 and 8, the last one saved model-only as torchtitan does).
TRAINING_STEPS, CRASH_AFTER, INTERVAL, KEEP = 8, 7, 2, 2
TIMEOUT = 600


# ---------------------------------------------------------------- one torchtitan job
class _TrainState:
    """What torchtitan's Trainer saves of itself (``Trainer.state_dict``)."""

    def __init__(self) -> None:
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self) -> dict:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.ntokens_seen = state["step"], state["ntokens_seen"]


class _Batches:
    """A dataloader whose state is its position: the batch of each position is fixed
    (benchmarks/titan.py's ``batch``), so a resumed job sees the batches the crashed one
    would have."""

    def __init__(self, dp_rank: int) -> None:
        self.dp_rank, self.position = dp_rank, 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        from benchmarks import titan

        self.position += 1
        return titan.batch(self.position, self.dp_rank)

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]


def _config(manager: str, **settings):
    if manager == "zerostate":
        from zerostate.integrations.torchtitan import CheckpointManager
    else:
        from torchtitan.components.checkpointer import CheckpointManager
    return CheckpointManager.Config(enable=True, **settings)


def _full_params(model) -> dict[str, torch.Tensor]:
    """The model's full tensors (collective); on rank 0 only, None elsewhere."""
    full = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    return full if torch.distributed.get_rank() == 0 else None


def _job(
    rank: int, world_size: int, manager: str, dump: str, settings: dict, stop_after: int,
    perturb: bool = False, hf: bool = False,
) -> dict:  # fmt: skip
    """One torchtitan job on the ranks (module docstring), trained to ``stop_after``."""
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

    from benchmarks import titan

    dims = titan.parallel_dims(world_size, 1)
    model = titan.build(None)
    if perturb:  # a job whose own initial weights differ from the saved run's
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.5).add_(0.01)
    dp_mesh = dims.get_mesh("fsdp")
    apply_fsdp_to_decoder(model, dp_mesh, param_dtype=torch.float32,
                          reduce_dtype=torch.float32, pp_enabled=False)  # fmt: skip
    for module in model.modules():
        if isinstance(module, FSDPModule):  # gloo has no PREMUL_SUM
            module.set_force_sum_reduction_for_comms(True)
    optimizers = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={
            "lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1})],
        implementation="for-loop",
    ).build(model_parts=[model])  # fmt: skip
    schedulers = LRSchedulersContainer.Config(warmup_steps=3).build(
        optimizers=optimizers, training_steps=TRAINING_STEPS
    )
    train_state, batches = _TrainState(), _Batches(dp_mesh.get_local_rank())
    adapter = None
    if hf:
        from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

        adapter = Llama3StateDictAdapter(titan.llama3_config(tp=False), None)
    config = _config(manager, **settings)
    checkpointer = config.build(
        dataloader=batches, model_parts=[model], optimizers=optimizers,
        lr_schedulers=schedulers, states={"train_state": train_state}, sd_adapter=adapter,
        base_folder=dump,
    )  # fmt: skip
    loaded = checkpointer.load(step=config.load_step)
    out = {
        "loaded": loaded,
        "step_after_load": train_state.step,
        "position_after_load": batches.position,
        "lr_epoch_after_load": schedulers.state_dict()["last_epoch"],
        "params_after_load": _full_params(model),
        "losses": {},
    }
    while train_state.step < stop_after:
        train_state.step += 1
        x, y = batches.next()
        local = titan.summed_loss(model(x), y)
        (local / (world_size * titan.ROWS * titan.SEQ)).backward()
        checkpointer.maybe_wait_for_staging()
        optimizers.step()
        schedulers.step()
        optimizers.zero_grad()
        train_state.ntokens_seen += x.numel()
        out["losses"][train_state.step] = titan.global_loss(local, dp_mesh.get_group(), world_size)
        checkpointer.save(train_state.step, last_step=train_state.step == TRAINING_STEPS)
    checkpointer.close()
    out["final_params"] = _full_params(model)
    if hf and rank == 0:
        out["final_hf"] = adapter.to_hf(out["final_params"])
    return out if rank == 0 else {}


def _steps(manager: str, folder: Path) -> list[int]:
    """The steps a manager's folder holds."""
    if manager == "zerostate":
        from zerostate.store import open_checkpoint

        return open_checkpoint(str(folder)).steps()
    return sorted(int(p.name.split("-")[1]) for p in folder.iterdir() if p.name.startswith("step-"))


def _settings(async_mode: str, **more) -> dict:
    return dict(folder="ckpt", interval=INTERVAL, keep_latest_k=KEEP, async_mode=async_mode,
                **more)  # fmt: skip


_RUNS: dict[str, dict] = {}  # per async mode: both fixtures share one pair of jobs


@pytest.fixture(scope="module", params=["disabled", "async"])
def runs(request, tmp_path_factory) -> dict:
    """Per manager: the first job (crashes after CRASH_AFTER) and the resumed one."""
    return _runs(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def sync_runs(tmp_path_factory) -> dict:
    """The synchronous jobs of :func:`runs`: what the tests of the load path start from
    (that path does not depend on the async mode)."""
    return _runs("disabled", tmp_path_factory)


def _runs(mode: str, tmp_path_factory) -> dict:
    if mode in _RUNS:
        return _RUNS[mode]
    out: dict = {"mode": mode}
    for manager in ("zerostate", "torchtitan"):
        dump = tmp_path_factory.mktemp(f"{manager}-{mode}")
        settings = _settings(mode)
        first = run_distributed(_job, WORLD, manager, str(dump), settings, CRASH_AFTER,
                                timeout=TIMEOUT)[0]  # fmt: skip
        steps_after_crash = _steps(manager, dump / "ckpt")
        resumed = run_distributed(_job, WORLD, manager, str(dump), settings, TRAINING_STEPS,
                                  perturb=True, timeout=TIMEOUT)[0]  # fmt: skip
        out[manager] = {"dump": dump, "first": first, "resumed": resumed,
                        "steps_after_crash": steps_after_crash,
                        "steps_at_end": _steps(manager, dump / "ckpt")}  # fmt: skip
    _RUNS[mode] = out
    return out


def _assert_bit_identical(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    differ = [k for k in want if not torch.equal(got[k], want[k])]
    assert differ == [], f"{len(differ)} tensors differ, e.g. {differ[:3]}"


@pytest.mark.slow
def test_saves_keep_the_latest_k_steps_as_torchtitan_does(runs):
    ours, theirs = runs["zerostate"], runs["torchtitan"]
    # Saved at 2, 4 and 6, keep_latest_k 2: step 2 is gone. The last step (8) is saved
    # model-only and purges nothing, as in torchtitan.
    assert ours["steps_after_crash"] == [4, 6]
    assert ours["steps_at_end"] == [4, 6, 8]
    if runs["mode"] == "disabled":
        assert theirs["steps_after_crash"] == [4, 6] and theirs["steps_at_end"] == [4, 6, 8]
    else:
        # torchtitan's async purge lists the folder while the step in flight may have no
        # folder yet, and then keeps one step more (2, 4, 6 in one run): a race, so only
        # "no fewer" is checked. The store deletes after the commit.
        assert set(ours["steps_after_crash"]) <= set(theirs["steps_after_crash"])
        assert set(ours["steps_at_end"]) <= set(theirs["steps_at_end"])
    # Same training before the crash: the managers do not change a step of it.
    assert ours["first"]["losses"] == theirs["first"]["losses"]


@pytest.mark.slow
def test_resume_restores_what_torchtitans_manager_restores(runs):
    ours, theirs = runs["zerostate"]["resumed"], runs["torchtitan"]["resumed"]
    assert ours["loaded"] and theirs["loaded"]
    assert ours["step_after_load"] == theirs["step_after_load"] == 6
    assert ours["position_after_load"] == theirs["position_after_load"] == 6
    assert ours["lr_epoch_after_load"] == theirs["lr_epoch_after_load"] == 6
    _assert_bit_identical(ours["params_after_load"], theirs["params_after_load"])
    # The perturbed start was really replaced.
    fresh = runs["zerostate"]["first"]["params_after_load"]
    assert not torch.equal(ours["params_after_load"]["norm.weight"], fresh["norm.weight"])


@pytest.mark.slow
def test_resumed_steps_equal_torchtitans_resume_and_the_uninterrupted_run(runs):
    ours, theirs = runs["zerostate"]["resumed"], runs["torchtitan"]["resumed"]
    assert sorted(ours["losses"]) == sorted(theirs["losses"]) == [7, 8]
    print(f"\n{runs['mode']}: resumed losses, zerostate {ours['losses']}, torchtitan "
          f"{theirs['losses']}")  # fmt: skip
    for step in (7, 8):
        assert abs(ours["losses"][step] - theirs["losses"][step]) <= 1e-6, step
    # Step 7 was also trained by the first job before its crash.
    assert abs(ours["losses"][7] - runs["zerostate"]["first"]["losses"][7]) <= 1e-6
    _assert_bit_identical(ours["final_params"], theirs["final_params"])


@pytest.mark.slow
def test_exclude_from_loading_leaves_those_states_untouched(sync_runs):
    dump = str(sync_runs["zerostate"]["dump"])
    settings = _settings(
        "disabled", load_step=6, exclude_from_loading=["dataloader", "lr_scheduler"]
    )
    got = run_distributed(_job, WORLD, "zerostate", dump, settings, 0, perturb=True,
                          timeout=TIMEOUT)[0]  # fmt: skip
    assert got["step_after_load"] == 6  # train_state loaded
    assert got["position_after_load"] == 0 and got["lr_epoch_after_load"] == 0  # untouched
    _assert_bit_identical(
        got["params_after_load"], sync_runs["zerostate"]["resumed"]["params_after_load"]
    )


@pytest.mark.slow
def test_initial_load_path_loads_the_model_only(sync_runs, tmp_path):
    source = sync_runs["zerostate"]["dump"] / "ckpt"  # newest: 8, the model-only last save
    settings = _settings("disabled", initial_load_path=str(source), initial_load_model_only=True)
    got = run_distributed(_job, WORLD, "zerostate", str(tmp_path), settings, 0, perturb=True,
                          timeout=TIMEOUT)[0]  # fmt: skip
    assert got["loaded"]
    assert got["step_after_load"] == 0 and got["position_after_load"] == 0
    assert got["lr_epoch_after_load"] == 0
    final = sync_runs["zerostate"]["resumed"]["final_params"]
    _assert_bit_identical(got["params_after_load"], final)
    assert not (tmp_path / "ckpt").exists() or _steps("zerostate", tmp_path / "ckpt") == []


@pytest.mark.slow
def test_last_save_in_hf_writes_a_directory_initial_load_in_hf_reads(tmp_path):
    from safetensors.torch import load_file

    settings = _settings("disabled", last_save_in_hf=True)
    settings["interval"] = 100  # only the last step is saved
    saved = run_distributed(_job, WORLD, "zerostate", str(tmp_path / "a"), settings,
                            TRAINING_STEPS, hf=True, timeout=TIMEOUT)[0]  # fmt: skip
    hf_dir = tmp_path / "a" / "ckpt-hf" / f"step-{TRAINING_STEPS}"
    index = json.loads((hf_dir / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) == WORLD, files  # each rank wrote its share
    exported: dict = {}
    for name in files:
        exported.update(load_file(str(hf_dir / name)))
    assert "model.layers.0.self_attn.q_proj.weight" in exported
    _assert_bit_identical(exported, saved["final_hf"])
    # And back: a new job starts from the directory (model only, through the adapter).
    settings = _settings("disabled", initial_load_path=str(hf_dir), initial_load_in_hf=True)
    got = run_distributed(_job, WORLD, "zerostate", str(tmp_path / "b"), settings, 0,
                          perturb=True, hf=True, timeout=TIMEOUT)[0]  # fmt: skip
    assert got["loaded"] and got["step_after_load"] == 0
    _assert_bit_identical(got["params_after_load"], saved["final_params"])


@pytest.mark.slow
def test_async_with_pinned_mem_saves_what_a_synchronous_job_saves(sync_runs, tmp_path):
    """Pinned staging writes from a checkpoint process of its own, which the test pool's
    (daemonic) workers may not start: this job runs under real ``torchrun``."""
    record = tmp_path / "pinned.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [
        str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH")])))  # fmt: skip
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD),
               __file__, str(tmp_path), str(record)]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=TIMEOUT)
    assert proc.returncode == 0 and record.exists(), (proc.stdout + proc.stderr)[-4000:]
    pinned = json.loads(record.read_text())
    first = sync_runs["zerostate"]["first"]["losses"]
    assert pinned["losses"] == [first[step] for step in range(1, 6)]
    assert pinned["steps"] == [2, 4]
    # A synchronous job resumes from the pinned save's newest step and trains step 5 again.
    settings = _settings("disabled")
    got = run_distributed(_job, WORLD, "zerostate", str(tmp_path), settings, 5, perturb=True,
                          timeout=TIMEOUT)[0]  # fmt: skip
    assert got["step_after_load"] == 4 and got["position_after_load"] == 4
    assert abs(got["losses"][5] - first[5]) <= 1e-6


def _pinned_main(dump: str, record: str) -> None:
    """One rank of the ``torchrun`` job of the pinned test: 5 steps, saving every 2."""
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    out = _job(rank, WORLD, "zerostate", dump, _settings("async_with_pinned_mem"), 5)
    if rank == 0:
        losses = [out["losses"][step] for step in range(1, 6)]
        steps = _steps("zerostate", Path(dump) / "ckpt")
        Path(record).write_text(json.dumps({"losses": losses, "steps": steps}))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


class _Tokens(torch.utils.data.IterableDataset):
    """A dataset with a resumable position, as torchtitan's text datasets have."""

    def __init__(self) -> None:
        self.position = 0

    def __iter__(self):
        while True:
            self.position += 1
            yield torch.full((4,), self.position)

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]


def _stored_values(root) -> str:
    """The non-tensor values of the newest step at ``root``, as the JSON stored."""
    import json

    from zerostate.store import open_checkpoint

    with open_checkpoint(str(root)).step() as step:
        return json.dumps(step.attrs["dcp"]["values"])


def test_torchtitans_dataloader_state_is_stored_without_pickle(tmp_path):
    if not os.environ.get("ZEROSTATE_REQUIRE_TORCHTITAN"):  # the scripts install it
        pytest.importorskip("torchdata", reason="torchtitan's ParallelAwareDataloader needs it")
    import torch.distributed.checkpoint as dcp
    from torchtitan.components.dataloader import ParallelAwareDataloader

    from zerostate.dcp import StorageReader, StorageWriter
    from zerostate.integrations.torchtitan import _dataloader_state

    def loader():
        return ParallelAwareDataloader(_Tokens(), dp_rank=0, dp_world_size=1, batch_size=2)

    saved = loader()
    batches = iter(saved)
    next(batches), next(batches)
    # As it is, its state is a pickle: the store keeps it as opaque bytes, and torchtitan's
    # own load_state_dict would unpickle them. Through the manager's wrapper the step holds
    # the plain state instead, and no bytes at all.
    dcp.save({"dataloader": saved}, storage_writer=StorageWriter(tmp_path / "raw"))
    assert "__zs_bytes__" in _stored_values(tmp_path / "raw")
    dcp.save({"dataloader": _dataloader_state(saved)}, storage_writer=StorageWriter(tmp_path))
    assert "__zs_bytes__" not in _stored_values(tmp_path)
    want = next(batches)
    resumed = loader()
    dcp.load({"dataloader": _dataloader_state(resumed)}, storage_reader=StorageReader(tmp_path))
    assert torch.equal(next(iter(resumed)), want)
    # Another dp world size is refused, as torchtitan refuses it.
    other = ParallelAwareDataloader(_Tokens(), dp_rank=0, dp_world_size=2, batch_size=2)
    with pytest.raises(Exception, match="dp world size 1"):
        dcp.load({"dataloader": _dataloader_state(other)}, storage_reader=StorageReader(tmp_path))


# ---------------------------------------------------------------- settings and import
def test_an_unknown_async_mode_is_refused_in_one_line():
    from zerostate.integrations.torchtitan import CheckpointManager

    with pytest.raises(ValueError) as info:
        CheckpointManager.Config(enable=True, async_mode="sometimes")
    message = str(info.value)
    assert "\n" not in message and "async_mode" in message and "'sometimes'" in message
    assert CheckpointManager.Config(async_mode=" Async ").async_mode == "async"
    # torchtitan's own checks hold too (keep_latest_k 1 would purge the step being written).
    with pytest.raises(ValueError, match="at least 2"):
        CheckpointManager.Config(keep_latest_k=1)


def test_the_config_builds_our_manager():
    from zerostate.integrations.torchtitan import CheckpointManager

    manager = CheckpointManager.Config(enable=False).build(
        dataloader=None, model_parts=[], optimizers=None, lr_schedulers=None, states={},
        sd_adapter=None,
    )  # fmt: skip
    assert type(manager) is CheckpointManager
    assert manager.save(2) is False and manager.load() is False  # disabled, as torchtitan's


def test_zerostate_does_not_import_torchtitan_and_the_module_says_what_is_missing():
    script = (
        "import sys\n"
        "import zerostate, zerostate.dcp, zerostate.integrations\n"
        "assert 'torchtitan' not in sys.modules, 'zerostate imported torchtitan'\n"
        "sys.modules['torchtitan'] = None  # as if it were not installed\n"
        "try:\n"
        "    import zerostate.integrations.torchtitan\n"
        "except ImportError as exc:\n"
        "    print(type(exc).__name__ + ': ' + str(exc))\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO),
               os.environ.get("PYTHONPATH")])))  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = proc.stdout.strip()
    assert "\n" not in line and line.startswith("ImportError: ") and "torchtitan" in line, line


if __name__ == "__main__":
    _pinned_main(sys.argv[1], sys.argv[2])
