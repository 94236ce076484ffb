"""Reference models: a GPT with a dense or mixture-of-experts feed-forward."""

from raytrain_ext.models.gpt import GPT, Block, build_model
from raytrain_ext.models.moe import MoEFeedForward

__all__ = ["GPT", "Block", "MoEFeedForward", "build_model"]
