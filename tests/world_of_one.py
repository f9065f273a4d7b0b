"""A torch.distributed world of one gloo rank inside the test process (no torchrun), for
tests that construct an Engine in-process. ``world_of_one`` is a module-scoped fixture."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch.distributed as dist
from helpers_dist import free_port


def init_world_of_one() -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=60),
    )


@pytest.fixture(scope="module")
def world_of_one() -> Iterator[None]:
    init_world_of_one()
    try:
        yield
    finally:
        dist.destroy_process_group()
