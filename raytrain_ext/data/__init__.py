"""Data: the builtin corpus, token files, and the world-size-independent global sampler."""

from raytrain_ext.data.sampler import GlobalSampler, rank_slice
from raytrain_ext.data.tokens import TokenDataset, open_token_dataset

__all__ = ["GlobalSampler", "TokenDataset", "open_token_dataset", "rank_slice"]
