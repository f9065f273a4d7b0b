"""Rank functions for the DCP plug-in tests: an FSDP2 model with AdamW on gloo ranks, saved
and loaded through torch's checkpoint API with zerostate's storage and with DCP's own."""

from __future__ import annotations

import io
from typing import Any

import torch
from torch import nn

from tests.llama_tp import parallelize, shard_2d

TRAIN_STEPS = 2
ADAMW = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


class Net(nn.Module):
    """Odd sizes: FSDP2's Shard(0) over 2 ranks is uneven (5 -> 3 + 2, 3 -> 2 + 1); a.weight
    has an even number of columns, so it can also be sharded by columns (FSDP2 shards
    only dimension 0 unevenly)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 5)
        self.b = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + rank))


def build(layout: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``layout``: ``shard0`` (FSDP2's default Shard(0)), ``shard1`` (a.weight sharded by
    columns) or ``plain`` (no FSDP)."""
    torch.manual_seed(0)
    model = Net()
    if layout != "plain":
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import Shard

        def placement(p: nn.Parameter) -> Shard:
            columns = layout == "shard1" and p.dim() == 2 and p.shape[1] % 2 == 0
            return Shard(1) if columns else Shard(0)

        for module in (model.a, model.b):
            fully_shard(module, shard_placement_fn=placement)
        fully_shard(model, shard_placement_fn=placement)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    return model, opt


def train(model: nn.Module, opt: torch.optim.Optimizer, rank: int, steps: int) -> None:
    for step in range(steps):
        model(_batch(step, rank)).square().mean().backward()
        opt.step()
        opt.zero_grad()


def state_of(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optim": optim_sd}


def save_fsdp2(rank: int, world_size: int, ours: str, theirs: str, options: dict | None) -> dict:
    """Train, then save the same state with our writer (``dcp.save`` twice, then
    ``dcp.async_save``) and with DCP's ``FileSystemWriter``. Returns this rank's local
    bytes of ``model.a.weight`` (to find them in the files) and the steps written."""
    import torch.distributed.checkpoint as dcp

    from zerostate.dcp import StorageWriter

    torch.set_num_threads(1)
    model, opt = build("shard0")
    train(model, opt, rank, TRAIN_STEPS)
    state = state_of(model, opt)
    steps = []
    for _ in range(2):
        writer = StorageWriter(ours, storage_options=options)
        dcp.save(state, storage_writer=writer)
        steps.append(writer.step)
    writer = StorageWriter(ours, storage_options=options)
    dcp.async_save(state, storage_writer=writer).result()
    steps.append(writer.step)
    if theirs:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(theirs))
    local = state["model"]["a.weight"].to_local().contiguous()
    return {"steps": steps, "a_weight_local": local.view(torch.uint8).clone()}


def _full(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Every value of the state, gathered whole, flat by key."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    out: dict[str, Any] = {f"model/{k}": v.detach().clone() for k, v in model_sd.items()}
    for fqn, states in optim_sd["state"].items():
        for k, v in states.items():
            out[f"optim/{fqn}/{k}"] = v.detach().clone() if isinstance(v, torch.Tensor) else v
    out["param_groups"] = optim_sd["param_groups"]
    return out


def load(rank: int, world_size: int, kind: str, path: str, layout: str, options: dict | None,
         step: int | None = None) -> dict:  # fmt: skip
    """Load into a fresh model of ``layout`` through our reader (``kind`` "ours") or DCP's
    (``"theirs"``); returns the full state (rank 0)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    from zerostate.dcp import StorageReader

    torch.set_num_threads(1)
    model, opt = build(layout)
    train(model, opt, rank + 7, 1)  # other values everywhere: the load must replace them
    state = state_of(model, opt)
    reader = (
        StorageReader(path, step=step, storage_options=options)
        if kind == "ours"
        else dcp.FileSystemReader(path)
    )
    dcp.load(state, storage_reader=reader)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    full = _full(model, opt)
    return full if rank == 0 else {}


# ------------------------------------------------------------- zerostate.save / load
class Wide(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(32, 48)
        self.out = nn.Linear(48, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.inp(x)))


def _halving(step: int) -> float:
    return 0.5**step


def ddp_parts(seed: int, lr: float) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = Wide()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, _halving)


def ddp_trained(rank: int) -> tuple[nn.Module, Any, torch.optim.Optimizer, Any]:
    """``(model, its DDP wrapper, AdamW, LambdaLR)`` after 2 steps on this rank's batches."""
    model, opt, sched = ddp_parts(0, 1e-2)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    for step in range(2):
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(10 * step + rank))
        ddp(x).square().mean().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return model, ddp, opt, sched


