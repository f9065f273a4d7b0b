"""``python -m benchmarks.dcp_to_safetensors DCP_DIR OUT.safetensors``: the model weights
of a torch.distributed.checkpoint checkpoint as one safetensors file, the way an FSDP2 user
exports today: read DCP's metadata, allocate every model tensor, ``dcp.load`` them in one
process (``no_dist``), write safetensors.

DCP's metadata file is a pickle (its own format); this reads only checkpoints this
benchmark run wrote moments before."""

from __future__ import annotations

import sys


def main() -> int:
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    src, out = sys.argv[1], sys.argv[2]
    meta = dcp.FileSystemReader(src).read_metadata()
    prefix = "model."
    state = {
        key: torch.empty(tuple(md.size), dtype=md.properties.dtype)
        for key, md in meta.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(md, TensorStorageMetadata)
    }
    if not state:
        print(f"no model tensors under {src}", file=sys.stderr)
        return 1
    dcp.load(state, storage_reader=dcp.FileSystemReader(src), no_dist=True)
    save_file({k[len(prefix):]: v.contiguous() for k, v in state.items()}, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
