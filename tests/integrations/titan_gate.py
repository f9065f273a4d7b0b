"""The one gate of the torchtitan tests: importing torchtitan, skipping the module where it
is missing unless ``ZEROSTATE_REQUIRE_TORCHTITAN`` is set (the scripts set it, so there a
missing torchtitan fails instead of skipping)."""

from __future__ import annotations

import os

import pytest


def require_torchtitan() -> None:
    """Call at a test module's top: skips the module when torchtitan is not installed."""
    try:
        import torchtitan  # noqa: F401
    except ModuleNotFoundError as exc:
        if exc.name != "torchtitan" or os.environ.get("ZEROSTATE_REQUIRE_TORCHTITAN"):
            raise
        pytest.skip(
            "torchtitan is not installed (0.3.0 cannot share the test environment: its "
            "datasets<4.8 pins an fsspec older than s3fs needs); `bash scripts/torchtitan.sh "
            "test` runs these tests in an environment of their own",
            allow_module_level=True,
        )