def ddp_save(rank: int, world_size: int, root: str) -> dict:
    """DDP + AdamW + LambdaLR, 2 steps, ``zerostate.save``; returns what was saved."""
    import zerostate

    torch.set_num_threads(1)
    model, ddp, opt, sched = ddp_trained(rank)
    got = zerostate.save({"model": ddp, "optim": opt, "sched": sched}, root)
    return {"step": got, **ddp_state(model, opt, sched)}


def ddp_state(model: nn.Module, opt: torch.optim.Optimizer, sched: Any) -> dict:
    return {
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "optim": opt.state_dict(),
        "sched": sched.state_dict(),
    }


def ddp_load(rank: int, world_size: int, root: str) -> dict:
    """A fresh DDP model with other values, ``zerostate.load``; returns what it holds."""
    import zerostate

    torch.set_num_threads(1)
    model, opt, sched = ddp_parts(1, 0.5)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    got = zerostate.load({"model": ddp, "optim": opt, "sched": sched}, root)
    return {"step": got, **ddp_state(model, opt, sched)}


# --------------------------------------------- FSDP2 + tensor parallelism (torchtitan's way)
LLAMA_VOCAB, LLAMA_HIDDEN, LLAMA_INTER = 250, 40, 90  # odd sizes: uneven tp and dp splits


def llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=LLAMA_VOCAB, hidden_size=LLAMA_HIDDEN, intermediate_size=LLAMA_INTER,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=32,
    )  # fmt: skip
    cfg._attn_implementation = "eager"
    return LlamaForCausalLM(cfg)


def _llama_opt(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)


def _llama_step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    x = torch.randint(0, LLAMA_VOCAB, (2, 6), generator=torch.Generator().manual_seed(seed))
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    opt.zero_grad()


def llama_layout(layout: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``dp2xtp2``: tp over ColwiseParallel / RowwiseParallel, then fully_shard per layer
    over dp (4 ranks); ``dp``: fully_shard only; ``plain``: no parallelism."""
    model = llama()
    if layout == "dp2xtp2":
        from torch.distributed.device_mesh import init_device_mesh

        shard_2d(model, init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")))
    elif layout == "dp":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    elif layout == "tp":
        _tensor_parallel(model)
    return model, _llama_opt(model)


def _tensor_parallel(model: nn.Module) -> None:
    """Tensor parallelism only, over every rank (no FSDP): the rest is replicated."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    parallelize(model, mesh)


def save_fsdp2_tp(rank: int, world_size: int, ours: str, theirs: str) -> dict:
    """dp_shard 2 x tp 2: one AdamW step, then ``dcp.save`` with our writer and DCP's."""
    import torch.distributed.checkpoint as dcp

    from zerostate.dcp import StorageWriter

    torch.set_num_threads(1)
    model, opt = llama_layout("dp2xtp2")
    _llama_step(model, opt, seed=1)
    state = state_of(model, opt)
    writer = StorageWriter(ours)
    dcp.save(state, storage_writer=writer)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(theirs))
    return {"step": writer.step}


# The torchtitan way end to end: LLAMA_TRAIN_STEPS steps at dp_shard 2 x tp 2, saved; loads at
# other layouts continue LLAMA_RESUME_STEPS steps on the same global batches.
LLAMA_TRAIN_STEPS, LLAMA_RESUME_STEPS, LLAMA_GLOBAL_BATCH = 3, 2, 4


def _data_parallel(layout: str, rank: int, world_size: int) -> tuple[int, int]:
    """``(dp rank, dp size)`` of a rank in ``layout``: tp peers share a dp rank."""
    if layout == "dp2xtp2":
        return rank // 2, world_size // 2  # mesh (dp, tp): ranks [[0, 1], [2, 3]]
    if layout == "dp":
        return rank, world_size
    return 0, 1  # tp or plain: every rank sees the whole batch


