"""What the checkpoint commands show of a step's layout and damage: ``inspect`` and
``reshard`` name the mesh a step was saved on (a (dp_shard 2 x tp 2) step is not a (dp 4)
one, though both have 4 rows), and ``verify`` summarises a row cut short in a bounded
number of lines instead of one line of thousands of characters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cli_helpers import run_cli

from zerostate.store import open_checkpoint, save_tensors
from zerostate.store.rows import row_path

# ------------------------------------------------------------------------- verify
LAYERS = 40


@pytest.fixture
def cut_row(tmp_path: Path) -> Path:
    """A 2-rank step whose rank-1 ``model`` row is cut to its first 100 kB: every inner chunk
    after the cut fails, over a thousand problems in 30-odd tensors."""
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for i in range(LAYERS):
        tensors[f"model/layers.{i}.w"] = torch.randn(64, 257, generator=gen)
        tensors[f"optim/exp_avg/layers.{i}.w"] = torch.randn(64, 257, generator=gen)
    root = tmp_path / "ckpt"
    save_tensors(str(root), 3, tensors, world_size=2)
    row = root / "step-00000003" / row_path("model", 1)
    assert row.stat().st_size > 1_000_000
    with open(row, "r+b") as f:
        f.truncate(100_000)
    return root


def test_verify_summarises_a_row_cut_short(cut_row: Path, capsys) -> None:
    code, out, err = run_cli(["verify", str(cut_row), "-q"], capsys)
    assert code == 1
    lines = out.splitlines()
    assert len(lines) <= 23, out  # headline, at most 20 lines, "... and N more"
    assert max(map(len, lines)) <= 160, out
    assert lines[0].startswith("step 3: ") and "on rank(s) 1" in lines[0], lines[0]
    count = int(lines[0].split()[2])
    assert count > 1000, lines[0]
    assert "rank 1's row of group 'model'" in lines[1] and "cut short" in lines[1], lines[1]
    assert lines[2].startswith("  model/layers."), lines[2]  # then tensor by tensor
    assert lines[-1].startswith("... and ") and "--all" in lines[-1], lines[-1]
    assert "optim/" not in out  # the intact rows are not mentioned
    # stderr keeps its one line, short, with the count
    assert err.count("\n") == 1 and err.startswith("zerostate: error: verify failed: "), err
    assert f"{count} problem(s)" in err and len(err) < 300, err

    code, out, _ = run_cli(["verify", str(cut_row), "-q", "--all"], capsys)
    assert code == 1
    listed = out.splitlines()[1:]
    assert len(listed) == count and all("rank 1's row of group 'model'" in x for x in listed)

    code, out, _ = run_cli(["verify", str(cut_row), "-q", "--json"], capsys)
    assert code == 1
    doc = json.loads(out)
    assert doc["ok"] is False and len(doc["problems"]) == count
    chunk = next(p for p in doc["problems"] if p["chunk"] is not None)
    assert (chunk["rank"], chunk["group"], chunk["damage"]) == (1, "model", "is cut short")
    assert chunk["tensors"] and all(t.startswith("model/") for t in chunk["tensors"])


def test_verify_names_every_tensor_of_a_problem_in_its_record(cut_row: Path) -> None:
    """The error message shows five names per problem; the record keeps them all."""
    from zerostate.store.problems import VerifyError

    (cut_row / "step-00000003" / row_path("optim/exp_avg", 0)).unlink()
    st = open_checkpoint(str(cut_row)).step(3)
    with pytest.raises(VerifyError) as info:
        st.verify()
    st.close()
    [missing] = [p for p in info.value.problems if p.damage == "is missing"]
    assert (missing.rank, missing.group) == (0, "optim/exp_avg")
    assert len(missing.tensors) == LAYERS and f"and {LAYERS - 5} more" in missing.message
    assert len(str(info.value).split("; ")) <= 21  # the message stays bounded too
