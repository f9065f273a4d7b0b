"""The engine makes non-contiguous buffers contiguous in place (a checkpoint writes each
buffer's flat storage): same values, same name, same persistence."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from world_of_one import world_of_one  # noqa: F401 - fixture

import zerostate


class _WithStridedBuffers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.register_buffer("kept", torch.arange(12.0).reshape(3, 4).t())
        self.register_buffer("scratch", torch.arange(6.0).reshape(2, 3).t(), persistent=False)


@pytest.mark.usefixtures("world_of_one")
def test_strided_buffers_become_contiguous_and_keep_their_persistence() -> None:
    model = _WithStridedBuffers()
    assert not model.kept.is_contiguous() and not model.scratch.is_contiguous()
    engine = zerostate.Engine(model, stage=2, lr=1e-2)
    try:
        assert model.kept.is_contiguous() and model.scratch.is_contiguous()
        assert torch.equal(model.kept, torch.arange(12.0).reshape(3, 4).t())
        assert torch.equal(model.scratch, torch.arange(6.0).reshape(2, 3).t())
        assert "kept" in model.state_dict() and "scratch" not in model.state_dict()
        assert dict(model.named_buffers()).keys() == {"kept", "scratch"}
    finally:
        engine.close()
