"""Checkpoints written by the peers themselves (DeepSpeed ZeRO, FSDP2 + DCP) on gloo ranks,
and the steps those peers take when they continue from them.

Each writer trains ``TRAIN_STEPS`` AdamW steps of :class:`TiedFrozen` (a tied embedding /
head pair, a frozen layer, a buffer) from the same seed, saves, then takes ``NEXT_STEPS``
more steps and returns the weights after each: what zerostate must reproduce when it
continues the peer's run from the checkpoint.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

VOCAB, DIM = 13, 8
LR, BETAS, EPS, WEIGHT_DECAY = 1e-2, (0.9, 0.95), 1e-8, 0.1
TRAIN_STEPS, NEXT_STEPS = 2, 2
MICRO_BATCH, SEQ = 2, 5


class TiedFrozen(nn.Module):
    """Embedding tied to the output head, one frozen layer, one persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.body = nn.Linear(DIM, 7)
        self.out = nn.Linear(7, DIM)
        self.frozen = nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.linspace(0.5, 1.5, DIM))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        h = self.out(torch.tanh(self.body(h))) + self.frozen(h) * self.scale.to(h.dtype)
        logits = self.head(h).float()
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def import_deepspeed(rank: int, world_size: int) -> Any:
    """DeepSpeed for a writer rank: the CPU accelerator, torchrun's rank variables, and no
    shared-memory all-reduce op. DeepSpeed builds that op with a C++ compiler the first
    time a process group starts in an environment (about 2 minutes on this machine, the
    first writer's whole cost in a clean clone) and uses it only for
    ``inference_all_reduce``; training, ZeRO's collectives, AutoTP's training all-reduce
    and the checkpoints all go through torch.distributed, so the checkpoints and the steps
    these writers record are the same without it."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world_size))
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return deepspeed


def build_model() -> TiedFrozen:
    torch.manual_seed(0)
    return TiedFrozen()


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s micro-batch at global step ``step`` (the same for every writer)."""
    g = torch.Generator().manual_seed(1000 + 97 * step + rank)
    data = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def global_batch(world_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's micro-batch at ``step`` concatenated: the same gradient at any world
    size (the mean over all of it)."""
    parts = [batch(r, step) for r in range(world_size)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def ds_config(stage: int, world_size: int, bf16: bool) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "train_batch_size": MICRO_BATCH * world_size,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "torch_adam": True,
                "lr": LR,
                "betas": list(BETAS),
                "eps": EPS,
                "weight_decay": WEIGHT_DECAY,
            },
        },
        "zero_optimization": {"stage": stage},
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def _full_fp32(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().clone() for n, p in model.named_parameters()}


def write_deepspeed(
    rank: int, world_size: int, out: str, stage: int, default_clipping: bool = False
) -> dict:
    """Train in fp32, save a DeepSpeed checkpoint to ``out`` (tag ``global_step<k>``), then
    take ``NEXT_STEPS`` more steps; rank 0 returns the fp32 weights after each of them.
    ``default_clipping`` leaves ``gradient_clipping`` out of the config, as most users do
    (DeepSpeed then clips at 1.0). bf16 runs are :func:`write_deepspeed_bf16`."""
    deepspeed = import_deepspeed(rank, world_size)
    from deepspeed.utils import safe_get_full_fp32_param

    model = build_model()
    config = ds_config(stage, world_size, bf16=False)
    if default_clipping:
        del config["gradient_clipping"]
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=config,
    )

    def train(step: int) -> None:
        idx, targets = batch(rank, step)
        loss = engine(idx, targets)
        engine.backward(loss)
        engine.step()

    for step in range(TRAIN_STEPS):
        train(step)
    engine.save_checkpoint(out, client_state={"note": "peer"})
    after = []
    for step in range(TRAIN_STEPS, TRAIN_STEPS + NEXT_STEPS):
        train(step)
        weights = {}
        for name, p in engine.module.named_parameters():
            full = safe_get_full_fp32_param(p) if p.requires_grad else None
            if full is None:
                full = p.detach().float() if stage < 3 else None
            if full is not None:
                weights[name] = full.detach().float().clone()
        after.append(weights)
    return {"after": after} if rank == 0 else {}


#: bf16 runs take 3 samples per DeepSpeed rank: a global batch of 6 (2 ranks) or 12 (4 ranks),
#: which splits evenly over the world sizes zerostate continues them at (1, 2, 3).
BF16_MICRO = 3


def bf16_global_batch(size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5000 + 31 * step)
    data = torch.randint(0, VOCAB, (size, SEQ + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def bf16_share(
    rank: int, world_size: int, step: int, size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s share of the bf16 global batch of ``size`` samples at ``step``."""
    idx, targets = bf16_global_batch(size, step)
    n = size // world_size
    assert n * world_size == size, "the global batch must split evenly"
    return idx[rank * n : (rank + 1) * n], targets[rank * n : (rank + 1) * n]


def write_deepspeed_bf16(rank: int, world_size: int, out: str, stage: int) -> dict:
    """Train ``TRAIN_STEPS`` bf16 steps, save, take ``NEXT_STEPS`` more; every rank returns
    its losses of the next steps, rank 0 also DeepSpeed's fp32 masters after each."""
    deepspeed = import_deepspeed(rank, world_size)
    from deepspeed.utils import safe_get_full_fp32_param

    size = BF16_MICRO * world_size
    cfg = ds_config(stage, world_size, bf16=True)
    cfg.update(train_micro_batch_size_per_gpu=BF16_MICRO, train_batch_size=size)
    # Stage 3 otherwise replaces torch.nn.functional.linear, process-wide, by a matmul and
    # a separate bias add, which rounds twice in bf16 (a first-step loss 1.4e-3 away from
    # torch's fused linear on the same weights): a kernel choice, not checkpoint state.
    cfg["zero_optimization"]["memory_efficient_linear"] = False
    model = build_model()
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=cfg,
    )

    def train(step: int) -> float:
        loss = engine(*bf16_share(rank, world_size, step, size))
        engine.backward(loss)
        engine.step()
        return loss.item()

    for step in range(TRAIN_STEPS):
        train(step)
    engine.save_checkpoint(out)
    losses, masters = [], []
    for step in range(TRAIN_STEPS, TRAIN_STEPS + NEXT_STEPS):
        losses.append(train(step))
        masters.append(
            {
                name: safe_get_full_fp32_param(p).detach().float().clone()
                for name, p in engine.module.named_parameters()
                if p.requires_grad
            }
        )
    assert next(engine.module.parameters()).dtype == torch.bfloat16  # it did run in bf16
    return {"losses": losses, "after": masters if rank == 0 else None}


