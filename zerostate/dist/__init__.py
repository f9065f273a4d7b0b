"""Communication over torch.distributed: every collective call (``collectives``), the
engine's communication context and buffer pool (``comm``), and the control collectives of
one group bound once (``coordinator``)."""
