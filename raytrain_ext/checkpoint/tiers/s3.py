"""The S3 tier: ``s3://bucket/prefix/step-<N>/`` on any S3-compatible endpoint.

Uploads are multipart and multi-threaded (boto3 ``TransferConfig``).  botocore
retries each request; on top of that every file upload is retried with
exponential backoff, so an outage of a few minutes delays persistence without
losing the checkpoint (the local tier already holds it).  The manifest is one
PUT, so an S3 commit is atomic.
"""

from __future__ import annotations

import functools
import logging
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Callable, List, Optional, TypeVar

from raytrain_ext.checkpoint.manifest import MANIFEST, Manifest, parse_step_dir, step_dir_name
from raytrain_ext.checkpoint.tiers.base import FetchMode, Tier, TierError
from raytrain_ext.storage.s3_errors import CHECKPOINT_KEYS, S3Keys, describe_s3_error

if TYPE_CHECKING:
    from raytrain_ext.checkpoint.tiers.s3_ranged import PlannedS3Fetch

log = logging.getLogger(__name__)
T = TypeVar("T")


def split_uri(uri: str) -> tuple[str, str]:
    bucket, _, prefix = uri[len("s3://") :].partition("/")
    return bucket, prefix.strip("/")


class S3Tier(Tier):
    name = "s3"
    fetch_mode = FetchMode.ranged

    def __init__(
        self,
        uri: str,
        endpoint_url: Optional[str] = None,
        region: Optional[str] = None,
        part_size_mb: int = 16,
        max_concurrency: int = 8,
        max_attempts: int = 5,
        retry_backoff_s: float = 1.0,
        keys: S3Keys = CHECKPOINT_KEYS,
    ):
        """``keys``: the names under which the caller took these settings, for errors."""
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        self.uri = uri.rstrip("/")
        self.bucket, self.prefix = split_uri(self.uri)
        self.endpoint_url = endpoint_url
        self.keys = keys
        self.max_attempts = max_attempts
        self.max_concurrency = max_concurrency
        self.retry_backoff_s = retry_backoff_s
        self.retries = 0  # failed attempts that were retried (an outage shows up here)
        try:
            self.client = boto3.client(
                "s3",
                endpoint_url=endpoint_url,
                region_name=region,
                config=Config(
                    retries={"max_attempts": 3, "mode": "standard"},
                    connect_timeout=5,
                    read_timeout=60,
                    max_pool_connections=max(10, max_concurrency * 2),
                ),
            )
        except ValueError as e:  # "Invalid endpoint: ..."
            raise TierError(self.describe(e)) from None
        part = part_size_mb * 1024 * 1024
        self.transfer = TransferConfig(
            multipart_threshold=part,
            multipart_chunksize=part,
            max_concurrency=max_concurrency,
            use_threads=True,
        )

    def location(self, step: int) -> str:
        return self.key(step)

    def ranged_fetch(
        self, step: int, manifest: Manifest, cache_dir: Path, threads: Optional[int] = None
    ) -> "PlannedS3Fetch":
        from raytrain_ext.checkpoint.tiers.s3_ranged import PlannedS3Fetch

        return PlannedS3Fetch(self, step, manifest, cache_dir, threads or self.max_concurrency)

    def key(self, step: int, name: str = "") -> str:
        parts = [self.prefix, step_dir_name(step), name]
        return "/".join(p for p in parts if p)

    def probe(self) -> None:
        """Fail at start, not after an hour: write, read back and delete a probe object."""
        from botocore.exceptions import BotoCoreError, ClientError

        key = "/".join(p for p in (self.prefix, f".probe-{uuid.uuid4().hex}") if p)
        try:
            self.client.put_object(Bucket=self.bucket, Key=key, Body=b"ok")
            self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()
            self.client.delete_object(Bucket=self.bucket, Key=key)
        except (BotoCoreError, ClientError) as e:
            raise TierError(self.describe(e)) from None

    def describe(self, error: BaseException) -> str:
        """One line naming the key to fix (bucket, endpoint, credentials or region)."""
        return describe_s3_error(error, self.keys, self.uri, self.endpoint_url)

    def upload(self, step: int, src_dir: Path, names: List[str]) -> None:
        for name in names:
            self._retry(
                f"upload {name} of step {step}",
                functools.partial(
                    self.client.upload_file,
                    str(src_dir / name),
                    self.bucket,
                    self.key(step, name),
                    Config=self.transfer,
                ),
            )

    def commit(self, manifest: Manifest) -> None:
        body = manifest.to_json().encode()
        self._retry(
            f"commit step {manifest.step}",
            lambda: self.client.put_object(
                Bucket=self.bucket, Key=self.key(manifest.step, MANIFEST), Body=body
            ),
        )

    def committed_steps(self) -> List[int]:
        return sorted({s for s, name in self._listing() if name == MANIFEST})

    def all_steps(self) -> List[int]:
        return sorted({s for s, _ in self._listing()})

    def manifest_text(self, step: int) -> Optional[str]:
        from botocore.exceptions import ClientError

        try:
            body = self._retry(
                f"read the manifest of step {step}",
                lambda: self.client.get_object(Bucket=self.bucket, Key=self.key(step, MANIFEST)),
                retry_missing=False,
            )
        except ClientError:  # no such key: never committed
            return None
        return body["Body"].read().decode(errors="replace")

    def materialize(self, step: int, names: List[str], cache_dir: Path) -> Path:
        target = cache_dir / step_dir_name(step)
        target.mkdir(parents=True, exist_ok=True)
        for name in names:
            self._retry(
                f"download {name} of step {step}",
                functools.partial(
                    self.client.download_file,
                    self.bucket,
                    self.key(step, name),
                    str(target / name),
                    Config=self.transfer,
                ),
            )
        return target

    def read_range(self, step: int, name: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of one file: a single ranged GET, retried."""
        return self._retry(
            f"read {name}[{start}:{end}] of step {step}",
            lambda: self.client.get_object(
                Bucket=self.bucket,
                Key=self.key(step, name),
                Range=f"bytes={start}-{end - 1}",
            )["Body"].read(),
        )

    def delete(self, step: int) -> None:
        keys = [{"Key": k} for k in self._keys(self.key(step) + "/")]
        for i in range(0, len(keys), 1000):
            self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": keys[i : i + 1000]})

    def _keys(self, prefix: str) -> List[str]:
        from botocore.exceptions import BotoCoreError, ClientError

        keys: List[str] = []
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=prefix
            ):
                keys.extend(obj["Key"] for obj in page.get("Contents", []))
        except (BotoCoreError, ClientError) as e:
            raise TierError(self.describe(e)) from None
        return keys

    def _listing(self):
        base = f"{self.prefix}/" if self.prefix else ""
        for key in self._keys(base):
            head, _, name = key[len(base) :].partition("/")
            step = parse_step_dir(head)
            if step is not None:
                yield step, name

    def _retry(self, what: str, action: Callable[[], T], retry_missing: bool = True) -> T:
        """``action`` with backoff; a missing key is raised at once unless ``retry_missing``
        (an object not there yet may appear; a manifest looked up is either there or not)."""
        from boto3.exceptions import S3UploadFailedError
        from botocore.exceptions import BotoCoreError, ClientError

        for attempt in range(1, self.max_attempts + 1):
            try:
                return action()
            except (BotoCoreError, ClientError, S3UploadFailedError, OSError) as e:
                if not retry_missing and _is_missing(e):
                    raise
                if attempt == self.max_attempts:
                    raise TierError(
                        f"S3 {what} failed after {attempt} attempts: {self.describe(e)}"
                    ) from e
                delay = self.retry_backoff_s * 2 ** (attempt - 1)
                self.retries += 1
                log.warning(
                    "ALARM: S3 %s failed (attempt %d/%d: %s); retrying in %.1f s",
                    what,
                    attempt,
                    self.max_attempts,
                    e,
                    delay,
                )
                time.sleep(delay)
        raise AssertionError("unreachable")


def _is_missing(error: BaseException) -> bool:
    from botocore.exceptions import ClientError

    return isinstance(error, ClientError) and error.response.get("Error", {}).get("Code") in (
        "NoSuchKey",
        "404",
        "NotFound",
    )
