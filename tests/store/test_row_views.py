"""Row views ([Note: row views] in zerostate/store/rows.py): a rank given only its own
tensors' specs and a view per group writes the same bytes it writes from every spec, and
rank 0 refuses a manifest written from another view."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from zerostate.errors import ConfigError, DistributedMismatchError
from zerostate.layout.partition import TensorLayout
from zerostate.store import StepWriter, format2, open_checkpoint
from zerostate.store import format as fmt
from zerostate.store.rows import RowView, plan_groups, row_views
from zerostate.store.writer import TensorSpec

DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.float16, torch.uint8]


def _pieces(seed: int, world_size: int) -> tuple[list[TensorSpec], dict[str, torch.Tensor]]:
    """Tensors each stored whole by one rank, named rank first (as a DCP step's pieces), in
    two groups, with odd sizes, empty tensors and ranks that store nothing."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    specs, data = [], {}
    for group in ("g", "h/sub"):
        for rank in range(world_size):
            if rng.random() < 0.2:
                continue  # this rank stores nothing in this group
            for seq in range(rng.randint(1, 6)):
                shape = tuple(rng.choice([0, 1, 3, 7, 129, 1000]) for _ in range(rng.randint(0, 2)))
                dtype = rng.choice(DTYPES)
                numel = math.prod(shape)
                name = f"{group}/r{rank:05d}.{seq:07d}.w"
                layout = TensorLayout(numel, world_size, max(1, numel), rank)
                specs.append(TensorSpec(name, shape, dtype, layout))
                if dtype == torch.bool:
                    value = torch.rand(shape, generator=gen) > 0.5
                elif dtype.is_floating_point:
                    value = torch.randn(shape, generator=gen).to(dtype)
                else:
                    value = torch.randint(0, 100, shape, generator=gen).to(dtype)
                data[name] = value
    return specs, data


def _write(root: Path, specs, data, world_size: int, *, views: bool, lie: int | None = None):
    owners = {s.name: s.layout.first_owner for s in specs}
    plans = plan_groups(((s.name, s.layout, s.dtype.itemsize) for s in specs), world_size)
    by_rank = row_views(plans, owners)
    digests = {}
    for rank in range(1, world_size):
        own = [s for s in specs if owners[s.name] == rank]
        if own:
            view = by_rank[rank]  # the digest the rank's own writer computes from its view
            entries = format2.tensor_entries(own, world_size, view)[0]
            digests[rank] = format2.writer_digest(entries, {}, view)
        else:
            digests[rank] = format2.writer_digest({}, {}, None)
    for rank in [*range(1, world_size), 0]:
        if views and rank:
            own = [s for s in specs if owners[s.name] == rank]
            given = dict(by_rank.get(rank, {}))
            if rank == lie:
                g, v = next(iter(given.items()))
                given[g] = RowView(v.offset, v.row_nbytes, v.inner * 2)
            kwargs = {"specs": own, "views": given}
        else:
            kwargs = {"specs": specs, "manifest_digests": digests if views and not rank else None}
        writer = StepWriter(
            str(root), 1, rank=rank, world_size=world_size, save_id="s", timeout_s=5, **kwargs
        )
        writer.write({s.name: data[s.name].reshape(-1) for s in specs if owners[s.name] == rank})
        writer.commit(wait=False)


def _files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("world_size", [2, 3, 5])
def test_a_rank_writes_the_same_bytes_from_its_view_as_from_every_spec(tmp_path, seed, world_size):
    specs, data = _pieces(seed, world_size)
    _write(tmp_path / "full", specs, data, world_size, views=False)
    _write(tmp_path / "view", specs, data, world_size, views=True)
    full, view = _files(tmp_path / "full"), _files(tmp_path / "view")
    assert set(full) == set(view)
    # Manifests carry each rank's digest, so they (and their checksums in the commit
    # record) differ; every row object, document and the rest of the record are equal.
    differ = [p for p in full if full[p] != view[p] and "manifest" not in p]
    assert differ == [f"{fmt.step_dir(1)}/{fmt.COMMIT_PATH}"]
    records = [
        fmt.parse_document(files[differ[0]], "zerostate_commit", "test") for files in (full, view)
    ]
    for record in records:
        assert len(record.pop("manifests")) == world_size
    assert records[0] == records[1]
    reader = open_checkpoint(str(tmp_path / "view")).step(1)
    for name, value in data.items():
        assert torch.equal(reader.read(name), value), name
    reader.verify()


def test_rank_0_refuses_a_manifest_written_from_another_view(tmp_path):
    specs, data = _pieces(1, 3)
    with pytest.raises(DistributedMismatchError, match="rank 2 saved step 1 with different"):
        _write(tmp_path, specs, data, 3, views=True, lie=2)
    assert not (tmp_path / fmt.step_dir(1) / fmt.COMMIT_PATH).exists()
    assert (tmp_path / fmt.step_dir(1) / fmt.manifest_path(2)).exists()  # it did write


def test_views_are_refused_where_they_cannot_hold(tmp_path):
    specs, _ = _pieces(2, 3)
    plans = plan_groups(((s.name, s.layout, s.dtype.itemsize) for s in specs), 3)
    mine = [s for s in specs if s.layout.first_owner == 1]
    views = row_views(plans, {s.name: 1 for s in mine})[1]
    with pytest.raises(ConfigError, match="row views are for ranks other than 0"):
        StepWriter(str(tmp_path), 1, rank=0, world_size=3, specs=mine, views=views)
    g, v = next(iter(views.items()))
    with pytest.raises(ConfigError, match="do not fit a row view"):
        StepWriter(
            str(tmp_path), 1, rank=1, world_size=3, specs=mine,
            views={**views, g: RowView(v.row_nbytes, v.row_nbytes, v.inner)},
        )  # fmt: skip
    with pytest.raises(ConfigError, match="no given tensor is in"):
        StepWriter(str(tmp_path), 1, rank=1, world_size=3, specs=mine, views={**views, "zz": v})
    # Tensors of one rank that other ranks' tensors interleave cannot be placed by a view.
    names = [s.name for s in specs if s.name.startswith("g/")]
    with pytest.raises(ConfigError, match="not consecutive"):
        row_views(plans, {names[0]: 1, names[-1]: 1, **{n: 2 for n in names[1:-1]}})
