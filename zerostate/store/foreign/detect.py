"""Which peer wrote a location, from its names alone: cheap checks with no reader imported,
so opening a zerostate checkpoint never loads the peers' readers."""

from __future__ import annotations

import re

from zerostate.store.storage import Storage

#: DCP's metadata document; its presence makes a directory a DCP checkpoint.
DCP_METADATA = ".metadata"
#: torch's HuggingFaceStorageWriter files (DCP in safetensors, no ``.metadata``).
HF_FILE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
HF_SHARD_FILE = re.compile(r"shard-\d{5}-model-\d{5}-of-\d{5}\.safetensors")
#: DeepSpeed's tag directories and per-rank optimizer files (groups: bf16 prefix, data-
#: parallel rank, tensor-parallel rank).
STEP_TAG = re.compile(r"global_step(\d{1,12})")
OPTIM_FILE = re.compile(r"(bf16_)?zero_pp_rank_(\d{1,6})_mp_rank_(\d{2,6})_optim_states\.pt")


def detect(storage: Storage) -> str | None:
    """``"dcp"``, ``"deepspeed"`` or None (a zerostate root, or nothing yet) from one
    listing of the root: on an object store one LIST, where asking for ``.metadata`` first
    and listing for each peer cost a HEAD and two."""
    names = storage.list_dir("")
    if is_dcp(storage, names):
        return "dcp"
    if is_deepspeed(storage, names):
        return "deepspeed"
    return None


def is_dcp(storage: Storage, names: list[str] | None = None) -> bool:
    """A DCP ``.metadata``, or the safetensors files of torch's ``HuggingFaceStorageWriter``.
    ``names``: the root's listing, where the caller has one."""
    if names is None:
        names = storage.list_dir("")
    if DCP_METADATA in names:
        return True
    if any(HF_FILE.fullmatch(n) or HF_SHARD_FILE.fullmatch(n) for n in names):
        return True
    # A listing that lags behind writes may not show a .metadata written just now.
    return not storage.listing_is_consistent and storage.exists(DCP_METADATA)


def is_deepspeed(storage: Storage, names: list[str] | None = None) -> bool:
    """A DeepSpeed root (``latest`` or a ``global_step*`` tag) or one tag directory.
    ``names``: the root's listing, where the caller has one."""
    if names is None:
        names = storage.list_dir("")
    return "latest" in names or any(STEP_TAG.fullmatch(n) for n in names) or is_tag(names)


def is_tag(names: list[str]) -> bool:
    """Whether a directory listing is one DeepSpeed tag (it holds optimizer files)."""
    return any(OPTIM_FILE.fullmatch(n) for n in names)
