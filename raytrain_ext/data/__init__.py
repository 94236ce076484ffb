"""Data: the builtin corpus, token files, and the world-size-independent global sampler.

The names below are imported on first use, so that importing one data module (a
``data prepare`` worker's ``raytrain_ext.prepare.pipeline``) does not import torch.
"""

from typing import TYPE_CHECKING

from raytrain_ext.lazy_exports import exporter

_EXPORTS = {
    "GlobalSampler": "raytrain_ext.data.sampler",
    "rank_slice": "raytrain_ext.data.sampler",
    "TokenDataset": "raytrain_ext.data.tokens",
    "open_token_dataset": "raytrain_ext.data.tokens",
}

if TYPE_CHECKING:
    from raytrain_ext.data.sampler import GlobalSampler, rank_slice
    from raytrain_ext.data.tokens import TokenDataset, open_token_dataset


__getattr__ = exporter(globals(), _EXPORTS)


__all__ = ["GlobalSampler", "TokenDataset", "open_token_dataset", "rank_slice"]
