"""One mapping from S3 failures (botocore, boto3, pyarrow) to the key that needs fixing.

Every command that talks to S3 (train's checkpoint tier and data, ``ckpt export``) names
its own keys in an :class:`S3Keys` and gets the same classes of message: the bucket or
URI, the endpoint, the credentials, or the region; each says the fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional
from urllib.parse import urlparse

CREDENTIALS_FIX = (
    "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, or give "
    "the node an instance role) for an identity allowed to use the bucket"
)
CREDENTIAL_CODES = {
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "AccessDenied",
    "InvalidToken",
    "ExpiredToken",
    "403",
    "Forbidden",
    "AllAccessDisabled",
}
REGION_CODES = {
    "AuthorizationHeaderMalformed",
    "PermanentRedirect",
    "301",
    "IllegalLocationConstraintException",
    "InvalidRegion",
}
BUCKET_CODES = {"NoSuchBucket", "InvalidBucketName"}
MISSING_CODES = {"NoSuchKey", "404", "NotFound"}


@dataclass(frozen=True)
class S3Keys:
    """The names under which a command takes its S3 settings."""

    uri: str
    endpoint: str
    region: str


CHECKPOINT_KEYS = S3Keys("checkpoint.s3.uri", "checkpoint.s3.endpoint_url", "checkpoint.s3.region")
DATA_KEYS = S3Keys("data.path", "data.s3_endpoint_url", "data.s3_region")
EXPORT_KEYS = S3Keys("RUN_OR_PATH", "--s3-endpoint-url", "AWS_DEFAULT_REGION")


def endpoint_problem(url: Optional[str], key: str) -> Optional[str]:
    """Why ``url`` is not an endpoint boto3 can use, or None (None and "" mean AWS itself)."""
    if not url:
        return None
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        return (
            f"{key}: {url!r} is not an endpoint URL. Give the scheme and host, for example "
            "http://127.0.0.1:9000 or https://s3.us-east-1.amazonaws.com, or leave it unset "
            "for AWS S3."
        )
    return None


def describe_s3_error(error: BaseException, keys: S3Keys, uri: str, endpoint: Optional[str]) -> str:
    """One line naming the key to fix for an S3 ``error`` met while using ``uri``."""
    where = endpoint or "AWS S3"
    bucket = uri[len("s3://") :].partition("/")[0] if uri.startswith("s3://") else uri
    kind = _classify(error)
    if kind == "credentials":
        return (
            f"S3 credentials: no usable credentials for s3://{bucket} ({keys.uri}) at "
            f"{where}: {_short(error)}. Fix the credentials: {CREDENTIALS_FIX}."
        )
    if kind == "endpoint":
        return (
            f"{keys.endpoint}: cannot reach {where} ({_short(error)}). Check that the "
            f"endpoint URL is right and the server is up, or set {keys.endpoint} to the "
            "S3 service this node can reach."
        )
    if kind == "region":
        return (
            f"{keys.region}: s3://{bucket} is not in the region this request was signed "
            f"for ({_short(error)}). Set {keys.region} to the bucket's region."
        )
    if kind == "bucket":
        return missing_message(keys, uri, endpoint, bucket_missing=True)
    if kind == "missing":
        return missing_message(keys, uri, endpoint, bucket_missing=False)
    return f"{keys.uri}: S3 request for {uri} at {where} failed: {_short(error)}."


def missing_message(keys: S3Keys, uri: str, endpoint: Optional[str], bucket_missing: bool) -> str:
    """The bucket, or the object or prefix within it, is not there."""
    where = endpoint or "AWS S3"
    bucket = uri[len("s3://") :].partition("/")[0]
    if bucket_missing:
        return (
            f"{keys.uri}: bucket '{bucket}' does not exist at {where}. Create it, or fix "
            f"the bucket name in {keys.uri}."
        )
    return f"{keys.uri}: {uri} does not exist at {where}. Check the path in {keys.uri}."


def _classify(error: BaseException) -> str:
    from botocore.exceptions import (
        ClientError,
        CredentialRetrievalError,
        NoCredentialsError,
        NoRegionError,
        PartialCredentialsError,
    )
    from botocore.exceptions import (
        ConnectionError as BotoConnectionError,
    )

    if isinstance(error, (NoCredentialsError, PartialCredentialsError, CredentialRetrievalError)):
        return "credentials"
    if isinstance(error, NoRegionError):
        return "region"
    if isinstance(error, BotoConnectionError) or (
        isinstance(error, ValueError) and "Invalid endpoint" in str(error)
    ):
        return "endpoint"
    if isinstance(error, ClientError):
        return _classify_code(str(error.response.get("Error", {}).get("Code", "")))
    cause = error.__cause__ or error.__context__
    if cause is not None and cause is not error and not isinstance(error, OSError):
        return _classify(cause)
    return _classify_text(str(error))


def _classify_code(code: str) -> str:
    for kind, codes in (
        ("credentials", CREDENTIAL_CODES),
        ("region", REGION_CODES),
        ("bucket", BUCKET_CODES),
        ("missing", MISSING_CODES),
    ):
        if code in codes:
            return kind
    return "other"


def _classify_text(text: str) -> str:
    """pyarrow's S3 errors are OSErrors whose text holds the AWS error."""
    lowered = text.lower()
    if any(code.lower() in lowered for code in ("NoSuchBucket", "bucket does not exist")):
        return "bucket"
    if (
        any(code.lower() in lowered for code in CREDENTIAL_CODES - {"403"})
        or "credentials" in lowered
        or "http response code: 403" in lowered
    ):
        return "credentials"
    if (
        "couldn't connect" in lowered
        or "could not connect" in lowered
        or "connection refused" in lowered
        or "curl error" in lowered
    ):
        return "endpoint"
    if "301" in lowered or "region" in lowered:
        return "region"
    return "other"


def _short(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = lines[0] if lines else type(error).__name__
    return text if len(text) <= 200 else text[:197] + "..."
