"""Small reference models used by the examples, tests and benchmarks."""

from zerostate.models.gpt2 import GPT2, GPT2Config

__all__ = ["GPT2", "GPT2Config"]
