"""Complex tensors through ``zerostate.dcp`` ([Note: complex chunks] in zerostate.dcp.common).

DCP saves a complex tensor as any other, and users' states hold them: a persistent RoPE
table (torchtitan's Llama registered ``freqs_cis`` as one before 0.3), a complex parameter
and the AdamW moments that follow it. A save through our writer used to refuse them
("dtype torch.complex64 is not storable"), so swapping DCP's ``FileSystemWriter`` for ours
failed on such a state. Here, FSDP2 at 2 gloo ranks with a complex64 parameter sharded
unevenly, a complex64 and a complex128 buffer, and a complex128 table sharded by columns:

* ``dcp.save`` and ``dcp.async_save`` through our writer, loaded at 3 ranks (the table by
  rows) and in one process without FSDP through our reader: bit-identical to what was saved
  and to what ``FileSystemReader`` loads from DCP's own save of the same state;
* ``zerostate.save`` / ``load`` of a replicated model with complex state, 2 ranks -> 1;
* the commands: ``inspect`` shows the complex dtypes, ``verify`` passes, ``consolidate``
  writes complex64 as safetensors' C64, ``reshard`` to 3 ranks and back gives the row
  objects byte for byte (and the 3-rank step loads as saved);
* a commit record whose piece or DCP document misdescribes a complex box is refused in one
  line;
* DCP's own checkpoint of the same state (``FileSystemWriter``), which no command could read
  (its complex storages were refused by the restricted unpickler): ``inspect``, ``verify``,
  ``consolidate`` (equal to ours) and ``reshard`` into the store and out again."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from tests.cli_helpers import run_cli
from tests.dcp import complex_workers as cw
from tests.helpers_dist import run_distributed
from zerostate.dcp import StorageReader
from zerostate.errors import CorruptCheckpointError

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("dcp-complex")
    roots = {k: str(base / k) for k in ("ours", "theirs", "async")}
    states = run_distributed(cw.save, 2, roots["ours"], roots["theirs"], roots["async"])
    return {"roots": roots, "state": states[0], "base": base}


def _equal(a, b, where: str = "") -> None:
    """``a`` and ``b`` hold the same values and dtypes, bit for bit."""
    if isinstance(a, dict):
        assert sorted(map(str, a)) == sorted(map(str, b)), where
        for k in a:
            _equal(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _equal(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype, (where, b)
        assert a.shape == b.shape and torch.equal(a, b), where
    else:
        assert a == b, (where, a, b)


def _complex_keys(state: dict) -> list[str]:
    keys = [f"model/{k}" for k, v in state["model"].items() if v.is_complex()]
    keys += [
        f"optim/{f}/{k}"
        for f, s in state["optim"]["state"].items()
        for k, v in s.items()
        if v.is_complex()
    ]
    return keys


def test_the_saved_state_holds_complex_tensors(saved):
    # What the rest checks is worth checking: the parameter, both buffers and the moments.
    assert sorted(_complex_keys(saved["state"])) == [
        "model/coil.z",
        "model/freqs_cis",
        "model/phase",
        "optim/coil.z/exp_avg",
        "optim/coil.z/exp_avg_sq",
    ]
    assert saved["state"]["model"]["phase"].dtype == torch.complex128
    assert saved["state"]["table"].dtype == torch.complex128


def test_fsdp2_state_loads_at_3_ranks_as_saved_and_as_dcp_loads_its_own(saved):
    roots, want = saved["roots"], saved["state"]
    ours = run_distributed(cw.load, 3, roots["ours"], False)
    theirs = run_distributed(cw.load, 3, roots["theirs"], True)
    later = run_distributed(cw.load, 3, roots["async"], False)
    for got in (ours[0], theirs[0], later[0]):
        _equal(got, want)
    _equal(ours[2], theirs[2])


def test_one_process_without_fsdp_loads_it(saved):
    model, opt = cw.build(False, 9)
    cw.train(model, opt, 1, 9)
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {
        "model": model_sd,
        "optim": optim_sd,
        "table": torch.zeros(cw.TABLE, dtype=torch.complex128),
        "epoch": 0,
    }
    dcp.load(state, storage_reader=StorageReader(saved["roots"]["ours"]), no_dist=True)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    _equal(state, saved["state"])
    _equal(cw._full(model.state_dict()), saved["state"]["model"])


def test_zerostate_save_of_complex_state_at_2_ranks_loads_in_one_process(tmp_path):
    import zerostate

    root = str(tmp_path / "session")
    want = run_distributed(cw.session_save, 2, root)[0]
    model, opt = cw.build(False, 11)
    cw.train(model, opt, 1, 11)
    tab = torch.zeros(cw.TABLE, dtype=torch.complex128)
    assert zerostate.load({"model": model, "optim": opt, "table": tab}, root) == 5
    _equal(cw._full(model.state_dict()), want["model"])
    _equal(cw._full(opt.state_dict()["state"]), want["optim"])
    assert torch.equal(tab, cw.table(2))


def _rows(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("c/*/0"))}


def test_the_commands_read_it(saved, tmp_path, capsys):
    ours, want = Path(saved["roots"]["ours"]), saved["state"]
    rc, out, _ = run_cli(["inspect", str(ours)], capsys)
    assert rc == 0
    assert "model.coil.z  7x3 complex64: [0:4, 0:3] rank 0, [4:7, 0:3] rank 1" in out
    assert "table  5x6 complex128: [0:5, 0:3] rank 0, [0:5, 3:6] rank 1" in out
    assert run_cli(["verify", str(ours)], capsys)[0] == 0

    out_file = tmp_path / "model.safetensors"
    rc, _, err = run_cli(["consolidate", str(ours), str(out_file), "-q"], capsys)
    assert rc == 0, err
    got = load_file(out_file)
    for name in ("coil.z", "freqs_cis", "a.weight", "a.bias"):
        assert got[name].dtype == want["model"][name].dtype, name
        assert torch.equal(got[name], want["model"][name]), name
    # safetensors has no complex128: its real pairs, as the format documents.
    assert torch.equal(got["phase"], torch.view_as_real(want["model"]["phase"]))

    # The table was saved by columns; a reshard writes FSDP2's rows, so the round trip that
    # must give the same row objects starts from the 2-rank layout a reshard writes.
    two, three, back = tmp_path / "r2", tmp_path / "r3", tmp_path / "r2-again"
    for src, dst, n in ((ours, two, 2), (two, three, 3), (three, back, 2)):
        rc, _, err = run_cli(["reshard", str(src), str(dst), "--world-size", str(n), "-q"], capsys)
        assert rc == 0, err
    rows = _rows(two)
    assert len(rows) == 2 and _rows(back) == rows
    assert len(_rows(three)) == 3
    loaded = run_distributed(cw.load, 3, str(three), False)
    _equal(loaded[1], want)


def _copy(saved, tmp_path) -> Path:
    root = tmp_path / "copy"
    shutil.copytree(saved["roots"]["ours"], root)
    return root


def _edit(root: Path, change) -> None:
    path = root / "step-00000000" / "_zerostate" / "commit" / "zarr.json"
    doc = json.loads(path.read_text())
    change(doc["attributes"]["zerostate_commit"])
    path.write_text(json.dumps(doc))


def _load_error(root: Path) -> str:
    """The one line reading the step's metadata refuses it with; ``dcp.load`` through our
    reader fails with it too (DCP wraps it)."""
    with pytest.raises(CorruptCheckpointError) as info:
        StorageReader(str(root)).read_metadata()
    message = str(info.value)
    assert "\n" not in message, message
    model, opt = cw.build(False, 9)
    cw.train(model, opt, 1, 9)
    model_sd, optim_sd = get_state_dict(model, opt)
    tab = torch.zeros(cw.TABLE, dtype=torch.complex128)
    state = {"model": model_sd, "optim": optim_sd, "table": tab, "epoch": 0}
    with pytest.raises((CheckpointException, AssertionError)) as wrapped:
        dcp.load(state, storage_reader=StorageReader(str(root)), no_dist=True)
    assert message in str(wrapped.value)
    return message


def _piece(commit: dict, fqn: str) -> str:
    return commit["attrs"]["dcp"]["tensors"][fqn]["chunks"][0]["piece"]


def _real_called_complex(commit: dict) -> None:
    commit["attrs"]["dcp"]["tensors"]["model.a.weight"]["dtype"] = "complex64"


def _pairs_called_real(commit: dict) -> None:
    doc = commit["attrs"]["dcp"]["tensors"]["model.coil.z"]
    doc["dtype"] = "float32"  # the box's piece is a complex64 one's real pairs
    doc["shape"] = [7, 3, 2]
    for chunk in doc["chunks"]:
        chunk["offsets"].append(0)
        chunk["sizes"].append(2)


def _marked_another_complex(commit: dict) -> None:
    entry = commit["tensors"][_piece(commit, "model.freqs_cis")]
    assert entry["attrs"] == {"complex_dtype": "complex64"}
    entry["attrs"] = {"complex_dtype": "complex128"}


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (
            _real_called_complex,
            ("'model.a.weight'", "float32 [3, 6, 2] (the real pairs of complex64)"),
        ),
        (_pairs_called_real, ("'model.coil.z'", "is marked complex64, the tensor is float32")),
        (_marked_another_complex, ("'model.freqs_cis'", "complex_dtype='complex128' does not")),
    ],
    ids=["real-called-complex", "pairs-called-real", "another-mark"],
)
def test_a_misdescribed_complex_box_is_refused_in_one_line(saved, tmp_path, change, expected):
    root = _copy(saved, tmp_path)
    _edit(root, change)
    message = _load_error(root)
    assert all(text in message for text in expected), message


# ------------------------------------------- DCP's own checkpoint of a complex state
def test_dcp_own_checkpoint_of_it_reads_through_every_command(saved, tmp_path, capsys):
    """``FileSystemWriter``'s files hold ``torch.ComplexFloatStorage`` items, which the
    restricted unpickler used to refuse ("refused to unpickle global torch.complex64"), so
    no command could read such a checkpoint ([Note: complex foreign tensors])."""
    theirs, ours = saved["roots"]["theirs"], saved["roots"]["ours"]
    rc, out, err = run_cli(["inspect", theirs], capsys)
    assert rc == 0, err
    assert re.search(r"model/coil\.z\s+7x3x2\s+float32", out), out
    assert run_cli(["verify", theirs], capsys)[0] == 0

    files = {}
    for name, root in (("theirs", theirs), ("ours", ours)):
        files[name] = tmp_path / f"{name}.safetensors"
        assert run_cli(["consolidate", root, str(files[name]), "-q"], capsys)[0] == 0
    want, got = load_file(files["ours"]), load_file(files["theirs"])
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name
    assert got["coil.z"].dtype == torch.complex64

    # Into the store (real pairs, marked) and back out as complex: the same tensors.
    imported = tmp_path / "imported"
    rc, _, err = run_cli(["reshard", theirs, str(imported), "--world-size", "3", "-q"], capsys)
    assert rc == 0, err
    again = tmp_path / "again.safetensors"
    assert run_cli(["consolidate", str(imported), str(again), "-q"], capsys)[0] == 0
    back = load_file(again)
    for name in want:
        assert back[name].dtype == want[name].dtype and torch.equal(back[name], want[name]), name


def test_a_complex_tensor_with_a_piece_of_another_dtype_is_refused():
    from zerostate.store.foreign.base import ForeignTensor, Segment, real_pairs
    from zerostate.store.safe_unpickle import StoredTensor

    def tensor(logical, stored):
        piece = StoredTensor("0", stored, 6, 0, (2, 3))
        return ForeignTensor("t", (2, 3), logical, (Segment(0, 6, None, piece),))

    pairs = real_pairs(tensor(torch.complex64, torch.complex64), "ckpt")
    assert (pairs.shape, pairs.dtype, pairs.attrs) == (
        (2, 3, 2),
        torch.float32,
        {"complex_dtype": "complex64"},
    )
    (seg,) = pairs.segments
    assert (seg.numel, seg.tensor.storage_numel, seg.tensor.shape) == (12, 12, (2, 3, 2))
    with pytest.raises(CorruptCheckpointError, match="stored as torch.float32"):
        real_pairs(tensor(torch.complex64, torch.float32), "ckpt")
    with pytest.raises(CorruptCheckpointError, match="stored complex"):
        real_pairs(tensor(torch.float32, torch.complex64), "ckpt")
    assert real_pairs(tensor(torch.float32, torch.bfloat16), "ckpt").dtype == torch.float32
