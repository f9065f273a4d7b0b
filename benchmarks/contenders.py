"""The contenders, built inside a torchrun rank: the same GPT-2, the same seeded data and
the same AdamW (lr, betas, eps, weight decay on EVERY parameter) for each of them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.common import LR, MLP, MODELS, SEED, WEIGHT_DECAY, deepspeed_config

# name -> (ZeRO partitioning it does, description). Order is the run order.
PEERS: dict[str, tuple[int, str]] = {
    "ddp": (0, "DDP + torch.optim.AdamW"),
    "zero1opt": (1, "DDP + torch ZeroRedundancyOptimizer(AdamW)"),
    "ds1": (1, "DeepSpeed ZeRO-1"),
    "ds2": (2, "DeepSpeed ZeRO-2"),
    "fsdp2_noreshard": (2, "FSDP2 fully_shard(reshard_after_forward=False)"),
    "ds3": (3, "DeepSpeed ZeRO-3"),
    "fsdp2": (3, "FSDP2 fully_shard"),
}
ZEROSTATE: dict[str, tuple[int, str]] = {
    f"zs{s}": (s, f"zerostate.Engine(stage={s})") for s in range(4)
}
CONTENDERS: dict[str, tuple[int, str]] = {**PEERS, **ZEROSTATE}


@dataclass
class Ctx:
    """Where this rank runs."""

    rank: int
    world: int
    device: torch.device
    cuda: bool


@dataclass
class Trainer:
    """One contender, ready to train: ``step(idx, targets) -> loss``; ``obj`` is the engine
    or wrapped module, ``optimizer`` the torch optimizer where there is one."""

    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    obj: Any
    model: torch.nn.Module
    optimizer: Any = None


class MLPModel(torch.nn.Module):
    """The communication-heavy model of the step row ([``MLP``] in benchmarks.common):
    ``forward(x, target)`` returns the mean-squared error, as GPT-2's returns its loss."""

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(layers))

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.nn.functional.gelu(layer(x))
        return torch.nn.functional.mse_loss(x, target)


def build_model(preset: str, device: torch.device, mlp: dict | None = None) -> torch.nn.Module:
    from zerostate.models import GPT2, GPT2Config

    torch.manual_seed(SEED)  # identical initial weights on every rank and for every contender
    if preset == "mlp":
        return MLPModel(**(mlp or MLP)).to(device)
    return GPT2(GPT2Config(**MODELS[preset])).to(device)


def batches(preset: str, rank: int, micro_batch: int, seq_len: int, pool: int,
            device: torch.device, mlp: dict | None = None) -> torch.Tensor:
    """``pool`` fixed batches per rank (different per rank, identical across contenders),
    cycled: a model that trains memorises them, so its loss must fall. A batch is split
    along dim 1 into input ``[:, :-1]`` and target ``[:, 1:]``: GPT-2's tokens shifted by
    one; the MLP's (``seq_len`` ignored) one input row and one target row per sample."""
    g = torch.Generator().manual_seed(SEED + 1000 * rank)
    if preset == "mlp":
        shape = (pool, micro_batch, 2, (mlp or MLP)["width"])
        return (torch.randn(shape, generator=g) * 0.5).to(device)
    shape = (pool, micro_batch, seq_len + 1)
    return torch.randint(0, MODELS[preset]["vocab_size"], shape, generator=g).to(device)


def adamw(params: Any, eps: float = 1e-8) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, eps=eps)


def torch_trainer(module: torch.nn.Module, model: torch.nn.Module, opt: Any,
                   autocast: torch.dtype | None, ctx: Ctx) -> Trainer:
    def step(idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        if autocast is not None:
            with torch.autocast(ctx.device.type, dtype=autocast):
                loss = module(idx, targets)
        else:
            loss = module(idx, targets)
        loss.backward()
        opt.step()
        return loss

    return Trainer(step, module, model, opt)


def fully_shard_model(model: torch.nn.Module, reshard_after_forward: bool = True,
                      bf16: bool = False) -> None:
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
    kw: dict[str, Any] = {"reshard_after_forward": reshard_after_forward}
    if bf16:
        # Same recipe as zerostate's bf16: bf16 compute and communication, fp32 master.
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                               reduce_dtype=torch.bfloat16)
    blocks = model.layers if isinstance(model, MLPModel) else model.transformer.h
    for block in blocks:
        fully_shard(block, **kw)
    fully_shard(model, **kw)


def make(name: str, model: torch.nn.Module, ctx: Ctx, *, micro_batch: int,
         precision: str = "fp32") -> Trainer:
    """Wrap ``model`` as contender ``name`` (a key of CONTENDERS)."""
    bf16 = precision == "bf16"
    if name in ("ddp", "zero1opt"):
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(model, device_ids=[ctx.device.index] if ctx.cuda else None)
        if name == "zero1opt":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW,
                                          lr=LR, weight_decay=WEIGHT_DECAY)
        else:
            opt = adamw(ddp.parameters())
        return torch_trainer(ddp, model, opt, torch.bfloat16 if bf16 else None, ctx)
    if name in ("fsdp2", "fsdp2_noreshard"):
        fully_shard_model(model, reshard_after_forward=name == "fsdp2", bf16=bf16)
        return torch_trainer(model, model, adamw(model.parameters()), None, ctx)
    if name in ("ds1", "ds2", "ds3"):
        return make_deepspeed(model, int(name[2]), ctx, micro_batch=micro_batch, bf16=bf16)
    if name in ZEROSTATE:
        return make_zerostate(model, int(name[2]), precision=precision)
    raise ValueError(f"unknown contender {name!r}; choose from {list(CONTENDERS)}")


def make_deepspeed(model: torch.nn.Module, stage: int, ctx: Ctx, *, micro_batch: int,
                   bf16: bool = False, extra: dict | None = None) -> Trainer:
    from benchmarks.deepspeed_import import import_deepspeed

    deepspeed = import_deepspeed()

    config = deepspeed_config(stage=stage, micro_batch=micro_batch, world=ctx.world,
                              bf16=bf16, extra=extra)
    engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                             config=config)

    def step(idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = engine(idx, targets)
        engine.backward(loss)
        engine.step()
        return loss

    return Trainer(step, engine, model, opt)


def make_zerostate(model: torch.nn.Module, stage: int, *, precision: str = "fp32",
                   eps: float = 1e-8) -> Trainer:
    import zerostate

    # The peers decay every parameter; zerostate's default exempts 1-D ones. Same step here.
    engine = zerostate.Engine(model, stage=stage, lr=LR, weight_decay=WEIGHT_DECAY,
                              precision=precision, eps=eps, no_decay=lambda name, p: False)

    def step(idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = engine(idx, targets)
        engine.backward(loss)
        engine.step()
        return loss

    return Trainer(step, engine, model, getattr(engine, "optimizer", None))
