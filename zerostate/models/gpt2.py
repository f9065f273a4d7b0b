"""A small GPT-2 for examples, tests and benchmarks.

Parameter names, shapes and maths follow Hugging Face's ``GPT2LMHeadModel`` (Conv1D weights
stored as ``(in, out)``, tanh-approximated GELU, tied ``lm_head``), so a consolidated
checkpoint loads there with ``from_pretrained`` and gives the same logits.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(kw_only=True)
class GPT2Config:
    vocab_size: int = 256
    n_positions: int = 64
    n_embd: int = 64
    n_layer: int = 2
    n_head: int = 4
    layer_norm_epsilon: float = 1e-5
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        for field in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPT2Config.{field} must be a positive int, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"GPT2Config.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})"
            )

    def to_hf_dict(self) -> dict:
        """A ``config.json`` body that ``transformers.GPT2Config`` reads."""
        d = asdict(self)
        d.update(
            model_type="gpt2",
            architectures=["GPT2LMHeadModel"],
            n_inner=None,
            activation_function="gelu_new",
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            tie_word_embeddings=True,
            scale_attn_weights=True,
            use_cache=False,
        )
        return d


class Conv1D(nn.Module):
    """A linear layer whose weight is stored ``(in_features, out_features)``, as GPT-2's."""

    def __init__(self, nx: int, nf: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(
            *x.shape[:-1], self.weight.shape[1]
        )


class Attention(nn.Module):
    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = Conv1D(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = Conv1D(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        shape = (b, t, self.n_head, c // self.n_head)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.c_fc = Conv1D(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = Conv1D(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.attn = Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Transformer(nn.Module):
    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.n_positions, cfg.n_embd)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)


class GPT2(nn.Module):
    """``GPT2LMHeadModel``-compatible. ``forward(idx, targets=None)`` returns logits, or the
    mean cross-entropy loss when ``targets`` is given."""

    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.config = cfg
        self.transformer = Transformer(cfg)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied: one parameter, two names
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = self.config.initializer_range
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif ".ln_" in name or name.startswith("transformer.ln_f"):
                nn.init.ones_(p)
            elif name.endswith("c_proj.weight"):
                nn.init.normal_(p, std=std / math.sqrt(2 * self.config.n_layer))
            else:
                nn.init.normal_(p, std=std)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.config.n_positions:
            raise ValueError(f"sequence length {t} exceeds n_positions {self.config.n_positions}")
        pos = torch.arange(t, device=idx.device)
        tr = self.transformer
        x = tr.wte(idx) + tr.wpe(pos)
        for block in tr.h:
            x = block(x)
        logits = self.lm_head(tr.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))
