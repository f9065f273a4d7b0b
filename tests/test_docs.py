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
    from zerostate.engine.config import field_docs

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


# ------------------------------------------------------- statements held to the code
def _words(text: str) -> str:
    """``text`` with every run of whitespace one space: sentences wrap anywhere."""
    return " ".join(text.split())


def _section(page: str, heading: str) -> str:
    """The text of ``page`` under ``heading``, to the next heading of its level or above
    (``#`` lines inside code blocks are comments, not headings)."""
    path = ROOT / page if page == "README.md" else DOCS / page
    lines = path.read_text().splitlines(keepends=True)
    first = lines.index(heading + "\n") + 1
    level, fenced = len(heading.split(" ", 1)[0]), False
    for i in range(first, len(lines)):
        fenced ^= lines[i].startswith("```")
        hashes = len(lines[i]) - len(lines[i].lstrip("#"))
        if not fenced and 0 < hashes <= level and lines[i][hashes : hashes + 1] == " ":
            return "".join(lines[first:i])
    return "".join(lines[first:])


def test_readme_names_the_format_versions_the_writer_writes() -> None:
    from zerostate.store import format as fmt
    from zerostate.store import geometry as mesh_mod

    checkpoints = _words(_section("README.md", "## Checkpoints"))
    named = re.search(r"format version (\d+); a step holding tensor-parallel pieces", checkpoints)
    assert named and int(named.group(1)) == fmt.FORMAT_VERSION, checkpoints[:400]
    tp = re.search(r"tensor-parallel pieces, saved on a mesh with `\"tp\"`, is version (\d+)",
                   checkpoints)  # fmt: skip
    assert tp and int(tp.group(1)) == mesh_mod.VERSION, checkpoints[:400]
    assert fmt.READ_VERSIONS[-1] == mesh_mod.VERSION  # every version written is read
    title = (DOCS / "format.md").read_text().splitlines()[0]
    assert title.endswith(f"versions {fmt.FORMAT_VERSION} and {mesh_mod.VERSION}"), title


def test_api_page_does_not_say_tensor_parallel_saves_are_refused() -> None:
    """The engine saves with tensor parallelism (format 3): the reference once said both."""
    text = _words((DOCS / "api.md").read_text())
    refused = re.findall(r"[^.]*sav\w* [^.]*tensor parallelism[^.]*\brefused\b[^.]*", text)
    refused += re.findall(r"[^.]*tensor parallelism[^.]*\bsav\w* [^.]*\brefused\b[^.]*", text)
    assert not refused, refused
    assert "With tensor parallelism `save` writes global tensors in tp x dp pieces (format 3" in (
        text
    )


def test_fsdp_guide_2d_section_uses_the_real_api() -> None:
    """The 2-D mesh section's code builds the engine with parameters ``Engine`` takes and
    names mesh dimensions the engine knows (the block itself runs in
    ``test_every_python_block_runs``)."""
    import ast
    import dataclasses
    import inspect

    from zerostate.engine import Engine
    from zerostate.engine.config import EngineConfig
    from zerostate.runtime.process_groups import DIM_NAMES

    section = _section("coming-from-fsdp.md", "## 2-D meshes: FSDP2 + tensor parallelism")
    [code] = _BLOCK.findall(section)
    accepted = {f.name for f in dataclasses.fields(EngineConfig)}
    accepted |= set(inspect.signature(Engine.__init__).parameters) - {"self", "kwargs"}
    calls = [
        node
        for node in ast.walk(ast.parse(code))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "Engine"
    ]
    assert calls, "the 2-D section builds no zerostate.Engine"
    for call in calls:
        names = {kw.arg for kw in call.keywords}
        assert {"mesh", "stage"} <= names and names <= accepted, names - accepted
    dims = re.findall(r"mesh_dim_names=\(([^)]*)\)", section)
    assert dims and all(
        name.strip(" \"'") in DIM_NAMES for group in dims for name in group.split(",")
    ), dims
    assert 'mesh["tp"]' in code and "parallelize_module" in code


def test_small_tensor_rule_is_documented_where_partitions_are() -> None:
    """``reshard``'s default keeps tensors under ``--min-shard-numel`` whole on one rank;
    the README's and the format's descriptions of partitions say so, with the real default."""
    from zerostate.layout.partition import DEFAULT_MIN_SHARD_NUMEL, plan_layouts

    readme = _words(_section("README.md", "## Checkpoints"))
    assert f"`--min-shard-numel` elements (default {DEFAULT_MIN_SHARD_NUMEL:,}) is stored " \
        "whole on one rank" in readme, readme[:800]  # fmt: skip
    layouts = _words(_section("format.md", "## 2. Tensors, groups and rows"))
    assert "`zerostate reshard` into version 2 places tensors by the partition rule" in layouts
    assert f"a tensor of at most {DEFAULT_MIN_SHARD_NUMEL:,} elements is one chunk owned by " \
        "one rank" in layouts  # fmt: skip
    # and that is what the rule does
    [small, large] = plan_layouts([DEFAULT_MIN_SHARD_NUMEL, DEFAULT_MIN_SHARD_NUMEL + 1], 4)
    assert small.num_chunks == 1 and large.num_chunks == 2


def test_cli_sample_in_api_page_is_what_the_commands_print(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The inspect / reshard / verify transcript of a (dp_shard 2 x tp 2) step in
    docs/api.md is the commands' output, line for line."""
    import os
    import shutil

    from cli_helpers import run_cli

    from tests.store.test_mesh_store import write_mesh_step
    from zerostate.store.rows import row_path

    text = (DOCS / "api.md").read_text()
    start = text.index("```text\n$ zerostate inspect ckpt\n") + len("```text\n")
    transcript = text[start : text.index("```", start)]
    monkeypatch.chdir(tmp_path)
    write_mesh_step("ckpt", 5, 2, 2)
    shutil.copytree("ckpt", "ckpt-cut")
    os.truncate(Path("ckpt-cut", "step-00000005", row_path("model", 3)), 100)

    got = []
    for command in re.findall(r"^\$ zerostate (.*)$", transcript, re.M):
        _, out, err = run_cli(command.split(), capsys)
        got.append(f"$ zerostate {command}\n" + (out + err).replace(f"{tmp_path}/", ""))
    assert len(got) == 4 and "".join(got) == transcript


_REPO_PATH = re.compile(
    r"`((?:zerostate|cli|benchmarks|tests|scripts|examples)/[A-Za-z0-9_/.\-]+)`"
)
_NOTE_IN = re.compile(
    r"\[Note:\s+([^\]]+)\]\s*in\s*`((?:zerostate|cli|benchmarks|tests)/[A-Za-z0-9_/.\-]+\.py)`"
)


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def test_every_file_the_docs_name_exists() -> None:
    """A module that moved leaves no page pointing at its old place."""
    gone = sorted(
        f"{page.relative_to(ROOT)}: {path}"
        for page in _pages()
        for path in _REPO_PATH.findall(page.read_text())
        if not (ROOT / path.rstrip("/.")).exists()
    )
    assert not gone, "\n".join(gone)


def test_every_note_the_docs_cite_is_in_the_file_they_name() -> None:
    wrong = []
    for page in _pages():
        for note, path in _NOTE_IN.findall(page.read_text()):
            note = " ".join(note.split())
            text = " ".join((ROOT / path).read_text().split()) if (ROOT / path).is_file() else ""
            if f"[Note: {note}]" not in text:
                wrong.append(f"{page.relative_to(ROOT)}: [Note: {note}] is not in {path}")
    assert not wrong, "\n".join(wrong)
