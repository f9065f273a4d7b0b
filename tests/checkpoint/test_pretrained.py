"""load_pretrained on 3 gloo ranks: a Hugging Face Llama (tied and untied, single file and
sharded index) loads into stages 0-3 (stage 3 from the meta device) with logits equal to
transformers'; each rank reads only the data bytes it owns; name mismatches are listed in
one error (strict) or returned (strict=False); a meta model's uninitialisable parameters
are refused at forward until loaded; ranks fail together."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from helpers_dist import run_distributed
from torch import nn

# Not pooled workers (this file is not in tests/conftest.py's POOLED_FILES): its ranks wrap
# SafetensorsSource.read_elements to count bytes and keep the wrapper. Each call forks new
# processes ([Note: forked workers] in tests/fork_server.py); nothing here needs a new interpreter,
# so the ranks are not spawned.

transformers = pytest.importorskip("transformers")

WORLD_SIZE = 3


def _config(tie: bool):
    return transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        tie_word_embeddings=tie,
    )  # fmt: skip


def _reference(tie: bool):
    torch.manual_seed(1 if tie else 2)
    return transformers.LlamaForCausalLM(_config(tie)).eval()


def _tokens() -> torch.Tensor:
    return torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(3))


def _engine(model, stage: int):
    import zerostate

    fields = {f.name for f in dataclasses.fields(zerostate.EngineConfig)}
    # Small tensors are cut across ranks too, so every rank reads a part of most tensors.
    extra = {"min_shard_numel": 16} if "min_shard_numel" in fields else {}
    return zerostate.Engine(model, stage=stage, device="cpu", **extra)


class _Norm(nn.Module):
    """Like a Hugging Face RMSNorm: parameters, no reset_parameters()."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.register_buffer("scale", torch.full((dim,), 2.0))

    def forward(self, x):
        return x * self.weight * self.scale


class _Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.norm = _Norm(8)

    def forward(self, x):
        return self.norm(self.lin(x))


def _count_data_reads() -> dict:
    """Count the tensor-data bytes this process reads (header reads excluded)."""
    from zerostate import safetensors_io

    counted = {"data": 0}
    original = safetensors_io.SafetensorsSource.read_elements

    def read_elements(self, entry, start, stop, out):
        counted["data"] += (stop - start) * entry.dtype.itemsize
        return original(self, entry, start, stop, out)

    safetensors_io.SafetensorsSource.read_elements = read_elements
    return counted


def _worker(rank: int, world_size: int, root: str) -> dict:
    import torch.distributed as dist
    from safetensors.torch import load_file

    from zerostate.checkpoint.pretrained import PretrainedMismatchError
    from zerostate.engine import EngineUsageError
    from zerostate.errors import DistributedMismatchError

    out: dict = {}
    counted = _count_data_reads()
    idx = _tokens()
    for tie in (True, False):
        ref = _reference(tie)
        with torch.no_grad():
            expected = ref(idx).logits
        for layout in ("single", "sharded"):
            for stage in (0, 1, 2, 3):
                if stage == 3:
                    with torch.device("meta"):
                        model = transformers.LlamaForCausalLM(_config(tie))
                else:
                    torch.manual_seed(100 + stage)
                    model = transformers.LlamaForCausalLM(_config(tie))
                engine = _engine(model, stage)
                counted["data"] = 0
                report = engine.load_pretrained(f"{root}/tie{int(tie)}-{layout}")
                owned = sum(
                    (sp.numel if stage == 0 else sp.stop - sp.start) * 4 for sp in engine._params
                )
                with torch.no_grad():
                    got = engine(idx).logits
                full = engine.full_state_dict()
                # Buffers too: the non-persistent rotary inv_freq the file lacks.
                ref_state = {**dict(ref.named_parameters()), **dict(ref.named_buffers())}
                out[(tie, layout, stage)] = {
                    "report": tuple(report),
                    "logits": (got - expected).abs().max().item(),
                    "params": max((full[n] - ref_state[n]).abs().max().item() for n in full),
                    "read": counted["data"],
                    "owned": owned,
                    "tied": engine.module.lm_head.weight is engine.module.model.embed_tokens.weight,
                }
    # Name checks: one missing, one unexpected, one mis-shaped tensor.
    bad = f"{root}/bad"
    engine = _engine(transformers.LlamaForCausalLM(_config(False)), 2)
    try:
        engine.load_pretrained(bad)
        out["strict"] = None
    except PretrainedMismatchError as exc:
        out["strict"] = str(exc)
    before = engine.full_state_dict()
    report = engine.load_pretrained(bad, strict=False)
    after = engine.full_state_dict()
    out["lenient"] = tuple(report)
    out["lenient_loaded"] = torch.equal(
        after["model.layers.0.mlp.up_proj.weight"],
        _reference(False).state_dict()["model.layers.0.mlp.up_proj.weight"],
    )
    out["lenient_kept"] = torch.equal(after["model.norm.weight"], before["model.norm.weight"])
    # A meta model whose module has no initialiser: refused at forward until loaded.
    with torch.device("meta"):
        plain = _Plain()
    engine = _engine(plain, 3)
    out["unset"] = sorted(engine._unset)
    x = torch.ones(2, 8)
    try:
        engine(x)
        out["unset_forward"] = None
    except EngineUsageError as exc:
        out["unset_forward"] = str(exc)
    engine.load_pretrained(f"{root}/plain.safetensors")
    reference = _Plain()
    reference.load_state_dict(load_file(f"{root}/plain.safetensors"))
    with torch.no_grad():
        out["plain"] = (engine(x) - reference(x)).abs().max().item()
    # Ranks fail together: rank 1 alone points at a directory without weights.
    engine = _engine(transformers.LlamaForCausalLM(_config(False)), 1)
    try:
        engine.load_pretrained(f"{root}/tie0-single" if rank != 1 else f"{root}/nothing")
        out["together"] = None
    except DistributedMismatchError:
        out["together"] = "peer failed"
    except FileNotFoundError:
        out["together"] = "not found"
    dist.barrier()
    return out