def write_fsdp2_dcp(rank: int, world_size: int, out: str) -> dict:
    """FSDP2 + get_state_dict / dcp.save, then ``NEXT_STEPS`` more steps (full weights
    after each, gathered, from rank 0)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    model = build_model()
    for module in (model.body, model.out):
        fully_shard(module)
    fully_shard(model)
    opt = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=LR,
        betas=BETAS,
        eps=EPS,
        weight_decay=WEIGHT_DECAY,
    )

    def train(step: int) -> None:
        loss = model(*batch(rank, step))
        loss.backward()
        opt.step()
        opt.zero_grad()

    for step in range(TRAIN_STEPS):
        train(step)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=out)
    after = []
    for step in range(TRAIN_STEPS, TRAIN_STEPS + NEXT_STEPS):
        train(step)
        after.append(
            {n: p.full_tensor().detach().float().clone() for n, p in model.named_parameters()}
        )
    return {"after": after} if rank == 0 else {}


def generate(kind: str, out: Path, world_size: int, **kw) -> dict:
    from tests.helpers_dist import run_distributed

    kw = dict(kw)
    # DeepSpeed changes process-wide state (environment, accelerator, torch functions at
    # stage 3): its writers get new processes, never pooled workers; forked ones, which
    # skip an interpreter's start and torch's import ([Note: forked workers]).
    if kind == "deepspeed":
        kw.update(pooled=False, spawn=False)
    if kind == "deepspeed" and kw.pop("bf16", False):
        ranks = run_distributed(write_deepspeed_bf16, world_size, str(out), **kw, timeout=600)
        # The loss of a step is the mean over the ranks' micro-batches.
        losses = [sum(r["losses"][k] for r in ranks) / world_size for k in range(NEXT_STEPS)]
        return {"after": ranks[0]["after"], "losses": losses}
    fn = write_deepspeed if kind == "deepspeed" else write_fsdp2_dcp
    results = run_distributed(fn, world_size, str(out), **kw, timeout=600)
    return results[0]


def zerostate_continue(
    rank: int, world_size: int, ckpt: str, stage: int, peer_world: int, **engine_kw: Any
) -> Any:
    """Load a peer's checkpoint into a zerostate engine at ``world_size`` ranks and take
    the peer's next ``NEXT_STEPS`` steps on the same global batches; rank 0 returns the
    full weights as loaded and after each step, and the warnings the load logged.
    ``engine_kw`` go to the engine (e.g. ``grad_clip``)."""
    import logging

    import zerostate

    model = build_model()
    with torch.no_grad():  # the load must replace every value
        for p in model.parameters():
            p.add_(1.0)
    engine = zerostate.Engine(
        model, stage=stage, lr=0.5, betas=(0.5, 0.5), eps=EPS, weight_decay=0.0, **engine_kw
    )
    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("zerostate").addHandler(handler)
    try:
        engine.load(ckpt)
    finally:
        logging.getLogger("zerostate").removeHandler(handler)
    loaded = {k: v.detach().float().clone() for k, v in engine.full_state_dict().items()}
    after = []
    for step in range(TRAIN_STEPS, TRAIN_STEPS + NEXT_STEPS):
        idx, targets = global_batch(peer_world, step)
        n = idx.shape[0] // world_size
        assert n * world_size == idx.shape[0], "the peer's global batch must split evenly"
        loss = engine(idx[rank * n : (rank + 1) * n], targets[rank * n : (rank + 1) * n])
        engine.backward(loss)
        engine.step()
        after.append({k: v.detach().float().clone() for k, v in engine.full_state_dict().items()})
    if rank != 0:
        return {"warnings": warnings}
    return {"loaded": loaded, "after": after, "steps": engine.optimizer_steps, "warnings": warnings}


def assert_continues(theirs: list[dict], ours: list[dict], tol: float = 1e-5) -> None:
    """The weights after each next step agree within ``tol`` (the peer may name the tied
    head ``head.weight``; zerostate keeps it as ``emb.weight``)."""
    for k, (step_theirs, step_ours) in enumerate(zip(theirs, ours, strict=True)):
        for key, value in step_theirs.items():
            mine = step_ours[key if key in step_ours or key != "head.weight" else "emb.weight"]
            diff = (mine - value).abs().max().item()
            assert diff <= tol, f"step {k}: {key} differs by {diff}"


def zerostate_load_only(rank: int, world_size: int, ckpt: str) -> str:
    """``engine.load(ckpt)``; the error's class and message, or ``"loaded"``."""
    import zerostate

    engine = zerostate.Engine(build_model(), stage=2)
    try:
        engine.load(ckpt)
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return f"{type(exc).__name__}: {exc}"
    return "loaded"


