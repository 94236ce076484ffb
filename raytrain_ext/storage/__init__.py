"""Where files live, shared by data, checkpoints and the driver's checks: local paths that
must be writable (``paths``), S3 failures mapped to the key that needs fixing
(``s3_errors``) and pyarrow's S3 filesystem (``s3_fs``).  A leaf: imports nothing from the
package."""
