"""A DCP checkpoint written by FSDP2 + tensor parallelism the torchtitan way (a transformers
Llama parallelized with torch's ``parallelize_module`` over ``mesh["tp"]``, then
``fully_shard`` over ``mesh["dp"]``, 4 gloo ranks; ``get_state_dict`` + ``dcp.save``).

Its tensors are stored as 2-D boxes: a column-parallel weight is split by rows over tp and
again over dp, a row-parallel one by columns over tp and by rows over dp. Every command reads
it (``consolidate`` equals torch's own ``dcp_to_torch_save``), and ``engine.load`` at other
layouts (2 ranks of plain data parallelism, one process) continues FSDP2 + TP's own run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.foreign.conftest import assert_reshards_to_format2, run_cli
from tests.helpers_dist import run_distributed
from tests.llama_tp import shard_2d

pytest.importorskip("transformers")

VOCAB = 250  # odd sizes: the tp and dp splits are uneven where torch allows it
HIDDEN = 40
INTER = 90
SEQ = 6
GLOBAL_BATCH = 4
TRAIN_STEPS = 2
NEXT_STEPS = 2
ADAMW = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1)
ROTARY = "model.rotary_emb.inv_freq"


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    cfg._attn_implementation = "eager"
    return LlamaForCausalLM(cfg)


def _global_batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)


def _loss(model, x: torch.Tensor) -> torch.Tensor:
    return model(input_ids=x, labels=x).loss


def _write_fsdp2_tp(rank: int, world_size: int, out: str) -> dict:
    """FSDP2 + TP on a (dp 2, tp 2) mesh: train, save with DCP, train on; rank 0 returns the
    full weights after each later step."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _llama()
    shard_2d(model, mesh)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    dp_rank, per = mesh["dp"].get_local_rank(), GLOBAL_BATCH // 2

    def train(step: int) -> None:
        x = _global_batch(step)[dp_rank * per : (dp_rank + 1) * per]
        _loss(model, x).backward()
        opt.step()
        opt.zero_grad()

    for step in range(TRAIN_STEPS):
        train(step)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=out)
    after = []
    for step in range(TRAIN_STEPS, TRAIN_STEPS + NEXT_STEPS):
        train(step)
        full = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
        after.append(full)
    return {"after": after} if rank == 0 else {}


def _zerostate_continue(rank: int, world_size: int, ckpt: str, stage: int) -> dict:
    """Load the FSDP2 + TP checkpoint into a plain data-parallel engine at ``world_size``
    ranks and take the peer's next steps on the same global batches."""
    import zerostate

    model = _llama()
    with torch.no_grad():  # the load must replace every value
        for p in model.parameters():
            p.add_(1.0)
    engine = zerostate.Engine(model, stage=stage, **ADAMW)
    engine.load(ckpt)
    per = GLOBAL_BATCH // world_size
    after = []
    for step in range(TRAIN_STEPS, TRAIN_STEPS + NEXT_STEPS):
        x = _global_batch(step)[rank * per : (rank + 1) * per]
        engine.backward(_loss(engine, x))
        engine.step()
        after.append({k: v.detach().clone() for k, v in engine.full_state_dict().items()})
    return {"after": after, "steps": engine.optimizer_steps} if rank == 0 else {}


@pytest.fixture(scope="module")
def fsdp2_tp(tmp_path_factory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("fsdp2-tp") / "ckpt"
    results = run_distributed(_write_fsdp2_tp, 4, str(out), timeout=600)
    return out, results[0]["after"]


def _box_shapes(path: Path) -> set[int]:
    """How many distinct chunk boxes per tensor torch recorded (sanity: the checkpoint
    really holds 2-D placements)."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(path)).read_metadata()
    return {
        len(entry.chunks)
        for key, entry in meta.state_dict_metadata.items()
        if key.startswith("model.") and hasattr(entry, "chunks")
    }


@pytest.mark.slow
def test_every_command_reads_an_fsdp2_tp_checkpoint(fsdp2_tp, tmp_path):
    path, _ = fsdp2_tp
    assert 4 in _box_shapes(path)  # tp x dp boxes: four chunks for the parallel weights
    shown = run_cli("inspect", str(path))
    assert shown.returncode == 0, shown.stderr
    assert "model/model.layers.1.self_attn.o_proj.weight" in shown.stdout, shown.stdout
    checked = run_cli("verify", str(path))
    assert checked.returncode == 0, checked.stderr
    out = tmp_path / "model.safetensors"
    done = run_cli("consolidate", str(path), str(out), "--json")
    assert done.returncode == 0, done.stderr
    mine = load_file(out)
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    ref_file = tmp_path / "ref.pt"
    dcp_to_torch_save(str(path), str(ref_file))
    ref = torch.load(ref_file, weights_only=True)["model"]
    assert set(mine) == set(ref), set(mine) ^ set(ref)
    for key, tensor in ref.items():
        assert mine[key].dtype == tensor.dtype and torch.equal(mine[key], tensor), key
    assert_reshards_to_format2(path, tmp_path / "resharded")


@pytest.mark.slow
@pytest.mark.parametrize(("world", "stage"), [(2, 2), (1, 1)])
def test_engine_load_at_another_layout_continues_fsdp2_tp(fsdp2_tp, world, stage):
    path, theirs = fsdp2_tp
    results = run_distributed(_zerostate_continue, world, str(path), stage, timeout=600)
    ours = results[0]
    assert ours["steps"] == TRAIN_STEPS + NEXT_STEPS
    worst = 0.0
    for a, b in zip(theirs, ours["after"], strict=True):
        # full_state_dict() also holds the rotary tables (non-persistent buffers, which
        # torch's state_dict and so DCP leave out; the model's own values stayed).
        assert set(b) - set(a) == {ROTARY, "model.rotary_emb.original_inv_freq"}, set(a) ^ set(b)
        assert torch.equal(b[ROTARY], _llama().model.rotary_emb.inv_freq)
        for name, value in a.items():
            worst = max(worst, (b[name] - value).abs().max().item())
    print(f"world {world} stage {stage}: worst difference from FSDP2 + TP {worst:.2e}")
    assert worst <= 1e-5, f"continuation differs from FSDP2 + TP's by {worst:.2e}"
