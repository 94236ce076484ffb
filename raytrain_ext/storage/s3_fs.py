"""pyarrow's S3 filesystem for ``data.*`` sources (a module of its own, free of torch, so
that a ``data prepare`` worker reading records from S3 need not import it)."""

from __future__ import annotations

from typing import Optional

import pyarrow.fs as pafs


def s3_filesystem(endpoint_url: Optional[str], region: Optional[str], **options) -> pafs.FileSystem:
    """pyarrow's S3 filesystem for ``data.s3_endpoint_url`` (http or https) and region."""
    scheme = "http" if (endpoint_url or "").startswith("http://") else "https"
    return pafs.S3FileSystem(
        endpoint_override=endpoint_url, region=region, scheme=scheme, **options
    )
