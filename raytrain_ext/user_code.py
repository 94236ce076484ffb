"""What the user hands ``Trainer`` from Python instead of naming it in the config.

One object carries all of it from the driver to every worker: it is pickled with
each ``fit`` call (cloudpickle, so a closure or a class defined in a notebook
works), and every rank gets the same copy.  Nothing here may depend on the rank:
a model factory must build the same model everywhere, a loss must be a pure
function of its inputs.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Optional


@dataclass(frozen=True)
class UserCode:
    """``model``: a factory ``(model_cfg, seed) -> nn.Module`` or a ``ModelSpec``
    (``model.source=python``); ``loss_fn``: ``(logits, batch) -> summed loss``
    (the ``user`` objective); ``train_loop``: the user's own loop
    (``user_loop.loop_function.LoopFunction``, ``raytrain_ext.train.TorchTrainer``), run by
    every rank instead of the built-in one."""

    model: Any = None
    loss_fn: Optional[Callable] = None
    train_loop: Any = None


def import_named(path: Optional[str], key: str, shape: str, error: type) -> Any:
    """The object ``"pkg.module:name"`` names, for config keys that point at the user's code
    (``model.factory``, ``objective.fn``); raises ``error`` naming ``key`` and the fix when
    the string is malformed, the module does not import or the name is not in it.  ``shape``
    says what the name should be (e.g. "a function (logits, batch) -> summed loss")."""
    module_name, _, attr = (path or "").partition(":")
    if not module_name or not attr:
        raise error(f"{key}: {path!r} is not 'pkg.module:name'. Name {shape}.")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise error(
            f"{key}: cannot import {module_name} ({e}). Install your package on every node "
            "(or ship it with the job's working_dir) and check the name."
        ) from None
    if attr not in vars(module):
        raise error(f"{key}: {module_name} has no {attr!r}; check the name.")
    return vars(module)[attr]


def import_function(path: Optional[str], key: str, shape: str, named: str, error: type) -> Any:
    """:func:`import_named`, and ``error`` naming ``key`` when what it names is not
    callable (``named``: what to name instead, e.g. "a function (logits, batch)")."""
    fn = import_named(path, key, shape, error)
    if not callable(fn):
        raise error(
            f"{key}: {path} is not callable (an object of type {type(fn).__name__!r}); "
            f"name {named}."
        )
    return fn
