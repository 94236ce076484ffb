"""The error raised for bad input found before anything started."""

from __future__ import annotations

from raytrain_ext.config.errors import ConfigError


class InputError(ConfigError):
    """A path, dataset, checkpoint or S3 setting that cannot work, found on the driver.

    Its message is one line that names the config key (or command-line argument), the
    path or URI, what is wrong, and the fix.  A subclass of ``ConfigError`` so that every
    caller that reports a bad config reports this too, with the same exit code.
    """
