"""A package's exported names, imported from their modules on first use (PEP 562).

Why: importing any module of a package runs the package's ``__init__`` first; eager
re-exports there made every process that needed one small module (a ``data prepare``
worker) import torch and the trainer, and a section's module (``parallel.config``) to
the loader that composes the sections.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Dict


def exporter(namespace: Dict[str, Any], exports: Dict[str, str]) -> Callable[[str], Any]:
    """The module ``__getattr__`` for ``namespace`` (a package's ``globals()``): name ->
    the attribute of that name in ``exports[name]``, cached in ``namespace`` once imported."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {namespace['__name__']!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name]), name)
        namespace[name] = value
        return value

    return __getattr__
