"""Data: the builtin corpus, token files, and the world-size-independent global sampler.

The names below are imported on first use, so that importing one data module (a
``data prepare`` worker's ``raytrain_ext.data.prepare``) does not import torch.
"""

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "GlobalSampler": "raytrain_ext.data.sampler",
    "rank_slice": "raytrain_ext.data.sampler",
    "TokenDataset": "raytrain_ext.data.tokens",
    "open_token_dataset": "raytrain_ext.data.tokens",
}

if TYPE_CHECKING:
    from raytrain_ext.data.sampler import GlobalSampler, rank_slice
    from raytrain_ext.data.tokens import TokenDataset, open_token_dataset


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'raytrain_ext.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


__all__ = ["GlobalSampler", "TokenDataset", "open_token_dataset", "rank_slice"]
