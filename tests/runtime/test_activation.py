"""Activation checkpointing (``activation_checkpointing=``), [Note: activation checkpoints]
in zerostate.runtime.activation.

On one process: every mode trains a transformers Llama (attention dropout on) exactly as
the engine without checkpointing does, a block with tensor and non-tensor keyword
arguments and a tuple-and-dict output gets the same gradients, and the errors. On 4 gloo
ranks at (dp_shard 2 x tp 2), stages 1-3: ZeRO-R Pa keeps half the activation-checkpoint bytes per
rank, Pa+cpu keeps them in host memory, and losses and weights equal the uncheckpointed
engine's. Bytes are counted by torch's saved-tensor pack hooks
(:func:`zerostate.runtime.activation.measure_saved`): what autograd holds between forward and
backward, each storage once.
"""

from __future__ import annotations

import pytest
import torch
from helpers_dist import run_distributed
from llama_tp import llama, parallelize
from torch.distributed.device_mesh import init_device_mesh
from world_of_one import world_of_one  # noqa: F401 - fixture

import zerostate
from zerostate.errors import ConfigError
from zerostate.runtime.activation import measure_saved

pytest.importorskip("transformers")

VOCAB = 256
SEQ = 8
STEPS = 3
MODES = ("full", "partitioned", "partitioned_cpu")


def _llama(layers: int = 2):
    return llama(
        vocab=VOCAB, hidden=48, inter=100, heads=4, kv=2, layers=layers, attention_dropout=0.2
    )


def _batch(step: int, rows: int, offset: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, VOCAB, (2 * rows, SEQ), generator=g)[offset : offset + rows]


def _train(engine, batches) -> tuple[list[float], list]:
    """Losses and saved-byte tallies of training ``engine`` on ``batches``."""
    torch.manual_seed(1)  # the dropout stream starts equal in every run
    losses, saved = [], []
    for x in batches:
        with measure_saved() as tally:
            loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        saved.append(dict(tally.by_kind))
    return losses, saved


