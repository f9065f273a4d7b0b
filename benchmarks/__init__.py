"""zerostate beside its peers, side by side, in one run: ``python -m benchmarks``."""
