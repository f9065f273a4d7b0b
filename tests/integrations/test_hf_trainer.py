"""A real ``transformers.Trainer`` through ``ZeroStateTrainer`` (examples/hf_trainer.py on
2 gloo ranks, under real torchrun at stage 3, with forked ranks otherwise ([Note: forked
launches] in tests/forked_launch.py); a small Llama from a config; warm-up + cosine; gradient
accumulation; clipping): every logged loss equals the stock Trainer with DDP, a resume
from a mid-epoch checkpoint on one rank continues the curve, and ``save_model``'s
directory loads with ``from_pretrained`` and gives the stock run's logits. For a peft model
``save_model`` writes the adapter, which ``PeftModel.from_pretrained`` loads."""

from __future__ import annotations

import json
import os
from pathlib import Path

import forked_launch
import pytest
import torch

from zerostate.store import open_checkpoint

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "hf_trainer.py"
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
PRELOAD = forked_launch.HF_TRAINER


def _run(work: Path, nproc: int, *args: str, torchrun: bool = False) -> list[tuple[int, float]]:
    """The example on ``nproc`` ranks: under real ``torchrun`` when asked, else with ranks
    forked from servers that imported transformers once ([Note: forked launches])."""
    log = work / "log.jsonl"
    argv = ["--workdir", str(work), "--log-json", str(log), *args]
    forked_launch.run_example(EXAMPLE, nproc, argv, env=ENV, workdir=work, preload=PRELOAD,
                              torchrun=torchrun)  # fmt: skip
    return [(r["step"], r["loss"]) for r in map(json.loads, log.read_text().splitlines())]


def _close(got, want, rtol=1e-5) -> float:
    assert [s for s, _ in got] == [s for s, _ in want]
    worst = max(abs(a - b) / abs(b) for (_, a), (_, b) in zip(got, want, strict=True))
    assert worst <= rtol, (worst, got, want)
    return worst


@pytest.fixture(scope="module")
def stock(tmp_path_factory):
    work = tmp_path_factory.mktemp("stock")
    return work, _run(work, 2, "--trainer", "stock")


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zerostate_trainer_matches_stock_ddp_and_resumes(tmp_path, stock, stage):
    from transformers import LlamaForCausalLM

    stock_dir, stock_curve = stock
    # Stage 3 under real torchrun, as users launch it; the other runs fork their ranks.
    curve = _run(tmp_path, 2, "--stage", str(stage), torchrun=stage == 3)
    assert [s for s, _ in curve] == list(range(1, 9))
    worst = _close(curve, stock_curve)
    print(f"\nstage {stage}: max relative loss difference to the stock Trainer {worst:.2e}")
    ckpt = tmp_path / "out" / "checkpoint-2"
    st = open_checkpoint(str(ckpt)).step()
    assert st.step == 2 and st.world_size == 2 and "scheduler" in st.attrs["stateful"]
    assert (ckpt / "trainer_state.json").is_file()
    # Mid-epoch checkpoint (4 steps per epoch), resumed on one rank.
    resumed = _run(tmp_path / "resume", 1, "--stage", str(stage), "--resume", str(ckpt))
    worst = _close(resumed, curve, rtol=1e-5)
    print(f"stage {stage}: resumed on 1 rank from step 2, max relative difference {worst:.2e}")
    # save_model's directory is a from_pretrained model with the stock run's weights.
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(5))
    ours = LlamaForCausalLM.from_pretrained(str(tmp_path / "final")).eval()
    theirs = LlamaForCausalLM.from_pretrained(str(stock_dir / "final")).eval()
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, theirs(ids).logits, rtol=1e-4, atol=1e-5)