def _llama_global_step(
    model: nn.Module, opt: torch.optim.Optimizer, step: int, dp: tuple[int, int]
) -> None:
    """One AdamW step on this dp rank's equal slice of global batch ``step``: every layout
    trains on the same data."""
    gen = torch.Generator().manual_seed(1000 + step)
    batch = torch.randint(0, LLAMA_VOCAB, (LLAMA_GLOBAL_BATCH, 6), generator=gen)
    dp_rank, dp_size = dp
    rows = LLAMA_GLOBAL_BATCH // dp_size
    x = batch[dp_rank * rows : (dp_rank + 1) * rows]
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    opt.zero_grad()


def train_save_llama(
    rank: int, world_size: int, ours: str, theirs: str, options: dict | None
) -> dict:
    """dp_shard 2 x tp 2, LLAMA_TRAIN_STEPS AdamW steps, then ``{"model", "optim"}`` from
    ``get_state_dict`` saved into ``ours`` with ``dcp.save`` (step 0) and ``dcp.async_save``
    with thread staging (step 1), and (``theirs`` given) with DCP's ``FileSystemWriter``.
    Returns the steps written and, from rank 0, the full state saved."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    from zerostate.dcp import StorageWriter

    torch.set_num_threads(1)
    model, opt = llama_layout("dp2xtp2")
    dp = _data_parallel("dp2xtp2", rank, world_size)
    for step in range(LLAMA_TRAIN_STEPS):
        _llama_global_step(model, opt, step, dp)
    state = state_of(model, opt)
    steps = []
    writer = StorageWriter(ours, storage_options=options)
    dcp.save(state, storage_writer=writer)
    steps.append(writer.step)
    writer = StorageWriter(ours, storage_options=options)
    future = dcp.async_save(
        state, storage_writer=writer, async_checkpointer_type=AsyncCheckpointerType.THREAD
    )
    future.result()
    steps.append(writer.step)
    if theirs:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(theirs))
    full = _full(model, opt)
    return {"steps": steps, "full": full if rank == 0 else {}}


def resume_llama(rank: int, world_size: int, layout: str, sources: list[tuple]) -> list[dict]:
    """For each source ``(kind, path, step, storage_options)``: a fresh Llama of ``layout``
    (after a step of its own, so every value differs) loaded through our reader (``kind``
    "ours", ``step`` None for the newest) or DCP's (``"theirs"``), then LLAMA_RESUME_STEPS
    more steps on the global batches after the saved run's. Rank 0 returns, per source, the
    full state after the load and after the steps."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    from zerostate.dcp import StorageReader

    torch.set_num_threads(1)
    dp = _data_parallel(layout, rank, world_size)
    out = []
    for kind, path, step, options in sources:
        model, opt = llama_layout(layout)
        _llama_step(model, opt, seed=50 + dp[0])
        state = state_of(model, opt)
        if kind == "ours":
            reader = StorageReader(path, step=step, storage_options=options)
        else:
            reader = dcp.FileSystemReader(path)
        dcp.load(state, storage_reader=reader)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        loaded = _full(model, opt)
        for i in range(LLAMA_RESUME_STEPS):
            _llama_global_step(model, opt, LLAMA_TRAIN_STEPS + i, dp)
        out.append({"loaded": loaded, "trained": _full(model, opt)})
    return out if rank == 0 else []


