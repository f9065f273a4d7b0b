"""A load_pretrained that fails while reading tensor data leaves weights part file, part
what they were ([Note: torn weights] in zerostate.engine): training, saving and close()
are refused, naming the call that failed, until a load_pretrained or a load writes them."""

from __future__ import annotations

import functools

import pytest
import torch
from helpers_dist import run_distributed

transformers = pytest.importorskip("transformers")

# Not pooled workers (this file is not in tests/conftest.py's POOLED_FILES): rank 0 wraps
# SafetensorsSource.read_elements to fail part-way.

FAIL_AT = 4  # rank 0's read call that fails; the ones before it went through


def _model(seed: int = 7):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=101, hidden_size=48, intermediate_size=76, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def _tokens() -> torch.Tensor:
    return torch.randint(0, 101, (2, 10), generator=torch.Generator().manual_seed(3))


def _failing_reads(rank: int):
    """Make rank 0's ``FAIL_AT``-th tensor-data read raise; returns the undo."""
    from zerostate import safetensors_io

    original = safetensors_io.SafetensorsSource.read_elements
    calls = {"n": 0}

    def read_elements(self, entry, start, stop, out):
        calls["n"] += 1
        if rank == 0 and calls["n"] == FAIL_AT:
            raise OSError("injected: the disk stopped answering")
        return original(self, entry, start, stop, out)

    safetensors_io.SafetensorsSource.read_elements = read_elements
    return lambda: setattr(safetensors_io.SafetensorsSource, "read_elements", original)


def _refusal(call) -> str | None:
    from zerostate.engine import EngineUsageError

    try:
        call()
    except EngineUsageError as exc:
        return str(exc)
    return None


def _worker(rank: int, world_size: int, root: str, stage: int) -> dict:
    import zerostate
    from zerostate.errors import ZerostateError

    hf, ckpt = f"{root}/hf", f"{root}/ckpt"
    idx = _tokens()
    clean = zerostate.Engine(_model(), stage=stage)
    clean.load_pretrained(hf)
    clean.save(ckpt)
    with torch.no_grad():
        want = clean(idx).logits
    out = {}
    for then in ("load_pretrained", "load"):
        engine = zerostate.Engine(_model(seed=100), stage=stage)  # unlike the file's
        before = engine.full_state_dict()
        undo = _failing_reads(rank)
        try:
            engine.load_pretrained(hf)
            failed = None
        except (ZerostateError, OSError) as exc:
            failed = str(exc)
        finally:
            undo()
        mixed = engine.full_state_dict()
        case = out[then] = {
            "failed": failed,
            # The scenario is real: some tensors took the file's values, some kept theirs.
            "some written": any(not torch.equal(before[n], mixed[n]) for n in before),
            "some kept": any(torch.equal(before[n], mixed[n]) for n in before),
            "forward": _refusal(functools.partial(engine, idx)),
            "save": _refusal(functools.partial(engine.save, f"{root}/torn-{then}")),
            "close": _refusal(engine.close),
        }
        if then == "load_pretrained":
            engine.load_pretrained(hf)
        else:
            engine.load(ckpt)
        with torch.no_grad():
            case["after"] = (engine(idx).logits - want).abs().max().item()
        engine.close()
    return out


@pytest.mark.parametrize("stage", [1, 3])
def test_a_load_pretrained_that_fails_while_reading_refuses_training_until_loaded(
    tmp_path, stage
) -> None:
    _model().save_pretrained(tmp_path / "hf")
    results = run_distributed(_worker, 2, str(tmp_path), stage, timeout=200)
    for rank, result in enumerate(results):
        for then, case in result.items():
            assert case["failed"] is not None, (rank, then)
            if rank == 0:
                assert "injected" in case["failed"], case["failed"]
                assert case["some written"] and case["some kept"], (then, case)
            for call in ("forward", "save", "close"):
                refusal = case[call]
                assert refusal is not None, (rank, then, call, "not refused")
                assert "failed while reading" in refusal and "load_pretrained(" in refusal, refusal
            assert case["after"] == 0.0, (rank, then, case["after"])
