"""The model state dict of one pipeline stage (or expert shard), for checkpoint checks."""

from __future__ import annotations

from typing import Any, Iterable, Mapping


class StageStateDict(dict):
    """A stage's model state dict that also knows every stage's keys (``whole_model_keys``)."""

    whole_model_keys: set = set()


def whole_model_keys(model_sd: Mapping[str, Any]) -> Iterable[str]:
    """Every key of the whole model: a stage's (or expert shard's) own dict knows the other
    ranks' keys too; a plain state dict holds them all itself."""
    if isinstance(model_sd, StageStateDict):
        return model_sd.whole_model_keys
    return model_sd.keys()
