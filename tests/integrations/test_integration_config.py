"""The integrations refuse settings that belong to the framework's own flags, naming them,
before any training starts (one process, no process group)."""

from __future__ import annotations

import pytest

from zerostate.errors import ConfigError
from zerostate.integrations.lightning import PRECISIONS, ZeroStateStrategy


@pytest.mark.parametrize("option", [{"precision": "bf16"}, {"grad_clip": 1.0},
                                    {"grad_accum_steps": 2}])  # fmt: skip
def test_strategy_refuses_what_the_trainer_sets(option):
    with pytest.raises(ConfigError, match="come from the Trainer"):
        ZeroStateStrategy(stage=2, **option)


def test_strategy_validates_engine_options_up_front():
    with pytest.raises(ConfigError, match="stage"):
        ZeroStateStrategy(stage=5)
    with pytest.raises(ConfigError, match="bucket_mb"):
        ZeroStateStrategy(stage=2, bucket_mb=-1)
    strategy = ZeroStateStrategy(stage=3, bucket_mb=4.0, async_save=True)
    assert strategy.stage == 3 and strategy.engine_options == {"bucket_mb": 4.0}
    assert PRECISIONS["bf16-mixed"] == "bf16" and PRECISIONS["32-true"] == "fp32"


def test_trainer_refuses_what_training_arguments_set(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

    from zerostate.integrations.transformers import ZeroStateTrainer, is_store_root

    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2))  # fmt: skip
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    with pytest.raises(ConfigError, match="come from TrainingArguments"):
        ZeroStateTrainer(model=model, args=args, grad_clip=1.0)
    trainer = ZeroStateTrainer(model=model, args=args, stage=1, bucket_mb=2.0)
    assert trainer.stage == 1 and trainer.engine_options == {"bucket_mb": 2.0}
    assert trainer.engine is None  # built with the optimizer, at train()
    assert not is_store_root(str(tmp_path))