def _save(root: Path) -> None:
    from safetensors.torch import save_file

    for tie in (True, False):
        ref = _reference(tie)
        ref.save_pretrained(root / f"tie{int(tie)}-single")
        ref.save_pretrained(root / f"tie{int(tie)}-sharded", max_shard_size="20KB")
        assert (root / f"tie{int(tie)}-sharded" / "model.safetensors.index.json").exists()
    state = {k: v.clone() for k, v in _reference(False).state_dict().items()}
    del state["model.norm.weight"]
    state["model.extra.weight"] = torch.zeros(3)
    state["model.layers.1.mlp.up_proj.weight"] = torch.zeros(4, 4)
    (root / "bad").mkdir()
    save_file(state, str(root / "bad" / "model.safetensors"))
    torch.manual_seed(5)
    plain = _Plain()
    with torch.no_grad():
        plain.norm.weight.uniform_()
        plain.norm.scale.uniform_()
    save_file(plain.state_dict(), str(root / "plain.safetensors"))


@pytest.mark.slow
def test_load_pretrained_on_three_ranks(tmp_path) -> None:
    _save(tmp_path)
    results = run_distributed(_worker, WORLD_SIZE, str(tmp_path), timeout=400)
    for rank, r in enumerate(results):
        for (tie, layout, stage), got in sorted((k, v) for k, v in r.items() if len(k) == 3):
            print(rank, tie, layout, stage, got)
            assert got["report"] == ([], [], []), got
            assert got["logits"] < 1e-5 and got["params"] == 0.0, got
            assert got["tied"] == tie
            # Only the owned elements' bytes are read (stage 0 reads everything).
            assert got["read"] == got["owned"], got
        if rank == 0:
            full = sum(p.numel() * 4 for p in _reference(False).parameters())
            assert r[(False, "sharded", 3)]["read"] < full  # a strict part of the model
        message = r["strict"]
        assert message is not None
        for needle in ("model.norm.weight", "model.extra.weight", "up_proj.weight", "[4, 4]"):
            assert needle in message, message
        missing, unexpected, mismatched = r["lenient"]
        assert missing == ["model.norm.weight"] and unexpected == ["model.extra.weight"]
        assert mismatched == [("model.layers.1.mlp.up_proj.weight", (4, 4), (48, 32))]
        assert r["lenient_loaded"] and r["lenient_kept"]
        assert r["unset"] == ["norm.scale", "norm.weight"]
        assert r["unset_forward"] is not None and "norm.weight" in r["unset_forward"]
        assert r["plain"] == 0.0
        assert r["together"] == ("not found" if rank == 1 else "peer failed")
