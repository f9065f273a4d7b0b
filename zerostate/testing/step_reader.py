"""``StepReaderTests``: the conformance suite every step format passes.

Subclass it in a pytest module and define the ``case`` fixture returning a
:class:`StepCase` (an opened checkpoint, one of its steps, and what some of its tensors
must hold, worked out independently of the reader); every test then runs against that
format. zerostate's formats 1 and 2, DeepSpeed ZeRO and DCP all run it (see
``tests/foreign/test_conformance.py``)::

    class TestMyFormat(StepReaderTests):
        @pytest.fixture
        def case(self):
            ckpt = open_source(PATH)
            return StepCase(ckpt, ckpt.step(), expected={"model/w": torch.ones(3)})
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from zerostate.errors import ConfigError
from zerostate.store.format import TensorInfo
from zerostate.store.protocol import CheckpointSource, StepSource


@dataclass
class StepCase:
    checkpoint: Any
    step: Any
    #: name -> the full tensor, or the sha256 of its bytes (flat, as stored).
    expected: dict[str, torch.Tensor | str] = field(default_factory=dict)


def _sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(
        t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
    ).hexdigest()


def _pieces(numel: int) -> list[tuple[int, int]]:
    """Uneven cuts of ``[0, numel)``: odd sizes, an empty piece, the whole."""
    cuts = sorted({0, numel, numel // 3, (2 * numel) // 3 + 1 if numel > 2 else numel})
    return [(a, b) for a, b in zip(cuts, cuts[1:], strict=False)] + [(numel // 2, numel // 2)]


class StepReaderTests:
    """Conformance tests of the step-reader protocol (``zerostate.store.protocol``)."""

    @pytest.fixture
    def case(self) -> StepCase:
        raise NotImplementedError("define a `case` fixture returning a StepCase")

    def test_satisfies_the_protocol(self, case: StepCase) -> None:
        assert isinstance(case.checkpoint, CheckpointSource)
        assert isinstance(case.step, StepSource)
        assert isinstance(case.step.attrs, dict)
        assert case.step.world_size >= 1 and case.step.object_count >= 1
        assert case.step.tensors, "a step holds tensors"

    def test_capabilities_are_flags_not_versions(self, case: StepCase) -> None:
        st = case.step
        assert isinstance(st.supports_references, bool)
        assert isinstance(st.supports_aliases, bool)
        assert isinstance(st.reads_locally, bool)
        refs = st.refs
        assert isinstance(refs, dict)
        assert refs == {} or st.supports_references, "only a step that says so holds refs"
        for name, holder in refs.items():
            assert name in st.tensors and isinstance(holder, int) and holder < st.step

    def test_records_are_tensor_infos(self, case: StepCase) -> None:
        for name, info in case.step.tensors.items():
            assert isinstance(info, TensorInfo) and info.name == name
            assert case.step.info(name) is info
            assert isinstance(info.attrs, dict)

    def test_close_and_context_manager(self, case: StepCase) -> None:
        name, info = next(iter(case.step.tensors.items()))
        with case.checkpoint.step(case.step.step) as st:
            want = st.read(name)
        st.close()  # idempotent
        assert torch.equal(st.read(name), want), "a closed step reads again on demand"
        st.close()
        assert tuple(want.shape) == tuple(info.shape)

    def test_aliases_when_supported(self, case: StepCase) -> None:
        name = next(iter(case.step.tensors))
        if not case.step.supports_aliases:
            return
        case.step.alias("alias/of/it", name)
        assert torch.equal(case.step.read("alias/of/it"), case.step.read(name))
        assert case.step.info("alias/of/it").shape == case.step.info(name).shape

    def test_read_many_lands_in_out(self, case: StepCase) -> None:
        requests, outs = [], []
        for name, info in case.step.tensors.items():
            for a, b in _pieces(info.numel):
                out = torch.empty(b - a, dtype=info.dtype)
                requests.append((name, a, b, out))
                outs.append(out)
        results = case.step.read_many(requests)
        for (name, a, b, _), out, got in zip(requests, outs, results, strict=True):
            assert got.data_ptr() == out.data_ptr() or out.numel() == 0, (name, a, b)
            assert torch.equal(out, case.step.read_range(name, a, b)), (name, a, b)

    def test_layout_reads_equal_the_logical_segments(self, case: StepCase) -> None:
        """``read_layout_many``: ranges of the tp shards of a tp 2 x dp 2 layout of every
        tensor (sharded on its last dim, as a row-parallel weight is) hold what the logical
        tensor has at their global segments."""
        from zerostate.layout.mesh_layout import MeshLayout

        requests = []
        for name, info in case.step.tensors.items():
            shape = tuple(info.shape)
            if not shape:
                continue
            mesh = MeshLayout(shape=shape, tp_dim=len(shape) - 1, tp_degree=2, dp_shard=2)
            for t, d in mesh.piece_ids():
                lo, hi = mesh.dp_layout(t).owned_range(d)
                out = torch.full((hi - lo,), 7, dtype=info.dtype)
                requests.append((name, mesh, t, lo, hi, out))
        case.step.read_layout_many(requests)
        for name, mesh, t, lo, hi, out in requests:
            flat = case.step.read(name).reshape(-1)
            for g, n, p in mesh.local_segments(t, lo, hi):
                assert torch.equal(out[p : p + n], flat[g : g + n]), (name, t, lo, hi)

    def test_out_of_the_wrong_kind_is_refused(self, case: StepCase) -> None:
        name, info = next((n, i) for n, i in case.step.tensors.items() if i.numel >= 2)
        wrong = torch.float64 if info.dtype != torch.float64 else torch.float32
        with pytest.raises(ConfigError):
            case.step.read_range(name, 0, 2, out=torch.empty(2, dtype=wrong))
        with pytest.raises(ConfigError):
            case.step.read_range(name, 0, 2, out=torch.empty(3, dtype=info.dtype))
        with pytest.raises(ConfigError):
            case.step.read_range(name, 0, 2, out=torch.empty(1, 2, dtype=info.dtype))

    def test_the_checkpoint_lists_and_reopens_the_step(self, case: StepCase) -> None:
        assert case.step.step in case.checkpoint.steps()
        again = case.checkpoint.step(case.step.step)
        assert set(again.tensors) == set(case.step.tensors)

    def test_expected_tensors(self, case: StepCase) -> None:
        assert case.expected, "a case names at least one tensor it knows independently"
        for name, want in case.expected.items():
            info = case.step.info(name)
            got = case.step.read(name)
            assert tuple(got.shape) == tuple(info.shape) and got.dtype == info.dtype, name
            if isinstance(want, str):
                assert _sha256(got) == want, name
            else:
                assert tuple(want.shape) == tuple(info.shape), name
                assert torch.equal(got, want.to(got.dtype)), name

    def test_ranges_equal_the_whole(self, case: StepCase) -> None:
        for name, info in case.step.tensors.items():
            flat = case.step.read(name).reshape(-1)
            assert flat.numel() == info.numel == info.layout.numel
            assert info.nbytes == info.numel * info.dtype.itemsize
            for start, stop in _pieces(info.numel):
                part = case.step.read_range(name, start, stop)
                assert part.dtype == info.dtype and part.shape == (stop - start,)
                assert torch.equal(part, flat[start:stop]), (name, start, stop)

    def test_reads_land_in_out(self, case: StepCase) -> None:
        for name, info in case.step.tensors.items():
            out = torch.full((info.numel,), 0, dtype=info.dtype)
            got = case.step.read_range(name, 0, info.numel, out=out)
            assert got.data_ptr() == out.data_ptr()
            assert torch.equal(out, case.step.read(name).reshape(-1))

    def test_read_many_equals_single_reads(self, case: StepCase) -> None:
        requests = []
        for name, info in case.step.tensors.items():
            requests += [(name, a, b, None) for a, b in _pieces(info.numel)]
        results = case.step.read_many(requests)
        assert len(results) == len(requests)
        for (name, a, b, _), got in zip(requests, results, strict=True):
            assert torch.equal(got, case.step.read_range(name, a, b)), (name, a, b)

    def test_chunks_cover_the_tensor(self, case: StepCase) -> None:
        for name, info in case.step.tensors.items():
            want = case.step.read(name).reshape(-1).view(torch.uint8).numpy().tobytes()
            got = b""
            for index in range(info.layout.num_chunks):
                start, stop = info.layout.chunk_range(index)
                got += bytes(case.step.read_chunk(name, index))[
                    : (stop - start) * info.dtype.itemsize
                ]
            assert got == want, name

    def test_bad_requests_fail_clearly(self, case: StepCase) -> None:
        name, info = next(iter(case.step.tensors.items()))
        with pytest.raises(ConfigError):
            case.step.read_range(name, 0, info.numel + 1)
        with pytest.raises(ConfigError):
            case.step.read_range(name, 1, 0)
        with pytest.raises(KeyError):
            case.step.read_range("no/such/tensor", 0, 0)
        with pytest.raises(ConfigError):
            case.step.rank_state(case.step.world_size)

    def test_rank_state_is_a_dict_or_none(self, case: StepCase) -> None:
        for rank in range(case.step.world_size):
            state = case.step.rank_state(rank)
            assert state is None or isinstance(state, dict)

    def test_verify_reads_everything(self, case: StepCase) -> None:
        seen = []
        case.step.verify(progress=seen.append)
        assert sum(seen) > 0
