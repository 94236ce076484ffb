"""``raytrain-ext config show``: every key of a resolved config beside its default, its
choices or range, so the keys can be found without reading the schema's source.

The listing is derived from the schema (:class:`TrainConfig`'s dataclasses and the
ranges and choices declared on their fields), so a new key appears here by being
declared; nothing is kept in a second list.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from enum import Enum
from typing import Any, List, Sequence, Tuple

from omegaconf import OmegaConf

from raytrain_ext.config.schema import TrainConfig
from raytrain_ext.errors import ConfigError
from raytrain_ext.typed_config.fields import RANGE, choice_of, leaf_fields


def plain(text: str) -> str:
    """reStructuredText literals as a terminal shows them: ``x`` -> x."""
    return re.sub(r"``([^`]*)``", r"\1", text)


def sections() -> List[Tuple[str, str]]:
    """Each section's name and the first sentence of its docstring."""
    hints = typing.get_type_hints(TrainConfig)
    described = []
    for f in dataclasses.fields(TrainConfig):
        doc = " ".join((hints[f.name].__doc__ or "").split())
        first = re.split(r"(?<=\.)\s", doc, maxsplit=1)[0]
        described.append((f.name, plain(first)))
    return described


def show_config(cfg, wanted: Sequence[str] = ()) -> str:
    """Lines ``key: value  # default ...; choices or range`` for the sections in
    ``wanted`` (all when empty), each section headed by what it is."""
    names = dict(sections())
    unknown = [name for name in wanted if name not in names]
    if unknown:
        raise ConfigError(
            f"config show: unknown section {unknown[0]!r}; the sections are {', '.join(names)}."
        )
    lines: List[str] = []
    for section, about in names.items():
        if wanted and section not in wanted:
            continue
        lines.append(f"# {section}: {about}")
        for key, field, _ in leaf_fields(TrainConfig):
            if key.split(".")[0] == section:
                lines.append(_line(cfg, key, field))
        lines.append("")
    return "\n".join(lines)


def _line(cfg, key: str, field: dataclasses.Field) -> str:
    value = _text(OmegaConf.select(cfg, key))
    notes = [f"default {_text(_default(field))}"]
    choice = choice_of(TrainConfig, key)
    if choice is not None:
        notes.append(f"one of {', '.join(choice.values())}")
    if RANGE in field.metadata:
        bounds = field.metadata[RANGE]
        notes.append(bounds.wording or bounds.bounds())
    return f"{key}: {value}".ljust(48) + f"  # {'; '.join(notes)}"


def _default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return "(required)"


def _text(value: Any) -> str:
    if OmegaConf.is_config(value):
        value = OmegaConf.to_container(value, resolve=True, enum_to_str=True)
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, dict)):
        return str(value)
    return str(value.value if isinstance(value, Enum) else value)
