"""The errors every layer raises, and how a failure is told in one line (``errors.text``).

A leaf under everything: it imports nothing from the package, so the config loader, the
driver's checks, data, checkpoints, models and the worker all raise and describe errors
without importing each other.
"""


class ConfigError(ValueError):
    """A configuration problem, with the full key and how to fix it."""


class InputError(ConfigError):
    """A path, dataset, checkpoint or S3 setting that cannot work, found on the driver.

    Its message is one line that names the config key (or command-line argument), the
    path or URI, what is wrong, and the fix.  A subclass of ``ConfigError`` so that every
    caller that reports a bad config reports this too, with the same exit code.
    """