def async_process_save(rank: int, world_size: int, root: str) -> dict:
    """``dcp.async_save`` with process staging: the writer travels to DCP's background
    process by pickle and saves there. Returns this rank's saved model bytes."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    from zerostate.dcp import StorageWriter

    torch.set_num_threads(1)
    model, opt = build("shard0")
    train(model, opt, rank, TRAIN_STEPS)
    state = state_of(model, opt)
    future = dcp.async_save(
        state,
        storage_writer=StorageWriter(root),
        async_checkpointer_type=AsyncCheckpointerType.PROCESS,
    )
    future.result()
    return {"a_weight_local": state["model"]["a.weight"].to_local().clone()}


# ------------------------------------------- torch's own DCP test patterns, through our pair
#: Global tensors of the pattern states, rebuilt from seeds wherever they are needed.
UNEVEN_SHAPE = (7, 5)  # Shard(0): 3 + 3 + 1 rows over 3 ranks, 4 + 3 over 2
GRID_SHAPE = (10, 20)  # torch's sharded-tensor tests use [10, 20]


def pattern_tensor(name: str, version: int = 0) -> torch.Tensor:
    shape = UNEVEN_SHAPE if name == "uneven" else GRID_SHAPE
    seed = 1000 * version + sum(map(ord, name))
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


#: Enumerable shard plans of GRID_SHAPE, ``(row offset, rows, rank)``: several boxes per
#: rank, uneven, not in rank order (torch's EnumerableShardingSpec tests).
ENUM_PLANS = {
    3: [(0, 2, 0), (2, 1, 2), (3, 3, 1), (6, 3, 0), (9, 1, 2)],
    2: [(0, 8, 1), (8, 2, 0)],
    "interleaved": [(0, 2, 0), (2, 1, 1), (3, 3, 0), (6, 3, 1), (9, 1, 0)],
}


class BlobState:
    """A Stateful whose state is raw bytes (torch's checkpoint tests' ``BlobState``)."""

    def __init__(self, blob: bytes) -> None:
        self.state = {"blob": blob}

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.state = state_dict


class TrainState:
    """A Stateful keeping its losses as a ``torch.save``-d io.BytesIO (torch's end-to-end
    tests' train state)."""

    def __init__(self, step: int, losses: list[float]) -> None:
        self.step, self.losses = step, list(losses)

    def state_dict(self) -> dict[str, Any]:
        buffer = io.BytesIO()
        torch.save(self.losses, buffer)
        return {"step": torch.tensor(self.step, dtype=torch.int32), "losses": buffer}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"].item())
        buffer = state_dict["losses"]
        self.position = buffer.tell()  # where the saved buffer stood
        buffer.seek(0)
        self.losses = torch.load(buffer)  # the job's own blob, plain floats


def _enum_sharded(plan_key: Any, value: torch.Tensor) -> Any:
    """A ShardedTensor of ``value`` laid out by ``ENUM_PLANS[plan_key]``."""
    import torch.distributed as dist
    from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards
    from torch.distributed._shard.sharding_spec import ShardMetadata

    rank, cols = dist.get_rank(), value.shape[1]
    shards = []
    for row, rows, owner in ENUM_PLANS[plan_key]:
        if owner == rank:
            meta = ShardMetadata([row, 0], [rows, cols], f"rank:{owner}/cpu")
            shards.append(Shard(value[row : row + rows].clone(), meta))
    return init_from_local_shards(shards, *value.shape)


def _columns_wrapped(mesh: Any, value: torch.Tensor, num_blocks: int) -> Any:
    """A DTensor whose local tensor holds several column blocks (LocalShardsWrapper, as
    TorchRec's column-wise tables): rank r holds blocks r, r + W, r + 2W, ..."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper

    rank, world = mesh.get_local_rank(), mesh.size()
    width = value.shape[1] // num_blocks
    mine = range(rank, num_blocks, world)
    local = LocalShardsWrapper(
        [value[:, b * width : (b + 1) * width].clone() for b in mine],
        [(0, b * width) for b in mine],
    )
    return DTensor.from_local(
        local, mesh, [Shard(1)], run_check=False, shape=value.shape, stride=value.stride()
    )


def _gather(value: Any) -> torch.Tensor:
    """The full tensor of a pattern value (collective)."""
    import torch.distributed as dist
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    if isinstance(value, ShardedTensor):
        full = torch.zeros(value.shape) if dist.get_rank() == 0 else None
        value.gather(out=full)
        return full
    if isinstance(value, DTensor):
        from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper

        local = value.to_local()
        if isinstance(local, LocalShardsWrapper):
            full = torch.zeros(value.shape)
            for shard, o in zip(local.local_shards(), local.local_offsets(), strict=True):
                full[o[0] : o[0] + shard.shape[0], o[1] : o[1] + shard.shape[1]] = shard
            dist.all_reduce(full)  # blocks are disjoint: the sum places them
            return full
        return value.full_tensor()
    return value.clone()


def pattern_state(world_size: int, version: int, layout: str) -> dict[str, Any]:
    """The patterns' state on this rank. ``layout``: ``rows`` (Shard(0) everywhere) or
    ``columns`` (the grid tensor by columns, Shard(1)); ``enum`` plans by world size, and
    the ``columns`` layout takes the interleaved plan; ``blocks`` are 4 column blocks, 5 in
    the ``columns`` layout. Values of ``version``; a
    loading state passes another version, so the load must replace every value."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    grid_dim = 1 if layout == "columns" else 0
    enum_key = "interleaved" if layout == "columns" else world_size
    return {
        "uneven": distribute_tensor(pattern_tensor("uneven", version), mesh, [Shard(0)]),
        "grid": distribute_tensor(pattern_tensor("grid", version), mesh, [Shard(grid_dim)]),
        "enum": _enum_sharded(enum_key, pattern_tensor("enum", version)),
        "blocks": _columns_wrapped(
            mesh, pattern_tensor("blocks", version), 5 if layout == "columns" else 4
        ),
        "blob": BlobState(bytes([version]) * 3 + b"\x00\x80\x04 raw"),
        "train": TrainState(version, [0.5 * version, 1.25]),
        "values": {"bytes0": [version], "bytes1": f"string {version}"},
    }


def pattern_result(state: dict[str, Any]) -> dict[str, Any]:
    """What a pattern state holds, gathered (rank 0 gets every tensor whole)."""
    out: dict[str, Any] = {k: _gather(state[k]) for k in ("uneven", "grid", "enum", "blocks")}
    train = state["train"]
    out.update(
        blob=state["blob"].state["blob"],
        train=(train.step, train.losses, getattr(train, "position", None)),
        values=state["values"],
    )
    return out


def save_patterns(rank: int, world_size: int, ours: str, theirs: str) -> dict:
    """Save the patterns' state (version 1, rows) with our writer and DCP's."""
    import torch.distributed.checkpoint as dcp

    from zerostate.dcp import StorageWriter

    torch.set_num_threads(1)
    state = pattern_state(world_size, 1, "rows")
    writer = StorageWriter(ours)
    dcp.save(state, storage_writer=writer)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(theirs))
    return {"step": writer.step}


