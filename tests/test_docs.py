"""The user-facing docs pages exist, every ``python`` block in them runs, and the API
reference documents every EngineConfig field and Engine method.

A page's blocks run in order, in one namespace, in a fresh Python process with a
torch.distributed world of one gloo rank (what ``torchrun --nproc-per-node 1`` gives) and a
scratch working directory, so relative paths such as ``ckpt/`` land there."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from helpers_dist import run_script

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [
    "api.md",
    "coming-from-deepspeed.md",
    "coming-from-fsdp.md",
    "dcp.md",
    "troubleshooting.md",
]
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.M | re.S)

RUNNER = """
import os, sys, traceback
sys.path.insert(0, {tests!r})
os.chdir({cwd!r})
import torch
torch.set_num_threads(1)
from world_of_one import init_world_of_one
init_world_of_one()
namespace = {{"__name__": "__main__"}}
for line, source in {blocks!r}:
    code = compile(source, f"{page}, block at line {{line}}", "exec")
    exec(code, namespace)
    print(f"block at line {{line}}: ok", flush=True)
import torch.distributed as dist
dist.destroy_process_group()
print("ALL OK")
"""


def python_blocks(page: Path) -> list[tuple[int, str]]:
    """``(line number, source)`` of every ```python block of ``page``."""
    text = page.read_text()
    return [(text.count("\n", 0, m.start()) + 2, m.group(1)) for m in _BLOCK.finditer(text)]


@pytest.mark.parametrize("page", PAGES)
def test_every_python_block_runs(page: str, tmp_path: Path) -> None:
    blocks = python_blocks(DOCS / page)
    assert len(blocks) >= 2, f"{page} has {len(blocks)} python blocks"
    proc = run_script(RUNNER, timeout=600, cwd=str(tmp_path), blocks=blocks, page=page)
    assert proc.returncode == 0 and "ALL OK" in proc.stdout, (
        f"{page}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    )
    assert proc.stdout.count(": ok") == len(blocks)


def test_api_page_holds_the_current_fields_table() -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import api_fields
    finally:
        sys.path.pop(0)
    from zerostate.config import field_docs

    undocumented = [name for name, (_, _, doc) in field_docs().items() if not doc.strip()]
    assert not undocumented, f"EngineConfig fields without a docstring: {undocumented}"
    page = (DOCS / "api.md").read_text()
    assert api_fields.refreshed(page) == page, "run: python scripts/api_fields.py --write"


def test_api_page_names_every_public_engine_member() -> None:
    from zerostate.checkpoint import SaveHandle
    from zerostate.engine import Engine

    page = (DOCS / "api.md").read_text()
    members = [n for n in dir(Engine) if not n.startswith("_")]
    missing = [n for n in members if f"`{n}`" not in page and f"engine.{n}" not in page]
    missing += [n for n in dir(SaveHandle) if not n.startswith("_") and f"handle.{n}" not in page]
    assert not missing, f"docs/api.md does not document: {missing}"
