"""Which peer wrote a location, from its names alone: cheap checks with no reader imported,
so opening a zerostate checkpoint never loads the peers' readers."""

from __future__ import annotations

import re

from zerostate.store.storage import Storage

#: DCP's metadata document; its presence makes a directory a DCP checkpoint.
DCP_METADATA = ".metadata"
#: DeepSpeed's tag directories and per-rank optimizer files.
STEP_TAG = re.compile(r"global_step(\d{1,12})")
OPTIM_FILE = re.compile(r"(bf16_)?zero_pp_rank_(\d{1,6})_mp_rank_00_optim_states\.pt")


def is_dcp(storage: Storage) -> bool:
    return storage.exists(DCP_METADATA)


def is_deepspeed(storage: Storage) -> bool:
    """A DeepSpeed root (``latest`` or a ``global_step*`` tag) or one tag directory."""
    names = storage.list_dir("")
    return "latest" in names or any(STEP_TAG.fullmatch(n) for n in names) or is_tag(names)


def is_tag(names: list[str]) -> bool:
    """Whether a directory listing is one DeepSpeed tag (it holds optimizer files)."""
    return any(OPTIM_FILE.fullmatch(n) for n in names)