def load_patterns(rank: int, world_size: int, kind: str, path: str, layout: str) -> dict:
    """A version-0 pattern state of ``layout`` loaded through our reader or DCP's."""
    import torch.distributed.checkpoint as dcp

    from zerostate.dcp import StorageReader

    torch.set_num_threads(1)
    state = pattern_state(world_size, 0, layout)
    reader = StorageReader(path) if kind == "ours" else dcp.FileSystemReader(path)
    dcp.load(state, storage_reader=reader)
    return pattern_result(state)


def plain_patterns(version: int) -> dict[str, Any]:
    """The patterns' state in one process without sharding (plain tensors)."""
    state: dict[str, Any] = {
        k: pattern_tensor(k, version) for k in ("uneven", "grid", "enum", "blocks")
    }
    state.update(
        blob=BlobState(bytes([version]) * 3 + b"\x00\x80\x04 raw"),
        train=TrainState(version, [0.5 * version, 1.25]),
        values={"bytes0": [version], "bytes1": f"string {version}"},
    )
    return state


def resave_patterns(rank: int, world_size: int, root: str, rounds: int) -> list[dict]:
    """torch's save-again-and-again pattern: ``rounds`` saves into one root, each of new
    values (version i) in another layout, each loaded back right away in the next layout;
    then every step loaded again by number. Rank 0 returns, per round, the step written,
    what its load gave, and what the later load of that step gave."""
    import torch.distributed.checkpoint as dcp

    from zerostate.dcp import StorageReader, StorageWriter

    torch.set_num_threads(1)
    layouts = ["rows", "columns"]
    out = []
    for i in range(rounds):
        state = pattern_state(world_size, i + 1, layouts[i % 2])
        writer = StorageWriter(root)
        dcp.save(state, storage_writer=writer)
        target = pattern_state(world_size, 0, layouts[(i + 1) % 2])
        dcp.load(target, storage_reader=StorageReader(root))
        out.append({"step": writer.step, "loaded": pattern_result(target)})
    for i, entry in enumerate(out):
        target = pattern_state(world_size, 0, layouts[i % 2])
        dcp.load(target, storage_reader=StorageReader(root, step=entry["step"]))
        entry["again"] = pattern_result(target)
    return out if rank == 0 else []


