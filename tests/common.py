"""Shared pieces of the engine tests: tiny models, data, a single-process reference."""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import zerostate
from zerostate.models.gpt2 import GPT2, GPT2Config

TINY = dict(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4)
GLOBAL_BATCH = 12  # divisible by every tested world size (1-4)
SEQ = 16
# Adam's eps: the attention key bias has an analytically zero gradient (softmax ignores a
# per-query shift), so its computed gradient is pure rounding noise (~1e-10) whose sign
# depends on reduction order. With eps=1e-8 Adam turns that noise into full-size steps and
# no two summation orders agree on those elements; eps=1e-6 keeps the noise out of the
# trajectory without changing anything else the comparison exercises.
EPS = 1e-6
LR = 1e-3
WD = 0.1


class CheckpointedGPT2(GPT2):
    """GPT2 whose blocks run under non-reentrant activation checkpointing."""

    def forward(self, idx, targets=None):
        t = idx.shape[1]
        tr = self.transformer
        x = tr.wte(idx) + tr.wpe(torch.arange(t, device=idx.device))
        for block in tr.h:
            x = checkpoint(block, x, use_reentrant=False)
        logits = self.lm_head(tr.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def make_model(seed: int = 0, cls=GPT2, **overrides) -> GPT2:
    torch.manual_seed(seed)
    return cls(GPT2Config(**{**TINY, **overrides}))


def batch(step: int, micro: int, vocab: int = 64, size: int = GLOBAL_BATCH):
    g = torch.Generator().manual_seed(1000 * step + micro)
    x = torch.randint(0, vocab, (size, SEQ), generator=g)
    y = torch.randint(0, vocab, (size, SEQ), generator=g)
    return x, y


def local(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    b = t.shape[0] // world_size
    return t[rank * b : (rank + 1) * b]


def param_groups(model, weight_decay=WD):
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def reference_run(model, steps, *, accum=1, grad_clip=None, first_step=0):
    """Single-process AdamW on the full global batch: per-step losses, final params."""
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(param_groups(model), lr=LR, eps=EPS)
    losses = []
    for step in range(first_step, first_step + steps):
        xs, ys = zip(*(batch(step, m) for m in range(accum)), strict=True)
        loss = model(torch.cat(xs), torch.cat(ys))
        opt.zero_grad()
        loss.backward()
        if grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def engine_steps(engine, rank, world_size, steps, *, accum=1, first_step=0):
    """Train ``steps`` optimizer steps; returns the global mean loss of each step."""
    losses = []
    for step in range(first_step, first_step + steps):
        total = torch.zeros(1)
        for m in range(accum):
            x, y = batch(step, m)
            loss = engine(local(x, rank, world_size), local(y, rank, world_size))
            engine.backward(loss)
            engine.step()
            total += loss.detach().float()
        dist.all_reduce(total)
        losses.append(total.item() / (world_size * accum))
    return losses


def make_engine(model, **kwargs):
    settings = dict(lr=LR, eps=EPS, weight_decay=WD)
    settings.update(kwargs)
    return zerostate.Engine(model, **settings)


def identical(a, b) -> bool:
    """Nested dicts / lists / tensors (an optimizer state dict, say) equal bit for bit:
    same keys, tensors of the same dtype, shape and values."""
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    if isinstance(a, dict):
        return (
            isinstance(b, dict) and a.keys() == b.keys() and all(identical(a[k], b[k]) for k in a)
        )
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(identical(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def error_of(fn) -> str | None:
    """The message of the zerostate error ``fn()`` raises; None if it raises none."""
    try:
        fn()
    except zerostate.ZerostateError as exc:
        return str(exc)
    return None


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    denom = b.float().norm().item()
    return (a.float() - b.float()).norm().item() / (denom if denom else 1.0)


def compare(losses, ref_losses, params, ref_params):
    """(max relative loss error, max relative param L2 error, worst param name)."""
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True))
    errs = {n: rel(params[n], p) for n, p in ref_params.items()}
    worst = max(errs, key=errs.get)
    return loss_err, errs[worst], worst


@contextlib.contextmanager
def log_messages(name: str = "zerostate", level: int | None = None) -> Iterator[list[str]]:
    """The messages logged to ``name`` while inside; the handler (and ``level``, when
    given) is taken off again on the way out, so a pooled worker stays as it started."""
    messages: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    logger = logging.getLogger(name)
    handler, old_level = Keep(), logger.level
    logger.addHandler(handler)
    if level is not None:
        logger.setLevel(level)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


@contextlib.contextmanager
def single_threaded():
    """One intra-op thread, as every rank has, for references computed in the test process
    and handed to the ranks: computed once there instead of on every rank at every world
    size (on 4 ranks the full-batch reference was about half of each rank's work)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
