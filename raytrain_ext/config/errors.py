"""The one error type of configuration problems, in its own module.

Why here: the loader raises it and calls the validators, which raise it too; with the
class in the loader, the two modules imported each other.
"""


class ConfigError(ValueError):
    """A configuration problem, with the full key and how to fix it."""