def _worst(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max(float((a[n] - b[n]).abs().max()) for n in a)


@pytest.mark.usefixtures("world_of_one")
@pytest.mark.filterwarnings("ignore:activation checkpointing runs block")
@pytest.mark.filterwarnings("ignore:activation_checkpointing='partitioned' without")
def test_every_mode_on_a_plain_engine_trains_as_without_checkpointing() -> None:
    batches = [_batch(s, 2) for s in range(STEPS)]
    ref = zerostate.Engine(_llama(), stage=2, lr=1e-2)
    ref_losses, ref_saved = _train(ref, batches)
    ref_state = ref.full_state_dict()
    hidden = 2 * SEQ * 48 * 4  # one block's input (fp32 hidden states), bytes
    for mode in MODES:
        model = _llama()
        engine = zerostate.Engine(model, stage=2, lr=1e-2, activation_checkpointing=mode)
        losses, saved = _train(engine, batches)
        print(mode, saved[-1], "uncheckpointed", ref_saved[-1])
        assert losses == pytest.approx(ref_losses, abs=1e-6, rel=0), mode
        assert _worst(engine.full_state_dict(), ref_state) <= 1e-6, mode
        # The blocks keep their inputs (on the host for Pa+cpu) and nothing inside them.
        kept = "host_slice" if mode == "partitioned_cpu" else "activation"
        assert saved[-1][kept] == 2 * hidden, (mode, saved[-1])
        assert saved[-1]["other"] < ref_saved[-1]["other"] / 3, (mode, saved[-1])
        assert "forward" in model.model.layers[0].__dict__
        engine.close()
        assert "forward" not in model.model.layers[0].__dict__  # the model handed back plain


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(6, 6)
        self.drop = torch.nn.Dropout(0.3)

    def forward(self, x, *, gate, mask, scale: float, label: str):
        assert label == "block" and isinstance(scale, float)
        y = self.drop(self.lin(x)) * gate * scale
        y = y.masked_fill(~mask, 0.0)
        return y + x, {"aux": (y * y).mean(), "count": mask.sum(), "label": label}


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.gate = torch.nn.Parameter(torch.rand(6) + 0.5)  # outside the blocks
        self.blocks = torch.nn.ModuleList(_Block() for _ in range(3))

    def forward(self, x):
        mask = torch.arange(6) % 4 != 1
        aux = 0.0
        for block in self.blocks:
            x, extra = block(x, gate=self.gate, mask=mask, scale=0.5, label="block")
            assert extra["label"] == "block" and int(extra["count"]) == 4
            aux = aux + extra["aux"]
        return x.square().mean() + aux


@pytest.mark.usefixtures("world_of_one")
def test_keyword_tensors_with_and_without_grad_and_structured_outputs() -> None:
    def train(**settings):
        model = _Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        engine = zerostate.Engine(model, stage=0, optimizer=opt, **settings)
        torch.manual_seed(3)
        for step in range(STEPS):
            x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
            engine.backward(engine(x))
            engine.step()
        return engine.full_state_dict()

    ref = train()
    for which in (None, _Block, [_Block], lambda name, m: name.startswith("blocks.")):
        got = train(activation_checkpointing="full", checkpoint_modules=which)
        assert _worst(got, ref) <= 1e-7, which
        assert not torch.equal(got["gate"], _Net().gate.detach())  # gate got its gradient


@pytest.mark.usefixtures("world_of_one")
def test_settings_are_checked_naming_the_fix() -> None:
    with pytest.raises(ConfigError, match="is not a mode; use 'full'"):
        zerostate.Engine(_Net(), activation_checkpointing="selective")
    with pytest.raises(ConfigError, match="must be a module class"):
        zerostate.Engine(_Net(), activation_checkpointing="full", checkpoint_modules="blocks")
    with pytest.raises(ConfigError, match="matches no module of the model"):
        zerostate.Engine(
            _Net(), activation_checkpointing="full", checkpoint_modules=torch.nn.Conv1d
        )
    with pytest.raises(ConfigError, match="found no nn.ModuleList"):
        zerostate.Engine(torch.nn.Linear(4, 4), activation_checkpointing="full")
    with pytest.warns(UserWarning, match="checkpoint_modules has no effect"):
        zerostate.Engine(_Net(), checkpoint_modules=_Block).close()
    with pytest.warns(UserWarning, match="nothing to partition over"):
        zerostate.Engine(_Net(), activation_checkpointing="partitioned").close()
    model = _Net()
    model.blocks[1].forward = model.blocks[1].forward  # another wrapper's instance forward
    with pytest.raises(ConfigError, match="module blocks.1 already has a forward of its own"):
        zerostate.Engine(model, activation_checkpointing="full")
    assert "forward" not in model.blocks[0].__dict__  # refused before anything was wrapped
    # Nested choices: only the outermost module is checkpointed.
    model = _Net()
    engine = zerostate.Engine(
        model,
        activation_checkpointing="full",
        checkpoint_modules=(lambda name, m: isinstance(m, (_Block, torch.nn.Linear))),
    )
    assert engine._activation.names == ["blocks.0", "blocks.1", "blocks.2"]
    engine.close()


# -- tensor parallelism: (dp_shard 2 x tp 2) ----------------------------------------------
def _parallelize(model, tp_mesh):
    return parallelize(model, tp_mesh)


def _tp_worker(rank: int, world_size: int, stage: int) -> dict:
    import warnings

    warnings.filterwarnings("ignore", "activation checkpointing runs block")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    dp = int(mesh.get_local_rank("dp_shard"))
    batches = [_batch(s, 2, offset=2 * dp) for s in range(STEPS)]
    out = {}
    for mode in (None, *MODES):
        model = _parallelize(_llama(layers=3), mesh["tp"])
        engine = zerostate.Engine(
            model, mesh=mesh, stage=stage, lr=1e-2, activation_checkpointing=mode
        )
        losses, saved = _train(engine, batches)
        out[mode] = {
            "losses": losses,
            "saved": saved[-1],
            "state": engine.full_state_dict(),
            # Stage 3: what stays gathered between steps (the recompute's gathers released).
            "gathered": engine.memory_stats()["gathered_params"],
        }
        engine.close()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_partitioned_checkpoints_at_tp2_halve_the_bytes_and_keep_parity(stage) -> None:
    results = run_distributed(_tp_worker, 4, stage, timeout=900)
    hidden = 2 * SEQ * 48 * 4  # one block's input on one rank: local batch 2, fp32
    layers = 3
    for rank, r in enumerate(results):
        ref = r[None]
        full = r["full"]["saved"]
        for mode in MODES:
            err = _worst(r[mode]["state"], ref["state"])
            loss_err = max(
                abs(a - b) for a, b in zip(r[mode]["losses"], ref["losses"], strict=True)
            )
            print(f"stage {stage} rank {rank} {mode}: {r[mode]['saved']}, weights {err:.1e}, "
                  f"losses {loss_err:.1e}")  # fmt: skip
            assert err <= 1e-6 and loss_err <= 1e-6, (mode, err, loss_err)
            assert r[mode]["saved"].get("shared") == full.get("shared"), mode
            assert r[mode]["gathered"] == ref["gathered"], (mode, r[mode]["gathered"])
        print(f"stage {stage} rank {rank} uncheckpointed: {ref['saved']}")
        assert full["activation"] == layers * hidden, full
        part = r["partitioned"]["saved"]
        assert "activation" not in part and "host_slice" not in part, part
        assert abs(part["slice"] - full["activation"] / 2) <= 0.05 * full["activation"] / 2
        cpu = r["partitioned_cpu"]["saved"]
        # Pa+cpu: the slices are in the host store; the device keeps no activation of a block.
        assert cpu["host_slice"] == part["slice"], cpu
        assert "activation" not in cpu and "slice" not in cpu, cpu


def _sequence_parallel_worker(rank: int, world_size: int) -> str:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    model = _parallelize(_llama(), mesh["tp"])
    engine = zerostate.Engine(model, mesh=mesh, stage=1, activation_checkpointing="partitioned")
    x = _batch(0, 2, offset=2 * rank)  # each tp rank a different batch: not replicated
    try:
        engine(input_ids=x, labels=x)
    except ConfigError as exc:
        return str(exc)
    return "accepted"


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:activation checkpointing runs block")
def test_partitioned_refuses_inputs_that_differ_across_tp() -> None:
    for r in run_distributed(_sequence_parallel_worker, 2, timeout=300):
        assert "differ across the tp ranks" in r, r
