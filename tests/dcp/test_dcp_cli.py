"""``zerostate inspect`` and ``verify`` on a step written through ``zerostate.dcp``: inspect
shows each global tensor and its boxes, verify names a damaged tensor and exits 1.

The CLI of this source tree runs in a child process (``zerostate_cli`` is the ``cli/``
directory beside ``zerostate/``), with no process group: DCP's no_dist path wrote the step.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from tests.dcp import cli_workers, workers
from tests.helpers_dist import run_distributed
from zerostate.dcp import StorageReader, StorageWriter, describe_step
from zerostate.store import open_checkpoint
from zerostate.store.sources import open_source

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _cli(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    alias = tmp_path / "cli-path"
    alias.mkdir(exist_ok=True)
    if not (alias / "zerostate_cli").exists():
        (alias / "zerostate_cli").symlink_to(ROOT / "cli")
    env = dict(os.environ, PYTHONPATH=f"{alias}{os.pathsep}{ROOT}")
    code = "import sys; from zerostate_cli.main import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=300
    )


@pytest.fixture
def step_root(tmp_path) -> Path:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 5)
    state = {"model": model.state_dict(), "epoch": 3}
    root = tmp_path / "ckpt"
    dcp.save(state, storage_writer=StorageWriter(str(root)))
    return root


def test_inspect_shows_global_tensors_and_boxes(step_root, tmp_path):
    with open_checkpoint(str(step_root)).step() as step:
        entries = {e["key"]: e for e in describe_step(step)}
    assert entries["model.weight"]["shape"] == [5, 8]
    assert entries["model.weight"]["chunks"][0]["offsets"] == [0, 0]
    assert entries["epoch"] == {"key": "epoch", "kind": "value"}

    proc = _cli(["inspect", str(step_root)], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "model.weight  5x8 float32: [0:5, 0:8] rank 0" in proc.stdout
    assert "epoch  (non-tensor value, JSON)" in proc.stdout


def test_verify_names_a_damaged_tensor(step_root, tmp_path):
    proc = _cli(["verify", str(step_root)], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    row = step_root / "step-00000000" / "dcp" / "c" / "0" / "0"
    data = bytearray(row.read_bytes())
    data[10] ^= 0x01  # inside model.weight, the first piece of the row
    row.write_bytes(bytes(data))
    proc = _cli(["verify", str(step_root)], tmp_path)
    assert proc.returncode == 1
    assert "model.weight" in proc.stdout + proc.stderr


# ----------------------------------------------- every command reads these steps
def _rows(root: Path) -> dict[str, bytes]:
    """The row objects of a root, by path inside it."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("c/*/0"))}


def _boxes(root: Path) -> dict[str, list[tuple[list[int], list[int], int]]]:
    with open_checkpoint(str(root)).step() as step:
        return {
            e["key"]: sorted((c["offsets"], c["sizes"], c["rank"]) for c in e["chunks"])
            for e in describe_step(step)
            if e["kind"] == "tensor"
        }


@pytest.fixture
def optim_root(tmp_path) -> tuple[Path, dict[str, torch.Tensor]]:
    """One process: a model with a bf16 layer and AdamW state, saved with ``get_state_dict``'s
    layout and a non-tensor value; the saved tensors by zerostate name."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 5), torch.nn.Linear(5, 3))
    model[1].to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model[1](model[0](torch.randn(2, 8)).bfloat16()).float().square().mean().backward()
    opt.step()
    model_sd, optim_sd = get_state_dict(model, opt)
    root = tmp_path / "ckpt"
    dcp.save({"model": model_sd, "optim": optim_sd, "epoch": 3}, storage_writer=StorageWriter(root))
    full = {f"model/{k}": v.detach().clone() for k, v in model_sd.items()}
    for fqn, states in optim_sd["state"].items():
        full.update({f"optim/{k}/{fqn}": v for k, v in states.items() if v.dim()})
    return root, full


def test_consolidate_of_one_process_equals_its_state(optim_root, tmp_path):
    root, full = optim_root
    out = tmp_path / "model.safetensors"
    done = _cli(["consolidate", str(root), str(out), "-q"], tmp_path)
    assert done.returncode == 0, done.stderr
    got = load_file(out)
    model = {k.removeprefix("model/"): v for k, v in full.items() if k.startswith("model/")}
    assert set(got) == set(model)
    for key, tensor in model.items():
        assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), key
    assert got["1.weight"].dtype == torch.bfloat16
    # Every command sees the optimizer's moments under zerostate's names, as loads do.
    with open_source(str(root)).step() as step:
        assert step.attrs["engine"]["source"] == "dcp"
        assert set(step.tensors) == set(full)
        for name, tensor in full.items():
            assert torch.equal(step.read(name), tensor), name


def test_reshard_there_and_back_gives_the_same_row_objects(optim_root, tmp_path):
    root, full = optim_root
    for src, dst, world in (
        (root, "r3", 3),
        (tmp_path / "r3", "r4", 4),
        (tmp_path / "r4", "r1", 1),
    ):
        done = _cli(
            ["reshard", str(src), str(tmp_path / dst), "--world-size", str(world)], tmp_path
        )
        assert done.returncode == 0, done.stderr
    # Rows split as FSDP2 splits them (torch.chunk): 5 rows over 4 ranks are 2, 2, 1 and 0.
    assert _boxes(tmp_path / "r4")["model.0.weight"] == [
        ([0, 0], [2, 8], 0), ([2, 0], [2, 8], 1), ([4, 0], [1, 8], 2), ([5, 0], [0, 8], 3),
    ]  # fmt: skip
    assert _rows(tmp_path / "r1") == _rows(root)
    # Still a DCP step: torch's own API loads it back.
    state = {"model": {k[6:]: torch.zeros_like(v) for k, v in full.items() if k[:6] == "model/"}}
    dcp.load(state, storage_reader=StorageReader(tmp_path / "r3"))
    assert torch.equal(state["model"]["0.weight"], full["model/0.weight"])


def test_inspect_shows_each_tensors_boxes_after_a_reshard(optim_root, tmp_path):
    root, _ = optim_root
    out = tmp_path / "r2"
    assert _cli(["reshard", str(root), str(out), "--world-size", "2"], tmp_path).returncode == 0
    shown = _cli(["inspect", str(out)], tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert "model/0.weight" in shown.stdout
    assert "model.0.weight  5x8 float32: [0:3, 0:8] rank 0, [3:5, 0:8] rank 1" in shown.stdout
    refused = _cli(["reshard", str(root), str(tmp_path / "tp"), "--world-size", "2", "--tp", "2"],
                   tmp_path)  # fmt: skip
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert "written through zerostate.dcp" in refused.stderr


def test_convert_to_dcp_writes_what_the_step_holds(optim_root, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    root, full = optim_root
    out = tmp_path / "dcp"
    done = _cli(["convert", str(root), str(out), "--to", "dcp"], tmp_path)
    assert done.returncode == 0, done.stderr
    dcp_to_torch_save(str(out), str(tmp_path / "ref.pt"))
    ref = torch.load(tmp_path / "ref.pt", weights_only=True)
    for name, tensor in full.items():
        if name.startswith("model/"):
            got = ref["model"][name[6:]]
        else:
            _, key, fqn = name.split("/")
            got = ref["optimizer"]["state"][fqn][key]
        assert got.dtype == tensor.dtype and torch.equal(got, tensor), name


def test_consolidate_refuses_a_damaged_piece_naming_its_tensor(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.Linear(48, 3))
    root = tmp_path / "ckpt"
    dcp.save({"model": model.state_dict()}, storage_writer=StorageWriter(root))
    row = root / "step-00000000" / "dcp" / "c" / "0" / "0"
    data = bytearray(row.read_bytes())
    # model.0.weight (12 KiB) is the row's first piece, over many inner chunks of its own.
    data[5000] ^= 0x01
    row.write_bytes(bytes(data))
    out = tmp_path / "m.safetensors"
    done = _cli(["consolidate", str(root), str(out), "-q"], tmp_path)
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert "model.0.weight (model/0.weight), the chunk at [0, 0]" in done.stderr
    assert "is damaged" in done.stderr and not out.exists()


# ------------------------------------------------------------- FSDP2 on 2 gloo ranks
@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory) -> tuple[Path, dict]:
    """An FSDP2 run (uneven Shard(0) over 2 ranks, AdamW) saved through our writer, with
    its full state as saved and its weights after each of the next steps."""
    root = tmp_path_factory.mktemp("fsdp2") / "ckpt"
    results = run_distributed(cli_workers.save_fsdp2_and_continue, 2, str(root), timeout=600)
    return root, results[0]


def test_consolidate_of_fsdp2_equals_the_saved_state(fsdp2, tmp_path):
    root, run = fsdp2
    saved = run["saved"]
    out = tmp_path / "model.safetensors"
    done = _cli(["consolidate", str(root), str(out), "-q"], tmp_path)
    assert done.returncode == 0, done.stderr
    got = load_file(out)
    model = {k[6:]: v for k, v in saved.items() if k.startswith("model/")}
    assert set(got) == set(model)
    for key, tensor in model.items():
        assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), key
    with open_source(str(root)).step() as step:
        assert step.world_size == 2
        moments = {k: v for k, v in saved.items() if k.startswith("optim/") and v.dim()}
        assert moments and set(moments) <= set(step.tensors)
        for name, tensor in moments.items():
            assert torch.equal(step.read(name), tensor), name
        assert step.attrs["engine"]["step"] == 2  # AdamW's step count, from the scalars


def test_reshard_of_fsdp2_there_and_back_gives_the_same_row_objects(fsdp2, tmp_path):
    root, _ = fsdp2
    for src, dst, world in ((root, "r3", 3), (tmp_path / "r3", "r2", 2)):
        done = _cli(
            ["reshard", str(src), str(tmp_path / dst), "--world-size", str(world)], tmp_path
        )
        assert done.returncode == 0, done.stderr
        assert "(dp" in done.stdout
    assert _boxes(tmp_path / "r3")["model.a.weight"] == [
        ([0, 0], [2, 8], 0), ([2, 0], [2, 8], 1), ([4, 0], [1, 8], 2),
    ]  # fmt: skip
    assert _boxes(tmp_path / "r2") == _boxes(root)
    assert _rows(tmp_path / "r2") == _rows(root)
    assert len(_rows(root)) == 2
    assert _cli(["verify", str(tmp_path / "r3")], tmp_path).returncode == 0


@pytest.mark.parametrize("stage", [1, 3])
def test_engine_load_at_one_rank_continues_the_fsdp2_run(fsdp2, stage):
    root, run = fsdp2
    ours = run_distributed(cli_workers.engine_continue, 1, str(root), stage, timeout=600)[0]
    assert ours["steps"] == 2 + cli_workers.NEXT_STEPS
    worst = 0.0
    for theirs, mine in zip(run["after"], ours["after"], strict=True):
        assert set(theirs) == set(mine)
        for name, value in theirs.items():
            worst = max(worst, (mine[name] - value).abs().max().item())
    print(f"stage {stage}: worst difference from FSDP2's own next steps {worst:.2e}")
    assert worst <= 1e-5, worst


# ------------------------------- a transformers Llama, FSDP2 + TP (dp_shard 2 x tp 2)
@pytest.fixture(scope="module")
def llama_tp(tmp_path_factory) -> tuple[Path, Path]:
    """The same state saved through our writer and DCP's own (4 gloo ranks, 2-D boxes)."""
    pytest.importorskip("transformers")
    base = tmp_path_factory.mktemp("llama-tp")
    ours, theirs = base / "ours", base / "theirs"
    run_distributed(workers.save_fsdp2_tp, 4, str(ours), str(theirs), timeout=600)
    return ours, theirs


def test_consolidate_dir_of_fsdp2_tp_loads_with_from_pretrained(llama_tp, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import LlamaForCausalLM

    ours, theirs = llama_tp
    shown = _cli(["inspect", str(ours)], tmp_path)
    assert shown.returncode == 0, shown.stderr
    # A row-parallel weight: columns over tp, rows over dp, four boxes on four ranks.
    assert (
        "model.model.layers.0.self_attn.o_proj.weight  40x40 float32: [0:20, 0:20] rank 0, "
        "[0:20, 20:40] rank 1, [20:40, 0:20] rank 2, [20:40, 20:40] rank 3"
    ) in shown.stdout, shown.stdout
    out = tmp_path / "hf"
    done = _cli(["consolidate", str(ours), f"{out}/", "-q"], tmp_path)
    assert done.returncode == 0, done.stderr
    # DCP records no model config: the trainer's own config.json goes beside the weights.
    workers.llama().config.save_pretrained(out)
    loaded = LlamaForCausalLM.from_pretrained(out)
    dcp_to_torch_save(str(theirs), str(tmp_path / "ref.pt"))
    ref = torch.load(tmp_path / "ref.pt", weights_only=True)["model"]
    got = loaded.state_dict()
    assert set(ref) <= set(got)
    for key, tensor in ref.items():
        assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), key
    # Resharded to FSDP2's layout at 2 ranks, the step consolidates to the same bytes.
    done = _cli(["reshard", str(ours), str(tmp_path / "dp2"), "--world-size", "2"], tmp_path)
    assert done.returncode == 0, done.stderr
    again = tmp_path / "again"
    assert _cli(["consolidate", str(tmp_path / "dp2"), f"{again}/", "-q"], tmp_path).returncode == 0
    assert (again / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()
