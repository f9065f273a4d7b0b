"""Where people train: ``zerostate.integrations.lightning.ZeroStateStrategy`` for
``lightning.pytorch.Trainer`` and ``zerostate.integrations.transformers.ZeroStateTrainer``
for Hugging Face. Each module imports its framework; importing this package imports
neither (install the ``lightning`` or ``hf`` extra for the one you use)."""
