"""Build the configured tiers, fastest first: memory, local disk, then S3."""

from __future__ import annotations

from typing import List

from raytrain_ext.checkpoint.disk import DiskTier
from raytrain_ext.checkpoint.memory import MemoryTier
from raytrain_ext.checkpoint.s3 import S3Tier
from raytrain_ext.checkpoint.tier import Tier


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
