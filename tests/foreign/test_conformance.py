"""zerostate's formats 1, 2 and 3 and the DeepSpeed and DCP readers pass one step-reader
conformance suite (``zerostate.testing.StepReaderTests``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.foreign.test_peers import _reference
from zerostate.store.sources import open_source
from zerostate.testing import StepCase, StepReaderTests

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"


def _golden(version: int) -> StepCase:
    golden = FIXTURES / f"golden-v{version}"
    expected = json.loads((golden / "expected.json").read_text())["tensors"]
    ckpt = open_source(str(golden / "ckpt"))
    return StepCase(ckpt, ckpt.step(), {n: w["sha256"] for n, w in expected.items()})


class TestFormat1(StepReaderTests):
    @pytest.fixture
    def case(self) -> StepCase:
        return _golden(1)


class TestFormat2(StepReaderTests):
    @pytest.fixture
    def case(self) -> StepCase:
        return _golden(2)


class TestFormat3(StepReaderTests):
    """Tensor-parallel pieces (tp 2 x dp 3): odd shapes, fused q/k/v and gate/up, bf16, a
    3-D tensor, an empty one, and a plain format-2 tensor in the same step."""

    @pytest.fixture
    def case(self, tmp_path) -> StepCase:
        from tests.store.test_mesh_store import write_mesh_step

        full = write_mesh_step(tmp_path, 3, 2, 3)
        ckpt = open_source(str(tmp_path))
        return StepCase(ckpt, ckpt.step(), full)


def _peer_case(peer_checkpoints, name: str) -> StepCase:
    path, _, _ = peer_checkpoints.get(name)
    ckpt = open_source(str(path))
    st = ckpt.step()
    expected = {}
    for key, tensor in _reference(path, name).items():
        for candidate in (f"model/{key}", f"buffers/{key}"):
            if candidate in st.tensors:
                expected[candidate] = tensor
    return StepCase(ckpt, st, expected)


class TestDeepSpeedStage2(StepReaderTests):
    @pytest.fixture
    def case(self, peer_checkpoints) -> StepCase:
        return _peer_case(peer_checkpoints, "ds2-fp32-2")


class TestDeepSpeedStage3(StepReaderTests):
    @pytest.fixture
    def case(self, peer_checkpoints) -> StepCase:
        return _peer_case(peer_checkpoints, "ds3-fp32-4")


class TestDcp(StepReaderTests):
    @pytest.fixture
    def case(self, peer_checkpoints) -> StepCase:
        return _peer_case(peer_checkpoints, "dcp-2")


from tests.foreign.test_dcp_safetensors import safetensors_checkpoints  # noqa: E402, F401


def _safetensors_case(checkpoints, name: str) -> StepCase:
    path, saved, _ = checkpoints.get(name)
    ckpt = open_source(str(path))
    return StepCase(ckpt, ckpt.step(), {f"model/{k}": v for k, v in saved["model"].items()})


class TestDcpSafetensorsItems(StepReaderTests):
    @pytest.fixture
    def case(self, safetensors_checkpoints) -> StepCase:  # noqa: F811
        return _safetensors_case(safetensors_checkpoints, "distcp-fsdp2-2")


class TestDcpHuggingFaceWriter(StepReaderTests):
    @pytest.fixture
    def case(self, safetensors_checkpoints) -> StepCase:  # noqa: F811
        return _safetensors_case(safetensors_checkpoints, "hf-fsdp2-2")