def _split(rank: int, world_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s share of the 2-rank global batch of ``step``."""
    idx, targets = global_batch(2, step)
    n = idx.shape[0] // world_size
    return idx[rank * n : (rank + 1) * n], targets[rank * n : (rank + 1) * n]


def zerostate_train_save(rank: int, world_size: int, root: str, stage: int) -> dict:
    """Train with zerostate (a torch AdamW of the peers' settings), save to ``root``, then
    take ``NEXT_STEPS`` more steps; rank 0 returns the weights after each."""
    import zerostate

    model = build_model()
    opt = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
    )  # fmt: skip
    engine = zerostate.Engine(model, stage=stage, optimizer=opt)

    def train(step: int) -> None:
        engine.backward(engine(*_split(rank, world_size, step)))
        engine.step()

    for step in range(TRAIN_STEPS):
        train(step)
    engine.save(root)
    after = []
    for step in range(TRAIN_STEPS, TRAIN_STEPS + NEXT_STEPS):
        train(step)
        after.append({k: v.detach().float().clone() for k, v in engine.full_state_dict().items()})
    return {"after": after} if rank == 0 else {}


def fsdp2_from_dcp(rank: int, world_size: int, ckpt: str) -> dict:
    """FSDP2 + AdamW loads ``ckpt`` with get_state_dict / dcp.load / set_state_dict and
    takes ``NEXT_STEPS`` steps of the same global batches."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    model = build_model()
    for module in (model.body, model.out):
        fully_shard(module)
    fully_shard(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.5)
    loss = model(*_split(rank, world_size, 0))  # creates the optimizer state to load into
    loss.backward()
    opt.step()
    opt.zero_grad()
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(state, checkpoint_id=ckpt)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    after = []
    for step in range(TRAIN_STEPS, TRAIN_STEPS + NEXT_STEPS):
        model(*_split(rank, world_size, step)).backward()
        opt.step()
        opt.zero_grad()
        after.append(
            {n: p.full_tensor().detach().float().clone() for n, p in model.named_parameters()}
        )
    return {"after": after} if rank == 0 else {}
