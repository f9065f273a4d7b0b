"""A downloaded checkpoint must not run code: hostile pickles in a DCP ``.metadata`` and in
DeepSpeed ``.pt`` files are refused by every command and by ``engine.load``, naming the
global they wanted, and their payload (creating a marker file) never runs."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch

from tests.foreign import peers
from tests.foreign.conftest import run_cli
from tests.helpers_dist import run_distributed


class _Payload:
    """Unpickling this calls ``os.system("touch <marker>")``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _hostile_dcp(root: Path, marker: Path) -> Path:
    path = root / "dcp"
    path.mkdir()
    (path / ".metadata").write_bytes(pickle.dumps({"state_dict_metadata": _Payload(marker)}))
    (path / "__0_0.distcp").write_bytes(b"")
    return path


def _hostile_deepspeed(root: Path, marker: Path, where: str) -> Path:
    """A DeepSpeed layout whose ``where`` file ("optim" or "model") carries the payload;
    the other is a plain, harmless torch.save file."""
    path = root / f"ds-{where}"
    tag = path / "global_step1"
    tag.mkdir(parents=True)
    (path / "latest").write_text("global_step1")
    harmless = {"optimizer_state_dict": {"zero_stage": 2, "partition_count": [1]}}
    optim = {"optimizer_state_dict": {"zero_stage": 2, "loss_scaler": _Payload(marker)}}
    model = {"module": {"w": torch.zeros(2)}, "param_shapes": [], "note": _Payload(marker)}
    torch.save(
        optim if where == "optim" else harmless, tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    )
    torch.save(
        model if where == "model" else {"module": {}, "param_shapes": []},
        tag / "mp_rank_00_model_states.pt",
    )
    return path


@pytest.fixture(params=["dcp", "ds-optim", "ds-model"])
def hostile(request, tmp_path) -> tuple[Path, Path]:
    marker = tmp_path / "payload-ran"
    if request.param == "dcp":
        return _hostile_dcp(tmp_path, marker), marker
    return _hostile_deepspeed(tmp_path, marker, request.param.split("-")[1]), marker


def test_the_payload_runs_when_unpickled_plainly(tmp_path):
    """The check below means something: the payload does create the marker."""
    marker = tmp_path / "payload-ran"
    pickle.loads(pickle.dumps(_Payload(marker)))
    assert marker.exists()


@pytest.mark.parametrize(
    "command",
    [
        ["inspect"],
        ["verify"],
        ["consolidate", "{out}/model.safetensors"],
        ["reshard", "{out}/resharded", "--world-size", "2"],
    ],
)
def test_every_command_refuses_it(hostile, tmp_path, command):
    path, marker = hostile
    argv = [command[0], str(path), *(a.format(out=tmp_path) for a in command[1:])]
    result = run_cli(*argv)
    assert result.returncode == 1
    assert not marker.exists(), "the pickle payload ran"
    assert "refused to unpickle global" in result.stderr
    assert "posix.system" in result.stderr or "os.system" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_engine_load_refuses_it(hostile):
    path, marker = hostile
    message = run_distributed(peers.zerostate_load_only, 1, str(path), timeout=120)[0]
    assert "UnsafePickleError" in message and "system" in message, message
    assert not marker.exists(), "the pickle payload ran"


def test_a_pickle_cannot_set_attributes_of_allowed_functions(tmp_path):
    """BUILD on anything but a stand-in record is refused: no pickle changes an allowed
    function's defaults for the rest of the process."""
    from zerostate.errors import CorruptCheckpointError
    from zerostate.store.safe_unpickle import TORCH_GLOBALS, restricted_loads

    # GLOBAL torch Size; EMPTY_DICT; NONE -> (None, {"__defaults__": ...}) state; BUILD
    data = (
        b"\x80\x02ctorch\nSize\nN}q\x00X\x0c\x00\x00\x00__defaults__q\x01(K\x07tq\x02s\x86q\x03b."
    )
    with pytest.raises(CorruptCheckpointError, match="refused to set state"):
        restricted_loads(data, TORCH_GLOBALS, "test")
