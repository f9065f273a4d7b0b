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

from tests.store.test_mesh_store import write_mesh_step
from zerostate.store import open_checkpoint, save_tensors
from zerostate.store.rows import row_path


# ------------------------------------------------------------------ inspect, reshard
@pytest.fixture
def tp_step(tmp_path: Path) -> Path:
    """A step as a (dp_shard 2 x tp 2) job writes it (no training needed: the store's
    writers, one per rank): fused q/k/v and gate/up, a norm replicated across tp, a plain
    buffer over all 4 rows."""
    write_mesh_step(tmp_path / "tp", 5, 2, 2)
    return tmp_path / "tp"


@pytest.fixture
def dp_step(tmp_path: Path) -> Path:
    """A plain (dp 4) step: also 4 rows."""
    gen = torch.Generator().manual_seed(1)
    tensors = {"model/w": torch.randn(512, 300, generator=gen), "model/b": torch.randn(300)}
    save_tensors(str(tmp_path / "dp"), 5, tensors, world_size=4)
    return tmp_path / "dp"


def _table(out: str) -> dict[str, str]:
    """``{tensor: layout}`` of the tensor table ``inspect`` prints."""
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("tensor "))
    column = lines[header].index("layout")
    rows = {}
    for line in lines[header + 1 :]:
        if line[:1].isspace() or line.split()[0] in ("model", "optim", "buffers", "total"):
            break
        rows[line.split()[0]] = line[column:]
    return rows


def test_inspect_shows_the_mesh_and_each_layout(tp_step: Path, dp_step: Path, capsys) -> None:
    code, out, _ = run_cli(["inspect", str(tp_step)], capsys)
    assert code == 0
    assert "step 5: world size 4 (dp_shard 2 x tp 2), format version 3" in out, out
    rows = _table(out)
    assert rows["model/attn.qkv.weight"] == "tp dim 0 of 2 fused 7+3+3, even over 2 dp ranks"
    assert rows["model/attn.o.weight"] == "tp dim 1 of 2, even over 2 dp ranks"
    assert rows["model/norm.weight"] == "tp replicated, even over 2 dp ranks"
    assert rows["model/empty"] == "tp dim 0 of 2, empty"
    assert rows["buffers/steps"] == "3 pieces of 2 from rank 0"  # 5 elements over 4 rows

    code, out, _ = run_cli(["inspect", str(dp_step)], capsys)
    assert code == 0
    assert "step 5: world size 4 (dp 4), format version 2" in out, out
    assert _table(out) == {"model/b": "even over 4 ranks", "model/w": "even over 4 ranks"}

    code, out, _ = run_cli(["inspect", str(tp_step), "--json"], capsys)
    doc = json.loads(out)
    assert doc["mesh"] == {"dp_replicate": 1, "dp_shard": 2, "tp": 2}
    qkv = next(t for t in doc["tensors"] if t["name"] == "model/attn.qkv.weight")
    detail = qkv["layout_detail"]
    assert (detail["tp_dim"], detail["tp_degree"], detail["fused_sizes"]) == (0, 2, [7, 3, 3])
    assert json.loads(run_cli(["inspect", str(dp_step), "--json"], capsys)[1])["mesh"] == {
        "dp_replicate": 1,
        "dp_shard": 4,
        "tp": 1,
    }


def test_reshard_prints_source_and_target_layouts(
    tp_step: Path, dp_step: Path, tmp_path: Path, capsys
) -> None:
    code, out, _ = run_cli(["reshard", str(tp_step), str(tmp_path / "a"), "--dp", "2"], capsys)
    assert code == 0
    assert out.startswith("resharded step 5: (dp_shard 2 x tp 2) -> (dp 2), world size 4 -> 2")
    code, out, _ = run_cli(["inspect", str(tmp_path / "a")], capsys)
    assert "world size 2 (dp 2)" in out  # the shard dims stay recorded for a later split
    assert _table(out)["model/attn.qkv.weight"] == "tp dim 0 of 1 fused 7+3+3, even over 2 dp ranks"

    argv = ["reshard", str(tmp_path / "a"), str(tmp_path / "b"), "--dp", "4", "--tp", "2"]
    code, out, _ = run_cli([*argv, "-q", "--dp-replicate", "2"], capsys)
    assert code == 0
    assert "(dp 2) -> (dp_replicate 2 x dp_shard 2 x tp 2), world size 2 -> 4" in out, out

    code, out, _ = run_cli(["reshard", str(dp_step), str(tmp_path / "c"), "--dp", "2"], capsys)
    assert code == 0
    assert "(dp 4) -> (dp 2), world size 4 -> 2" in out
    # the small-tensor rule, said where it applies
    assert "1 tensor(s) of at most 65,536 elements stored whole on one rank each" in out, out
    code, out, _ = run_cli(["inspect", str(tmp_path / "c")], capsys)
    assert _table(out) == {"model/b": "whole on rank 0", "model/w": "even over 2 ranks"}
    code, out, _ = run_cli(
        ["reshard", str(dp_step), str(tmp_path / "d"), "--dp", "2", "--json"], capsys
    )
    doc = json.loads(out)
    assert (doc["src_mesh"]["dp_shard"], doc["mesh"]["dp_shard"], doc["whole_on_one_rank"]) == (
        4,
        2,
        1,
    )


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
    assert len(lines) <= 22, out  # headline, at most 20 lines, "... and N more"
    # detail lines are cut to 160 characters; a row's heading keeps its whole path
    assert max(map(len, lines)) <= 160 + len(str(cut_row)), out
    assert lines[0].startswith("step 3: ") and "on rank(s) 1" in lines[0], lines[0]
    count = int(lines[0].split()[2])
    assert count > 1000, lines[0]
    row = cut_row / "step-00000003" / row_path("model", 1)
    assert lines[1] == f"rank 1's row of group 'model' ({row}):", lines[1]
    assert lines[2].startswith("  ") and "inner chunk(s) cut short" in lines[2], lines[2]
    assert lines[3].startswith("    model/layers."), lines[3]  # then tensor by tensor
    # what is wrong with the whole row is shown before the tensors that do not fit
    assert "  its chunk checksums do not match the commit record" in lines, out
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
