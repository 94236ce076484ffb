"""The package version, importable without importing the whole package (``Trainer``)."""

__version__ = "0.1.0"
