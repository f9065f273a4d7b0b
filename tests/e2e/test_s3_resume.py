"""The elastic round trip through a real S3 server (SeaweedFS on 127.0.0.1): save at 4 ranks,
resume at 3, match the single-process reference; consolidate straight from the bucket."""

from __future__ import annotations

import json

import pytest
import torch
from e2e_common import assert_matches_reference, torchrun
from safetensors.torch import load_file

from zerostate.store import open_checkpoint


@pytest.mark.s3
def test_s3_round_trip_save_4_resume_3(s3_server, tmp_path, reference20):
    bucket, opts = s3_server.new_bucket("elastic")
    url = f"s3://{bucket}/run"
    torchrun(4, [{"name": "s3-n4", "stage": 2, "start": 0, "stop": 10,
                  "storage_options": opts, "saves": [{"path": url, "blocking": False}]}],
             tmp_path / "out")
    ckpt = open_checkpoint(url, storage_options=opts)
    assert ckpt.steps() == [10]
    st = ckpt.step()
    assert st.world_size == 4
    st.verify()
    torchrun(3, [{"name": "s3-n3", "stage": 3, "start": 10, "stop": 20, "load": url,
                  "storage_options": opts}], tmp_path / "out")
    first = json.loads((tmp_path / "out" / "s3-n4.json").read_text())
    second = json.loads((tmp_path / "out" / "s3-n3.json").read_text())
    params = load_file(str(tmp_path / "out" / "s3-n3.safetensors"))
    ref_losses, ref_params = reference20
    assert_matches_reference(first["losses"] + second["losses"], params, ref_losses, ref_params)

    from zerostate.store.consolidate import consolidate

    out = tmp_path / "model.safetensors"
    consolidate(url, str(out), storage_options=opts)
    merged = load_file(str(out))
    saved = load_file(str(tmp_path / "out" / "s3-n4.safetensors"))
    for name, tensor in saved.items():
        assert torch.equal(merged[name], tensor), name
