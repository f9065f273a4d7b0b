from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from e2e_common import reference_run  # noqa: E402


@pytest.fixture(scope="session")
def reference20():
    """Losses and final parameters of 20 single-process torch.optim.AdamW steps."""
    return reference_run(20)