class _Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> dict:
        ids = torch.randint(0, 96, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def _peft_worker(rank, world_size, out):
    from lora_common import make_base, make_lora_model
    from peft import PeftModel
    from transformers import TrainingArguments

    from zerostate.integrations.transformers import ZeroStateTrainer

    args = TrainingArguments(output_dir=f"{out}/run", per_device_train_batch_size=8,
                             max_steps=3, save_steps=2, learning_rate=1e-2, report_to=[],
                             use_cpu=True, disable_tqdm=True)  # fmt: skip
    trainer = ZeroStateTrainer(model=make_lora_model(), args=args, train_dataset=_Tokens())
    trainer.train()
    trainer.save_model(f"{out}/adapter")
    ids = _Tokens()[99]["input_ids"][None]
    loaded = PeftModel.from_pretrained(make_base(), f"{out}/adapter").eval()
    trainer.model.eval()
    with torch.no_grad():
        return trainer.model(input_ids=ids).logits, loaded(input_ids=ids).logits


@pytest.mark.slow
def test_peft_model_save_model_writes_an_adapter(tmp_path):
    from helpers_dist import run_distributed

    trained, loaded = run_distributed(_peft_worker, 1, str(tmp_path), timeout=300)[0]
    written = {p.name for p in (tmp_path / "adapter").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= written
    assert not (tmp_path / "adapter" / "model.safetensors").exists()
    torch.testing.assert_close(loaded, trained, rtol=0, atol=1e-6)
    assert open_checkpoint(str(tmp_path / "run" / "checkpoint-2")).step().refs == {}


class _EvalTokens(_Tokens):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict:
        return super().__getitem__(1000 + i)


def _best_worker(rank, world_size, out, stage):
    from lora_common import make_base
    from transformers import TrainingArguments

    from zerostate.integrations.transformers import ZeroStateTrainer

    # eval_loss with greater_is_better=True: the best checkpoint is the first one (the loss
    # falls), so the model that train() leaves must be step 2's, not the last step's.
    args = TrainingArguments(output_dir=f"{out}/run", per_device_train_batch_size=4,
                             max_steps=6, eval_strategy="steps", eval_steps=2, save_steps=2,
                             load_best_model_at_end=True, metric_for_best_model="eval_loss",
                             greater_is_better=True, learning_rate=5e-3, report_to=[],
                             use_cpu=True, disable_tqdm=True)  # fmt: skip
    trainer = ZeroStateTrainer(model=make_base(), args=args, train_dataset=_Tokens(),
                               eval_dataset=_EvalTokens(), stage=stage)  # fmt: skip
    trainer.train()
    held = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    return trainer.state.best_model_checkpoint, held


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_load_best_model_at_end_leaves_the_best_checkpoints_weights(tmp_path, stage):
    from helpers_dist import run_distributed

    results = run_distributed(_best_worker, 2, str(tmp_path), stage, timeout=300)
    best = results[0][0]
    assert best is not None and best.endswith("checkpoint-2"), best
    best_step = open_checkpoint(best).step()
    last_step = open_checkpoint(str(tmp_path / "run" / "checkpoint-6")).step()
    for _, held in results:
        differs_from_last = False
        for name, value in held.items():
            if f"model/{name}" not in best_step.tensors:
                continue  # a tied weight, stored once
            torch.testing.assert_close(value, best_step.read(f"model/{name}"), rtol=0, atol=0)
            differs_from_last |= not torch.equal(value, last_step.read(f"model/{name}"))
        assert differs_from_last


def _checkpointing_worker(rank, world_size, out, checkpointing):
    from lora_common import make_base
    from transformers import TrainerCallback, TrainingArguments

    from zerostate.integrations.transformers import ZeroStateTrainer

    class Losses(TrainerCallback):
        def __init__(self) -> None:
            self.losses: list[float] = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.losses.append(logs["loss"])

    extra = {}
    if checkpointing is not None:
        reentrant = {"use_reentrant": checkpointing == "reentrant"}
        extra = {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": reentrant}
    args = TrainingArguments(output_dir=f"{out}/{checkpointing}", per_device_train_batch_size=4,
                             max_steps=4, logging_steps=1, learning_rate=5e-3, report_to=[],
                             save_strategy="no", use_cpu=True, disable_tqdm=True,
                             **extra)  # fmt: skip
    losses = Losses()
    trainer = ZeroStateTrainer(model=make_base(), args=args, train_dataset=_Tokens(), stage=3,
                               callbacks=[losses])  # fmt: skip
    trainer.train()
    return losses.losses, trainer.model.is_gradient_checkpointing


@pytest.mark.slow
def test_transformers_gradient_checkpointing_at_stage_3_gives_the_same_losses(tmp_path):
    """``gradient_checkpointing=True`` (transformers' own, torch.utils.checkpoint in each
    decoder layer) recomputes the layers in backward, where stage 3 gathers them again."""
    from helpers_dist import run_distributed

    plain = run_distributed(_checkpointing_worker, 2, str(tmp_path), None, timeout=300)
    for mode in ("reentrant", "non-reentrant"):
        got = run_distributed(_checkpointing_worker, 2, str(tmp_path), mode, timeout=300)
        for (losses, on), (want, _) in zip(got, plain, strict=True):
            assert on and len(losses) == 4, (mode, losses)
            assert losses == pytest.approx(want, rel=1e-6), (mode, losses, want)
