"""Tests of zerostate.dcp, torch.distributed.checkpoint storage plug-ins over the store."""