def cached_plan_saves(rank: int, world_size: int, root: str, theirs: str) -> dict:
    """Saves with DCP's plan caching on (``DefaultSavePlanner(enable_plan_caching=True)``,
    one cache key throughout): four saves of new values into one root of ours (a new writer,
    one writer twice, a new writer), each followed by a save of the same state
    through DCP's ``FileSystemWriter`` under the same key; the planners see unchanged plans
    from the second save on. Every step and every DCP directory loaded back; rank 0 returns
    what each gave, the steps written and the plan-caching warnings each rank saw."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner

    from zerostate.dcp import StorageReader, StorageWriter

    torch.set_num_threads(1)

    def planner() -> DefaultSavePlanner:
        return DefaultSavePlanner(enable_plan_caching=True)

    steps, reused = [], StorageWriter(root)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for i in range(4):
            state = pattern_state(world_size, i + 1, "rows")
            writer = reused if i in (1, 2) else StorageWriter(root)
            dcp.save(state, storage_writer=writer, planner=planner())
            steps.append(writer.step)
            dcp.save(state, storage_writer=dcp.FileSystemWriter(f"{theirs}/{i}"), planner=planner())
    warned = [str(w.message) for w in seen if "plan caching" in str(w.message)]
    ours, dcps = [], []
    for i, step in enumerate(steps):
        target = pattern_state(world_size, 0, "columns")
        dcp.load(target, storage_reader=StorageReader(root, step=step))
        ours.append(pattern_result(target))
        target = pattern_state(world_size, 0, "columns")
        dcp.load(target, storage_reader=dcp.FileSystemReader(f"{theirs}/{i}"))
        dcps.append(pattern_result(target))
    return {"steps": steps, "warned": len(warned), "ours": ours, "dcp": dcps}


def async_sharded_save(rank: int, world_size: int, root: str) -> dict:
    """``async_save`` of a state with a ShardedTensor (FSDP1's sharded state dicts) and a
    DTensor, their originals overwritten as soon as it returns (staging is done), then loaded
    back: rank 0 returns what the load gave."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor

    from zerostate.dcp import StorageReader, StorageWriter

    torch.set_num_threads(1)
    keys = ("uneven", "grid", "enum")
    state = {k: v for k, v in pattern_state(world_size, 1, "rows").items() if k in keys}
    future = dcp.async_save(state, storage_writer=StorageWriter(root))
    for value in state.values():  # the training loop goes on
        for local in (
            [value.to_local()]
            if isinstance(value, DTensor)
            else [s.tensor for s in value.local_shards()]
        ):
            local.fill_(-1.0)
    future.result()
    target = {k: v for k, v in pattern_state(world_size, 0, "columns").items() if k in keys}
    dcp.load(target, storage_reader=StorageReader(root))
    return {k: _gather(target[k]) for k in keys}


def no_dist_save(rank: int, world_size: int, root: str) -> dict:
    """``dcp.save(..., no_dist=True)`` on rank 0 only, while the process group is up: the
    rank saves alone, every value whole (rank 1 saves nothing). Then every rank loads it
    with ``no_dist=True``."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from zerostate.dcp import StorageReader, StorageWriter

    torch.set_num_threads(1)
    if rank == 0:
        dcp.save(plain_patterns(2), storage_writer=StorageWriter(root), no_dist=True)
    dist.barrier()
    state = plain_patterns(0)
    dcp.load(state, storage_reader=StorageReader(root), no_dist=True)
    return pattern_result(state)


def main() -> None:
    """``torchrun --nproc-per-node 2 -m tests.dcp.workers async-process ROOT``: the process
    staging of ``async_save`` needs ranks that may start processes (torchrun's may; the
    test harness's daemonic workers may not)."""
    import sys

    import torch.distributed as dist

    task, root = sys.argv[1], sys.argv[2]
    if task != "async-process":
        raise SystemExit(f"unknown task {task!r}")
    dist.init_process_group("gloo")
    saved = async_process_save(dist.get_rank(), dist.get_world_size(), root)
    local = saved["a_weight_local"].contiguous()
    with open(f"{root}.rank{dist.get_rank()}.bin", "wb") as f:  # raw float32, for the test
        f.write(local.view(torch.uint8).numpy().tobytes())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
