"""``engine.gathered()``: running the wrapped module yourself at stage 3 (generate,
evaluation, save_pretrained), and the error when it is called without it."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers_dist import run_distributed

import zerostate


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=80, n_positions=32, n_embd=32, n_layer=2, n_head=4)
    cfg.attn_pdrop = cfg.resid_pdrop = cfg.embd_pdrop = 0.0
    return GPT2LMHeadModel(cfg).eval()


def _worker(rank: int, world_size: int, out_dir: str) -> dict:
    plain = _gpt2()
    engine = zerostate.Engine(copy.deepcopy(plain), stage=3, lr=1e-3)
    prompt = torch.tensor([[1, 2, 3, 4]])
    result = {}
    try:
        engine.module(prompt)
    except zerostate.ZerostateError as exc:
        result["outside"] = str(exc)
    with torch.no_grad(), engine.gathered():
        result["generated"] = engine.module.generate(
            prompt, max_new_tokens=6, do_sample=False, pad_token_id=0
        ).tolist()
        result["logits"] = engine.module(prompt).logits
    result["plain_generated"] = plain.generate(
        prompt, max_new_tokens=6, do_sample=False, pad_token_id=0
    ).tolist()
    with torch.no_grad():
        result["plain_logits"] = plain(prompt).logits
    with engine.gathered(rank0_only=True):
        if rank == 0:
            engine.module.save_pretrained(out_dir)
    dist.barrier()
    # Writeback: an edit made inside the block reaches the shards and the masters.
    with torch.no_grad(), engine.gathered(writeback=True):
        engine.module.transformer.wte.weight.mul_(2.0)
    result["wte"] = engine.full_state_dict()["transformer.wte.weight"]
    result["plain_wte"] = plain.transformer.wte.weight.detach() * 2.0
    # Training still works afterwards, and the parameters are released again.
    x = torch.randint(0, 80, (2, 8))
    engine.backward(engine(input_ids=x, labels=x).loss)
    engine.step()
    result["gathered_after"] = engine.memory_stats()["gathered_params"]
    return result


@pytest.mark.slow
def test_stage3_generate_and_save_pretrained_inside_gathered(tmp_path: Path) -> None:
    from transformers import GPT2LMHeadModel

    results = run_distributed(_worker, 2, str(tmp_path / "hf"), timeout=240)
    for r in results:
        assert "gathered()" in r["outside"], r["outside"]
        assert r["generated"] == r["plain_generated"]
        assert torch.equal(r["logits"], r["plain_logits"])
        assert torch.equal(r["wte"], r["plain_wte"])
        assert r["gathered_after"] == 0
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        logits = loaded(torch.tensor([[1, 2, 3, 4]])).logits
    assert torch.equal(logits, results[0]["plain_logits"])
