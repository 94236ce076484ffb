"""Sharded, tiered, asynchronous checkpoints of the whole training state (DCP based)."""
