"""Checkpoint tiers, one module per medium, and the configured set, fastest first.

``base`` declares what a tier is (``Tier``: a place that holds ``step-<N>/`` file sets)
and retention; ``memory`` (the Ray object store, replicated to a peer node), ``disk``
(a local or shared directory) and ``s3`` (any S3-compatible store, with ranged reads in
``s3_ranged``) implement it.
"""

from __future__ import annotations

from typing import List

from raytrain_ext.checkpoint.tiers.base import Tier
from raytrain_ext.checkpoint.tiers.disk import DiskTier
from raytrain_ext.checkpoint.tiers.memory import MemoryTier
from raytrain_ext.checkpoint.tiers.s3 import S3Tier


def s3_tier(ckpt_cfg, uri: str) -> S3Tier:
    s3 = ckpt_cfg.s3
    return S3Tier(
        uri,
        endpoint_url=s3.endpoint_url,
        region=s3.region,
        part_size_mb=s3.part_size_mb,
        max_concurrency=s3.max_concurrency,
        max_attempts=s3.max_attempts,
        retry_backoff_s=s3.retry_backoff_s,
    )


def build_tiers(ckpt_cfg, run_name: str) -> List[Tier]:
    """Fastest first: memory (when resolved on), local disk, S3."""
    tiers: List[Tier] = []
    if ckpt_cfg.memory:
        tiers.append(MemoryTier(run_name))
    if ckpt_cfg.local:
        tiers.append(DiskTier(ckpt_cfg.dir, recycle=ckpt_cfg.recycle_files))
    if ckpt_cfg.s3.uri:
        tiers.append(s3_tier(ckpt_cfg, ckpt_cfg.s3.uri))
    return tiers


def tier_for_location(ckpt_cfg, location: str) -> Tier:
    """A tier rooted at an explicit location (a directory or an s3:// prefix)."""
    return s3_tier(ckpt_cfg, location) if location.startswith("s3://") else DiskTier(location)
