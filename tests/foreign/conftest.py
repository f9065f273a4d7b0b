"""Peer checkpoints, written once per session by DeepSpeed and FSDP2 + DCP themselves."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.foreign import peers

#: (name, world size, keyword arguments of the writer)
DEEPSPEED_CASES = [
    ("ds1-fp32-2", 2, {"stage": 1, "bf16": False}),
    ("ds2-fp32-2", 2, {"stage": 2, "bf16": False}),
    ("ds3-fp32-2", 2, {"stage": 3, "bf16": False}),
    ("ds1-fp32-4", 4, {"stage": 1, "bf16": False}),
    ("ds2-fp32-4", 4, {"stage": 2, "bf16": False}),
    ("ds3-fp32-4", 4, {"stage": 3, "bf16": False}),
    # bf16 runs (``peers.write_deepspeed_bf16``) also keep DeepSpeed's losses of the next
    # steps; test_deepspeed_bf16_continue.py continues them, test_peers.py reads them.
    ("ds1-bf16-2", 2, {"stage": 1, "bf16": True}),
    ("ds2-bf16-2", 2, {"stage": 2, "bf16": True}),
    ("ds3-bf16-2", 2, {"stage": 3, "bf16": True}),
    ("ds1-bf16-4", 4, {"stage": 1, "bf16": True}),
    ("ds2-bf16-4", 4, {"stage": 2, "bf16": True}),
    ("ds3-bf16-4", 4, {"stage": 3, "bf16": True}),
]
#: Tensor-parallel peers (tests/foreign/peers_tp.py): (name, kind, world size, writer's
#: keyword arguments); DeepSpeed AutoTP at tp 2 (dp 1) and tp 2 x dp 2, Megatron-Core at tp 2.
TP_CASES = [
    ("dstp1-tp2", "deepspeed-tp", 2, {"stage": 1, "tp": 2}),
    ("dstp2-tp2-dp2", "deepspeed-tp", 4, {"stage": 2, "tp": 2}),
    ("mcore-tp2", "megatron", 2, {}),
]
#: Written for one test file each, not for every test of test_peers.py.
OTHER_DEEPSPEED_CASES = [
    # a config without gradient_clipping: DeepSpeed clips at 1.0 (test_peer_settings.py)
    ("ds2-fp32-2-clipdefault", 2, {"stage": 2, "bf16": False, "default_clipping": True}),
]


class PeerCheckpoints:
    """Generates each peer checkpoint on first use; keeps what the peer did next."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._made: dict[str, tuple[Path, dict]] = {}

    def get(self, name: str) -> tuple[Path, dict, int]:
        """``(path, {"after": [weights after each next step]}, world size)``; bf16 runs
        also give ``"losses"`` (the mean loss of each next step)."""
        tp_case = next((c for c in TP_CASES if c[0] == name), None)
        if tp_case is not None:
            from tests.foreign import peers_tp

            _, kind, world, kw = tp_case
            if name not in self._made:
                out = self.root / name
                self._made[name] = (out, peers_tp.generate_tp(kind, out, world, **kw))
            path, result = self._made[name]
            return path, result, world
        if name == "dcp-2":
            kind, world, kw = "dcp", 2, {}
        else:
            _, world, kw = next(c for c in DEEPSPEED_CASES + OTHER_DEEPSPEED_CASES if c[0] == name)
            kind = "deepspeed"
        if name not in self._made:
            out = self.root / name
            self._made[name] = (out, peers.generate(kind, out, world, **kw))
        path, result = self._made[name]
        return path, result, world


@pytest.fixture(scope="session")
def peer_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> PeerCheckpoints:
    return PeerCheckpoints(tmp_path_factory.mktemp("peers"))


def run_cli(*argv: str) -> SimpleNamespace:
    """One in-process ``zerostate`` call: ``returncode``, ``stdout``, ``stderr``."""
    from zerostate_cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as exc:
            code = exc.code
    return SimpleNamespace(returncode=int(code or 0), stdout=out.getvalue(), stderr=err.getvalue())


def one_line_refusals(root: Path, out: Path, *extra: list[str]) -> list[tuple[list[str], str]]:
    """Runs ``inspect``, ``verify``, ``consolidate``, ``reshard --world-size 2`` and ``extra``
    commands on ``root`` (outputs under ``out``); each must exit non-zero with exactly one
    line on stderr. Returns ``(command, line)`` pairs for the caller's checks of the line."""
    commands = [
        ["inspect", str(root)],
        ["verify", str(root)],
        ["consolidate", str(root), str(out / "out.safetensors")],
        ["reshard", str(root), str(out / "out"), "--world-size", "2"],
        *extra,
    ]
    found = []
    for args in commands:
        result = run_cli(*args)
        assert result.returncode != 0, (args, result.stdout)
        lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
        assert len(lines) == 1, (args, result.stderr)
        found.append((args, lines[0]))
    return found


def assert_reshards_to_format2(path: Path, out: Path, world_size: int = 3) -> None:
    """``zerostate reshard`` of the peer checkpoint at ``path`` writes a format-2 step for
    ``world_size`` ranks holding exactly the tensors the peer's step holds."""
    import torch

    from zerostate.store.sources import open_source

    done = run_cli("reshard", str(path), str(out), "--world-size", str(world_size))
    assert done.returncode == 0, done.stderr
    src, dst = open_source(str(path)).step(), open_source(str(out)).step()
    assert dst.format_version == 2 and dst.world_size == world_size
    assert set(dst.tensors) == set(src.tensors)
    for key in src.tensors:
        assert torch.equal(dst.read(key), src.read(key)), key
